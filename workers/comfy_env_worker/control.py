"""Call control inside the worker: cancellation, progress and events of the running call.

Data flow::

    host  --CANCEL(id)--> cancel pipe --> watchdog thread: CONTROL.cancel(id)
                                            sets the flag at once; after ``interrupt_after``
                                            seconds raises ``Cancelled`` asynchronously in the
                                            thread running the call (if it is still running)
    call code (main thread): cancelled() / raise_if_cancelled()   read the flag
                             progress(...) / emit(...)  --EVENT(id)--> host, in band

The main thread runs calls and is the only reader of the channel, so cancel frames travel on a
pipe of their own, read by the worker's watchdog thread; the small-call path pays one
uncontended lock at the start and one at the end of a call.

**Races this module closes** (everything below runs under ``CallControl.lock``):

- a cancel for call N that arrives before the serve loop has read CALL N is kept in ``early``
  and applies when N begins; a cancel for a call that already ended (N < the last call begun)
  is late news and is dropped, so it can never hit call N+1;
- the asynchronous exception is armed only while call N still runs, at most once, and ``end``
  disarms it if it has not landed yet: it never fires in the serve loop or in call N+1. If it
  lands after the call's function returned (while the reply is built), the call ends as
  cancelled, which is the truth;
- coalesced progress: a burst of ``progress`` calls sends at most one frame per
  ``PROGRESS_INTERVAL``; the latest value is kept and flushed by the watchdog, by the next
  event, or before the reply, so the host always ends with the latest one and the events keep
  their order.

Stdlib only; parses under Python 3.8.
"""

from __future__ import annotations

import _thread
import pickle
import time

from . import native

# Bound at import: the env's code may replace the module attributes (see protocol._monotonic).
_dumps = pickle.dumps
_monotonic = time.monotonic

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Set, Tuple

PROGRESS_INTERVAL = 0.05  # seconds between two progress frames of one call (latest wins)


class Cancelled(BaseException):
    """Raised inside a call that the host cancelled: by ``raise_if_cancelled()``, or
    asynchronously in code that never checks. A ``BaseException`` (like
    ``asyncio.CancelledError``) so that ``except Exception`` does not swallow it; let it
    propagate (clean up in ``finally``) and the host's caller gets ``CallCancelled`` while this
    worker lives on."""


def _set_async_exc(thread_id: int, exc: Optional[type]) -> None:
    """Raise ``exc`` in thread ``thread_id`` at its next bytecode (None: disarm a pending one).
    Through ``native``, resolved on the main thread during the handshake: the watchdog thread
    calls this during a call, and a first ``import ctypes`` there (a ``dlopen``) deadlocks
    against a library the call is loading (see ``native``)."""
    native.set_async_exc(thread_id, exc)


class CallControl:
    """The state of the call the main thread runs, shared with the watchdog thread."""

    def __init__(self, send: Callable[[int, bytes], bool], interrupt_after: float) -> None:
        self.lock = _thread.allocate_lock()
        self.send = send  # (call id, EVENT payload) -> sent? (False once the call is over)
        self.interrupt_after = interrupt_after
        self.thread_id = _thread.get_ident()  # calls run on the thread that serves
        self.call_id = 0  # the running call, 0 between calls
        self.last_begun = 0
        self.is_cancelled = False
        self.early: Set[int] = set()  # cancels of calls not begun yet
        self.interrupt_at: Optional[float] = None
        self.armed = False  # an asynchronous Cancelled is pending or landed for this call
        self.pending: Optional[Tuple[int, bytes]] = None  # coalesced progress (call id, data)
        self.last_progress = 0.0
        # The largest EVENT payload the host reads (its max_frame_bytes, from CONFIG): a larger
        # one would be a protocol error there, which retires this worker.
        self.max_payload = 2**62

    # ---- main thread ----

    def begin(self, call_id: int) -> bool:
        """Call ``call_id`` starts. True if it was cancelled before it began."""
        with self.lock:
            self.call_id = call_id
            self.last_begun = call_id
            self.last_progress = 0.0
            if not self.early:
                return False
            cancelled = call_id in self.early
            self.early = {i for i in self.early if i > call_id}
            self.is_cancelled = cancelled
            return cancelled

    def end(self) -> None:
        """The call's function returned or raised: flush the latest progress, disarm."""
        with self.lock:
            if self.armed:
                _set_async_exc(self.thread_id, None)  # not landed yet: it never will
            pending, self.pending = self.pending, None
            if pending is not None:
                self.send(*pending)  # before the reply, which the caller sends next
            self.call_id = 0
            self.is_cancelled = False
            self.interrupt_at = None
            self.armed = False

    # ---- watchdog thread ----

    def cancel(self, call_id: int, now: float) -> None:
        """A CANCEL frame for ``call_id`` arrived."""
        with self.lock:
            if call_id == self.call_id and call_id:
                if not self.is_cancelled:
                    self.is_cancelled = True
                    self.interrupt_at = now + self.interrupt_after
            elif call_id > self.last_begun:
                self.early.add(call_id)  # the serve loop has not read that CALL yet
            # else: the call ended already; late news changes nothing

    def tick(self, now: float) -> float:
        """Do what is due (interrupt, progress flush); return seconds until the next thing."""
        with self.lock:
            if self.interrupt_at is not None and now >= self.interrupt_at:
                self.interrupt_at = None
                if self.call_id and not self.armed:
                    self.armed = True
                    _set_async_exc(self.thread_id, Cancelled)
            pending = self.pending
            if pending is not None and now - self.last_progress >= PROGRESS_INTERVAL:
                self.pending = None
                self.last_progress = now
                # Sent under the lock: ``end`` cannot pass it, so it precedes the reply.
                self.send(*pending)
            due = [1.0]
            if self.interrupt_at is not None:
                due.append(self.interrupt_at - now)
            if self.pending is not None:
                due.append(self.last_progress + PROGRESS_INTERVAL - now)
        return max(0.0, min(due))

    # ---- any thread of the call ----

    def event(self, kind: str, data: Any, progress: bool) -> None:
        call_id = self.call_id
        if not call_id:
            return  # outside a call nobody would read it
        payload = _dumps((kind, data), protocol=4)
        if len(payload) > self.max_payload:
            # Raised in the env's code, as an unpicklable ``data`` is: the call decides.
            raise OverflowError(
                "the %s event's data pickles to %d bytes, over the frame limit of %d bytes "
                "(PoolConfig.max_frame_bytes); send a small summary instead"
                % ("progress" if progress else repr(kind), len(payload), self.max_payload)
            )
        now = _monotonic()
        with self.lock:  # one sender at a time, so frames keep the order of the calls
            if call_id != self.call_id:
                return
            if progress:
                if now - self.last_progress < PROGRESS_INTERVAL:
                    self.pending = (call_id, payload)  # the latest wins; flushed later
                    return
                self.pending = None  # superseded by this one
                self.last_progress = now
            elif self.pending is not None:
                self.send(*self.pending)  # the progress reported before this event
                self.pending = None
            self.send(call_id, payload)


CONTROL: Optional[CallControl] = None  # set by the serve loop of a worker process


def cancelled() -> bool:
    """Whether the host cancelled the call this code runs in (False outside a worker call).
    Poll it in long loops and stop early; see also ``raise_if_cancelled``."""
    control = CONTROL
    return control is not None and control.is_cancelled


def raise_if_cancelled() -> None:
    """Raise ``Cancelled`` if the host cancelled the running call."""
    control = CONTROL
    if control is not None and control.is_cancelled:
        raise Cancelled("the call was cancelled by the host")


def progress(done: float, total: Optional[float] = None, **info: Any) -> None:
    """Report progress of the running call to the host's ``on_event`` callback as a
    ``CallEvent(kind="progress", data={"done": ..., "total": ..., **info})``. Cheap to call
    often: updates are coalesced (at most one frame per 50 ms; the latest wins), except that
    an ``emit`` first sends the update held back before it (the order is kept)."""
    control = CONTROL
    if control is not None and control.call_id:
        data = {"done": done, "total": total}
        data.update(info)
        control.event("progress", data, True)


def emit(kind: str, data: Any = None) -> None:
    """Send an event (``kind``, picklable and small ``data``) to the host's ``on_event``
    callback of the running call; delivered in order, before the call's result."""
    control = CONTROL
    if control is not None and control.call_id:
        control.event(str(kind), data, False)
