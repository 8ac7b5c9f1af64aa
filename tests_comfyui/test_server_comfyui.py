"""Packs that import ComfyUI's own modules, isolated with ``comfyui="server"``: the worker
imports the server's ComfyUI (its source tree, its command line, its directories).

One server for this module: the real third-party pack ComfyUI_essentials (from
``../shared/comfyui/packs/``, unpacked unchanged) loaded in-process *and* through a shim that
isolates the same directory (``essentials_shim``: its nodes renamed ``<name> (isolated)``), so
one prompt runs each node both ways and ``CE_TensorHash`` compares what they return, byte for
byte; and ``server_comfyui_pack``, whose nodes report what the worker's ComfyUI sees (device,
directories, model folders) once in the server's interpreter and once in an empty venv layered
on the server's packages. Run against both ComfyUI versions: ``python3 dev.py test-comfyui
[--comfyui ../shared/comfyui/ComfyUI-0.8.0-src.tar.gz] -k server_comfyui``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import tarfile
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, Server, _need, server_environment, start_server, stop_server

ESSENTIALS_TARBALL = (
    REPO.parent / "shared" / "comfyui" / "packs" / "ComfyUI_essentials-33ff89f.tar.gz"
)
SRC = "ce_source.png"
ISO = " (isolated)"

pytestmark = pytest.mark.timeout(600)


def _png(width: int, height: int) -> bytes:
    """An RGB PNG with gradients, a pattern and a pure red block (stdlib only)."""
    rows = []
    for y in range(height):
        row = bytearray([0])
        for x in range(width):
            if 8 <= x < 20 and 6 <= y < 16:
                row += bytes((255, 0, 0))
            else:
                row += bytes(((x * 4) % 256, (y * 5) % 256, (x * y * 7 + 13) % 256))
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def mods_server(
    tmp_path_factory: pytest.TempPathFactory, pack_envs: dict[str, str], env_home: Path
) -> Iterator[Server]:
    comfy_dir = _need("COMFY_ENV_TEST_COMFYUI_DIR")
    python = _need("COMFY_ENV_TEST_COMFYUI_PYTHON")
    if not ESSENTIALS_TARBALL.is_file():
        pytest.skip(f"no {ESSENTIALS_TARBALL}")
    base = tmp_path_factory.mktemp("comfyui-mods")
    nodes = base / "custom_nodes"
    nodes.mkdir()
    with tarfile.open(ESSENTIALS_TARBALL) as tf:
        tf.extractall(nodes, filter="data")  # custom_nodes/ComfyUI_essentials, unchanged
    essentials = nodes / "ComfyUI_essentials"
    assert (essentials / "__init__.py").is_file()
    (nodes / "essentials_shim").symlink_to(REPO / "tests_comfyui" / "essentials_shim")
    (nodes / "server_comfyui_pack").symlink_to(REPO / "tests_comfyui" / "server_comfyui_pack")
    (base / "input").mkdir()
    (base / "input" / SRC).write_bytes(_png(64, 48))
    # An env with no packages of its own, of the server's Python: torch comes from the server.
    layered = base / "layered-env"
    subprocess.run([python, "-m", "venv", "--without-pip", str(layered)], check=True)
    env = server_environment(pack_envs, base, env_home)
    env["CE_TEST_ESSENTIALS"] = str(essentials)
    env["CE_TEST_LAYERED_ENV"] = str(layered)
    srv = start_server(base, comfy_dir, python, env, timeout=400)
    try:
        yield srv
    finally:
        stop_server(srv)


def _ok(history: dict[str, Any]) -> dict[str, Any]:
    assert history["status"]["status_str"] == "success", json.dumps(history["status"])[-3000:]
    return history["outputs"]


# node class, its inputs (``image`` / ``mask`` are wired), its outputs by TensorHash input
CASES: list[tuple[str, dict[str, Any], list[str]]] = [
    ("ImageFlip+", {"axis": "xy"}, ["image"]),
    (
        "ImageResize+",
        {
            "width": 40,
            "height": 30,
            "interpolation": "bicubic",
            "method": "keep proportion",
            "condition": "always",
            "multiple_of": 0,
        },
        ["image", "a", "b"],
    ),
    (
        "ImageCrop+",
        {"width": 32, "height": 24, "position": "center", "x_offset": 3, "y_offset": -2},
        ["image", "a", "b"],
    ),
    ("ImageDesaturate+", {"factor": 0.7, "method": "luminance (Rec.709)"}, ["image"]),
    ("ImagePosterize+", {"threshold": 0.4}, ["image"]),
    ("ImageCASharpening+", {"amount": 0.8}, ["image"]),
    ("GetImageSize+", {}, ["a", "b", "c"]),
    ("MaskFromColor+", {"red": 255, "green": 0, "blue": 0, "threshold": 40}, ["mask"]),
    ("MaskBlur+", {"amount": 5, "device": "auto"}, ["mask"]),
    ("MaskFlip+", {"axis": "x"}, ["mask"]),
]


def _comparison_prompt() -> dict[str, Any]:
    prompt: dict[str, Any] = {
        "1": {"class_type": "LoadImage", "inputs": {"image": SRC}},
        "2": {"class_type": "ImageToMask", "inputs": {"image": ["1", 0], "channel": "green"}},
    }
    for i, (name, inputs, outputs) in enumerate(CASES):
        takes_mask = name.startswith("MaskBlur") or name.startswith("MaskFlip")
        for j, class_type in enumerate((name, name + ISO)):
            node = str(100 + 10 * i + j)
            wired = dict(inputs)
            wired["mask" if takes_mask else "image"] = ["2", 0] if takes_mask else ["1", 0]
            prompt[node] = {"class_type": class_type, "inputs": wired}
            prompt[str(500 + 10 * i + j)] = {
                "class_type": "CE_TensorHash",
                "inputs": {slot: [node, k] for k, slot in enumerate(outputs)},
            }
    return prompt


def test_server_comfyui_essentials_nodes_run_isolated_unchanged_with_exact_outputs(
    mods_server: Server,
) -> None:
    info = mods_server.get("/object_info")
    for name, _, _ in CASES:
        assert name in info and name + ISO in info, (name, mods_server.log_text()[-6000:])
        # The scanned schema is the in-process one (the same class, imported in the worker).
        assert info[name + ISO]["input"] == info[name]["input"], name
        assert info[name + ISO]["output"] == info[name]["output"], name
    outputs = _ok(mods_server.run(_comparison_prompt(), timeout=300)[0])
    for i, (name, _, _) in enumerate(CASES):
        here = outputs[str(500 + 10 * i)]["digest"][0]
        isolated = outputs[str(500 + 10 * i + 1)]["digest"][0]
        assert isolated == here, f"{name}: isolated {isolated} != in-process {here}"
        assert "None | None | None | None | None" != here
    # The isolated nodes ran in a worker, not in the server.
    assert "IMPORT FAILED" not in mods_server.log_text()


def test_server_comfyui_an_isolated_save_node_writes_into_the_servers_directories(
    mods_server: Server,
) -> None:
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": SRC}},
        "2": {"class_type": "ImageToMask", "inputs": {"image": ["1", 0], "channel": "red"}},
        # essentials' MaskPreview+ subclasses ComfyUI's SaveImage and saves into the temp dir
        "3": {"class_type": "MaskPreview+" + ISO, "inputs": {"mask": ["2", 0]}},
        # ComfyUI's SaveImage, subclassed by a pack, saves into the output directory
        "4": {
            "class_type": "CE_ServerSave",
            "inputs": {"images": ["1", 0], "filename_prefix": "ce_server_save"},
        },
    }
    outputs = _ok(mods_server.run(prompt)[0])
    temp = outputs["3"]["images"][0]
    assert temp["type"] == "temp"
    served = mods_server.get(f"/view?filename={temp['filename']}&type=temp&subfolder=")
    assert served[:8] == b"\x89PNG\r\n\x1a\n"
    saved = outputs["4"]["images"][0]
    assert saved["type"] == "output" and saved["filename"].startswith("ce_server_save")
    assert (mods_server.output / saved["subfolder"] / saved["filename"]).is_file()


@pytest.mark.parametrize("prefix", ["CE_Server", "CE_Layered"])
def test_server_comfyui_the_worker_sees_the_servers_device_directories_and_progress(
    mods_server: Server, prefix: str
) -> None:
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": SRC}},
        "2": {"class_type": prefix + "Report", "inputs": {"image": ["1", 0]}},
    }
    history, messages = mods_server.run(prompt)
    report = json.loads(_ok(history)["2"]["report"][0])
    assert report["pid"] != mods_server.process.pid
    # --cpu reached comfy.cli_args: no GPU driver looked for (this machine has none)
    assert report["args_cpu"] is True and report["device"] == "cpu"
    assert "CPU" in report["cpu_state"]
    assert Path(report["output"]) == mods_server.output
    assert Path(report["input"]) == mods_server.base / "input"
    assert Path(report["temp"]).parent == mods_server.base
    # main.py's own additions (--output-directory adds <output>/checkpoints) came along
    assert report["checkpoints"] == [
        str(mods_server.base / "models" / "checkpoints"),
        str(mods_server.output / "checkpoints"),
    ]
    comfy_dir = os.path.realpath(_need("COMFY_ENV_TEST_COMFYUI_DIR"))
    assert os.path.realpath(report["nodes"]) == comfy_dir  # the server's tree, not a copy
    assert report["max_resolution"] >= 8192
    assert report["shape"] == [1, 48, 64, 3]
    python = Path(_need("COMFY_ENV_TEST_COMFYUI_PYTHON"))
    server_prefix = python.parent.parent
    torch_at = Path(report["torch"]).resolve()
    assert server_prefix.resolve() in torch_at.parents  # the server's torch, never a second
    if prefix == "CE_Layered":
        assert Path(report["prefix"]) == mods_server.base / "layered-env"
    progress = [m for m in messages if m["type"] == "progress" and m["data"]["node"] == "2"]
    assert progress and progress[-1]["data"]["value"] == 3 and progress[-1]["data"]["max"] == 3
    assert any(m["type"] == "ce_server_probe" for m in messages)


def test_server_comfyui_an_interrupt_stops_the_node_at_comfyuis_own_check_and_keeps_the_worker(
    mods_server: Server,
) -> None:
    def report() -> dict[str, Any]:
        prompt = {
            "1": {"class_type": "LoadImage", "inputs": {"image": SRC}},
            "2": {"class_type": "CE_ServerReport", "inputs": {"image": ["1", 0]}},
        }
        return dict(json.loads(_ok(mods_server.run(prompt)[0])["2"]["report"][0]))

    before = report()

    def on_message(message: dict[str, Any]) -> None:
        if message["type"] == "executing" and message["data"].get("node") == "1":
            threading.Timer(1.0, mods_server.post, ("/interrupt", {})).start()

    prompt = {"1": {"class_type": "CE_ServerSteps", "inputs": {"steps": 2000}}}
    history, messages = mods_server.run(prompt, timeout=60, on_message=on_message)
    assert any(m["type"] == "execution_interrupted" for m in messages), history["status"]
    # the node stopped at comfy.model_management's check (cooperatively): same worker after
    assert report()["pid"] == before["pid"]
