"""``isolate(..., warm=True)``: the pack's worker is started and its module imported before the
first prompt, after a server start with a cached scan and again right after each death.

The pack's module appends its worker's pid to a file when it is imported, so each test sees
which worker imported it and when, and that a node call did not import it again.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest
from conftest import wait_until

import comfy_env
from comfy_env._events import WorkerRetired
from comfy_env.comfyui import isolate
from comfy_env.comfyui._warm import Warmer

NODES = """
import ctypes
import os

with open({imports!r}, "a") as fh:
    fh.write("%d\\n" % os.getpid())
if os.path.exists({crash_flag!r}):
    ctypes.string_at(0)  # the module crashes its worker at import


class Pid:
    RETURN_TYPES = ("INT",)
    FUNCTION = "pid"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{}}}}

    def pid(self):
        return (os.getpid(),)


class Crash:
    RETURN_TYPES = ("INT",)
    FUNCTION = "crash"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{}}}}

    def crash(self):
        ctypes.string_at(0)


NODE_CLASS_MAPPINGS = {{"Pid": Pid, "Crash": Crash}}
"""


class Pack:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.imports = root.parent / "imports.txt"
        self.crash_flag = root.parent / "crash-at-import"
        root.mkdir()
        (root / "__init__.py").write_text("raise RuntimeError('the pack init must not run')\n")
        (root / "nodes.py").write_text(
            NODES.format(imports=str(self.imports), crash_flag=str(self.crash_flag))
        )

    def importers(self) -> list[int]:
        if not self.imports.exists():
            return []
        return [int(line) for line in self.imports.read_text().split()]


@pytest.fixture
def pack(tmp_path: Path) -> Pack:
    return Pack(tmp_path / "pack")


def _isolate(
    pack: Pack, pool: comfy_env.Pool, cache: Path, warm: bool = True
) -> tuple[dict[str, type], Warmer | None]:
    mappings, _ = isolate(
        str(pack.root / "__init__.py"), None, "nodes", pool=pool, cache_dir=str(cache), warm=warm
    )
    warmer = mappings["Pid"]._comfy_env_node.pack.warmer  # type: ignore[attr-defined]
    return mappings, warmer


def _pid(mappings: dict[str, type]) -> int:
    result: tuple[int] = asyncio.run(mappings["Pid"]().pid())  # type: ignore[attr-defined]
    return result[0]


def _retired_events(pool: comfy_env.Pool) -> tuple[list[WorkerRetired], threading.Event]:
    seen: list[WorkerRetired] = []
    got = threading.Event()

    def on_event(event: object) -> None:
        if isinstance(event, WorkerRetired):
            seen.append(event)
            got.set()

    pool.subscribe(on_event)
    return seen, got


def test_a_warm_pack_imports_its_module_before_the_first_prompt_after_a_cached_start(
    pack: Pack, config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    with comfy_env.Pool(config) as first:
        _isolate(pack, first, cache, warm=False)  # the scan, now cached
    scanned_by = pack.importers()
    with comfy_env.Pool(config) as pool:
        mappings, warmer = _isolate(pack, pool, cache)
        assert warmer is not None and warmer.join(60)
        warmed_by = pack.importers()[len(scanned_by) :]
        assert len(warmed_by) == 1 and warmer.warmups == 1  # imported once, before any prompt
        assert _pid(mappings) == warmed_by[0]  # the first prompt runs there
        assert pack.importers()[len(scanned_by) :] == warmed_by  # and imports nothing again
        assert pool.stats()[sys.prefix].spawns == 1


def test_a_cold_pack_pays_its_import_at_the_first_prompt(
    pack: Pack, config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    """The same without warm: the first prompt spawns the worker and imports the module (what
    ``warm`` saves)."""
    cache = tmp_path / "cache"
    with comfy_env.Pool(config) as first:
        _isolate(pack, first, cache, warm=False)
    before = len(pack.importers())
    with comfy_env.Pool(config) as pool:
        mappings, warmer = _isolate(pack, pool, cache, warm=False)
        assert warmer is None and pool.stats() == {}
        pid = _pid(mappings)
        assert pack.importers()[before:] == [pid]


def test_after_a_crash_a_fresh_worker_imports_the_module_before_the_next_prompt(
    pack: Pack, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, warmer = _isolate(pack, pool, tmp_path / "cache")  # scanned: warm already
    assert warmer is not None
    scanned_by = pack.importers()
    assert _pid(mappings) == scanned_by[-1]
    with pytest.raises(comfy_env.WorkerCrashed):
        asyncio.run(mappings["Crash"]().crash())  # type: ignore[attr-defined]
    assert wait_until(lambda: warmer.warmups == 1, timeout=30)
    assert warmer.join(30)
    rewarmed_by = pack.importers()[len(scanned_by) :]
    assert len(rewarmed_by) == 1 and rewarmed_by[0] != scanned_by[-1]
    assert _pid(mappings) == rewarmed_by[0]
    assert pack.importers()[len(scanned_by) :] == rewarmed_by


def test_an_idle_reap_is_not_undone_by_a_warm_up(
    pack: Pack, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    _, warmer = _isolate(pack, pool, tmp_path / "cache")
    assert warmer is not None
    seen, got = _retired_events(pool)  # subscribed after the warmer: told after it
    assert pool.retire_idle(sys.prefix) == 1
    assert got.wait(10) and seen[0].reason == "idle"
    assert warmer.join(10) and warmer.warmups == 0
    assert pool.stats()[sys.prefix].spawns == 1


def test_a_module_that_crashes_at_import_is_not_warmed_in_a_loop(
    pack: Pack, config: comfy_env.PoolConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    with comfy_env.Pool(config) as first:
        _isolate(pack, first, cache, warm=False)  # scanned while it imported fine
    pack.crash_flag.write_text("")
    with comfy_env.Pool(config) as pool:
        seen, got = _retired_events(pool)
        mappings, warmer = _isolate(pack, pool, cache)
        assert warmer is not None and warmer.join(60)
        assert got.wait(10) and seen[0].reason == "crashed"
        assert warmer.join(10)
        assert not warmer.healthy and warmer.warmups == 0
        assert pool.stats()[sys.prefix].spawns == 1  # the death started no other warm-up
        assert "could not warm node pack" in caplog.text
        # The env recovers: a prompt succeeds, and the next crash is warmed after again.
        pack.crash_flag.unlink()
        assert _pid(mappings) > 0
        with pytest.raises(comfy_env.WorkerCrashed):
            asyncio.run(mappings["Crash"]().crash())  # type: ignore[attr-defined]
        assert wait_until(lambda: warmer.warmups == 1, timeout=30)
        assert warmer.join(30) and warmer.healthy


def test_warm_must_be_a_bool(pack: Pack, pool: comfy_env.Pool, tmp_path: Path) -> None:
    with pytest.raises(comfy_env.ArgumentError, match="warm"):
        isolate(str(pack.root), None, "nodes", pool=pool, warm="yes")  # type: ignore[arg-type]
