"""Ctrl-C held back across the pool's bookkeeping: ``Deferred``, and the storm mode.

Why: Python runs a SIGINT handler on the main thread between two bytecodes (at a call or a
backward jump), so the default one raises ``KeyboardInterrupt`` at almost any point of the
pool's own code: after the gate marked a slot ``Starting`` and before it recorded the start's
outcome, between a lease and the ``try`` whose ``finally`` gives it back, inside the
``except`` clause that cleans up after a first Ctrl-C, between making a shared-memory block
and recording it. A burst of them (Jupyter's repeated "interrupt kernel", a double Ctrl-C in
a REPL) left a slot starting with no process for the pool's lifetime (every later call queued
until its deadline), a slot leased by a call that was gone, the runtime dir made but not
marked made (every later start failed with EEXIST), and a block nobody knew of.

How::

    main thread                          SIGINT (the C handler trips a flag; Python runs ours)
    -----------------------------------  -------------------------------------------------
    with Deferred() as held:             installs ``held._handler`` (the user's is kept)
        bookkeeping                      -> recorded, nothing raised
        with held.allowing():            a blocking wait a user must be able to interrupt
            wait                         -> the user's handler runs (the default raises),
                                            once: the wait is closed before it runs
        clean-up after it                -> recorded (a second Ctrl-C cannot cut it short)
    (exit)                               the user's handler is put back; a Ctrl-C recorded
                                         meanwhile is delivered to it now (merged into a
                                         KeyboardInterrupt already on its way out)

The races it prevents: an interrupt between two steps of a critical section (the section runs
whole, then the interrupt is delivered); a second interrupt inside the clean-up of a first (a
wait takes one interrupt, so the ``except``/``finally`` clauses that undo a half-done start or
settle an interrupted call run to their end). A pending signal may fire as ``Deferred``
installs its handler (``signal.signal`` runs pending handlers first): that is before the
section, where nothing is half-done. Sections nest: the inner one's "user handler" is the outer
one's, so what the inner one records reaches the outer one at its exit, while a wait the inner
one opens is opened to the user's own handler (a start's handshake inside a held call).

Cost: ``signal.signal`` twice per section, a system call each: 12 us the pair on the
development VM, where a small warm call costs ~35 us. So the hot path (a warm plain call, or a
general call with no Ctrl-C lately) holds no section; the storm mode below covers it instead.
The cold sections always hold one: a worker's start from ``SpawnBegan`` to its outcome
(``Pool._spawn``), the making of the runtime dir, the host's shared-memory blocks being made,
given up or destroyed (``BlockPool.hold``), and the clean-up of a call that ends by an
exception (``Pool.settle_interrupted``).

Storm mode: once a Ctrl-C reached the pool, calls made in the next ``STORM_SECONDS`` take the
general path and hold a section for the whole call (``Ticket.held``), opened only for its
waits (the queue, the reply, the drain after a cancel). So in a burst, only its first
interrupt can land in the hot path's few unprotected steps (between its lock sections, which
make no call between their first and last write); the call's safety net then settles it held
(``settle_interrupted``; ``settle`` is idempotent). What is left: a second interrupt within
the few bytecodes between the first one's raise and that safety net installing its handler.
The storm test (tests/test_interrupt_storm.py) has not met it in hundreds of storms. A slot
left starting by it shows as stuck (``WorkerStats.stuck``, ``comfy-env status``) and
``Pool.reset(env)`` or the reaper retires it; a lease left held would not be detected.

Only the main thread runs Python signal handlers, so elsewhere (the reactor, an asyncio
call's thread, a caller's own thread) ``Deferred`` does nothing; so too where SIGINT is
ignored or left to the OS (``SIG_IGN``/``SIG_DFL``: no ``KeyboardInterrupt`` can come).
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any

_MAIN = threading.main_thread()


class Deferred:
    """A critical section during which Ctrl-C is recorded, not raised (see the module
    docstring); ``allowing()`` opens it for one blocking wait."""

    __slots__ = ("_open", "_pending", "_previous", "_user")

    def __init__(self) -> None:
        self._previous: Any = None  # the handler to put back; None: not installed
        self._user: Any = None  # the user's own handler (below every section held now)
        self._pending = False  # a Ctrl-C came while closed, not yet delivered
        self._open = False  # in a blocking wait that the next Ctrl-C interrupts

    def __enter__(self) -> Deferred:
        if threading.current_thread() is not _MAIN:
            return self
        try:
            current = signal.getsignal(signal.SIGINT)
        except ValueError:  # pragma: no cover - not the main interpreter
            return self
        if not callable(current):
            return self  # ignored or the OS default: no KeyboardInterrupt can come
        # Inside another section (a start inside a held call): a wait of this one is opened
        # to the user's handler itself, not to the outer section, which would only record.
        user: Any = current
        while getattr(user, "__func__", None) is Deferred._handler:
            user = user.__self__._user
        self._user = user
        # (A pending Ctrl-C runs the user's handler here, before anything is half-done.)
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        note_interrupt()
        if self._open:
            # In a wait: the user's handler decides (the default raises KeyboardInterrupt).
            # Closed meanwhile, so a second Ctrl-C before the wait's clean-up is recorded.
            self._open = False
            self._user(signum, frame)
            self._open = True  # (it did not raise: the wait goes on, open as before)
            return
        self._pending = True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        previous = self._previous
        if previous is None:
            return
        self._previous = None
        # Still ours while it is put back: a Ctrl-C arriving now is recorded, then delivered.
        signal.signal(signal.SIGINT, previous)
        if self._pending:
            self._pending = False
            if kind is not None and issubclass(kind, KeyboardInterrupt):
                return  # one interrupt is on its way out already: the rest merge into it
            # The user's handler decides (the default raises KeyboardInterrupt here, after
            # the section; an error already on its way becomes its context).
            previous(signal.SIGINT, None)

    def allowing(self) -> _Allowing:
        """Open the section for one blocking wait: the first Ctrl-C raises there (one already
        recorded raises at once, before the wait), later ones are recorded."""
        return _Allowing(self)


class _Allowing:
    __slots__ = ("_held",)

    def __init__(self, held: Deferred) -> None:
        self._held = held

    def __enter__(self) -> None:
        held = self._held
        if held._previous is None:
            return
        if held._pending:
            held._pending = False
            held._user(signal.SIGINT, None)  # (the default raises KeyboardInterrupt)
        held._open = True

    def __exit__(self, *exc: object) -> None:
        self._held._open = False


class _NotHeld:
    """``allowing`` where no section is held: nothing to open."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NOT_HELD = _NotHeld()


def allowing(held: Deferred | None) -> _Allowing | _NotHeld:
    """``held.allowing()``, or a no-op where the call holds no section."""
    return NOT_HELD if held is None else _Allowing(held)


# ---- storm mode -------------------------------------------------------------------------
# The hot path holds no section (two system calls per call: a third of a small call). After
# a Ctrl-C, calls on the main thread hold one for a while (``STORM_SECONDS``): a burst of
# interrupts (Jupyter's repeated "interrupt kernel") then meets only sections that run whole
# and waits that take one interrupt each; only the first interrupt of a burst can meet the
# hot path's few unprotected steps, whose clean-up the caller's ``except`` runs held.
STORM_SECONDS = 5.0
NEVER = -1e18
LAST_INTERRUPT = [NEVER]  # monotonic time of the last Ctrl-C the pool saw


def note_interrupt() -> None:
    """A Ctrl-C reached the pool's code (raised through it, or recorded by a section)."""
    LAST_INTERRUPT[0] = time.monotonic()


def in_storm() -> bool:
    """Whether a Ctrl-C reached the pool in the last ``STORM_SECONDS`` (cheap: one clock
    read only once there was one)."""
    last = LAST_INTERRUPT[0]
    return last > NEVER and time.monotonic() - last < STORM_SECONDS
