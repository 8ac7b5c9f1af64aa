"""``CallSite``: the narrow face of the pool that the public handles and the asyncio path use.

Data flow (who holds what; arrows are calls)::

    Worker (_worker)                        RemoteRef (_refs)
      each call its own Exchange, run by      call_method/release
      _exchange (run_plain, run_prepared)       -> site.call(site.exchange(entry)
      or _acall.arun: no frame of the pool's       .prepare(..., bound=...))
      (it reads the site: settings, clock)  |
                                            v
    CallSite (this Protocol; implemented by _pool.Pool)
      exchange                                           a new call (``_exchange.Exchange``)
      call                                               a prepared call leased, run, settled
      dispose_later, status_changed                      what leasing (_lease) asks for
      settings, clock, closed, closed_error, call_ids    what those read
                                |
                                v
    the core (_entry): EnvEntry, Slot, Ticket and the gate

The handles hold a ``CallSite`` and an ``EnvEntry``; they never import ``_pool``, so the pool
can import them without a circle, and a handle depends only on what is written here (and, for
``Worker``'s calls, on ``_exchange.ExchangeSite``, which extends it). The site *is* the pool
object (a Protocol is a type, not a wrapper), so asking it costs one method call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._call import EventCallback, Stage
    from ._entry import EnvEntry, Slot
    from ._errors import PoolClosedError
    from ._settings import Settings

# ``_exchange.run_plain``'s answer when the call must go the general way (``exchange``):
# never a call's result, since nothing unpickled is this object.
GENERAL_PATH: Any = object()


class CallSite(Protocol):
    """What a handle and leasing may ask of their pool (see the module docstring); not for
    users. The call's own steps are its ``Exchange``'s (``_exchange``), not the pool's."""

    settings: Settings  # the values the pool runs on (PoolConfig's fields, already valid)
    clock: Callable[[], float]  # monotonic seconds: idleness, the reaper, the breaker

    @property
    def closed(self) -> bool: ...

    @property
    def call_ids(self) -> Iterator[int]:
        """This pool's call ids (1 is the canary's)."""
        ...

    def closed_error(self) -> PoolClosedError: ...

    def exchange(self, entry: EnvEntry) -> PendingCall:
        """A new call of ``entry``, nothing prepared yet: ``prepare(...)`` checks and
        encodes it; a handle may keep it first as its ticket (to cancel it)."""
        ...

    def call(self, prepared: PendingCall) -> Any:
        """A prepared call to its end: leased (waiting in the queue), run, settled."""
        ...

    def dispose_later(self, process: WorkerGeneration) -> None:
        """Release a retired worker's descriptors and memory soon, off the caller's path."""
        ...

    def status_changed(self) -> None:
        """Something ``comfy-env status`` shows changed (the write is throttled)."""
        ...


class PendingCall(Protocol):
    """A new call of an env as a handle sees it (an ``_exchange.Exchange``, which is also the
    call's ``Ticket``): ``prepare`` checks and encodes it (bad input raises there),
    ``CallSite.call`` runs it to its end; ``cancel`` works from any thread, queued or running.
    After the call, ``ran_on`` and ``generation`` say where it ran (a ``RemoteRef`` is bound
    to them)."""

    entry: EnvEntry
    on_event: EventCallback | None  # set before ``call``: the caller's event callback
    ran_on: Slot | None
    generation: int
    call_id: int
    stage: Stage
    cancelled: bool

    @property
    def site(self) -> CallSite: ...

    def prepare(
        self,
        target: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,  # seconds, already checked (``_settings.check_timeout``)
        bound: tuple[Slot, int] | None = None,
    ) -> PendingCall: ...

    def cancel(self, force: bool = False) -> bool: ...
