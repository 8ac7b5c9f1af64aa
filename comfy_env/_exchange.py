"""The sync call's exchange with its worker, once the call holds a slot: start, send, receive,
open the reply, decode and settle (``run``), its failures turned into errors in one place.

Data flow of one call after leasing (``Pool.call`` / ``Pool.call_plain`` enter here)::

    run(site, entry, slot, ticket, ...)          decode the reply, settle once (``_lease.settle``)
      exchange                                   loops while the call never ran on a worker
        start    live worker (the site spawns), checks, CallStarted through the gate
        send     the CALL frame; EPIPE before a byte went out -> (False, None): loop
        receive  LOG/EVENT frames on the way; the worker died with our request unread ->
                 NotDelivered: loop; Ctrl-C -> drain_cancelled (ask it to stop, read on)
        open the reply's out-of-band buffers (``open_reply``), free the request's block
      crashed / timed_out / protocol_error        the errors of a broken exchange

The lifecycle table is written only through ``entry.apply`` / the entry's ``*_locked`` writers
(``EnvEntry._store``), and what a failure does to the process (report its death) goes through the
site, outside the entry's lock. This module never imports the pool, the spawner or the process
mechanism (``tests/test_structure.py``): it sees a worker as a ``WorkerGeneration`` and the pool
as an ``ExchangeSite``.

``resume``: the plain call (``Pool.call_plain``) sends and reads once itself; anything unusual
after its call started goes on here from where it stopped, as if this loop had done it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from comfy_env_worker.protocol import ChannelClosed, FrameError, FrameType, Payload

from . import _lease, _policies
from . import _lifecycle as lc
from ._call import event_handler
from ._callsite import CallSite
from ._codec import decode_reply, target_label
from ._errors import (
    CallCancelled,
    CallTimeout,
    HostResourceError,
    SerializationError,
    WorkerCrashed,
    chained,
)
from ._failures import (
    HostFault,
    NotDelivered,
    completed_timeout,
    crash_error,
    not_the_reply,
    protocol_error,
    retire_reason,
    timeout_error,
)
from ._interrupts import allowing
from ._refs import check_bound

if TYPE_CHECKING:
    from comfy_env_worker.shm import Block

    from ._backend import WorkerGeneration
    from ._entry import EnvEntry, Slot, Ticket

# How far the plain call's own exchange went before it handed on (``Pool.call_plain``): its
# send raised, its read raised, or it read a frame that is not a plain reply.
SEND_FAILED, READ_FAILED, READ = 1, 2, 3
Resume = tuple[int, Any]


class ExchangeSite(CallSite, Protocol):
    """What the exchange asks of its pool beyond ``CallSite`` (implemented by ``_pool.Pool``)."""

    def live_process(self, entry: EnvEntry, slot: Slot) -> WorkerGeneration:
        """The slot's verified process, spawning generation g+1 if it is empty or retired."""
        ...

    def report_death(
        self, entry: EnvEntry, process: WorkerGeneration, returncode: int | None, tail: str
    ) -> None:
        """Record a worker's death (its exit status and output tail)."""
        ...


def python_mismatch(entry: EnvEntry, process: WorkerGeneration) -> str | None:
    """Why a by-value callable cannot go to this worker, or None if it can."""
    env_version = process.python_version[:2]
    if env_version == tuple(sys.version_info[:2]):
        return None
    return (
        f"env {entry.spec.key} runs Python {'.'.join(map(str, env_version))}, the host "
        f"{sys.version_info[0]}.{sys.version_info[1]}: a function sent by value (a lambda, a "
        "closure, or one defined in __main__) only loads in the same Python version; pass it "
        "as 'package.module:function' instead"
    )


def run(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot | None,
    ticket: Ticket,
    target: str | Callable[..., Any],
    body: bytes,
    buffers: list[memoryview],
    by_value: bool,
    deadline: float | None,
    resume: Resume | None = None,
) -> Any:
    """The rest of a call once it holds ``slot`` (None: acquiring failed and raised in
    the caller, who still must settle): exchange, decode, settle, count once. ``resume``:
    see ``_exchange``."""
    outcome = "failed"
    replied_at: float | None = None
    try:
        assert slot is not None
        ftype, reply, reply_buffers, replied_at = exchange(
            site, entry, slot, ticket, target, body, buffers, by_value, deadline, resume
        )
        del buffers
        if ticket.interrupted:
            raise KeyboardInterrupt  # Ctrl-C: the worker stopped the call in time
        outcome = "raised"
        try:
            result = decode_reply(ftype, reply, target, reply_buffers)
        except FrameError as exc:  # an error record that is not the runtime's
            outcome = "failed"
            process = slot.process
            assert process is not None and process.generation == ticket.generation
            raise chained(protocol_error(entry, slot, process, str(exc)), None)  # noqa: B904
        outcome = "ok"
        return result
    except HostFault as fault:
        replied_at = fault.replied_at  # the worker replied whole: it goes back to idle
        raise chained(fault.error, None)  # noqa: B904
    except CallTimeout as exc:
        outcome = "timed_out"
        completed_timeout(exc, ticket.timeout, ticket.call_id, target_label(target))
        raise
    except CallCancelled as exc:
        outcome = "cancelled"
        if exc.env is None:  # stopped by the worker itself: it lives on
            exc.env = entry.spec.key
            exc.generation = ticket.generation
            exc.pid = _pid_of(slot, ticket.generation)
        raise
    except KeyboardInterrupt:
        outcome = "cancelled"
        raise
    except WorkerCrashed:
        outcome = "crashed"
        raise
    finally:
        _lease.settle(site, entry, ticket, outcome, replied_at)


def _pid_of(slot: Slot | None, generation: int) -> int | None:
    process = slot.process if slot is not None else None
    return process.pid if process is not None and process.generation == generation else None


def exchange(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot,
    ticket: Ticket,
    target: str | Callable[..., Any],
    body: bytes,
    buffers: list[memoryview],
    by_value: bool,
    deadline: float | None,
    resume: Resume | None = None,
) -> tuple[int, Payload | memoryview, list[Any] | None, float]:
    """Send the call to the leased slot's worker (spawning one if needed) and read the reply.

    Returns the reply's type, body and out-of-band buffers (private copies; the worker has
    been told it may reuse its blocks) and the time of the reply (``Replied``, which
    ``settle`` applies). ``resume``: how far the plain call's own exchange went on the
    worker it started (``call_plain``); the rest goes as if this loop had done it."""
    started = ticket.started
    ticket.started = None
    assert resume is None or started is not None
    while True:
        if started is not None:
            # Started in ``_acquire``'s lock section (the common call): checked there.
            process, started = started, None
            call_id = ticket.call_id
            generation = process.generation
        else:
            process, call_id = start(site, entry, slot, ticket, by_value, deadline)
            if call_id == 0:
                continue
            generation = process.generation
        if ticket.on_event is not None:
            ticket.sink = event_handler(ticket.on_event, call_id, generation)
        # The plain call's own exchange went as far as ``resume`` says (first round only).
        resumed, resume = resume, None
        if resumed is None or resumed[0] == SEND_FAILED:
            sent, block = send(
                site,
                entry,
                slot,
                process,
                call_id,
                target,
                body,
                buffers,
                deadline,
                None if resumed is None else resumed[1],
            )
            resumed = None
            if not sent:
                continue  # EPIPE before a byte went out: it died idle; nothing was sent
        else:
            block = None
        try:
            ftype, flags, reply = receive(
                site, entry, slot, process, ticket, call_id, target, deadline, resumed
            )
        except NotDelivered:
            continue  # it died with our request unread: the call never ran
        replied_at = site.clock()
        if not flags and block is None:
            return ftype, reply, None, replied_at  # the small-call path: nothing out of band
        try:
            reply_body, reply_buffers, retained = process.open_reply(call_id, flags, reply)
        except FrameError as exc:
            raise chained(protocol_error(entry, slot, process, str(exc)), None)  # noqa: B904
        except HostResourceError as exc:  # the host's fault: the worker stays, idle
            process.finish_request(block, [block.name] if block is not None else [])
            raise chained(HostFault(replied_at, exc), None)  # noqa: B904
        process.finish_request(block, retained)
        return ftype, reply_body, reply_buffers, replied_at


def start(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot,
    ticket: Ticket,
    by_value: bool,
    deadline: float | None,
) -> tuple[WorkerGeneration, int]:
    """The general start of a call on the leased slot: a live worker (spawned if needed),
    checked (binding, idle channel, ping, refs, Python version, deadline), then
    ``CallStarted``. Returns the process and the call id, or call id 0 if the worker was
    replaced meanwhile (the caller loops and the call goes to a fresh worker)."""
    if ticket.wanted is not None:
        check_bound(entry, slot, ticket.bound_generation)
    process = site.live_process(entry, slot)
    channel = process.idle_channel_state()
    if channel != "quiet":
        # Died idle (EOF) or wrote bytes nobody asked for: retire it before it gets
        # the call, which then runs on a fresh worker.
        stray = lc.ChannelClosed if channel == "closed" else lc.ProtocolViolated
        entry.apply(slot, stray(process.generation))
        return process, 0
    ping_after = site.settings.ping_after_idle
    if ping_after is not None and lc.needs_ping(slot.state, site.clock(), ping_after):
        if not _policies.ping(entry, slot, process, site.settings.ping_timeout):
            return process, 0  # replaced through the gate; a fresh worker runs it
    if entry.dropped_refs:
        _policies.release_dropped_refs(entry, slot, process)
    if by_value:
        # It reads only ``python_version`` (a WorkerGeneration member); _process types it
        # by its own class.
        why = python_mismatch(entry, process)
        if why is not None:
            raise SerializationError(why)
    if deadline is not None and time.monotonic() >= deadline:
        raise CallTimeout(
            f"the call's deadline passed before it reached a worker of env "
            f"{entry.spec.key} (start-up took {process.startup_seconds:.2f}s)",
            env=entry.spec.key,
            pid=process.pid,
            generation=process.generation,
        )
    call_id = next(site.call_ids)
    generation = process.generation
    with entry.lock:
        if ticket.cancelled:
            raise CallCancelled("the call was cancelled", env=entry.spec.key)
        started = entry.start_call_locked(slot, generation, call_id, site.clock())
        ticket.generation = generation
        ticket.call_id = call_id
        ticket.ran_on = slot
    if not started:
        return process, 0  # died idle after we looked: a fresh worker takes it
    return process, call_id


def send(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    call_id: int,
    target: str | Callable[..., Any],
    body: bytes,
    buffers: list[memoryview],
    deadline: float | None,
    failed: BaseException | None = None,
) -> tuple[bool, Block | None]:
    """Send the CALL frame. Returns (False, None) if the worker was already gone before any
    byte went out (safe to run the call elsewhere), else (True, the request's shared-memory
    block). Raises the call's error once part of it was sent.

    ``failed``: what the plain call's own send raised (``call_plain``), answered here as
    if this send had raised it."""
    try:
        if failed is not None:
            raise failed
        # Not opened to Ctrl-C even when held: the worker is idle and reads the request
        # (a full socket waits on it, bounded by the deadline), and the send does the
        # request's shared-memory bookkeeping, which an interrupt must not cut in two.
        block = process.send_request(call_id, body, buffers, deadline)
    except (BrokenPipeError, ConnectionResetError):
        entry.apply(slot, lc.ChannelClosed(process.generation))
        return False, None
    except TimeoutError:
        label = target_label(target)
        raise chained(  # noqa: B904 - see chained
            timed_out(site, entry, slot, process, call_id, label), None
        )
    except SerializationError:
        raise
    except OSError:
        raise chained(  # noqa: B904 - see chained
            crashed(site, entry, slot, process, call_id, target_label(target)), None
        )
    return True, block


def receive(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    ticket: Ticket,
    call_id: int,
    target: str | Callable[..., Any],
    deadline: float | None,
    resumed: Resume | None = None,
) -> tuple[int, int, Payload]:
    """Read the call's reply (its LOG and EVENT frames handled on the way). ``resumed``:
    the frame the plain call already read, or what its read raised (``call_plain``),
    taken here as this read's."""
    reader = process.reader
    assert reader is not None
    try:
        if resumed is None:
            held = ticket.held
            if held is None:
                ftype, flags, reply_id, reply = reader.read(deadline)
            else:
                with held.allowing():
                    ftype, flags, reply_id, reply = reader.read(deadline)
        elif resumed[0] == READ:
            ftype, flags, reply_id, reply = resumed[1]
        else:
            raise resumed[1]
        if ftype == FrameType.LOG or ftype == FrameType.EVENT:
            # What the call logged or reported: handle it, then read on to the reply.
            with allowing(ticket.held):
                ftype, flags, reply_id, reply = process.read_frame(
                    deadline, (ftype, reply_id, reply), ticket.sink
                )
    except TimeoutError:
        label = target_label(target)
        raise chained(  # noqa: B904 - see chained
            timed_out(site, entry, slot, process, call_id, label), None
        )
    except (ChannelClosed, ConnectionError, OSError) as exc:
        # The worker died before it read the whole request: the call never ran and may
        # run on a fresh worker. Its exit resets the requests socket (a reply end only
        # reads EOF), so ``request_unread`` asks there; a reset read here directly is a
        # backend whose one socket carries both ways. Any reply bytes mean it did run.
        if isinstance(exc, ConnectionResetError) or process.request_unread():
            entry.apply(slot, lc.ChannelClosed(process.generation))
            reason = retire_reason(slot, process.generation)
            if reader.buffered == 0 and reason is lc.RetireReason.CRASHED:
                raise chained(NotDelivered(), None)  # noqa: B904
        raise chained(  # noqa: B904 - see chained
            crashed(site, entry, slot, process, call_id, target_label(target)), None
        )
    except FrameError as exc:
        raise chained(protocol_error(entry, slot, process, str(exc)), None)  # noqa: B904
    except BaseException as exc:
        # KeyboardInterrupt (or another async exception) while waiting: the call's result
        # can no longer be delivered. Ctrl-C asks the worker first (it may keep its
        # caches); anything else, or a second Ctrl-C, stops the worker at once.
        if not isinstance(exc, KeyboardInterrupt) or entry.settings.cancel_grace <= 0:
            entry.apply(slot, lc.CallCancelled(process.generation, call_id))
            raise
        frame = drain_cancelled(site, entry, slot, process, ticket, call_id)
        if frame is None:
            raise
        ticket.interrupted = True
        ftype, flags, reply_id, reply = frame
    if (ftype != FrameType.REPLY_OK and ftype != FrameType.REPLY_ERR) or reply_id != call_id:
        raise not_the_reply(entry, slot, process, ftype, reply_id, call_id, reply)
    return ftype, flags, reply


def drain_cancelled(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    ticket: Ticket,
    call_id: int,
) -> tuple[int, int, int, Payload] | None:
    """After Ctrl-C: ask the worker to stop ``call_id`` and read on until its reply (the
    grace timer kills it if it does not stop). The reply frame, or None if the worker was
    stopped (or the reader state was lost to the interrupt: then it is stopped now)."""
    _lease.cancel(site, entry, ticket)
    try:
        with allowing(ticket.held):  # a second Ctrl-C stops the worker at once
            frame = process.read_frame(None, None, ticket.sink)
    except BaseException:  # noqa: BLE001 - EOF after the kill, a garbled read, a second Ctrl-C
        entry.apply(slot, lc.CallCancelled(process.generation, call_id))
        return None
    if frame[2] != call_id or frame[0] not in (FrameType.REPLY_OK, FrameType.REPLY_ERR):
        entry.apply(slot, lc.ProtocolViolated(process.generation))
        return None
    return frame


# ---- errors (texts in _failures) ----


def crashed(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    call_id: int,
    label: str,
) -> Exception:
    """The error of a call whose worker's channel broke (``_failures.crash_error``)."""
    return crash_error(*_failure(site, entry, slot, process, call_id, label))


def timed_out(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    call_id: int,
    label: str,
) -> Exception:
    return timeout_error(*_failure(site, entry, slot, process, call_id, label))


def _failure(
    site: ExchangeSite,
    entry: EnvEntry,
    slot: Slot,
    process: WorkerGeneration,
    call_id: int,
    label: str,
) -> tuple[
    EnvEntry, Slot, WorkerGeneration, int, str, bool, float, Callable[[int | None, str], None]
]:
    """What both error builders of ``_failures`` take: the call, the pool's state, and how
    to report the worker's death."""

    def report_death(returncode: int | None, tail: str) -> None:
        site.report_death(entry, process, returncode, tail)

    closed, grace = site.closed, entry.settings.cancel_grace
    return entry, slot, process, call_id, label, closed, grace, report_death
