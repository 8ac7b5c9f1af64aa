"""A pack that reads the server's directories when its module is imported, isolated.

Very many packs do ``INPUT_DIR = folder_paths.get_input_directory()`` at module level. In the
env, ``folder_paths`` is comfy-env's stand-in; it must answer with the server's directories at
the scan, in a worker started after a crash, and in a worker started when the scan came from
the cache (the module is then imported inside the first node call). The server is played by a
``folder_paths`` module in this process, as ComfyUI's own is when a pack is loaded.
"""

from __future__ import annotations

import asyncio
import sys
import types
from pathlib import Path

import pytest

import comfy_env
from comfy_env.comfyui import isolate

NODES = """
import ctypes
import os
import folder_paths

INPUT_DIR = folder_paths.get_input_directory()
OUTPUT_AT_IMPORT = folder_paths.get_output_directory()


class Where:
    RETURN_TYPES = ("STRING", "STRING", "STRING", "INT")
    FUNCTION = "where"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def where(self):
        return (INPUT_DIR, OUTPUT_AT_IMPORT, folder_paths.get_temp_directory(), os.getpid())


class Crash:
    RETURN_TYPES = ("INT",)
    FUNCTION = "crash"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def crash(self):
        ctypes.string_at(0)


NODE_CLASS_MAPPINGS = {"Where": Where, "Crash": Crash}
"""


@pytest.fixture
def server_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    dirs = {name: str(tmp_path / "server" / name) for name in ("input", "output", "temp")}
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_input_directory = lambda: dirs["input"]  # type: ignore[attr-defined]
    folder_paths.get_output_directory = lambda: dirs["output"]  # type: ignore[attr-defined]
    folder_paths.get_temp_directory = lambda: dirs["temp"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    return dirs


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


def _where(mappings: dict[str, type]) -> tuple[str, str, str, int]:
    result: tuple[str, str, str, int] = asyncio.run(mappings["Where"]().where())  # type: ignore[attr-defined]
    return result


def test_directories_read_at_import_are_the_servers_at_the_scan_and_after_a_crash(
    pack: Path, server_dirs: dict[str, str], pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings = _isolate(pack, pool, tmp_path / "cache")  # the scan imports the module
    expected = (server_dirs["input"], server_dirs["output"], server_dirs["temp"])
    first = _where(mappings)
    assert first[:3] == expected
    with pytest.raises(comfy_env.WorkerCrashed):
        asyncio.run(mappings["Crash"]().crash())  # type: ignore[attr-defined]
    again = _where(mappings)  # a fresh worker imports the module inside this call
    assert again[3] != first[3]
    assert again[:3] == expected


def test_directories_read_at_import_are_the_servers_when_the_scan_came_from_the_cache(
    pack: Path, server_dirs: dict[str, str], config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with comfy_env.Pool(config) as first:
        _isolate(pack, first, cache)
    with comfy_env.Pool(config) as warm:
        mappings = _isolate(pack, warm, cache)
        assert warm.stats() == {}  # the scan came from the cache: no worker yet
        assert _where(mappings)[:3] == (
            server_dirs["input"],
            server_dirs["output"],
            server_dirs["temp"],
        )


def test_other_server_directories_are_another_scan(
    pack: Path, server_dirs: dict[str, str], config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    """A module may have kept what it read at import: a server started with another input
    directory must not reuse the scan (or the INPUT_TYPES) made under the old one."""
    cache = tmp_path / "cache"
    with comfy_env.Pool(config) as first:
        _isolate(pack, first, cache)
    server_dirs["input"] = str(tmp_path / "elsewhere")
    with comfy_env.Pool(config) as moved:
        mappings = _isolate(pack, moved, cache)
        assert moved.stats()[sys.prefix].spawns == 1  # scanned again
        assert _where(mappings)[0] == server_dirs["input"]
