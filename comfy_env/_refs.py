"""``RemoteRef``: a handle on an object kept alive inside one worker generation.

``Worker.call_ref`` runs a function in the worker and keeps its result there; the host gets a
``RemoteRef`` naming (env, slot, generation, id). Passing the ref as an argument (or
``ref.call_method``) sends the call to *that* worker, where the ref unpickles to the live object.

The generation is the invalidation authority: once the generation that holds the object is
retired (crash, timeout, reap, close), every use raises ``StaleGenerationError`` naming both
generations, checked in the host before anything is sent and again in the worker
(``comfy_env_worker.refs.resolve``). A ref never silently resolves to an object of another
worker, even if a replacement happens to reuse the id.

Releasing: ``ref.release()`` frees the object now (a call to the worker). A ref that is garbage
collected (or ``discard``-ed) is queued lock-free and its release is woken at once: the pool's
reactor sends it to the worker within milliseconds if the worker is idle, or the moment the
call in flight on it ends, never waiting for another call (``_policies.release_idle``). The
finaliser only appends to a deque and writes one non-blocking byte (``Reactor.notify``):
``__del__`` may run in any thread, inside any lock (a pool's own included), at interpreter exit,
so it takes no lock, blocks on nothing and raises nothing.

Data flow::

    Worker.call_ref -> call_ref(site.exchange(entry), ...)   runs refs:call_and_keep
                       under entry lock: slot.live_refs.add(id) if the generation still holds
                       -> RemoteRef(site, entry, slot, generation, id)
    a later call's arguments -> bound_by_refs(entry, args, kwargs) -> (slot, generation)
                       the call is leased to that slot only; check_bound before it is sent
    ref.release()   -> site.call(exchange.prepare("comfy_env_worker.refs:release",
                       bound=(slot, generation)))
    ref.discard() / __del__ -> entry.dropped_refs (lock-free) + entry.refs_dropped()
                       -> reactor: ``_policies.release_idle`` (an idle worker: one release
                       frame under the entry lock); a worker in a call: when its slot is freed
                       (``Pool.settle``), or by the next call first
                       (``_policies.release_dropped_refs``)

A ref depends on the pool only through ``CallSite`` and on the core's ``EnvEntry``/``Slot``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from comfy_env_worker import refs as worker_refs

from . import _lifecycle as lc
from ._codec import check_target, target_label
from ._entry import holds
from ._errors import ComfyEnvError, RefReleasedError, StaleGenerationError

if TYPE_CHECKING:
    from ._callsite import CallSite, PendingCall
    from ._entry import EnvEntry, Slot


def released_error(ref: RemoteRef) -> RefReleasedError:
    return RefReleasedError(
        f"RemoteRef {ref.id} of env {ref.env} (generation {ref.generation}) was released; "
        "its object is gone"
    )


class RemoteRef:
    """An object living in a worker. Pass it as an argument to calls on the same env, or use
    ``call_method``. Not constructible by users; get one from ``Worker.call_ref``."""

    __slots__ = ("__weakref__", "_entry", "_pool", "_released", "_slot", "generation", "id")

    def __init__(self, pool: CallSite, entry: EnvEntry, slot: Slot, generation: int, ref_id: int):
        self._pool = pool
        self._entry = entry
        self._slot = slot
        self.generation = generation
        self.id = ref_id
        self._released = False

    @property
    def env(self) -> str:
        return self._entry.spec.key

    @property
    def alive(self) -> bool:
        """Whether the object can still be used: not released, and its worker generation is
        still the live one. (A True answer can turn False at any moment if the worker dies;
        using the ref then raises ``StaleGenerationError``.)"""
        return not self._released and self._is_live()

    def call_method(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Call ``obj.name(*args, **kwargs)`` on the live object in its worker."""
        if self._released:
            raise released_error(self)
        try:
            site = self._pool
            call = site.exchange(self._entry)
            return site.call(call.prepare(_CALL_METHOD, (self, name, args, kwargs), {}))
        except ComfyEnvError as exc:
            told_as(exc, _CALL_METHOD, f"RemoteRef {self.id}.{name}")
            raise

    def release(self) -> None:
        """Free the object in the worker now. Idempotent; a no-op once its worker is gone."""
        if self._released:
            return
        self._released = True
        if self._is_live():
            site = self._pool
            bound = (self._slot, self.generation)
            call = site.exchange(self._entry)
            site.call(call.prepare("comfy_env_worker.refs:release", ([self.id],), {}, None, bound))
            self._uncount()

    def discard(self) -> None:
        """Let go of the object without calling the worker: the pool's reactor releases it
        there soon (at once if the worker is idle, else when its call ends), or it goes with
        the worker when that is retired. Idempotent; for code that must not call a worker (a
        reap hook, a finalizer)."""
        if self._released:
            return
        self._released = True
        if self._is_live():
            self._entry.dropped_refs.append((self._slot, self.generation, self.id))
            self._uncount()
            self._entry.refs_dropped()

    def _is_live(self) -> bool:
        with self._entry.lock:
            return holds(self._slot, self.generation) and self.id in self._slot.live_refs

    def _uncount(self) -> None:
        with self._entry.lock:
            self._slot.live_refs.discard(self.id)

    def __reduce__(self) -> tuple[Any, ...]:
        # In the worker this unpickles to the live object (or raises if stale).
        return (worker_refs.resolve, (self.id, self.generation))

    def __del__(self) -> None:
        # Runs in any thread, inside any lock (the entry's or the pool's, during a gc pass in
        # their code), or at interpreter exit with the pool closed and modules half torn down:
        # only an atomic deque.append and a wake-up that takes no lock (``Spawner.refs_dropped``)
        # and nothing that could raise out of here.
        try:
            if self._released:
                return
            self._released = True
            entry = self._entry
            entry.dropped_refs.append((self._slot, self.generation, self.id))
            entry.refs_dropped()
        except Exception:  # noqa: BLE001 - a finaliser must never raise
            pass

    def __repr__(self) -> str:
        return f"<RemoteRef {self.id} env={self.env!r} generation={self.generation}>"


_CALL_AND_KEEP = "comfy_env_worker.refs:call_and_keep"
_CALL_METHOD = "comfy_env_worker.refs:call_method"


def call_ref(
    call: PendingCall,
    target: str | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float | None = None,
) -> RemoteRef:
    """Run ``target(*args, **kwargs)`` as ``call`` (a new exchange of the env, its
    ``on_event`` set if any), keep the result in the worker, and return a ``RemoteRef``
    bound to the generation that ran it (``Worker.call_ref``)."""
    # The target travels as an argument of ``call_and_keep``: checked here, as a direct call's
    # is, so a malformed one raises ``ArgumentError`` before anything runs.
    check_target(target)
    site, entry = call.site, call.entry
    try:
        ref_id = site.call(call.prepare(_CALL_AND_KEEP, (target, args, kwargs), {}, timeout))
    except ComfyEnvError as exc:
        told_as(exc, _CALL_AND_KEEP, target_label(target))
        raise
    slot = call.ran_on
    assert slot is not None
    generation = call.generation
    with entry.lock:
        if holds(slot, generation):
            slot.live_refs.add(ref_id)
    return RemoteRef(site, entry, slot, generation, ref_id)


def told_as(exc: ComfyEnvError, internal: str, shown: str) -> None:
    """``exc`` naming the user's call (``shown``) where it named the runtime's helper that
    carries it (``internal``): a ref's call runs as ``comfy_env_worker.refs:...``, which a
    ``CallTimeout``, a ``WorkerCrashed`` or a ``SerializationError`` would otherwise name as
    its target. Changed in place; the caller re-raises it, traceback intact."""
    if getattr(exc, "target", None) == internal:
        exc.target = shown  # type: ignore[attr-defined]
    if exc.args and isinstance(exc.args[0], str) and internal in exc.args[0]:
        exc.args = (exc.args[0].replace(internal, shown), *exc.args[1:])


def check_bound(entry: EnvEntry, slot: Slot, generation: int) -> None:
    """A call that uses a RemoteRef may only run on the generation that holds the object."""
    state = slot.state
    if holds(slot, generation):
        return
    if state is None or state.generation == generation:
        now = f"generation {generation} was retired ({_retire_text(state)})"
    else:
        now = f"the env's worker is now generation {state.generation}"
    raise StaleGenerationError(
        f"a RemoteRef of env {entry.spec.key} belongs to worker generation {generation}, "
        f"which is gone: {now}; its object died with it",
        env=entry.spec.key,
        generation=generation,
    )


def _retire_text(state: lc.State | None) -> str:
    return state.reason.value if isinstance(state, lc.Retired) else "gone"


def bound_by_refs(
    entry: EnvEntry, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Slot, int] | None:
    """The (slot, generation) the call's RemoteRef arguments live in, if any. Looks at the
    arguments and one container level into them; anything scalar is skipped at once (the
    small-call hot path pays one type check per argument)."""
    found: RemoteRef | None = None
    values = (*args, *kwargs.values()) if kwargs else args
    for value in values:
        kind = type(value)
        if kind in _SCALARS:
            continue
        if kind is list or kind is tuple:
            candidates: Any = value
        elif kind is dict:
            candidates = value.values()
        else:
            candidates = (value,)
        for item in candidates:
            if not isinstance(item, RemoteRef):
                continue
            if item._released:
                raise released_error(item)
            if item._entry is not entry:
                raise StaleGenerationError(
                    f"a RemoteRef of env {item.env} cannot be used in a call to env "
                    f"{entry.spec.key}",
                    env=entry.spec.key,
                    generation=item.generation,
                )
            if found is not None and (item._slot, item.generation) != (
                found._slot,
                found.generation,
            ):
                raise StaleGenerationError(
                    "a call cannot use RemoteRefs of two different workers", env=entry.spec.key
                )
            found = item
    return None if found is None else (found._slot, found.generation)


# Types that can hold no RemoteRef: ``bound_by_refs`` skips them at once.
_SCALARS = frozenset((int, float, bool, type(None), str, bytes))
