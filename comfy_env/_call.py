"""``CallEvent`` (what a running call reports) and ``Call`` (the handle ``Worker.submit`` returns).

Events: code in the worker calls ``comfy_env_worker.progress(...)`` or ``emit(kind, data)``;
the frames travel in band on the call's channel, ahead of its reply, and the thread (or event
loop) that reads the reply turns each into a frozen ``CallEvent`` and hands it to the call's
``on_event`` callback, in order, before the result is returned. A callback that raises is
logged and does not disturb the call.

``Call`` follows ``concurrent.futures.Future``: ``result(timeout)``, ``exception(timeout)``,
``done()``, ``running()``, ``add_done_callback``. As there, ``cancel()`` of a call that has not
started settles it before it returns: ``cancelled()`` and ``done()`` are True, done callbacks
have run (on the cancelling thread) and ``result()`` raises ``CallCancelled`` at once. It
differs where a subprocess call must: ``cancel()`` also works on a running call (it starts the
cooperative cancellation: the worker is asked, and killed after ``PoolConfig.cancel_grace``)
and returns True when cancellation was requested; that call then ends with ``CallCancelled``
(or with its result, if the reply crossed the cancel). Each submitted call runs on a thread of
its own while it waits and runs; whichever of that thread and ``cancel()`` settles the call
first decides its outcome, and the other's is dropped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any, Literal, Protocol

from ._errors import CallCancelled
from ._values import value

_log = logging.getLogger("comfy_env")


if sys.version_info >= (3, 11):  # ``concurrent.futures.TimeoutError`` is ``TimeoutError``
    WaitTimeout: type[TimeoutError] = TimeoutError
else:  # Python 3.10: the futures' own class, which ``except TimeoutError`` would miss

    class _WaitTimeout(concurrent.futures.TimeoutError, TimeoutError):
        """``Call.result``/``exception``'s wait ended first (the call goes on)."""

    WaitTimeout = _WaitTimeout


@value
class CallEvent:
    """Something a running call reported: ``kind`` ``"progress"`` (``data`` is
    ``{"done", "total", **info}``) or the kind given to ``comfy_env_worker.emit``; ``call_id``
    and ``generation`` name the call and the worker generation it ran on."""

    kind: str
    data: Any
    call_id: int
    generation: int


EventCallback = Callable[[CallEvent], object]


def event_handler(
    callback: EventCallback, call_id: int, generation: int
) -> Callable[[int, Any], None]:
    """Turn EVENT frames of call ``call_id`` into ``callback(CallEvent)``; frames of any other
    call id are late news and dropped."""

    def handle(frame_call_id: int, payload: Any) -> None:
        if frame_call_id != call_id:
            return
        try:
            kind, data = pickle.loads(payload)
        except (Exception, SystemExit):  # noqa: BLE001 - a bad event must not break the call
            # (SystemExit: a reducer in the event; it must not unwind the reading caller.)
            _log.warning("comfy-env: an event of call %d could not be unpickled", call_id)
            return
        deliver(callback, CallEvent(kind, data, call_id, generation))

    return handle


def deliver(callback: EventCallback, event: CallEvent) -> None:
    try:
        returned = callback(event)
    except Exception:  # noqa: BLE001 - the caller's callback must not break the call
        _log.exception("comfy-env: on_event callback failed for %s", event)
        return
    if returned is not None and hasattr(returned, "__await__") and hasattr(returned, "close"):
        # A callback that returns a coroutine (``lambda ev: handle(ev)`` with an async
        # ``handle``; an ``async def`` itself is refused at the call): nobody would await it.
        returned.close()
        _log.error(
            "comfy-env: on_event returned a coroutine for %s; it is not awaited (events are "
            "delivered synchronously: schedule async work with loop.create_task)",
            event,
        )


# A call's stage, written by leasing alone (``_lease``): "new" -> "queued" -> "in_flight" ->
# "done" (a call leased at once skips "queued"). A Literal: a misspelt stage is a type error.
Stage = Literal["new", "queued", "in_flight", "done"]


class CallTicket(Protocol):
    """What a ``Call`` reads of the pool's ticket for its call (narrow on purpose: this module
    never needs the pool's names)."""

    call_id: int  # 0 until sent
    generation: int  # 0 until sent
    stage: Stage  # "queued", then "in_flight"
    cancelled: bool


class Call:
    """A call started by ``Worker.submit``. Not constructible by users."""

    __slots__ = ("_cancel", "_env", "_future", "_ticket")

    def __init__(self, env: str, ticket: CallTicket, cancel: Callable[[bool], bool]) -> None:
        self._env = env
        self._ticket = ticket
        # (force) -> unqueue, ask the worker, or (force) kill at once; True: it never runs.
        self._cancel = cancel
        self._future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._future.set_running_or_notify_cancel()

    def _start(self, run: Callable[[], Any]) -> None:
        def body() -> None:
            # The race this guards: ``cancel()`` settled a queued call while this thread was
            # being woken to raise the same cancellation; the first outcome stands.
            try:
                result = run()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    self._future.set_exception(exc)
            else:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    self._future.set_result(result)

        threading.Thread(target=body, name="comfy-env-call", daemon=True).start()

    @property
    def env(self) -> str:
        return self._env

    @property
    def call_id(self) -> int:
        """The call's id once it was sent to a worker, else 0."""
        return self._ticket.call_id

    @property
    def generation(self) -> int:
        """The worker generation the call was sent to, else 0."""
        return self._ticket.generation

    def cancel(self) -> bool:
        """Cancel a queued call, or ask the worker to stop a running one (killed after
        ``PoolConfig.cancel_grace``; a second ``cancel()`` kills it at once). False if the
        call is already done. A call that had not started is settled before this returns
        (``cancelled()`` is True, done callbacks ran); a running one when it ends."""
        if self._future.done():
            return False
        if self._cancel(self._ticket.cancelled):
            error = CallCancelled(
                "the call was cancelled while queued; it never ran", env=self._env
            )
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self._future.set_exception(error)
        return True

    def cancelled(self) -> bool:
        """True if the call ended because it was cancelled."""
        return self._future.done() and isinstance(self._future.exception(), CallCancelled)

    def running(self) -> bool:
        return self._ticket.stage == "in_flight" and not self._future.done()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        """The call's result (or its error raised). ``timeout`` bounds this wait only
        (``TimeoutError``; a wait too long for the clock, such as ``math.inf``, is no bound);
        Ctrl-C while waiting cancels the call, then re-raises."""
        self._wait(timeout)
        return self._future.result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's error, or None if it returned; ``timeout`` as for ``result``."""
        self._wait(timeout)
        return self._future.exception()

    def _wait(self, timeout: float | None) -> None:
        """Wait for the call's end (``result``, ``exception``): ``TimeoutError`` when
        ``timeout`` ends the wait first; Ctrl-C while waiting cancels the call, then re-raises.
        Waited for apart from the outcome: the call's own error may be a TimeoutError."""
        wait = _wait_bound(timeout)
        try:
            if not concurrent.futures.wait((self._future,), wait).done:
                raise self._still_running(wait)
        except KeyboardInterrupt:
            self.cancel()
            raise

    def _still_running(self, wait: float | None) -> TimeoutError:
        """The error of a wait that ended before the call: a plain ``TimeoutError`` (on
        Python 3.10 also ``concurrent.futures.TimeoutError``), never ``CallTimeout``, whose
        worker was stopped: this one's call goes on untouched."""
        sent = f"call {self.call_id}" if self.call_id else "the call (not sent to a worker yet)"
        return WaitTimeout(
            f"{sent} on env {self._env} has not ended within this wait ({wait or 0:g}s); it "
            "goes on (call.cancel() stops it)"
        )

    def add_done_callback(self, fn: Callable[[Call], object]) -> None:
        """Run ``fn(call)`` when the call is done (at once if it is), on the thread that
        finished it (the call's own, or the one whose ``cancel()`` settled a queued call)."""
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else self._ticket.stage
        return f"<comfy_env.Call {state} env={self.env!r} call_id={self.call_id}>"


def _wait_bound(timeout: object) -> float | None:
    """What ``Call.result``/``exception`` pass to the future: None for no bound (also for a
    wait longer than the clock can take, which made the lock raise ``OverflowError``); an
    ``ArgumentError`` for what is no number of seconds (NaN, a string, a bool). Zero or less
    only looks, as in ``concurrent.futures``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout != timeout:
        from ._errors import ArgumentError

        raise ArgumentError(f"timeout must be seconds (a number) or None, not {timeout!r}")
    if timeout >= threading.TIMEOUT_MAX:
        return None
    return float(timeout)
