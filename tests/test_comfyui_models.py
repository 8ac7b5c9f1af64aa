"""Worker-resident models in ComfyUI's model manager: the registry's rules, without ComfyUI.

``FakeModelManagement`` reproduces the parts of ``comfy.model_management`` (0.3.64) that matter
here, with their hazards: ``LoadedModel`` holds the model and its ``model`` by weak reference,
a ``weakref.finalize`` on the latter runs ``cleanup_models`` (which pops entries), and
``free_memory`` captures indices, calls ``model_unload`` for each, then pops them. The same
sequence on a real ComfyUI server is in ``tests_comfyui/test_models.py``.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from comfy_env._errors import WorkerCrashed
from comfy_env.comfyui import _models
from comfy_env_worker.comfyui.runner import measure

ENV = "/envs/a"


class FakeRef:
    """A RemoteRef's surface: env, generation, alive, release (a worker call), discard."""

    def __init__(self, world: World, generation: int, crash_on_release: bool = False) -> None:
        self.world = world
        self.env = ENV
        self.generation = generation
        self.crash_on_release = crash_on_release
        self.released = False
        self.discarded = False

    @property
    def alive(self) -> bool:
        return not self.released and not self.discarded and self.world.live == self.generation

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.world.live != self.generation:
            return  # a stale ref sends nothing
        self.world.calls.append(self.generation)
        if self.crash_on_release:
            self.world.live = None
            raise WorkerCrashed("the worker died", env=ENV, generation=self.generation)

    def discard(self) -> None:
        self.discarded = True


class World:
    def __init__(self) -> None:
        self.live: int | None = 1  # the live generation
        self.calls: list[int] = []  # generations that received a release call


class LoadedModel:
    def __init__(self, model: Any, mm: FakeModelManagement) -> None:
        self._model = weakref.ref(model)
        self.device = model.load_device
        self.real_model: Any = None
        self.model_finalizer: Any = None
        self._mm = mm

    @property
    def model(self) -> Any:
        return self._model()

    def model_load(self) -> None:
        real = self.model.model
        self.real_model = weakref.ref(real)
        self.model_finalizer = weakref.finalize(real, self._mm.cleanup_models)

    def model_unload(self, memory_to_free: Any = None) -> bool:
        self.model.detach(True)
        self.model_finalizer.detach()
        self.model_finalizer = None
        self.real_model = None
        return True


class FakeModelManagement:
    def __init__(self) -> None:
        self.current_loaded_models: list[LoadedModel] = []
        self.mutations_in_iteration = 0
        self._iterating = False

    def get_torch_device(self) -> str:
        return "cpu"

    def cleanup_models(self) -> None:
        if self._iterating:
            self.mutations_in_iteration += 1
        for i in range(len(self.current_loaded_models) - 1, -1, -1):
            if self.current_loaded_models[i].real_model() is None:
                self.current_loaded_models.pop(i)

    def load_models_gpu(self, models: list[Any]) -> None:
        for m in models:
            entry = LoadedModel(m, self)
            entry.model_load()
            self.current_loaded_models.insert(0, entry)

    def free_memory(self, device: str = "cpu") -> list[LoadedModel]:
        loaded = self.current_loaded_models
        can_unload = [(e.model.model_size(), i) for i, e in enumerate(loaded) if e.device == device]
        unloaded = []
        self._iterating = True
        try:
            for _, i in sorted(can_unload):
                size_before = len(loaded)
                loaded[i].model.model.__class__.__name__  # noqa: B018 - ComfyUI logs this
                if loaded[i].model_unload():
                    unloaded.append(i)
                gc.collect()  # the worst moment for a finalizer
                assert len(loaded) == size_before, "the list changed inside the iteration"
        finally:
            self._iterating = False
        return [loaded.pop(i) for i in sorted(unloaded, reverse=True)]


@pytest.fixture
def setup() -> Iterator[tuple[_models.ModelRegistry, FakeModelManagement, World]]:
    yield _models.ModelRegistry(), FakeModelManagement(), World()


def _register(
    registry: _models.ModelRegistry,
    mm: FakeModelManagement,
    world: World,
    size: int,
    crash: bool = False,
) -> _models.WorkerModel:
    ref: Any = FakeRef(world, world.live or 0, crash)
    model = _models.WorkerModel(registry, ref, size, mm.get_torch_device(), f"m{size}")
    registry.register(mm, model)
    return model


def test_comfyui_counts_a_registered_model_and_its_eviction_releases_it_in_the_worker(
    setup: tuple[_models.ModelRegistry, FakeModelManagement, World],
) -> None:
    registry, mm, world = setup
    model = _register(registry, mm, world, 1000)
    assert [e.model for e in mm.current_loaded_models] == [model]
    assert model.model_size() == model.loaded_size() == 1000
    assert registry.resident_bytes(ENV) == 1000
    assert len(mm.free_memory()) == 1 and mm.current_loaded_models == []
    assert world.calls == [1] and model.state == _models.EVICTED
    assert model.model_size() == 0 and registry.resident_bytes() == 0
    assert registry.retired() == [model]  # kept alive until the next registration
    _register(registry, mm, world, 10)
    assert registry.retired() == []


def test_a_model_that_comfyuis_cache_drops_leaves_through_comfyuis_own_cleanup(
    setup: tuple[_models.ModelRegistry, FakeModelManagement, World],
) -> None:
    registry, mm, world = setup
    kept = _register(registry, mm, world, 100)  # held by the cache (a KeptOutput), not by us
    other = _register(registry, mm, world, 5)
    assert len(mm.current_loaded_models) == 2
    ref = weakref.ref(kept.ref)
    del kept
    gc.collect()
    assert [e.model for e in mm.current_loaded_models] == [other]  # cleanup_models popped it
    assert registry.live() == [other] and ref() is None  # its ref is gone: released by the pool


def test_a_worker_dying_inside_free_memorys_iteration_mutates_nothing_and_skips_nothing(
    setup: tuple[_models.ModelRegistry, FakeModelManagement, World],
) -> None:
    registry, mm, world = setup
    crasher = _register(registry, mm, world, 1, crash=True)  # smallest: unloaded first
    others = [_register(registry, mm, world, n) for n in (20, 30)]
    collected: list[str] = []
    for m in (crasher, *others):
        weakref.finalize(m, collected.append, m.label)
    del m

    unloaded = mm.free_memory()  # the crash and the retirement happen inside it

    assert mm.mutations_in_iteration == 0 and mm.current_loaded_models == []
    assert {e.model for e in unloaded} == {crasher, *others}  # no entry skipped
    assert [m.detach_calls for m in (crasher, *others)] == [1, 1, 1]
    assert world.calls == [1]  # only the first eviction reached the (dying) worker
    assert crasher.state == _models.EVICTED
    assert [m.state for m in others] == [_models.STALE, _models.STALE]
    assert registry.retirements == 1
    del crasher, others, unloaded
    gc.collect()
    assert collected == []  # the retired proxies are alive ...
    world.live = 2
    _register(registry, mm, world, 5)
    gc.collect()
    assert sorted(collected) == ["m1", "m20", "m30"]  # ... until the next registration


def test_a_crash_outside_eviction_leaves_a_stale_entry_until_the_next_registration(
    setup: tuple[_models.ModelRegistry, FakeModelManagement, World],
) -> None:
    registry, mm, world = setup
    old = _register(registry, mm, world, 100)
    world.live = None  # the worker crashed; the pool's event has not arrived yet
    assert old.model_size() == 0  # it reports itself unloaded at once
    registry.generation_retired(ENV, 1)  # the event (from the pool's event thread)
    registry.generation_retired(ENV, 1)  # delivered twice: idempotent
    assert registry.retirements == 1
    assert [e.model for e in mm.current_loaded_models] == [old]  # the list is not touched
    world.live = 2
    new = _register(registry, mm, world, 200)
    assert [e.model for e in mm.current_loaded_models] == [new]
    assert registry.purged_entries == 1 and registry.retired() == []
    assert new.generation == 2 and new.loaded


def test_a_stale_proxy_never_calls_a_new_generation(
    setup: tuple[_models.ModelRegistry, FakeModelManagement, World],
) -> None:
    registry, mm, world = setup
    old = _register(registry, mm, world, 100)
    world.live = 2  # generation 1 was replaced, nobody told the registry yet
    assert not old.loaded and old.model_size() == 0
    mm.free_memory()
    assert world.calls == []  # the release was never sent to generation 2
    assert old.detach_calls == 1 and mm.current_loaded_models == []


class FakeQueue:
    def __init__(self) -> None:
        self.mutex = threading.RLock()
        self.currently_running: dict[int, Any] = {}
        self.flags: dict[str, Any] = {}


@pytest.fixture
def comfyui_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, FakeQueue]]:
    mm = FakeModelManagement()
    queue = FakeQueue()
    server = types.ModuleType("server")
    server.PromptServer = types.SimpleNamespace(  # type: ignore[attr-defined]
        instance=types.SimpleNamespace(prompt_queue=queue)
    )
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "server", server)
    yield mm, queue


def test_the_reap_hook_evicts_through_the_model_manager_between_prompts(
    comfyui_modules: tuple[Any, FakeQueue],
) -> None:
    mm, queue = comfyui_modules
    registry, world = _models.ModelRegistry(), World()
    model = _register(registry, mm, world, 100)
    other_env = _register(registry, mm, world, 7)
    other_env.env = "/envs/b"
    queue.currently_running[1] = "a prompt"
    registry.evict_for_reap(ENV, 1)
    assert model.loaded and len(mm.current_loaded_models) == 2  # not while a prompt runs
    queue.currently_running.clear()
    queue.flags["unload_models"] = True
    registry.evict_for_reap(ENV, 1)
    assert model.loaded  # nor while a /free is pending
    queue.flags.clear()
    registry.evict_for_reap(ENV, 1)
    assert [e.model for e in mm.current_loaded_models] == [other_env]
    assert model.state == _models.EVICTED and model.evicted_by == "reaper"
    assert model.detach_calls == 1
    assert model.ref.discarded and world.calls == []  # let go without calling the worker
    registry.evict_for_reap(ENV, 1)  # nothing left: a no-op
    assert other_env.loaded


def test_the_worker_measures_what_a_kept_output_holds() -> None:
    class Weights:
        def __init__(self) -> None:
            self.a = np.ones(1000)  # 8000 bytes
            self.nested = [bytes(10), {"b": np.ones(10, np.float32)}, "text", 3]
            self.me = self  # a cycle is counted once

    class Sized:
        def comfy_env_size(self) -> int:
            return 12345

    shared = np.ones(100, np.uint8)
    assert measure(Weights()) == 8000 + 10 + 40
    assert measure([Sized(), shared, shared, bytearray(5)]) == 12345 + 100 + 5
    assert measure(object()) == 0 and measure(None) == 0
