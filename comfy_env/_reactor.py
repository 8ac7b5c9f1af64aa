"""The pool's one service thread: exit watching, output pipes, timers, and spawning.

One ``Reactor`` per pool, started when the pool first spawns a worker and stopped by
``Pool.close()``. Its thread count does not grow with the number of workers:

- **Readers.** Each worker's exit descriptor (a pidfd on Linux) and its stdout/stderr pipes are
  registered with one ``selectors`` selector. An exit is therefore seen the moment it happens,
  with no polling, including for idle workers that nobody is talking to.
- **Timers.** ``call_later`` keeps a heap; the SIGTERM -> SIGKILL escalation uses it.
- **Spawning.** ``run_sync`` runs a function on the reactor thread and waits for its result. The
  pool launches workers this way because ``PR_SET_PDEATHSIG`` fires when the *thread* that
  forked a child exits: spawning on a caller's short-lived thread would kill the worker when that
  thread ends. The reactor thread lives as long as the pool.

Callbacks run on the reactor thread and must be short and never block; they report to the pool
by submitting events to its gate. The loop outlives what goes wrong in it: a callback that
raises (anything, ``SystemExit`` included: it would end this thread silently) is logged, and a
``select`` that fails is logged and retried after a pause; only ``_SELECT_FAILURES`` failures
in a row end the thread. If it ends anyway, ``running`` says so at once (callers then take
their no-reactor paths) and ``run_sync`` raises ``ReactorFailed`` instead of waiting for ever.
Channels are never read here: a call's caller reads its own reply, so the hot path has no
thread hand-off.

Thread safety: every mutation of the selector or the heap happens on the reactor thread; other
threads enqueue a closure and write one byte to a wake-up socket. A timer due no earlier than
the moment the loop wakes by itself needs no byte: the loop arms it then, in time. The loop
publishes that moment (``_sleep_until``) before it looks at the queue one last time and
selects, so a closure queued after that look is covered by the published moment, and one
queued before it is seen by the look. A new worker's start schedules four timers from the
caller (the thread lookup, two for the status file, the host watcher); with a byte each, each
woke the reactor to take the GIL from the caller on its way to the first call.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import logging
import math
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

_log = logging.getLogger("comfy_env.reactor")

T = TypeVar("T")

# The longest the loop sleeps in one select (seconds). A timer due later is waited for in
# several sleeps: the OS bounds a wait (epoll takes at most INT_MAX ms, about 24.8 days, and
# raises OverflowError past it).
LONGEST_SLEEP = 3600.0

# A select that fails (it never should) is logged and retried after a pause; this many
# failures in a row end the loop (a selector that cannot work any more), with ``failure`` set.
_SELECT_FAILURES = 50
_FAILURE_PAUSE = 0.02
# How often ``run_sync`` looks whether the thread it waits for is still there.
_RUN_SYNC_CHECK = 0.5


class ReactorFailed(RuntimeError):
    """The pool's service thread has ended without being stopped (see ``Reactor.failure``)."""


class TimerHandle:
    """A scheduled callback; ``cancel()`` is safe from any thread and idempotent."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Reactor:
    def __init__(self, name: str = "comfy-env-reactor") -> None:
        self._name = name
        self._selector = selectors.DefaultSelector()
        try:
            self._wake_r, self._wake_w = socket.socketpair()
        except OSError:  # out of descriptors: leave nothing open behind
            self._selector.close()
            raise
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._pending: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, TimerHandle]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        # Why the loop ended without ``stop`` (None while it runs or after a clean stop).
        self.failure: BaseException | None = None
        # When the loop wakes by itself (monotonic seconds): -inf while it is awake, inf while
        # it sleeps with no timer (see the module docstring).
        self._sleep_until = -math.inf
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

    # ---- lifecycle ----

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("reactor is closed")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        """Started, not stopped, and its thread still there to run what is scheduled."""
        thread = self._thread
        return thread is not None and not self._closed and thread.is_alive()

    def in_reactor_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the selector. Registered descriptors are not closed here:
        their owners do that (the pool disposes every worker before stopping the reactor)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        self._stopping = True
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def abandon_in_forked_child(self) -> None:
        """In a forked child the thread does not exist: just release the inherited
        descriptors (the selector and the wake-up pair)."""
        self._closed = True
        self._stopping = True
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- scheduling (any thread) ----

    def call_soon(self, fn: Callable[[], None]) -> None:
        self._pending.append(fn)
        # From the reactor thread itself the loop runs it before it selects again: no wake-up
        # byte (a write now and two reads later: system calls that, on a crash's path, each
        # hand the GIL to the caller writing its report and wait to get it back).
        if threading.current_thread() is not self._thread:
            self._wake()

    def notify(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the reactor soon; callable from a finaliser (``RemoteRef.__del__``),
        which may run in any thread, inside any lock, even inside this reactor's own code. So
        it takes no lock and never blocks or raises: an append to the lock-free queue and one
        non-blocking byte on the wake-up socket (``call_soon`` also asks which thread runs it,
        and ``threading.current_thread`` may take a lock on a thread ``threading`` never saw).
        After ``stop`` it does nothing useful and nothing harmful: the byte is refused, and
        ``fn`` never runs."""
        self._pending.append(fn)
        self._wake()

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        handle = TimerHandle(time.monotonic() + delay, fn)

        def arm() -> None:
            heapq.heappush(self._timers, (handle.when, next(self._seq), handle))

        self._pending.append(arm)
        # No wake-up byte from the reactor thread (the loop runs ``arm`` before it selects
        # again), nor for a timer due after the loop wakes by itself: it is armed then.
        if handle.when < self._sleep_until and threading.current_thread() is not self._thread:
            self._wake()
        return handle

    def run_sync(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the reactor thread and return its result (or raise its exception)."""
        if self.in_reactor_thread():
            return fn()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(exc)

        self.call_soon(run)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _RUN_SYNC_CHECK
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            try:
                return future.result(wait)
            except concurrent.futures.TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                thread = self._thread
                if thread is None or not thread.is_alive():
                    future.cancel()
                    raise ReactorFailed(self._failure_text()) from self.failure

    def _failure_text(self) -> str:
        if self._closed:
            return "the pool's service thread was stopped (the pool is closed)"
        return (
            f"the pool's service thread ({self._name}) has ended: {self.failure!r}; "
            "close this pool and make a new one"
        )

    def add_reader(self, fileobj: Any, callback: Callable[[], None]) -> None:
        def register() -> None:
            self._selector.register(fileobj, selectors.EVENT_READ, callback)

        self._in_thread(register)

    def remove_reader(self, fileobj: Any) -> None:
        """Unregister (on the reactor thread). Must be called before the descriptor closes."""

        def unregister() -> None:
            try:
                self._selector.unregister(fileobj)
            except (KeyError, ValueError):
                pass

        self._in_thread(unregister)

    def _in_thread(self, fn: Callable[[], None]) -> None:
        if self.in_reactor_thread():
            fn()
        else:
            self.call_soon(fn)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0", socket.MSG_NOSIGNAL)  # (closing: EPIPE, not SIGPIPE)
        except (BlockingIOError, OSError):
            pass  # already awake (buffer full) or closing

    # ---- the loop ----

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - recorded, logged; the thread ends
            self.failure = exc
        if self.failure is not None and not self._stopping:
            _log.critical(
                "comfy-env: the pool's service thread (%s) has ended; workers' exits, output "
                "and timers are no longer watched: close this pool and make a new one",
                self._name,
                exc_info=self.failure,
            )

    def _loop(self) -> None:
        select = self._selector.select
        timers = self._timers
        pending = self._pending
        failures = 0
        while not self._stopping:
            timeout: float | None = None
            if timers:
                now = time.monotonic()
                timeout = min(max(0.0, timers[0][0] - now), LONGEST_SLEEP)
                self._sleep_until = now + timeout
            else:
                self._sleep_until = math.inf
            # After publishing the moment: a closure queued before this look runs now, one
            # queued after it is either due later than that moment or has woken us.
            if pending:
                timeout = 0
            try:
                ready = select(timeout)
            except Exception as exc:  # noqa: BLE001 - see the module docstring
                if self._stopping:
                    break  # the selector closed under us during stop
                failures += 1
                if failures >= _SELECT_FAILURES:
                    self.failure = exc
                    return
                _log.error(
                    "comfy-env reactor: select failed (%d in a row); retrying",
                    failures,
                    exc_info=failures == 1,
                )
                self._sleep_until = -math.inf
                time.sleep(_FAILURE_PAUSE)
                ready = []
            else:
                failures = 0
            self._sleep_until = -math.inf
            for key, _mask in ready:
                if key.data is None:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                self._safely(key.data)
            while pending:
                self._safely(pending.popleft())
            now = time.monotonic()
            while timers and timers[0][0] <= now:
                _when, _seq, handle = heapq.heappop(timers)
                if not handle.cancelled:
                    self._safely(handle.callback)
        # Run what was queued before stop (e.g. final unregisters) so nothing is left dangling.
        while pending:
            self._safely(pending.popleft())

    @staticmethod
    def _safely(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException:  # noqa: BLE001 - one bad callback must not stop exit watching
            # (SystemExit too: on this thread it would end the loop without a word.)
            _log.exception("comfy-env reactor callback failed")
