"""``RemoteRef``: a handle on an object kept alive inside one worker generation.

``Worker.call_ref`` runs a function in the worker and keeps its result there; the host gets a
``RemoteRef`` naming (env, slot, generation, id). Passing the ref as an argument (or
``ref.call_method``) sends the call to *that* worker, where the ref unpickles to the live object.

The generation is the invalidation authority: once the generation that holds the object is
retired (crash, timeout, reap, close), every use raises ``StaleGenerationError`` naming both
generations, checked in the host before anything is sent and again in the worker
(``comfy_env_worker.refs.resolve``). A ref never silently resolves to an object of another
worker, even if a replacement happens to reuse the id.

Releasing: ``ref.release()`` frees the object now (a call to the worker); a ref that is garbage
collected is queued lock-free (``__del__`` may run inside any code, even under a pool lock) and
released before the next call on its worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from comfy_env_worker import refs as worker_refs

from ._errors import RefReleasedError

if TYPE_CHECKING:
    from ._pool import Pool, _EnvEntry, _Slot


def released_error(ref: RemoteRef) -> RefReleasedError:
    return RefReleasedError(
        f"RemoteRef {ref.id} of env {ref.env} (generation {ref.generation}) was released; "
        "its object is gone"
    )


class RemoteRef:
    """An object living in a worker. Pass it as an argument to calls on the same env, or use
    ``call_method``. Not constructible by users; get one from ``Worker.call_ref``."""

    __slots__ = ("__weakref__", "_entry", "_pool", "_released", "_slot", "generation", "id")

    def __init__(self, pool: Pool, entry: _EnvEntry, slot: _Slot, generation: int, ref_id: int):
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
        return not self._released and self._pool._ref_is_live(self)

    def call_method(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Call ``obj.name(*args, **kwargs)`` on the live object in its worker."""
        if self._released:
            raise released_error(self)
        return self._pool.call(
            self._entry, "comfy_env_worker.refs:call_method", (self, name, args, kwargs), {}, None
        )

    def release(self) -> None:
        """Free the object in the worker now. Idempotent; a no-op once its worker is gone."""
        if self._released:
            return
        self._released = True
        if self._pool._ref_is_live(self):
            self._pool.call(
                self._entry,
                "comfy_env_worker.refs:release",
                ([self.id],),
                {},
                None,
                bound=(self._slot, self.generation),
            )
            self._pool._ref_released(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # In the worker this unpickles to the live object (or raises if stale).
        return (worker_refs.resolve, (self.id, self.generation))

    def __del__(self) -> None:
        if not self._released:
            self._released = True
            # Lock-free hand-off: deque.append is atomic; the pool drains it before a call.
            self._entry.dropped_refs.append((self._slot, self.generation, self.id))

    def __repr__(self) -> str:
        return f"<RemoteRef {self.id} env={self.env!r} generation={self.generation}>"
