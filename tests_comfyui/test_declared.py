"""Packs whose env is declared in their ``pyproject.toml``, built by comfy-env with uv when the
server starts: a pack pinned to numpy 1 beside a server with numpy 2, a second server start
that reuses the env without building, and a pack whose env cannot be resolved."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    REPO,
    Server,
    _need,
    server_environment,
    start_server,
    stop_server,
)

PROMPT = {
    "1": {
        "class_type": "EmptyImage",
        "inputs": {"width": 4, "height": 2, "batch_size": 1, "color": 0},
    },
    "2": {"class_type": "CE_DeclaredNumpy", "inputs": {"image": ["1", 0]}},
    "99": {
        "class_type": "CE_Digest",
        "inputs": {"text": ["2", 0], "number": ["2", 1], "image": ["2", 2]},
    },
}


def _digest(history: dict) -> dict:
    assert history["status"]["status_str"] == "success", history["status"]
    return history["outputs"]["99"]["digest"][0]


def test_a_pack_declaring_numpy_1_runs_in_its_built_env_beside_a_numpy_2_server(
    server: Server, env_home: Path
) -> None:
    history, _ = server.run(PROMPT)
    report = _digest(history)
    version, prefix = report["text"].split(" ", 1)
    assert version == "1.26.4"  # the server has numpy 2.x
    assert Path(prefix).resolve().parent == (env_home / "envs").resolve()
    assert report["image"]["values"] == [1.0] * (4 * 2 * 3)  # inverted black, exact
    assert "comfy-env: building env" in server.log_text()


def test_a_pack_whose_env_cannot_be_resolved_fails_its_import_and_the_others_work(
    server: Server,
) -> None:
    log = server.log_text()
    assert "unresolvable_pack" in log and "IMPORT FAILED" in log
    assert "comfy-env-no-such-package-4f1c" in log  # the resolver names the requirement
    info = server.get("/object_info")
    assert "CE_NeverBuilt" not in info
    assert "CE_DeclaredNumpy" in info and "CE_Digest" in info


@pytest.mark.timeout(300)
def test_a_second_server_start_reuses_the_env_without_building(
    server: Server, pack_envs: dict[str, str], env_home: Path, tmp_path: Path
) -> None:
    server.run(PROMPT)  # the env exists (built by the session's server)
    base = tmp_path / "second"
    (base / "custom_nodes").mkdir(parents=True)
    for pack in ("numpy_pack", "declared_pack"):
        source = REPO / ("examples/comfyui" if pack == "numpy_pack" else "tests_comfyui") / pack
        (base / "custom_nodes" / pack).symlink_to(source)
    second = start_server(
        base,
        _need("COMFY_ENV_TEST_COMFYUI_DIR"),
        _need("COMFY_ENV_TEST_COMFYUI_PYTHON"),
        server_environment(pack_envs, base, env_home),
    )
    try:
        history, _ = second.run(PROMPT)
        assert _digest(history)["text"].startswith("1.26.4 ")
        assert "comfy-env: building env" not in second.log_text()
    finally:
        stop_server(second)
