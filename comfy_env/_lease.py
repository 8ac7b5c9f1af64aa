"""Leasing: who holds which slot of an env, who waits for one, and the call counters.

Data flow of one call's lease (every step under the entry's lock, effects after it)::

    lease_now ----------- a free slot, nobody waiting before it -> leased, counted in flight
      |   (eager: the slot's idle worker is also started in the same lock section,
      |    ``Ticket.start_idle_locked``; the common call's second lock round saved)
      `-- none free: the ticket queues (FIFO) with its waiter's way to wake
              (``thread_waiter``: a threading.Event; ``_acall``: an asyncio future)
    acquire               lease_now, then the thread's wait (deadline, Ctrl-C)
    release_locked        a slot handed to the first waiter (a call bound to another slot by a
                          RemoteRef lets others pass), else marked free
    leave_queue           a waiter that gives up; a slot handed over meanwhile is passed on
    settle / settle_ok    the call's end: ``Replied`` through the gate, the slot released, the
                          outcome counted, once
    cancel                from any thread: out of the queue, or ``CancelRequested`` to the gate

The call's ``stage`` (``new -> queued -> in_flight -> done``) and the call counters
(``submitted``, the outcomes, ``in_flight``, ``queued``) are written here and nowhere else
(``tests/test_structure.py`` holds that), so a call is counted once whatever path it took. The
slot's lifecycle state is not: this module asks the gate (``EnvEntry``) for every change of it.

Nothing here knows how a worker runs or how a caller waits: the pool's part it needs
(closed or not, its clock and settings, disposing of a retired worker, the status file) is the
``CallSite`` handed in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from . import _lifecycle as lc
from ._entry import run_effects
from ._errors import CallCancelled, CallTimeout, PoolClosedError
from ._failures import abandoned_error
from ._interrupts import Deferred, allowing, note_interrupt

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._callsite import CallSite
    from ._entry import EnvEntry, Slot, Ticket

# The counter a settled call's outcome increments, one each (``_count_locked``). A Literal: a
# misspelt outcome is a type error, not a counter nobody reads.
Outcome = Literal["ok", "raised", "crashed", "timed_out", "cancelled", "failed"]


def thread_waiter(ticket: Ticket) -> None:
    """How a thread waits in the queue (``acquire``): an event its slot's releaser sets."""
    ticket.event = threading.Event()


def lease_now(
    site: CallSite,
    entry: EnvEntry,
    ticket: Ticket,
    eager: bool,
    waiter: Callable[[Ticket], None],
) -> Slot | None:
    """Lease a free slot to ``ticket`` at once, counted submitted and in flight; or queue the
    ticket (FIFO) after ``waiter(ticket)`` gave it its way to be woken, and return None.

    ``eager``: a slot leased at once whose verified idle worker needs nothing first is also
    started in the same lock section (``ticket.start_idle_locked``: ``CallStarted`` through
    the gate); anything unusual leaves the start to the call's general start, which checks
    and explains. A call cancelled before it got here, or an env
    the breaker abandoned, raises (counted in flight: its settling counts the outcome)."""
    with entry.lock:
        if site.closed:
            raise site.closed_error()
        entry.submitted += 1
        if ticket.cancelled:  # a submitted call cancelled before its thread got here
            # (Checked first: its ``Call`` already settled as cancelled, see ``cancel``.)
            ticket.stage = "in_flight"
            entry.in_flight += 1
            raise CallCancelled("the call was cancelled before it was queued", env=entry.spec.key)
        if isinstance(entry.env_state, lc.EnvAbandoned) and (
            abandoned := entry.abandoned_locked(site.clock())
        ):
            ticket.stage = "in_flight"
            entry.in_flight += 1
            raise abandoned_error(entry.spec.key, abandoned, entry.breaker is not None)
        slot = lease_at_once_locked(entry, ticket)
        if slot is not None:
            if eager and ticket.wanted is None and not entry.dropped_refs:
                ticket.start_idle_locked(slot)
            return slot
        waiter(ticket)
        queue_locked(entry, ticket)
    return None


def acquire(
    site: CallSite, entry: EnvEntry, ticket: Ticket, deadline: float | None, eager: bool
) -> Slot:
    """Lease a slot for a sync call (``lease_now``), waiting on the thread while all are
    leased: until one is handed over, the deadline passes, the call is cancelled or the pool
    closes (each its own error). ``eager``: the call may start in the lease's lock section."""
    slot = lease_now(site, entry, ticket, eager, thread_waiter)
    if slot is not None:
        return slot
    event = ticket.event
    assert event is not None
    try:
        with allowing(ticket.held):
            if deadline is None:
                event.wait()
            else:
                event.wait(max(0.0, deadline - time.monotonic()))
    except BaseException:
        leave_queue(entry, ticket)
        raise
    if ticket.slot is not None:
        return ticket.slot
    leave_queue(entry, ticket)
    raise queue_error(entry, ticket, False)


def queue_error(entry: EnvEntry, ticket: Ticket, past_deadline: bool) -> Exception:
    """Why a queued call left the queue without a slot: the pool closed, the call was
    cancelled, or (else, or ``past_deadline``) its deadline passed."""
    if ticket.closed and not past_deadline:
        return PoolClosedError("the pool was closed while the call was queued")
    if ticket.cancelled and not past_deadline:
        return CallCancelled("the call was cancelled while queued", env=entry.spec.key)
    return CallTimeout(
        f"the call's deadline passed while it was queued for env {entry.spec.key}",
        env=entry.spec.key,
    )


def leave_queue(entry: EnvEntry, ticket: Ticket) -> None:
    """Called by a waiter that gives up; if a slot was handed over meanwhile, pass it on."""
    with entry.lock:
        slot = ticket.slot
        if slot is None:
            try:
                entry.waiters.remove(ticket)
            except ValueError:
                pass
            return
        ticket.slot = None
        retired = release_locked(entry, slot)
    if retired is not None:
        retired.dispose()
    if entry.dropped_refs:
        entry.refs_dropped()  # the slot may be free now: release what waited for it


def lease_plain(
    site: CallSite, entry: EnvEntry, ticket: Ticket, deadline: float | None
) -> WorkerGeneration | None:
    """Lease and start the common call in one lock section: an idle worker's slot that no
    caller holds, whose worker can take the call as it is (the checks of ``ready_locked``),
    with nobody waiting before the call, no dropped refs to release first, the pool open and
    the env not abandoned by its breaker. Counted submitted and in flight, as ``lease_now``
    counts, and ``CallStarted`` applied through the gate (``EnvEntry.start_plain_locked``).
    Returns the worker it started on, or None having leased, counted and started nothing:
    the general path leases, and explains, instead."""
    with entry.lock:
        if (
            site.closed
            or entry.waiters
            or entry.dropped_refs
            or (
                isinstance(entry.env_state, lc.EnvAbandoned)
                and entry.abandoned_locked(site.clock())
            )
        ):
            return None
        for slot in entry.slots:  # ``free_slot``'s first choice
            state = slot.state
            if type(state) is lc.Idle and not slot.leased:
                break
        else:
            return None
        # ``ready_locked``, inline: this runs on every small call, where a Python call costs
        # about 0.2 us on one CPU (benchmarks/HISTORY.md).
        process = slot.process
        if process is None or process.generation != state.generation:
            return None
        now = site.clock()
        ping_after = site.settings.ping_after_idle
        if ping_after is not None and lc.needs_ping(state, now, ping_after):
            return None
        if deadline is not None and time.monotonic() >= deadline:
            return None
        if process.idle_channel_state() != "quiet":
            return None
        slot.leased = True
        ticket.slot = slot
        ticket.stage = "in_flight"
        entry.submitted += 1
        entry.in_flight += 1
        entry.start_plain_locked(ticket, slot, state, next(site.call_ids), now)
    return process


def ready_locked(
    site: CallSite, state: lc.Idle, process: WorkerGeneration, deadline: float | None
) -> float | None:
    """Whether ``process``, idle in ``state``, can take a call as it is (the entry's lock
    held): verified in that generation, no ping due, the deadline not passed, its channel
    quiet. The time read for the ping check (``CallStarted`` uses it too), or None: the
    call's general start (``Exchange.start``) then decides and explains. (``lease_plain``
    makes the same checks inline.)"""
    if process.generation != state.generation:
        return None
    now = site.clock()
    ping_after = site.settings.ping_after_idle
    if ping_after is not None and lc.needs_ping(state, now, ping_after):
        return None
    if deadline is not None and time.monotonic() >= deadline:
        return None
    # One poll(2) under the lock: the idle channel must be quiet (``Exchange.start`` retires
    # a worker that hung up or wrote unasked, and explains it).
    if process.idle_channel_state() != "quiet":
        return None
    return now


def settle(
    site: CallSite, entry: EnvEntry, ticket: Ticket, outcome: Outcome, replied_at: float | None
) -> None:
    """End of a call, in one lock section: apply its ``Replied`` (``replied_at``: when the
    worker's whole reply arrived; None if it did not), release its slot (to the next waiter,
    if any) and count its outcome. Idempotent: a call already settled is counted once."""
    retired = None
    stop: tuple[lc.Effect, ...] | None = None
    stopped: WorkerGeneration | None = None
    with entry.lock:
        slot = ticket.slot
        if slot is not None:
            if replied_at is not None:
                # A reply that raced a kill is still delivered (the function completed); the
                # gate drops this late Replied if the worker was retired meanwhile.
                entry.replied_locked(slot, ticket.generation, ticket.call_id, replied_at)
            elif type(slot.state) is lc.InCall and slot.state.call_id == ticket.call_id:
                # The call ended with neither its reply read nor its worker retired (an error
                # nobody foresaw while it held the slot): what the worker still writes is
                # unknown, and a slot left in the call would never be free again (every later
                # call would queue until its deadline). Stopped at once, as the sync path
                # stops a worker whose wait an exception broke.
                stop = entry.apply_locked(slot, lc.CallCancelled(ticket.generation, ticket.call_id))
                stopped = slot.process
            ticket.slot = None
            retired = release_locked(entry, slot)
        stage = ticket.stage
        if stage == "queued" or stage == "in_flight":
            if stage == "queued":
                entry.queued -= 1
            else:
                entry.in_flight -= 1
            ticket.stage = "done"
            _count_locked(entry, outcome)
    if stop:
        run_effects(stop, stopped, True)
    if retired is not None:
        site.dispose_later(retired)
    if entry.dropped_refs:
        # Refs dropped while this call held the slot waited for its end (release_idle).
        entry.refs_dropped()
    site.status_changed()


def _count_locked(entry: EnvEntry, outcome: Outcome) -> None:
    """Count a settled call's ``outcome`` (lock held), by name, one counter each."""
    if outcome == "ok":  # the common call first
        entry.ok += 1
    elif outcome == "raised":
        entry.raised += 1
    elif outcome == "crashed":
        entry.crashed += 1
    elif outcome == "timed_out":
        entry.timed_out += 1
    elif outcome == "cancelled":
        entry.cancelled += 1
    else:
        assert outcome == "failed", outcome
        entry.failed += 1


def settle_ok(site: CallSite, entry: EnvEntry, ticket: Ticket, replied_at: float) -> None:
    """``settle(site, entry, ticket, "ok", replied_at)`` for a call that holds its slot and
    replied ok (the plain call, a warm ``acall``), with one step of the gate."""
    with entry.lock:
        # (No assert: this runs on every small call. Only the call's own ``run`` settles it,
        # once, while it holds its slot in flight.)
        slot: Slot = ticket.slot  # type: ignore[assignment]
        idle = entry.settle_ok_locked(ticket, slot, replied_at)
        ticket.slot = None
        ticket.stage = "done"
        entry.in_flight -= 1
        entry.ok += 1
        if entry.waiters or not idle:
            retired = release_locked(entry, slot)
        else:
            slot.leased = False
            retired = None
    if retired is not None:
        site.dispose_later(retired)
    if entry.dropped_refs:
        entry.refs_dropped()  # as in ``settle``
    site.status_changed()


def settle_interrupted(site: CallSite, entry: EnvEntry, ticket: Ticket, exc: BaseException) -> None:
    """The safety net of a sync call that ends with ``exc``: settle it, held against Ctrl-C
    (``_interrupts``), if an interrupt cut short the settling its own path does (between the
    lease and the ``try`` that settles, or inside that settling). ``settle`` is idempotent: a
    call already settled is left as it is. A call whose reply was read whole (``replied_at``)
    leaves its worker idle: ``Replied``, as its own settling would have applied. A call whose
    worker may still run it is stopped (``settle``), as for any interrupted call."""
    if isinstance(exc, KeyboardInterrupt):
        note_interrupt()
    if ticket.stage == "done" and ticket.slot is None:
        return
    with Deferred():
        if ticket.slot is None and ticket.stage == "queued":
            # Its waiter was interrupted before it left the queue (``leave_queue``): out now,
            # or a slot released later would be handed to a call that is gone.
            with entry.lock:
                try:
                    entry.waiters.remove(ticket)
                except ValueError:
                    pass
        settle(site, entry, ticket, outcome_of(exc), ticket.replied_at)


def cancel(site: CallSite, entry: EnvEntry, ticket: Ticket, force: bool = False) -> bool:
    """Cancel a call from any thread: unqueue it, or ask the worker running it to stop
    (``CancelRequested``: CANCEL frame, then the kill after ``cancel_grace``); ``force`` kills
    at once. A call holding a slot but not sent yet (its worker is starting) sees the flag
    before it is sent.

    True when the call will never run, so its handle may settle as cancelled at once
    (``Call.cancel``): it was queued, and is now out of the queue and counted cancelled here,
    in the same lock section (its waiter, woken, finds it settled and counts nothing); or it
    was not queued yet, and its thread stops it on the flag before it queues (and counts it
    there). False otherwise: the call's own end settles it."""
    with entry.lock:
        ticket.cancelled = True
        stage = ticket.stage
        if stage == "new":
            return True
        if stage == "queued" and ticket.slot is None:
            try:
                entry.waiters.remove(ticket)
            except ValueError:
                pass
            entry.queued -= 1
            entry.cancelled += 1
            ticket.stage = "done"
            ticket.wake()
            return True
        slot = ticket.slot
        if slot is None or ticket.call_id == 0:
            return False
        event: lc.Event
        if force:
            event = lc.CallCancelled(ticket.generation, ticket.call_id)
        else:
            grace = entry.settings.cancel_grace
            event = lc.CancelRequested(ticket.generation, ticket.call_id, site.clock(), grace)
    entry.apply(slot, event)
    return False


def release_locked(entry: EnvEntry, slot: Slot) -> WorkerGeneration | None:
    """Hand ``slot`` to the first waiter or mark it free (lock held). Returns its process if
    that is retired, for the caller to dispose of after unlocking (nobody reads it any more)."""
    # FIFO, except that a call bound to another slot (it uses a RemoteRef) lets others pass.
    nxt = None
    if entry.waiters:  # none in the common call: no generator built
        nxt = next((t for t in entry.waiters if t.wanted is None or t.wanted is slot), None)
    if nxt is not None:
        entry.waiters.remove(nxt)
        nxt.slot = slot
        nxt.stage = "in_flight"
        entry.queued -= 1
        entry.in_flight += 1
        nxt.wake()
    else:
        slot.leased = False
    if isinstance(slot.state, lc.Retired):
        return slot.process
    return None


def outcome_of(exc: BaseException) -> Outcome:
    """The counter a call that ended with ``exc`` before it ran increments."""
    if isinstance(exc, CallTimeout):
        return "timed_out"
    if isinstance(exc, (CallCancelled, KeyboardInterrupt)):
        return "cancelled"
    return "failed"


def lease_at_once_locked(entry: EnvEntry, ticket: Ticket) -> Slot | None:
    """Lease a free slot to ``ticket`` now, if no caller waits before it (FIFO; lock held):
    the slot, with the call counted in flight, or None (the caller queues the ticket with
    ``queue_locked`` and its own way of waiting)."""
    if entry.waiters:
        return None
    slot = free_slot(entry, ticket.wanted)
    if slot is not None:
        slot.leased = True
        ticket.slot = slot
        ticket.stage = "in_flight"
        entry.in_flight += 1
    return slot


def queue_locked(entry: EnvEntry, ticket: Ticket) -> None:
    """Append ``ticket`` to the env's FIFO of waiters (lock held; its waker is set)."""
    ticket.stage = "queued"
    entry.queued += 1
    entry.waiters.append(ticket)


def free_slot(entry: EnvEntry, wanted: Slot | None = None) -> Slot | None:
    """A slot no caller holds: a verified idle worker first, else an empty or retired slot.
    A call bound to one slot (``wanted``) takes that one or none."""
    if wanted is not None:
        return None if wanted.leased else wanted
    fallback = None
    for slot in entry.slots:
        if slot.leased:
            continue
        if isinstance(slot.state, lc.Idle):
            return slot
        if fallback is None and (slot.state is None or isinstance(slot.state, lc.Retired)):
            fallback = slot
    return fallback
