"""``CallSite``: the narrow face of the pool that the public handles and the asyncio path use.

Data flow (who holds what; arrows are calls)::

    Worker (_worker) ----------.            RemoteRef (_refs)
      call/run/submit/arun_ref  |             call_method/release -> site.call(bound=...)
      (call/run: call_plain     |
       first, else call)        |
      acall/arun -> _acall.arun |
                                v
    CallSite (this Protocol; implemented by _pool.Pool)
      prepare -> [lease] -> run_leased -> settle         the sync call path
      call_prepared / call                               the same, in one step
      start_plain, call_plain, settle_ok                 the common call in a straight line
      start_locked, crash_error                          pieces the asyncio path reuses
      cancel                                             from any thread
      dispose_later, status_changed                      what leasing (_lease) asks for
      config, clock, call_ids, closed, closed_error      what those read
                                |
                                v
    the core (_entry): EnvEntry, Slot, Ticket and the gate

The handles hold a ``CallSite`` and an ``EnvEntry``; they never import ``_pool``, so the pool
can import them without a circle, and a handle depends only on what is written here. A call
through a handle costs what it cost before: the site *is* the pool object (a Protocol is a
type, not a wrapper), so ``worker.call`` is still one method call on the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._call import EventCallback
    from ._entry import EnvEntry, Slot, Ticket
    from ._errors import PoolClosedError
    from ._settings import Settings

# What ``prepare`` returns and ``call_prepared`` takes: the pickled body, its out-of-band
# buffers, whether the callable travels by value, and the deadline (monotonic) or None.
Prepared = tuple[bytes, list[memoryview], bool, float | None]

# ``call_plain``'s answer when the call must go the general way (``call``): never a call's
# result, since nothing unpickled is this object.
GENERAL_PATH: Any = object()


class CallSite(Protocol):
    """What a handle may ask of its pool (see the module docstring); not for users."""

    settings: Settings  # the values the pool runs on (PoolConfig's fields, already valid)
    clock: Callable[[], float]  # monotonic seconds: idleness, the reaper, the breaker

    @property
    def call_ids(self) -> Iterator[int]:
        """This pool's call ids (1 is the canary's)."""
        ...

    @property
    def closed(self) -> bool: ...

    def closed_error(self) -> PoolClosedError: ...

    def start_plain(
        self, entry: EnvEntry, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Ticket, WorkerGeneration, bytes, float | None] | None:
        """The common call (scalar arguments, an idle worker ready, nobody waiting) leased
        and started in one step, nothing sent; or None with nothing counted or leased."""
        ...

    def call_plain(
        self, entry: EnvEntry, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``start_plain`` and the exchange in one straight line, or ``GENERAL_PATH`` with
        nothing counted, leased or sent."""
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
    ) -> Any: ...

    def prepare(
        self,
        entry: EnvEntry,
        target: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        ticket: Ticket,
        bound: tuple[Slot, int] | None,
    ) -> Prepared: ...

    def call_prepared(
        self,
        entry: EnvEntry,
        ticket: Ticket,
        target: str | Callable[..., Any],
        body: bytes,
        buffers: list[memoryview],
        by_value: bool,
        deadline: float | None,
    ) -> Any: ...

    def run_leased(
        self,
        entry: EnvEntry,
        slot: Slot | None,
        ticket: Ticket,
        target: str | Callable[..., Any],
        body: bytes,
        buffers: list[memoryview],
        by_value: bool,
        deadline: float | None,
    ) -> Any: ...

    def start_locked(
        self, entry: EnvEntry, slot: Slot, ticket: Ticket, deadline: float | None
    ) -> None: ...

    def dispose_later(self, process: WorkerGeneration) -> None:
        """Release a retired worker's descriptors and memory soon, off the caller's path."""
        ...

    def status_changed(self) -> None:
        """Something ``comfy-env status`` shows changed (the write is throttled)."""
        ...

    def cancel(self, entry: EnvEntry, ticket: Ticket, force: bool = False) -> bool:
        """Cancel from any thread; True when the call will never run (see ``Pool.cancel``)."""
        ...

    def crash_error(
        self, entry: EnvEntry, slot: Slot, process: WorkerGeneration, call_id: int, label: str
    ) -> Exception: ...
