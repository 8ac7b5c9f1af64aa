"""A real ComfyUI server with the example packs, for the integration tests.

``python3 dev.py test-comfyui`` prepares ComfyUI and the example envs and passes their paths in
``COMFY_ENV_TEST_COMFYUI_DIR``, ``COMFY_ENV_TEST_COMFYUI_PYTHON`` and
``COMFY_ENV_TEST_PACK_ENV_{NUMPY,TORCH}``; without them every test here skips with that message.

One server per session (start-up is 6-15 s): a temporary base directory whose ``custom_nodes``
links the example packs (numpy, torch, V3, and the pack whose env is missing) and the test-only
``probe_pack`` (routes that show and instrument ComfyUI's model manager), its own output
directory and scan cache, on 127.0.0.1 with a free port. Teardown kills the server's whole
process group (its comfy-env workers included) and checks that none of them survived.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKS = ("numpy_pack", "torch_pack", "v3_pack", "broken_pack")
TEST_PACKS = ("declared_pack", "unresolvable_pack")


def _need(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.skip(
            f"no ComfyUI prepared ({name} unset): run `python3 dev.py test-comfyui` "
            "(it needs the ComfyUI source tarball; see dev.py)"
        )
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A running ComfyUI server and a small HTTP/websocket client for it."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, base: Path, log: Path):
        self.process = process
        self.port = port
        self.base = base
        self.output = base / "output"
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body[:1] in (b"{", b"[") else body

    def post(self, path: str, data: Any) -> tuple[int, Any]:
        req = urllib.request.Request(
            self.url + path, json.dumps(data).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read()
                return r.status, json.loads(body) if body else None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def run(
        self, prompt: dict[str, Any], *, timeout: float = 120.0, on_message: Any = None
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Queue ``prompt``; return (its history entry, the websocket messages about it)."""
        import websocket

        client_id = uuid.uuid4().hex
        ws = websocket.create_connection(
            f"ws://127.0.0.1:{self.port}/ws?clientId={client_id}", timeout=timeout
        )
        messages: list[dict[str, Any]] = []
        try:
            status, body = self.post("/prompt", {"prompt": prompt, "client_id": client_id})
            assert status == 200, body
            prompt_id = body["prompt_id"]
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                raw = ws.recv()
                if not isinstance(raw, str):
                    continue  # binary preview frames
                message = json.loads(raw)
                data = message.get("data", {})
                if data.get("prompt_id") not in (None, prompt_id):
                    continue
                messages.append(message)
                if on_message is not None:
                    on_message(message)
                kind = message["type"]
                if kind in ("execution_error", "execution_interrupted", "execution_success"):
                    break
                if kind == "executing" and data.get("node") is None and data.get("prompt_id"):
                    break
            else:
                raise AssertionError(f"prompt {prompt_id} did not finish in {timeout}s")
        finally:
            ws.close()
        for _ in range(100):
            history = self.get(f"/history/{prompt_id}")
            if prompt_id in history:
                return history[prompt_id], messages
            time.sleep(0.05)
        raise AssertionError(f"no history for {prompt_id}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@pytest.fixture(scope="session")
def pack_envs() -> dict[str, str]:
    return {
        "numpy": _need("COMFY_ENV_TEST_PACK_ENV_NUMPY"),
        "torch": _need("COMFY_ENV_TEST_PACK_ENV_TORCH"),
    }


def start_server(
    base: Path, comfy_dir: str, python: str, env: dict[str, str], timeout: float = 180
) -> Server:
    """Start ComfyUI on a free port with ``base`` as its base directory (its ``custom_nodes``
    already laid out) and wait until it answers."""
    (base / "output").mkdir(exist_ok=True)
    port = free_port()
    log = base / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                python,
                "main.py",
                "--cpu",
                "--listen",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-auto-launch",
                "--base-directory",
                str(base),
                "--output-directory",
                str(base / "output"),
            ],
            cwd=comfy_dir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    srv = Server(process, port, base, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise AssertionError(f"ComfyUI exited at start-up:\n{srv.log_text()[-4000:]}")
            try:
                srv.get("/system_stats")
                break
            except (OSError, urllib.error.URLError) as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"ComfyUI did not start:\n{srv.log_text()[-4000:]}"
                    ) from exc
                time.sleep(0.25)
    except BaseException:
        stop_server(srv)
        raise
    return srv


def stop_server(srv: Server) -> None:
    """Stop the server's whole process group and check that none of its workers survived."""
    members = []
    try:
        members = psutil.Process(srv.process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    _stop(srv.process)
    _, alive = psutil.wait_procs(members, timeout=10)
    assert not alive, f"processes of the server survived its stop: {alive}"


@pytest.fixture(scope="session")
def env_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's servers build declared envs (``COMFY_ENV_HOME``); uv's own cache
    stays the user's, so a repeat builds from it in seconds."""
    return tmp_path_factory.mktemp("envs")


def server_environment(pack_envs: dict[str, str], base: Path, env_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        COMFY_ENV_EXAMPLE_NUMPY_ENV=pack_envs["numpy"],
        COMFY_ENV_EXAMPLE_TORCH_ENV=pack_envs["torch"],
        COMFY_ENV_COMFYUI_CACHE=str(base / "scan-cache"),
        COMFY_ENV_HOME=str(env_home),
        PYTHONFAULTHANDLER="1",
        # the session provokes many deliberate crashes; the breaker is tested in tests/
        COMFY_ENV_MAX_RESTARTS="50",
    )
    # The server imports comfy_env from this checkout, whichever checkout last installed itself
    # (editable) into the shared, cached ComfyUI venv: two checkouts running the suite at once
    # would otherwise test each other's code. Workers never see it (PYTHONPATH is stripped).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, pack_envs: dict[str, str], env_home: Path
) -> Iterator[Server]:
    comfy_dir = _need("COMFY_ENV_TEST_COMFYUI_DIR")
    python = _need("COMFY_ENV_TEST_COMFYUI_PYTHON")
    base = tmp_path_factory.mktemp("comfyui")
    (base / "custom_nodes").mkdir()
    for pack in PACKS:
        (base / "custom_nodes" / pack).symlink_to(REPO / "examples" / "comfyui" / pack)
    # test-only, runs in the server: shows and instruments ComfyUI's model manager
    (base / "custom_nodes" / "ce_probe").symlink_to(REPO / "tests_comfyui" / "probe_pack")
    # test-only packs whose envs are declared in their pyproject.toml (one cannot be built)
    for pack in TEST_PACKS:
        (base / "custom_nodes" / pack).symlink_to(REPO / "tests_comfyui" / pack)
    srv = start_server(base, comfy_dir, python, server_environment(pack_envs, base, env_home))
    try:
        yield srv
    finally:
        stop_server(srv)
