"""Worker-resident models inside ComfyUI's memory management.

An isolated node whose outputs stay in its worker (``KeptOutput``, a loaded model, a mesh
kernel) leaves a ``RemoteRef`` of its run in the host. ``register`` wraps that ref in a
``WorkerModel``: a small host object with the interface of ComfyUI's ``ModelPatcher`` that
``comfy.model_management.load_models_gpu`` accepts, so the run appears in
``current_loaded_models`` with the size measured in the worker. Data flow::

    proxy.run_node (prompt thread, node execution)
      -> REGISTRY.register(mm, WorkerModel(run ref, bytes measured in the worker)); the run's
         KeptOutputs hold the proxy, so ComfyUI's output cache owns it, as it owns its own
         ModelPatchers (current_loaded_models only holds them by weak reference): when the
         cache drops the outputs, ComfyUI's cleanup_models removes the entry and the run's ref
         is released
           1. purge: entries of retired proxies (evicted, or of a dead generation) leave
              current_loaded_models; the retired proxies are dropped (now they may be freed)
           2. mm.load_models_gpu([proxy])  -> LoadedModel(proxy) inserted by ComfyUI itself
    ComfyUI free_memory / unload_all_models / POST /free (prompt thread)
      -> LoadedModel.model_unload() -> WorkerModel.detach()
           -> RemoteRef.release(): the worker drops the run (its memory returns);
              the proxy moves to the retired list (kept alive) and reports size 0
    pool event WorkerRetired(env, g) (the pool's event thread)  -> generation_retired(env, g)
    idle reaper (reactor thread) -> Pool reap hook -> evict_for_reap(env, g)

**The invariant (ADR-0019, ``_STALE_PATCHERS``).** A worker can die while ComfyUI iterates over
``current_loaded_models`` (``free_memory``: an eviction calls into the worker, the call finds it
dead). ``generation_retired`` then runs inside that iteration: synchronously from ``detach``, and
again from the pool's event thread, concurrently with it. So it (a) never mutates ComfyUI's list
(``free_memory`` captured indices before calling ``model_unload``) and (b) never drops the last
strong reference to a proxy: ``LoadedModel`` holds the proxy and its ``model`` only by weak
reference, and the ``weakref.finalize`` on ``model`` runs ``cleanup_models``, which pops entries
from the list -- mid-iteration, that corrupts it. Retired proxies are therefore kept in
``_retired`` until the next ``register`` call, which runs on the prompt thread (no iteration in
progress), removes their entries from the list and only then lets them go.

**Generation.** A proxy is bound to the generation of its ref. Once that generation is gone it
reports itself unloaded (size 0) and its ``detach`` sends nothing: ``RemoteRef`` checks the
generation in the host and releases are bound to it, so a proxy never reaches a new worker.

**Reaping.** Before the idle reaper retires a worker holding registered models, the pool's reap
hook (``Pool.add_reap_hook``) evicts them through ComfyUI's model manager
(``LoadedModel.model_unload`` and removal from the list), under ComfyUI's queue mutex and only
while no prompt runs and no ``/free`` is pending (the prompt thread is the list's only other
user; otherwise the worker stays and the reaper asks again on its next tick). The refs are
discarded without a call (``RemoteRef.discard``); with no live ref left, the reaper retires the
worker.

**What is counted.** ``model_size()`` / ``loaded_size()`` are the bytes of the kept outputs as
measured in the worker right after the run, and again after every node run that used them
(``update_sizes``: a node may load more into a kept object, or drop some): numpy arrays, torch
tensors and module parameters, bytes, containers and object attributes (see
``comfy_env_worker.comfyui.runner.measure``); 0 once the model is evicted or its generation is
gone. They count against ``comfy.model_management.get_torch_device()`` (the device
``unload_all_models`` frees), also when the worker holds the object in RAM. The worker's own
interpreter (~20-200 MB) is not counted: evicting cannot free it; only the reaper does.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from .._errors import WorkerError
from .._events import Event, WorkerRetired

if TYPE_CHECKING:
    from .._pool import Pool
    from .._refs import RemoteRef

log = logging.getLogger("comfy_env.comfyui")

LOADED = "loaded"
EVICTED = "evicted"
STALE = "stale"


class WorkerResident:
    """What ComfyUI sees as the "real model" of a ``WorkerModel`` (it holds it by weak
    reference and logs its class name). Carries no data: the object lives in the worker."""

    def __init__(self, label: str, size: int) -> None:
        self.label = label
        self.size = size

    def __repr__(self) -> str:
        return f"<WorkerResident {self.label} {self.size} bytes>"


class WorkerModel:
    """A worker-resident model, as ComfyUI's model manager sees it (the ``ModelPatcher``
    interface it uses). Not constructed by users: ``register`` makes one per node run whose
    outputs stay in the worker."""

    def __init__(
        self, registry: ModelRegistry, ref: RemoteRef, size: int, device: Any, label: str
    ) -> None:
        self._registry = registry
        self.ref = ref
        self.env = ref.env
        self.generation = ref.generation
        self.size = max(int(size), 0)
        self.label = label
        self.load_device = device
        self.offload_device = device
        self.parent = None
        self.model = WorkerResident(label, self.size)
        self.state = LOADED
        self.detach_calls = 0  # how often ComfyUI asked it to unload (diagnostics, tests)
        self.evicted_by: str | None = None  # "comfyui" (model_unload) or "reaper"

    # ---- sizes: what ComfyUI's memory decisions see ----

    @property
    def loaded(self) -> bool:
        """Whether the object is still held by the live worker generation."""
        return self.state == LOADED and self.ref.alive

    def model_size(self) -> int:
        return self.size if self.loaded else 0

    def loaded_size(self) -> int:
        return self.model_size()

    def current_loaded_device(self) -> Any:
        return self.load_device

    def model_dtype(self) -> Any:
        return None

    def lowvram_patch_counter(self) -> int:
        return 0

    # ---- loading: nothing to move, the object is already in the worker ----

    def model_patches_to(self, device: Any) -> None:
        return None

    def model_patches_models(self) -> list[Any]:
        return []

    def partially_load(
        self, device: Any, extra_memory: Any = 0, force_patch_weights: bool = False
    ) -> int:
        return 0

    def partially_unload(self, device: Any, memory_to_free: Any = 0) -> int:
        return 0  # all or nothing: ComfyUI then unloads it whole (detach)

    def is_clone(self, other: Any) -> bool:
        # load_models_gpu unloads clones of a model it loads; a worker model has none (and is
        # registered once), so it never asks ComfyUI to detach itself on registration.
        return False

    # ---- eviction ----

    def detach(self, unpatch_all: bool = True) -> None:
        """ComfyUI unloads the model (``LoadedModel.model_unload``, inside its iteration over
        ``current_loaded_models``): release the object in the worker. Mutates no list."""
        self.detach_calls += 1
        if self.state != LOADED:
            return
        self.evicted_by = self.evicted_by or "comfyui"
        self._registry.evicted(self)
        if self.evicted_by == "reaper":
            self.ref.discard()  # the worker is retired right after: nothing is sent
            return
        try:
            self.ref.release()  # a no-op when its generation is already gone
        except WorkerError as exc:
            # The worker died under this call. Its retirement is handled here, inside
            # ComfyUI's iteration: the callback only marks proxies (see the module docstring).
            log.warning("comfy-env: evicting %s: its worker is gone (%s)", self.label, str(exc))
            self._registry.generation_retired(self.env, self.generation)

    def __repr__(self) -> str:
        return (
            f"<WorkerModel {self.label} env={self.env!r} generation={self.generation} "
            f"{self.state} {self.size} bytes>"
        )


class _QuietRegistration(logging.Filter):
    """Moves ComfyUI's INFO records about loading a ``WorkerResident`` to DEBUG on our logger.
    Installed on the root logger (ComfyUI logs with ``logging.info``) only while
    ``load_models_gpu`` registers a worker model; records of other models pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or "WorkerResident" not in str(record.msg):
            return True
        log.debug("ComfyUI: %s", record.getMessage())
        return False


_QUIET_REGISTRATION = _QuietRegistration()


class ModelRegistry:
    """The host's registered worker models: live ones (weakly: ComfyUI's cache owns them), and
    retired ones (strongly) kept alive until the next registration. Thread-safe:
    ``generation_retired`` arrives on the pool's event thread (and inside ComfyUI's iteration),
    the reap hook on the reactor thread, the rest on ComfyUI's prompt thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Weak, like ComfyUI's own list: ComfyUI's output cache owns a live model (through its
        # KeptOutputs); once the cache drops it, ComfyUI's cleanup_models removes its entry and
        # the run's ref is released. Only retired proxies are held strongly.
        self._live: weakref.WeakSet[WorkerModel] = weakref.WeakSet()
        self._retired: list[WorkerModel] = []  # strong refs: see the module docstring
        self._pools: weakref.WeakSet[Pool] = weakref.WeakSet()
        self.retirements = 0  # generation_retired calls that retired at least one proxy
        self.purged_entries = 0  # list entries removed at registrations

    # ---- observations ----

    def live(self) -> list[WorkerModel]:
        with self._lock:
            return list(self._live)

    def retired(self) -> list[WorkerModel]:
        with self._lock:
            return list(self._retired)

    def resident_bytes(self, env: str | None = None) -> int:
        """Bytes of the live models (of ``env``, or all): what ComfyUI is told."""
        return sum(m.model_size() for m in self.live() if env is None or m.env == env)

    # ---- transitions ----

    def attach(self, pool: Pool) -> None:
        """Follow ``pool``'s retirements and answer its reaper (once per pool)."""
        with self._lock:
            if pool in self._pools:
                return
            self._pools.add(pool)
        pool.subscribe(self._on_event)
        pool.add_reap_hook(self.evict_for_reap)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, WorkerRetired):
            self.generation_retired(event.env, event.generation)

    def generation_retired(self, env: str, generation: int) -> int:
        """The worker generation ``(env, generation)`` is gone: its proxies report themselves
        unloaded and move to the retired list. Never touches ComfyUI's list, never drops a
        proxy (may run inside ComfyUI's iteration). Idempotent. Returns how many moved."""
        with self._lock:
            gone = [m for m in self._live if m.env == env and m.generation == generation]
            if not gone:
                return 0
            for m in gone:
                m.state = STALE
            for m in gone:
                self._live.discard(m)
            self._retired.extend(gone)
            self.retirements += 1
        return len(gone)

    def update_sizes(self, refs: list[RemoteRef], sizes: list[int | None]) -> None:
        """The worker measured the kept runs ``refs`` again (after a node used them): their
        models report the new sizes from now on."""
        with self._lock:
            for ref, size in zip(refs, sizes, strict=False):
                if size is None:
                    continue
                for m in self._live:
                    if m.ref is ref:
                        m.size = m.model.size = max(int(size), 0)

    def evicted(self, model: WorkerModel) -> None:
        with self._lock:
            if model.state != LOADED:
                return
            model.state = EVICTED
            self._live.discard(model)
            self._retired.append(model)

    def purge(self, loaded: list[Any]) -> int:
        """Remove the entries of retired proxies from ComfyUI's ``current_loaded_models``
        (``loaded``) and let the retired proxies go. Call only where no iteration over the list
        is in progress (the prompt thread, at a registration). Returns entries removed."""
        with self._lock:
            retired, self._retired = self._retired, []
        removed = 0
        for i in range(len(loaded) - 1, -1, -1):
            entry = loaded[i]
            if any(entry.model is m for m in retired):
                loaded.pop(i)
                finalizer = getattr(entry, "model_finalizer", None)
                if finalizer is not None:
                    finalizer.detach()  # the proxy may be freed now; no cleanup_models for it
                removed += 1
        with self._lock:
            self.purged_entries += removed
        return removed

    def register(self, mm: Any, model: WorkerModel) -> None:
        """Hand ``model`` to ComfyUI's model manager ``mm`` (``comfy.model_management``), after
        purging retired entries. Runs on the prompt thread, from the node's proxy."""
        self.purge(mm.current_loaded_models)
        with self._lock:
            self._live.add(model)
        # ComfyUI logs "Requested to load <class>" at INFO for every model it loads, and a kept
        # output is registered on every run of its node: one server log line per run. Those
        # lines (ours only: the class is WorkerResident) go to comfy_env's log at DEBUG.
        root = logging.getLogger()
        root.addFilter(_QUIET_REGISTRATION)
        try:
            mm.load_models_gpu([model])
        finally:
            root.removeFilter(_QUIET_REGISTRATION)

    def evict_for_reap(self, env: str, generation: int) -> None:
        """The pool's reap hook: evict the models of ``(env, generation)`` through ComfyUI's
        model manager (their refs are discarded, so the reaper can retire the worker). Does
        nothing while a prompt runs or a ``/free`` is pending: the worker then stays, and the
        reaper asks again on its next tick."""
        with self._lock:
            ours = [m for m in self._live if m.env == env and m.generation == generation]
        if not ours:
            return
        mm = sys.modules.get("comfy.model_management")
        queue = _prompt_queue()
        if mm is None or queue is None:
            for m in ours:
                m.evicted_by = "reaper"
                m.detach()
            return
        with queue.mutex:
            if queue.currently_running or queue.flags:
                return
            loaded = mm.current_loaded_models
            for i in range(len(loaded) - 1, -1, -1):
                entry = loaded[i]
                model = entry.model
                if any(model is m for m in ours):
                    model.evicted_by = "reaper"
                    if getattr(entry, "model_finalizer", None) is not None:
                        entry.model_unload()  # ComfyUI's own unload: detach + finalizer
                    else:
                        model.detach()
                    loaded.pop(i)
        for m in ours:  # registered but no longer listed: let go all the same
            if m.state == LOADED:
                m.evicted_by = "reaper"
                m.detach()


def _prompt_queue() -> Any:
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    return getattr(instance, "prompt_queue", None)


REGISTRY = ModelRegistry()


def register(pool: Pool, ref: RemoteRef, size: int, label: str) -> WorkerModel | None:
    """Register the kept run ``ref`` with ComfyUI's model manager, when this process is a
    ComfyUI server (else None)."""
    mm = sys.modules.get("comfy.model_management")
    if mm is None or not hasattr(mm, "load_models_gpu"):
        return None
    REGISTRY.attach(pool)
    model = WorkerModel(REGISTRY, ref, size, mm.get_torch_device(), label)
    REGISTRY.register(mm, model)
    return model
