"""Lifecycle events: what ``Pool.subscribe`` callbacks receive.

Every event is a frozen record (tuples, never lists or dicts the pool might change later). The
pool queues them in causal order (a death's ``WorkerRetired`` before the ``EnvAbandoned`` it
trips: ``Pool._report_death``) and one dispatcher thread per pool (started by the first
``subscribe``) delivers them in that order, outside every pool lock and outside every caller's
slot: a callback may call back into the pool, even ``get_worker(env).call(...)`` on the env it
is told about, without deadlock. An exception in a callback is logged and the next callback
still runs.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from ._lifecycle import Death
from ._sweep import SweepReport
from ._values import value

_log = logging.getLogger("comfy_env")


@value
class WorkerSpawned:
    """A worker process was launched (not yet verified). ``pid`` is the launched process's.
    For a worker the host does not launch itself (a Ray actor) it comes once the worker's
    hello names its pid, just before ``WorkerReady``."""

    env: str
    generation: int
    pid: int


@value
class WorkerReady:
    """The worker passed its handshake and canary; ``pid`` is the interpreter's own."""

    env: str
    generation: int
    pid: int
    startup_seconds: float


@value
class WorkerRetired:
    """A generation ended. ``reason``: crashed, start_failed, timeout, cancelled, idle,
    ping_failed, protocol_error or closed. ``exitcode``/``signal`` once the process is reaped
    (None if it never ran)."""

    env: str
    generation: int
    pid: int | None
    reason: str
    exitcode: int | None
    signal: str | None


@value
class EnvAbandoned:
    """The crash-loop breaker cut the env off; ``deaths`` are the recent ones."""

    env: str
    deaths: tuple[Death, ...]


@value
class EnvReset:
    """``Pool.reset(env)`` brought an abandoned env back."""

    env: str


@value
class ShmSwept:
    """The start-up sweep removed leftovers of dead hosts."""

    report: SweepReport


Event = WorkerSpawned | WorkerReady | WorkerRetired | EnvAbandoned | EnvReset | ShmSwept
Callback = Callable[[Event], object]


class Dispatcher:
    """Delivers events to subscribers, in order, on its own thread."""

    def __init__(self, name: str = "comfy-env-events") -> None:
        self._callbacks: tuple[Callback, ...] = ()
        self._queue: deque[Event] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._name = name

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        with self._cond:
            if self._closing:
                raise RuntimeError("the pool is closed")
            self._callbacks = (*self._callbacks, callback)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

        def unsubscribe() -> None:
            with self._cond:
                self._callbacks = tuple(c for c in self._callbacks if c is not callback)

        return unsubscribe

    @property
    def subscribed(self) -> bool:
        """Whether anyone listens (an event nobody would get need not be built)."""
        return bool(self._callbacks)

    def emit(self, event: Event) -> None:
        if not self._callbacks:
            return
        with self._cond:
            self._queue.append(event)
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                event = self._queue.popleft()
                callbacks = self._callbacks
            for callback in callbacks:
                try:
                    callback(event)
                except Exception:  # noqa: BLE001 - a subscriber's bug must not break the pool
                    _log.exception("comfy-env: event callback %r failed on %r", callback, event)
