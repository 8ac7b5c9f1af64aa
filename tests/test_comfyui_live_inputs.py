"""Live ``INPUT_TYPES``: a node's list of choices (the files of the input directory) follows the
files while the server runs, as it does in-process, at a bounded cost (``comfyui._live``).

The server is played by a ``folder_paths`` module in this process, as ComfyUI's own is.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import types
from pathlib import Path

import pytest
from conftest import wait_until

import comfy_env
from comfy_env.comfyui import isolate

NODES = """
import os
import time

import folder_paths


class LoadFile:
    RETURN_TYPES = ("INT",)
    FUNCTION = "load"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        files = sorted(os.listdir(folder_paths.get_input_directory()))
        return {"required": {"file": (files, {})}}

    def load(self, file):
        return (os.path.getsize(os.path.join(folder_paths.get_input_directory(), file)),)


class Sleep:
    RETURN_TYPES = ("INT",)
    FUNCTION = "sleep"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seconds": ("FLOAT", {})}}

    def sleep(self, seconds):
        time.sleep(seconds)
        return (os.getpid(),)


NODE_CLASS_MAPPINGS = {"LoadFile": LoadFile, "Sleep": Sleep}
"""


@pytest.fixture
def input_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "server"
    for name in ("input", "output", "temp"):
        (root / name).mkdir(parents=True)
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_input_directory = lambda: str(root / "input")  # type: ignore[attr-defined]
    folder_paths.get_output_directory = lambda: str(root / "output")  # type: ignore[attr-defined]
    folder_paths.get_temp_directory = lambda: str(root / "temp")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    (root / "input" / "a.png").write_bytes(b"a")
    return root / "input"


@pytest.fixture
def pack(tmp_path: Path) -> Path:
    root = tmp_path / "pack"
    root.mkdir()
    (root / "__init__.py").write_text("raise RuntimeError('the pack init must not run')\n")
    (root / "nodes.py").write_text(NODES)
    return root


def _isolate(pack: Path, pool: comfy_env.Pool, cache: Path) -> dict[str, type]:
    mappings, _ = isolate(str(pack / "__init__.py"), None, "nodes", pool=pool, cache_dir=str(cache))
    return mappings


def _choices(mappings: dict[str, type]) -> list[str]:
    spec = mappings["LoadFile"].INPUT_TYPES()  # type: ignore[attr-defined]
    return list(spec["required"]["file"][0])


def test_a_list_of_files_follows_the_input_directory(
    pack: Path, input_dir: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings = _isolate(pack, pool, tmp_path / "cache")  # scanned with a.png only
    (input_dir / "b.png").write_bytes(b"bb")  # an upload
    assert _choices(mappings) == ["a.png", "b.png"]
    (input_dir / "c.png").write_bytes(b"ccc")
    assert wait_until(lambda: _choices(mappings) == ["a.png", "b.png", "c.png"], timeout=10)
    size = asyncio.run(mappings["LoadFile"]().load(file="c.png"))  # type: ignore[attr-defined]
    assert size == (3,)


def test_one_worker_call_answers_for_a_burst_and_nodes_without_choices_never_ask(
    pack: Path, input_dir: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings = _isolate(pack, pool, tmp_path / "cache")
    live = mappings["LoadFile"]._comfy_env_node.pack.live_inputs  # type: ignore[attr-defined]
    for _ in range(50):  # /object_info and validation asking again and again
        _choices(mappings)
        mappings["Sleep"].INPUT_TYPES()  # type: ignore[attr-defined]
    assert 1 <= live.calls <= 3  # one per LIVE_TTL, not one per question
    assert live.names == ["LoadFile"]


def test_without_a_live_worker_the_scan_answers_and_nothing_is_spawned(
    pack: Path, input_dir: Path, config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with comfy_env.Pool(config) as first:
        _isolate(pack, first, cache)
    (input_dir / "b.png").write_bytes(b"bb")
    with comfy_env.Pool(config) as pool:
        mappings = _isolate(pack, pool, cache)  # from the cache: no worker
        assert _choices(mappings) == ["a.png"]  # the scan's list
        assert pool.stats() == {}  # asking spawned nothing


def test_a_busy_worker_is_not_waited_for(
    pack: Path, input_dir: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings = _isolate(pack, pool, tmp_path / "cache")
    outcome: list[BaseException] = []

    def sleep() -> None:
        try:
            asyncio.run(mappings["Sleep"]().sleep(seconds=20.0))  # type: ignore[attr-defined]
        except comfy_env.PoolClosedError as exc:
            outcome.append(exc)

    sleeper = threading.Thread(target=sleep, daemon=True)
    sleeper.start()
    assert wait_until(lambda: pool.stats()[sys.prefix].state == "in_call", timeout=10)
    (input_dir / "b.png").write_bytes(b"bb")
    assert _choices(mappings) == ["a.png"]  # the scan answers at once...
    assert sleeper.is_alive()  # ...while the node still runs: nothing waited for it
    pool.close()  # ends the sleeping call
    sleeper.join(10)
    assert outcome
