"""One call's own object: ``Exchange``, the ticket of a call and its exchange with a worker.

A call is an ``Exchange`` (a ``_entry.Ticket``: one allocation per call, as before) between
the slot it leases and that slot's worker. It holds what the call is (target, pickled body,
out-of-band buffers, deadline) and where it runs (entry, slot, process, request block), so
every step reads its own fields::

    a handle: site.exchange(entry).prepare(...)   encode, size, deadline, RemoteRef binding
      run_prepared      lease (``_lease.acquire``; an idle worker may start in the lease's
                        lock section: ``start_idle_locked``), then ``run``
    run_plain / _acall   start_plain: the common call prepared, leased and started in
                        one lock section (``_lease.lease_plain``), then ``run``
    run       the loop until the call ran on a worker, decode, settle once (``_lease``)
      start     a live worker (the site spawns), checks, CallStarted through the gate (begin)
      send      the CALL frame; EPIPE before a byte went out: loop (it died idle: send_failed)
      read      LOG/EVENT frames on the way (side_frames); the worker died with our request
                unread: loop; Ctrl-C: ask it to stop and read on (read_failed, drain_cancelled)
      open      the reply's out-of-band buffers, the request's block freed
    crashed / timed_out / protocol_broken     every failure turned into its error here: the
                gate event, the exit status collected, the death reported; the words are
                ``_failures``' (texts built from facts)

The asyncio path (``_acall``) keeps only its waiting (spin, the loop's reader, the big-reply
thread) and asks this object for every decision (``begin``, ``open``, ``decode``,
``deadline_hit``, ``crashed``, ``protocol_broken``).

A crash, from EOF to ``WorkerCrashed`` (the sync path; nothing calls back into the pool),
on seven floors::

    frames      protocol.FrameReader.read raises ChannelClosed
    call        Exchange.read_failed, then Exchange.crashed; they ask the floors below:
    channel       request_unread: was our request read? (no: loop, to a fresh worker)
    exit watch    status_at_eof, await_exit, log.tail, memory.verdict: how the generation
                  ended (``_exitwatch`` bound on the ``_process`` facade, ``_outputpipes``,
                  ``_logs``, the memory leaf ``_memlimit``)
    gate          entry.apply(ChannelClosed): ``_entry`` -> ``_lifecycle`` (Retired; its
                  kill effect goes to the facade)
    report        site.report_death: ``_spawner`` -> ``_policies`` (the breaker), ``_events``
    words         crash_story: ``_failures`` (with ``_errors``' exit-status words and classes,
                  the target's name from ``_codec``)
    -> run settles (``_lease``) and raises

Nothing below this object calls back up into it, and the words gather no facts
(``tests/test_call_paths.py`` traces a real crash and holds the seven floors).

The lifecycle table is written only through ``entry.apply`` / the entry's ``*_locked``
writers (``EnvEntry._store``), effects outside the entry's lock. This module never imports the
pool, the spawner or the process mechanism (``tests/test_structure.py``): it sees a worker as a
``WorkerGeneration`` and the pool as an ``ExchangeSite``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from comfy_env_worker.protocol import (
    HEADER_SIZE,
    ChannelClosed,
    FrameError,
    FrameType,
    Payload,
)
from comfy_env_worker.shm import SCALARS

from . import _lease, _policies
from . import _lifecycle as lc
from ._call import event_handler
from ._callsite import GENERAL_PATH, CallSite, PendingCall
from ._codec import decode_reply, encode_call, target_label, use_shm
from ._entry import Ticket
from ._errors import (
    CallCancelled,
    CallTimeout,
    HostResourceError,
    SerializationError,
    WorkerCrashed,
    chained,
)
from ._failures import (
    Death,
    cancelled_error,
    completed_timeout,
    crash_story,
    missed_deadline,
    not_reached,
    not_the_reply,
    pool_closed,
    protocol_error,
    python_mismatch,
    retire_reason,
)
from ._inflight import CALLS_IN_FLIGHT
from ._interrupts import LAST_INTERRUPT, NEVER, Deferred, allowing, in_storm
from ._refs import bound_by_refs, check_bound
from ._settings import Settings

if TYPE_CHECKING:
    from comfy_env_worker.shm import Block

    from ._backend import WorkerGeneration
    from ._entry import EnvEntry, Slot
    from ._generation import GenerationEnd

    # Where a call reports the death it met (``Spawner.report_death``: the breaker and
    # ``WorkerRetired``), with the generation's end record, exit status and output tail.
    ReportDeath = Callable[[EnvEntry, WorkerGeneration, GenerationEnd, int | None, str], None]

# A frame as read: (type, flags, call id, payload).
Frame = tuple[int, int, int, Payload]
# A reply once opened: its type, body and out-of-band buffers (None: none).
Reply = tuple[int, Any, list[Any] | None]
_REPLY_OK = int(FrameType.REPLY_OK)  # (plain ints: no enum lookup on every call's path)
_REPLY_ERR = int(FrameType.REPLY_ERR)
_LOG = int(FrameType.LOG)
_EVENT = int(FrameType.EVENT)
_NO_BUFFERS: list[memoryview] = []  # a call without out-of-band buffers (never appended to)


class ExchangeSite(CallSite, Protocol):
    """What the exchange asks of its pool beyond ``CallSite`` (implemented by ``_pool.Pool``)."""

    oob_threshold: int  # bytes from which a buffer goes out of band (``_codec.oob_threshold``)
    report_death: ReportDeath  # the spawner's own method: a crash reported with no hop

    def live_process(self, entry: EnvEntry, slot: Slot) -> WorkerGeneration:
        """The slot's verified process, spawning generation g+1 if it is empty or retired."""
        ...


def all_scalars(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether every argument is of an exact scalar type (int, str, None, ...): such a call
    holds no RemoteRef and nothing that could go out of band (bytes could)."""
    for value in args:
        if type(value) not in SCALARS:
            return False
    if kwargs:
        for value in kwargs.values():
            if type(value) not in SCALARS:
                return False
    return True


def pid_of(slot: Slot | None, generation: int) -> int | None:
    process = slot.process if slot is not None else None
    return process.pid if process is not None and process.generation == generation else None


def check_size(config: Settings, target: Any, body: bytes, buffers: list[memoryview]) -> None:
    """Refuse a call whose frame would pass ``PoolConfig.max_frame_bytes``: its pickled body
    and the out-of-band buffers that travel inline (those under the shared-memory threshold,
    or all of them without shared memory)."""
    inline = len(body)
    if buffers:  # the small call has none: two generator scans saved
        if not (config.shared_memory and use_shm(buffers, config.shm_threshold_bytes)):
            inline += sum(b.nbytes for b in buffers)
    if inline + HEADER_SIZE > config.max_frame_bytes:
        raise SerializationError(
            f"the call to {target_label(target)} pickles to {inline} bytes, over "
            f"PoolConfig.max_frame_bytes={config.max_frame_bytes}"
        )


def await_exit(process: WorkerGeneration, rc: int | None) -> tuple[int | None, bool]:
    """The exit status of a worker whose channel broke (``rc``: as read at EOF; None: not in
    yet): reaped, or waited for (bounded), killed if still running (a backend without exit
    codes, such as Ray, reports a death with None), its output drained. Also whether it was
    still running (the host's kill, then, not anyone else's)."""
    if rc is not None:
        return rc, False
    process.collect_exit()
    rc = process.wait_exit(1.0)
    still_running = rc is None and not process.exited.is_set()
    if still_running:
        process.kill(lc.Stop.KILL)
        rc = process.wait_exit(1.0)
    process.wait_output(0.5)
    return rc, still_running


class Exchange(Ticket):
    """One call: its ticket (queue place, lease, cancel flag) and its exchange with a worker.

    One allocation per call. Fields are class-level defaults, as ``Ticket``'s, so that only the
    fields a call sets are written, except those every call reads (``__init__`` says why)."""

    target: str | Callable[..., Any] = ""
    body = b""
    buffers: list[memoryview]
    by_value = False
    deadline: float | None  # time.monotonic(); None: no deadline
    process: WorkerGeneration | None = None  # the worker it started on (CallStarted applied)
    block: Block | None = None  # the request's shared-memory block, freed with the reply

    def __init__(self, site: ExchangeSite, entry: EnvEntry) -> None:
        self.site, self.entry = site, entry
        # Read on every call: set here, so that each read finds them on the instance (a
        # field read through the class is not specialised by CPython 3.11: about 150
        # instructions each, against 5 for a store).
        self.held = self.on_event = self.deadline = None
        self.buffers = _NO_BUFFERS
        self.interrupted = False

    def cancel(self, force: bool = False) -> bool:
        """Cancel this call from any thread, queued or running (``_lease.cancel``)."""
        return _lease.cancel(self.site, self.entry, self, force)

    # ---- before the lease ----

    def prepare(
        self,
        target: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None = None,  # checked by the handle (``_settings.check_timeout``)
        bound: tuple[Slot, int] | None = None,
    ) -> Exchange:
        """Everything a call checks before it queues: pickle it (bad input raises here),
        its size, its deadline (which starts now), the RemoteRefs that bind it to a slot
        (``bound``: the slot and generation a ref's own call must run on). Returns the call,
        ready for ``call``."""
        site, entry = self.site, self.entry
        if site.closed:
            raise site.closed_error()
        # One scan of the arguments: a call whose arguments are all scalars (the common small
        # call) can hold no RemoteRef and no out-of-band buffer, so both checks are skipped.
        plain = all_scalars(args, kwargs)
        if bound is None and not plain:
            bound = bound_by_refs(entry, args, kwargs)
        body, buffers, by_value = encode_call(target, args, kwargs, site.oob_threshold, plain)
        check_size(site.settings, target, body, buffers)
        if timeout is None:
            timeout = entry.settings.call_timeout
        if timeout is not None:
            self.deadline = time.monotonic() + timeout
            self.timeout = timeout  # (for a CallTimeout's message)
        if bound is not None:
            self.wanted, self.bound_generation = bound
            check_bound(entry, bound[0], bound[1])
        self.target, self.body, self.by_value = target, body, by_value
        if buffers:
            self.buffers = buffers
        return self

    def start_plain(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Prepare, lease and start the common call in one step: a target string, scalar
        arguments, an idle worker ready to take it and nobody waiting before it; ``prepare``
        and the lease without their branches for anything else. True: leased, counted,
        ``CallStarted`` applied, nothing sent; False, having counted, leased and sent nothing,
        when the call or the env asks for more (the general path decides and explains)."""
        site, entry = self.site, self.entry
        if not all_scalars(args, kwargs):
            return False
        body, _, _ = encode_call(target, args, kwargs, site.oob_threshold, True)
        if len(body) + HEADER_SIZE > site.settings.max_frame_bytes:
            return False  # (``prepare`` says why)
        timeout = entry.settings.call_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        process = _lease.lease_plain(site, entry, self, deadline)
        if process is None:
            return False
        self.process, self.target, self.body = process, target, body
        if deadline is not None:
            self.deadline, self.timeout = deadline, timeout
        return True

    def start_idle_locked(self, slot: Slot) -> None:
        """The eager start in the lease's lock section (``_lease.lease_now``): ``CallStarted``
        if the slot's idle worker can take the call as it is; else nothing, and ``start``
        decides (and explains) after the lease."""
        state, process = slot.state, slot.process
        if type(state) is lc.Idle and process is not None:
            now = _lease.ready_locked(self.site, state, process, self.deadline)
            if now is not None:
                self.begin_locked(slot, process, now)

    def begin_locked(self, slot: Slot, process: WorkerGeneration, now: float) -> bool:
        """``CallStarted`` for this call on ``process``, idle in ``slot`` (lock held): True
        once applied; False if it is no longer that slot's idle worker."""
        call_id = next(self.site.call_ids)
        self.generation, self.call_id, self.ran_on = process.generation, call_id, slot
        if not self.entry.start_call_locked(slot, process.generation, call_id, now):
            return False
        self.process = process
        return True

    def run(self) -> Any:
        """The rest of a call once it holds its slot: sent to the leased slot's worker
        (starting one if needed) until a worker has it, its reply read and opened (private
        copies: the worker may reuse its blocks) and decoded; settled and counted once."""
        outcome: _lease.Outcome = "failed"
        try:
            try:
                while True:
                    process = self.process
                    if process is None:
                        process = self.start()
                        if process is None:
                            continue  # the worker was replaced meanwhile: a fresh one takes it
                    if self.on_event is not None:
                        self.sink = event_handler(self.on_event, self.call_id, self.generation)
                    try:
                        # Not opened to Ctrl-C when held: it does the request's shm bookkeeping.
                        self.block = process.send_request(
                            self.call_id, self.body, self.buffers, self.deadline
                        )
                    except BaseException as exc:  # noqa: BLE001 - answered in one place
                        self.send_failed(exc, process)  # the call's error, or it never went out
                        continue
                    try:
                        held = self.held
                        if held is None:
                            frame = process.reader.read(self.deadline)  # type: ignore[union-attr]
                        else:
                            with held.allowing():
                                frame = process.reader.read(self.deadline)  # type: ignore[union-attr]
                        if frame[0] != _REPLY_OK:  # (one compare on the common call's path)
                            ftype = frame[0]
                            if ftype == _LOG or ftype == _EVENT:
                                frame = self.side_frames(process, frame)
                    except BaseException as exc:  # noqa: BLE001 - answered in one place
                        frame = self.read_failed(exc)
                        if frame is None:
                            self.process = None  # died with the request unread: it never ran
                            continue
                    ftype = frame[0]
                    if (ftype != _REPLY_OK and ftype != _REPLY_ERR) or frame[2] != self.call_id:
                        why = not_the_reply(ftype, frame[2], self.call_id, frame[3])
                        raise self.protocol_broken(why)
                    break
                if frame[1] or self.block is not None:
                    ftype, reply, reply_buffers = self.open(frame)
                else:  # the small call: nothing out of band (``open`` without its branches)
                    self.replied_at = self.site.clock()
                    reply, reply_buffers = frame[3], None
                if self.interrupted:
                    raise KeyboardInterrupt  # Ctrl-C: the worker stopped the call in time
                outcome = "raised"
                try:
                    result = decode_reply(ftype, reply, self.target, reply_buffers)
                except FrameError as exc:  # an error record that is not the runtime's
                    outcome = "failed"
                    raise chained(self.protocol_broken(str(exc)), None)  # noqa: B904
            except CallTimeout as exc:
                outcome = "timed_out"
                completed_timeout(exc, self.timeout, self.call_id, target_label(self.target))
                raise
            except CallCancelled as exc:
                outcome = "cancelled"
                if exc.env is None:  # stopped by the worker itself: it lives on
                    exc.env = self.entry.spec.key
                    exc.generation = self.generation
                    exc.pid = pid_of(self.slot, self.generation)
                raise
            except KeyboardInterrupt:
                outcome = "cancelled"
                raise
            except WorkerCrashed:
                outcome = "crashed"
                raise
        except BaseException:
            _lease.settle(self.site, self.entry, self, outcome, self.replied_at)
            raise
        # (Settled outside the ``try``: the common call's path keeps no outcome of its own.)
        _lease.settle_ok(self.site, self.entry, self, self.replied_at)  # type: ignore[arg-type]
        return result

    def start(self) -> WorkerGeneration | None:
        """The general start on the leased slot: a live worker (spawned if needed), checked
        (binding, idle channel, ping, refs, Python version, deadline), then ``begin``: the
        worker it started on, or None if it was replaced meanwhile (the caller loops)."""
        site, entry, slot = self.site, self.entry, self.slot
        assert slot is not None
        if self.wanted is not None:
            check_bound(entry, slot, self.bound_generation)
        process = site.live_process(entry, slot)
        channel = process.idle_channel_state()
        if channel != "quiet":
            # Died idle (EOF) or wrote bytes nobody asked for: retire it before it gets
            # the call, which then runs on a fresh worker.
            stray = lc.ChannelClosed if channel == "closed" else lc.ProtocolViolated
            entry.apply(slot, stray(process.generation))
            return None
        ping_after = site.settings.ping_after_idle
        if ping_after is not None and lc.needs_ping(slot.state, site.clock(), ping_after):
            if not _policies.ping(entry, slot, process, site.settings.ping_timeout):
                return None  # replaced through the gate; a fresh worker runs it
        if entry.dropped_refs:
            _policies.release_dropped_refs(entry, slot, process)
        if self.by_value:
            why = python_mismatch(entry.spec.key, process)
            if why is not None:
                raise SerializationError(why)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise not_reached(entry.spec.key, f" (start-up took {process.startup_seconds:.2f}s)")
        return process if self.begin(process) else None

    def begin(self, process: WorkerGeneration) -> bool:
        """``begin_locked`` after the general start's checks. False if the worker died idle
        after the caller looked (a fresh worker takes it); a call cancelled meanwhile raises
        ``CallCancelled``."""
        entry, slot = self.entry, self.slot
        assert slot is not None
        with entry.lock:
            if self.cancelled:
                raise CallCancelled("the call was cancelled", env=entry.spec.key)
            return self.begin_locked(slot, process, self.site.clock())

    def send_failed(self, exc: BaseException, process: WorkerGeneration) -> None:
        """A send of the CALL frame that raised ``exc``: the call's error (raised); or, the
        worker gone before any byte went out, nothing: it never ran, a fresh worker takes it."""
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            self.entry.apply(self.slot, lc.ChannelClosed(process.generation))  # type: ignore[arg-type]
            self.process = None
            return
        if isinstance(exc, TimeoutError):
            raise chained(self.timed_out(), None)
        if isinstance(exc, OSError) and not isinstance(exc, SerializationError):
            raise chained(self.crashed(), None)
        raise exc

    def side_frames(self, process: WorkerGeneration, frame: Frame) -> Frame:
        """What the call logged or reported (LOG, EVENT frames) handled, then the next frame
        that is neither (Ctrl-C reaches this wait when the call holds it back)."""
        with allowing(self.held):
            return process.read_frame(self.deadline, (frame[0], frame[2], frame[3]), self.sink)

    def read_failed(self, exc: BaseException) -> Frame | None:
        """What a read that raised ``exc`` means: the call's error (raised); None if the
        worker died with the request unread (the call never ran and may run on a fresh
        worker); or, after Ctrl-C, the reply the worker sent once asked to stop."""
        process, entry, slot = self.process, self.entry, self.slot
        assert process is not None and slot is not None
        if isinstance(exc, TimeoutError):
            raise chained(self.timed_out(), None)
        if isinstance(exc, (ChannelClosed, ConnectionError, OSError)):
            # Its exit resets the requests socket (a reply end only reads EOF), so
            # ``request_unread`` asks there; a reset read here directly is a backend whose
            # one socket carries both ways. Any reply bytes mean it did run.
            if isinstance(exc, ConnectionResetError) or process.request_unread():
                entry.apply(slot, lc.ChannelClosed(process.generation))
                reason = retire_reason(slot, process.generation)
                reader = process.reader
                if reader is not None and reader.buffered == 0:
                    if reason is lc.RetireReason.CRASHED:
                        return None
            raise chained(self.crashed(), None)
        if isinstance(exc, FrameError):
            raise chained(self.protocol_broken(str(exc)), None)
        # KeyboardInterrupt (or another async exception) while waiting: the call's result
        # can no longer be delivered. Ctrl-C asks the worker first (it may keep its caches);
        # anything else, or a second Ctrl-C, stops the worker at once.
        if isinstance(exc, KeyboardInterrupt) and entry.settings.cancel_grace > 0:
            frame = self.drain_cancelled()
            if frame is not None:
                self.interrupted = True
                return frame
        else:
            entry.apply(slot, lc.CallCancelled(process.generation, self.call_id))
        raise exc

    def drain_cancelled(self) -> Frame | None:
        """After Ctrl-C: ask the worker to stop the call and read on until its reply (the
        grace timer kills it if it does not stop). The reply frame, or None if the worker was
        stopped (or the reader state was lost to the interrupt: then it is stopped now)."""
        process, entry, slot = self.process, self.entry, self.slot
        assert process is not None and slot is not None
        self.cancel()
        try:
            with allowing(self.held):  # a second Ctrl-C stops the worker at once
                frame = process.read_frame(None, None, self.sink)
        except BaseException:  # noqa: BLE001 - EOF after the kill, a garbled read, a second Ctrl-C
            entry.apply(slot, lc.CallCancelled(process.generation, self.call_id))
            return None
        if frame[2] != self.call_id or frame[0] not in (_REPLY_OK, _REPLY_ERR):
            entry.apply(slot, lc.ProtocolViolated(process.generation))
            return None
        return frame

    # ---- the reply ----

    def open(self, frame: Frame | tuple[int, int, int, Any]) -> Reply:
        """The reply's body and out-of-band buffers (loaned blocks opened), the request's
        block freed; the time of the reply kept for ``Replied``."""
        ftype, flags, _, payload = frame
        replied_at = self.site.clock()
        block = self.block
        if not flags and block is None:
            self.replied_at = replied_at
            return ftype, payload, None  # the small call: nothing out of band
        process = self.process
        assert process is not None
        try:
            body, reply_buffers, retained = process.open_reply(self.call_id, flags, payload)
        except BaseException as exc:  # noqa: BLE001 - answered in one place
            self.not_opened(exc, replied_at)
        process.finish_request(block, retained)
        self.replied_at = replied_at
        return ftype, body, reply_buffers

    def not_opened(self, exc: BaseException, replied_at: float) -> NoReturn:
        """A reply whose out-of-band part could not be opened: a broken table is the
        worker's fault (retired); the host's own (``HostResourceError``) keeps the worker,
        which replied whole (``replied_at``: it goes back to idle) while the call fails."""
        if isinstance(exc, FrameError):
            raise chained(self.protocol_broken(str(exc)), None)
        if isinstance(exc, HostResourceError) and self.process is not None:
            block = self.block
            self.process.finish_request(block, [block.name] if block is not None else [])
            self.replied_at = replied_at
        raise exc

    def decode(self, ftype: int, reply: Any, buffers: list[Any] | None) -> Any:
        """The call's result, or its error raised; an error record that is not the
        runtime's breaks the protocol."""
        try:
            return decode_reply(ftype, reply, self.target, buffers)
        except FrameError as exc:
            raise chained(self.protocol_broken(str(exc)), None)  # noqa: B904

    # ---- failures: each acts (gate, collect, report), then ``_failures`` tells ----

    def crashed(self) -> Exception:
        """The error of a call whose worker's channel broke: retire it through the gate,
        collect its exit status (a bounded wait) and output, report its death (the breaker,
        ``WorkerRetired``) before the caller hears of it, then tell the story."""
        process, entry, slot = self.process, self.entry, self.slot
        assert process is not None and slot is not None
        label = target_label(self.target)
        # The common crash: the kernel holds the exit status already and what it wrote is in
        # the pipes; both are read before the gate's kill, which then has nothing to signal.
        rc = process.status_at_eof()
        # Still running though its channel closed (it closed or replaced its descriptors):
        # the gate's SIGKILL is then the host's, not "a kill -9 from outside".
        alive_at_eof = rc is None and not process.exited.is_set()
        entry.apply(slot, lc.ChannelClosed(process.generation))
        reason = retire_reason(slot, process.generation)
        if reason is lc.RetireReason.CLOSED or self.site.closed:
            return pool_closed(label)
        ending = slot.ending  # this generation's: the lease keeps the slot from the next one
        assert ending is not None
        if reason is lc.RetireReason.CANCELLED:
            grace = entry.settings.cancel_grace
            return cancelled_error(entry.spec.key, label, process, ending.cancel_kill, grace)
        rc, still_running = await_exit(process, rc)  # reaped and drained, or waited for
        tail = process.log.tail()
        self.site.report_death(entry, process, ending, rc, tail)
        memory = process.memory.verdict(rc, tail) if process.memory is not None else None
        death = Death(rc, tail, still_running, alive_at_eof, memory)
        return crash_story(entry.spec.key, process, self.call_id, label, death)

    def deadline_hit(self) -> CallTimeout | None:
        """``DeadlineHit`` through the gate (it stops the worker): the call's ``CallTimeout``,
        or None if something else retired the worker first (``crashed`` tells that)."""
        process = self.process
        assert process is not None and self.slot is not None
        if not self.entry.apply(self.slot, lc.DeadlineHit(process.generation, self.call_id)):
            return None
        label = target_label(self.target)
        env = self.entry.spec.key
        return missed_deadline(env, self.call_id, label, process.pid, process.generation)

    def timed_out(self) -> Exception:
        """The error of a call that missed its deadline (``deadline_hit``, else ``crashed``)."""
        return self.deadline_hit() or self.crashed()

    def protocol_broken(self, detail: str) -> Exception:
        """Retire a worker that broke the protocol (a stream is never resynchronised)."""
        process = self.process
        assert process is not None and self.slot is not None
        self.entry.apply(self.slot, lc.ProtocolViolated(process.generation))
        return protocol_error(self.entry.spec.key, process, detail)


def run_prepared(site: ExchangeSite, prepared: PendingCall) -> Any:
    """A prepared call (``site.exchange(entry).prepare(...)``) to its end: leased (waiting in
    the queue), run (``Exchange.run``), settled once. A ``Worker``'s calls enter here when
    ``run_plain`` declines; a ``RemoteRef``'s through ``Pool.call``."""
    call: Exchange = prepared  # type: ignore[assignment]  # (what ``site.exchange`` makes)
    # Counted while it runs: a reader polls for its reply only while this process makes one
    # call at a time (see _inflight).
    CALLS_IN_FLIGHT.add(call)
    try:
        if in_storm():
            # Ctrl-C was pressed lately: hold the call's bookkeeping against the next ones; its
            # waits (the queue, the reply) take one each (``held``).
            with Deferred() as held:
                call.held = held
                return _leased_run(site, call)
        return _leased_run(site, call)
    except BaseException as exc:
        _lease.settle_interrupted(site, call.entry, call, exc)
        raise
    finally:
        CALLS_IN_FLIGHT.discard(call)  # (gone already in a child forked during the call)


def _leased_run(site: ExchangeSite, call: Exchange) -> Any:
    entry = call.entry
    try:
        _lease.acquire(site, entry, call, call.deadline, not call.by_value)
    except BaseException as exc:
        _lease.settle(site, entry, call, _lease.outcome_of(exc), None)
        if isinstance(exc, CallTimeout):
            completed_timeout(exc, call.timeout, call.call_id, target_label(call.target))
        raise
    return call.run()


def run_plain(
    site: ExchangeSite, entry: EnvEntry, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The common call in one straight line: prepared, leased and started in one step
    (``Exchange.start_plain``), then run as any call (``Exchange.run``: whatever it meets is
    answered by the same rules). ``GENERAL_PATH``, having counted, leased and sent nothing,
    when the call or the env asks for more. ``Worker.call`` and ``run`` enter here first."""
    if LAST_INTERRUPT[0] > NEVER and in_storm():  # (one compare until a first Ctrl-C)
        return GENERAL_PATH  # Ctrl-C was pressed lately: the held path (``run_prepared``)
    call = Exchange(site, entry)
    CALLS_IN_FLIGHT.add(call)  # as in ``run_prepared``
    try:
        # Leased inside the ``try``: an interrupt right after the lease is settled below.
        if not call.start_plain(target, args, kwargs):
            return GENERAL_PATH
        return call.run()
    except BaseException as exc:
        _lease.settle_interrupted(site, entry, call, exc)
        raise
    finally:
        CALLS_IN_FLIGHT.discard(call)
