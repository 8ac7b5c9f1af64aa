"""``CallSite``: the narrow face of the pool that the public handles and the asyncio path use.

Data flow (who holds what; arrows are calls)::

    Worker (_worker) ----------.            RemoteRef (_refs)
      call/run/submit/arun_ref  |             call_method/release -> site.call(bound=...)
      (call/run: call_plain     |
       first, else call)        |
      acall/arun -> _acall.arun |
                                v
    CallSite (this Protocol; implemented by _pool.Pool)
      call_plain, call                                   the handles' entry points
      exchange                                           a new call (``_exchange.Exchange``)
                                                         for a handle that keeps its ticket
      dispose_later, status_changed                      what leasing (_lease) asks for
      settings, clock, closed, closed_error              what those read
                                |
                                v
    the core (_entry): EnvEntry, Slot, Ticket and the gate

The handles hold a ``CallSite`` and an ``EnvEntry``; they never import ``_pool``, so the pool
can import them without a circle, and a handle depends only on what is written here. A call
through a handle costs what it cost before: the site *is* the pool object (a Protocol is a
type, not a wrapper), so ``worker.call`` is still one method call on the pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._call import EventCallback
    from ._entry import EnvEntry, Slot, Ticket
    from ._errors import PoolClosedError
    from ._settings import Settings

# ``call_plain``'s answer when the call must go the general way (``call``): never a call's
# result, since nothing unpickled is this object.
GENERAL_PATH: Any = object()


class CallSite(Protocol):
    """What a handle and leasing may ask of their pool (see the module docstring); not for
    users. The call's own steps are its ``Exchange``'s (``_exchange``), not the pool's."""

    settings: Settings  # the values the pool runs on (PoolConfig's fields, already valid)
    clock: Callable[[], float]  # monotonic seconds: idleness, the reaper, the breaker

    @property
    def closed(self) -> bool: ...

    def closed_error(self) -> PoolClosedError: ...

    def exchange(self, entry: EnvEntry) -> Ticket:
        """A new call of ``entry`` (an ``_exchange.Exchange``), nothing prepared yet."""
        ...

    def call_plain(
        self, entry: EnvEntry, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The common call in one straight line, or ``GENERAL_PATH`` with nothing counted,
        leased or sent."""
        ...

    def call(
        self,
        entry: EnvEntry,
        target: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        ticket: Ticket | None = None,
        bound: tuple[Slot, int] | None = None,
        on_event: EventCallback | None = None,
    ) -> Any:
        """A call prepared and run to its end (``ticket``: its ``exchange``, made earlier)."""
        ...

    def dispose_later(self, process: WorkerGeneration) -> None:
        """Release a retired worker's descriptors and memory soon, off the caller's path."""
        ...

    def status_changed(self) -> None:
        """Something ``comfy-env status`` shows changed (the write is throttled)."""
        ...
