"""asyncio-native calls (``Worker.arun``/``acall``): no thread while a call waits or runs warm.

Data flow of one ``arun`` (everything on the event loop unless said otherwise)::

    encode + deadline (starts now)         bad input raises here, as in ``Pool.call``; the
                                           common call (scalar arguments, an idle worker
                                           ready, nobody waiting) is encoded, leased and
                                           started in one step (``CallSite.start_plain``)
    lease a slot, or queue the ticket      a queued call waits on an asyncio future that the
                                           thread releasing a slot resolves through
                                           ``call_soon_threadsafe``; no thread is held
    warm path (idle verified worker, small request or out-of-band buffers of at most
    _OOB_LOOP_MAX bytes going to shared memory, into an idle block above _FRESH_LOOP_MAX,
    no ping due):
        gate(CallStarted) -> send CALL     ``WorkerProcess.send_request``: one ``sendall`` of
                                           <= 64 KiB into an idle channel, plus (buffers) one
                                           memcpy into a pooled shared-memory block
        spin (at most _REPLY_SPIN)         one read; a whole REPLY frame in it is the reply
                                           (the common small call: no parser object). If
                                           this thread and the worker share one single CPU:
                                           a non-blocking recv first (the worker often ran
                                           already), nothing yet -> yield the CPU to it once
                                           (cheaper than sleeping in select and being woken);
                                           across CPUs, poll (FrameReader.spins: at most
                                           spin_wait, never while another call is in
                                           flight); still nothing, select for the rest
        loop.add_reader(channel)           only if the spin did not end the call: frames
                                           parsed as they arrive: LOG -> logging, EVENT ->
                                           on_event (on the loop), REPLY -> future; one read
                                           per callback, a frame's payload received in place
                                           (``FrameBuffer``: one copy however large)
        a large reply (its header, read    the rest of it is received and unpickled on a
        on the spot or through the loop,   thread of the call's own (``_BigReply``); the
        announces _BIG_REPLY bytes or      coroutine keeps the deadline and answers cancels
        more)                              meanwhile, and waits for the thread's end
        gate(Replied) via settle           the slot goes to the next waiter (``settle_ok``
                                           for an ok reply: one step of the gate)
    otherwise (a worker must start, a ping is due, a large in-band request, out-of-band
    buffers above _OOB_LOOP_MAX or that would stream inline (shared memory off or
    unavailable), RemoteRefs):
        the sync exchange runs on a thread of its own (never the loop's default executor),
        and the coroutine awaits its outcome; a worker start never blocks the loop.

A large reply off the loop: the loop would hold, for each one, the zero-fill of a buffer of
the payload's size (in the GIL: 40-60 ms at 64 MiB here, where glibc maps fresh memory for
it), a readiness callback per read and the unpickling. The thread receives into memory the
kernel faults in during ``recv_into`` (``_MappedFrame``, from _MAPPED_REPLY), with the GIL
released, and unpickles there. The unpickling of one big object (a ``str``, ``bytes``) is one
C call that holds the GIL all along, so the loop still waits for that part wherever it runs
(about 0.8 ms per MiB here): a thread cannot take it off the loop's critical path.

The spin blocks the loop for at most _REPLY_SPIN (select's timeout counts from the first
read). The one-CPU yield is no wait on I/O: it hands the CPU to a worker that could only run
there anyway, and the loop's thread is runnable again within one scheduler slice; it is taken
only when ``sched_getaffinity`` of both threads is the same single CPU (``_shares_one_cpu``:
the worker's reader keeps the answer for _AFFINITY_TTL): a caller free to run on more CPUs
never yields.

Deadline: one timer per call, from the moment ``arun`` is called. Queued: the ticket leaves
the queue and the call raises ``CallTimeout``. Warm: the gate applies ``DeadlineHit`` and the
worker is stopped, as in the sync path. On the thread path the caller gets ``CallTimeout`` at
the deadline even while a worker is still starting; the thread finishes the start (a slow start
is not a failed one) and ends the call with the same deadline, which counts it once.

Cancellation (the task is cancelled): queued, the ticket is removed; running, the pool's
cooperative cancel (``CancelRequested``: CANCEL frame, kill after ``cancel_grace``) and the
coroutine keeps waiting for the call's end, so the slot is settled exactly once, then raises
``CancelledError``. A second cancellation kills the worker at once. A reply that crosses the
cancel is dropped (the task is cancelled) and counted once.

Out-of-band buffers on the loop: the request's buffers are copied into one of the worker's
pooled shared-memory blocks on the loop (the same ``send_request`` the sync path uses), so the
loop is blocked for one memcpy: 0.1-0.17 ms per MiB measured here (16 MiB: 1.7-2.7 ms, 32 MiB
14 ms under load), hence the bound _OOB_LOOP_MAX (16 MiB); above it the copy runs on the call's
own thread, where it lets go of the GIL in steps (``shm.Block.write``). A fresh block costs
5-10 times the copy (create, reserve, fault its pages in: 107 ms for a 16 MiB array was
measured on the loop), so above _FRESH_LOOP_MAX (4 MiB) a call goes on the loop only if the
pool has an idle block of its size; the first call of a size makes its block on its thread. The
reply is opened with ``open_reply`` (loaned blocks, the consumed ack through the next request)
and the request's block goes back with ``finish_request``, both as in ``Pool._exchange``. If
the block cannot be created at send time (``/dev/shm`` full: ENOSPC), ``send_request`` streams
that one request inline from the loop (bounded by _OOB_LOOP_MAX; the worker reads it as it
comes) and marks shared memory unavailable, so the next such call takes the thread path.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from comfy_env_worker import shm
from comfy_env_worker.protocol import (
    HEADER_SIZE,
    SPIN_RECHECK,
    FrameBuffer,
    FrameError,
    FrameReader,
    FrameType,
    Payload,
    decode_header,
)

from . import _lease
from . import _lifecycle as lc
from ._call import deliver, event_handler
from ._codec import decode_reply, target_label, use_shm
from ._errors import (
    CallCancelled,
    CallTimeout,
    HostResourceError,
    WorkerCrashed,
)
from ._exchange import Exchange, pid_of
from ._failures import (
    completed_timeout,
    missed_deadline,
    not_reached,
    not_the_reply,
    python_mismatch,
)
from ._inflight import CALLS_IN_FLIGHT

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._callsite import CallSite, PendingCall
    from ._channel import Channel
    from ._entry import EnvEntry, Slot, Ticket

T = TypeVar("T")

_REPLY_OK = int(FrameType.REPLY_OK)
_REPLY_ERR = int(FrameType.REPLY_ERR)
_SMALL = 65536  # a request this small goes out in one sendall on the loop
# Out-of-band bytes a warm call may copy into shared memory on the loop (one memcpy, ~2 ms
# at most here); above it the call runs on a thread of its own so the loop never stalls long.
_OOB_LOOP_MAX = 16 << 20
# Out-of-band bytes a warm call may send from the loop through a *fresh* block: making one
# (create, reserve, fault its pages in on the first copy) costs about 1 ms per MiB here, 5-10
# times the copy into a block used before; above this, with no idle block of the size at hand,
# the call runs on a thread of its own (whose copy lets go of the GIL: ``shm.Block.write``).
_FRESH_LOOP_MAX = 4 << 20
_REPLY_SPIN = 0.0002  # seconds a warm call waits for its reply before yielding to the loop
# A reply frame whose header announces at least this many payload bytes is received and
# unpickled on a thread of the call's own (``_BigReply``), never on the loop. At 1 MiB both
# ways measured alike (the loop's worst stall and the call's time, within this machine's
# noise); above, the loop's share grows with the size: the buffer's zero-fill (0.6-0.9 ms per
# MiB where its pages are fresh) and a callback per read (HISTORY.md, fifteenth round).
_BIG_REPLY = 1 << 20
# From this size on, that thread receives the payload into memory mapped for it
# (``_MappedFrame``), whose pages the kernel faults in during ``recv_into``, the GIL released.
# A ``bytearray``'s zero-fill holds the GIL, and where glibc hands it fresh pages (always from
# 32 MiB, where its mmap threshold stops; often below) it costs about 0.6 ms per MiB: a loop
# stall, from any thread. Up to this size that is about one GIL switch interval (5 ms), which
# any other thread may cost the loop anyway, and memory freed before is often reused (16 MiB:
# 1.5 ms), where a mapping faults in every page again (HISTORY.md, fifteenth round).
_MAPPED_REPLY = 8 << 20


async def arun(
    pending: PendingCall,
    target: str | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float | None,
) -> Any:
    """``target(*args, **kwargs)`` run as ``call`` (a new exchange of the env, its
    ``on_event`` set if any) on the event loop, to its end."""
    call: Exchange = pending  # type: ignore[assignment]  # (what CallSite.exchange makes)
    # The common call (scalar arguments, an idle worker ready, nobody waiting) is prepared,
    # leased and started in one step, as the sync call's (``Exchange.start_plain``).
    plain = False
    if timeout is None and call.on_event is None and type(target) is str:
        plain = call.start_plain(target, args, kwargs)
    if not plain:
        call.prepare(target, args, kwargs, timeout)
    CALLS_IN_FLIGHT.add(call)  # a sync caller's reader must not poll meanwhile
    try:
        if not plain:
            await _lease_call(call)
        # Started in the lease (``Exchange.start_idle_locked``), or a worker to start on the
        # loop; a generation without a channel of its own (a Ray actor) runs on the thread.
        process = call.process if call.process is not None else _warm_process(call)
        if process is not None and process.channel is not None:
            sent, value = await _warm_call(call, process)
            if sent:
                return value
        return await _on_thread(call)
    except CallTimeout as exc:
        completed_timeout(exc, call.timeout, call.call_id, target_label(target))
        raise
    finally:
        CALLS_IN_FLIGHT.discard(call)  # (gone already in a child forked during the call)


async def _lease_call(call: Exchange) -> None:
    """Lease a slot for ``call``, waiting in the queue on the loop (no thread) while all are
    leased. A small in-band call by reference may start in the lease's own lock section, as
    the sync call does: one lock round instead of two."""
    site, entry = call.site, call.entry
    small = not call.by_value and not call.buffers and len(call.body) <= _SMALL
    try:
        if _lease.lease_now(site, entry, call, small, _loop_waiter) is None:
            await _queued(site, entry, call, call.deadline)
    except BaseException as exc:
        cancelled = isinstance(exc, asyncio.CancelledError)
        outcome = "cancelled" if cancelled else _lease.outcome_of(exc)
        _lease.settle(site, entry, call, outcome, None)
        raise


# ---- queueing ---------------------------------------------------------------------------------


def _resolve(future: asyncio.Future[Any], value: Any = None) -> None:
    if not future.done():
        future.set_result(value)


# What a deadline timer resolves a waiter's future with (``_queued``, ``_on_thread``).
_PAST_DEADLINE: Any = object()


def _loop_waiter(ticket: Ticket) -> None:
    """How a coroutine waits in the queue (``_lease.lease_now``; lock held): a future of the
    running loop, resolved from whichever thread releases a slot."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        # Under the entry's lock, on whichever thread released a slot.
        try:
            loop.call_soon_threadsafe(_resolve, woken)
        except RuntimeError:  # the loop is closed: its coroutine will never run again
            pass

    ticket.waker = wake
    ticket.woken = woken


async def _queued(pool: CallSite, entry: EnvEntry, ticket: Ticket, deadline: float | None) -> Slot:
    """Wait, costing no thread, until a slot is handed over (or give up: deadline, cancel)."""
    woken = ticket.woken
    assert woken is not None
    # The deadline is a timer that resolves the same future, not ``asyncio.wait_for``: before
    # Python 3.12, wait_for returns the result of a future that completed in the same turn of
    # the loop as the task's cancellation, and the cancel is lost (a slot handed over as the
    # task was cancelled: the call then ran in full and the task ended as if never cancelled).
    timer = None
    if deadline is not None:
        delay = max(0.0, deadline - time.monotonic())
        timer = asyncio.get_running_loop().call_later(delay, _resolve, woken, _PAST_DEADLINE)
    try:
        woke = await woken
    except BaseException:  # cancelled (or the coroutine closed): leave the queue
        _lease.leave_queue(entry, ticket)
        raise
    finally:
        if timer is not None:
            timer.cancel()
    if woke is _PAST_DEADLINE or ticket.slot is None:
        _lease.leave_queue(entry, ticket)  # (passes on a slot handed over meanwhile)
        raise _lease.queue_error(entry, ticket, woke is _PAST_DEADLINE)
    return ticket.slot


# ---- cancellation of the task -----------------------------------------------------------------


class _Cancels:
    """The cancellations a waiting call's task received: how many (a second kills the worker
    at once) and the first one's message (``task.cancel(msg)``), which the ``CancelledError``
    raised at the call's end carries on. Made only where a call waits (never on a warm call
    whose reply came in the spin).

    asyncio throws one ``CancelledError`` for any number of ``task.cancel()`` made before the
    task runs again: two back-to-back cancels (the documented "cancel again to kill at once")
    would count as one and wait out the grace. ``Task.cancelling()`` (Python 3.11+) counts
    the requests themselves; only those since this wait began are ours (an outer scope may
    have left its own uncounted)."""

    __slots__ = ("base", "count", "message", "task")

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.base = self.requested()
        self.count = 0
        self.message: tuple[Any, ...] = ()

    def requested(self) -> int:
        cancelling = getattr(self.task, "cancelling", None)  # (Python 3.11+)
        return cancelling() if cancelling is not None else 0

    def __bool__(self) -> bool:
        return self.count > 0

    def add(self, exc: asyncio.CancelledError) -> bool:
        """Count a cancellation; True if the worker is to be killed at once."""
        self.count = max(self.count + 1, self.requested() - self.base)
        if not self.message:
            self.message = exc.args
        return self.count > 1

    def error(self) -> asyncio.CancelledError:
        return asyncio.CancelledError(*self.message)


# ---- the warm path: on the loop ---------------------------------------------------------------


def _warm_process(call: Exchange) -> WorkerGeneration | None:
    """The leased slot's worker if this call can run on the loop: verified and idle, with a
    channel of its own, nothing to ping, release or check first, a small request whose
    out-of-band buffers (if any) go to shared memory and total at most _OOB_LOOP_MAX bytes.
    Else None (the thread path: the exchange's general start decides and explains)."""
    slot = call.slot
    assert slot is not None
    state, process = slot.state, slot.process
    if not isinstance(state, lc.Idle) or process is None:
        return None  # no verified worker
    channel = process.channel
    if channel is None or channel.reply_sock is None:
        return None  # a backend without an fd channel, or one shut
    if len(call.body) > _SMALL or call.entry.dropped_refs or call.wanted is not None:
        return None
    if call.buffers and not _loop_sendable(channel, call.body, call.buffers):
        return None
    settings = call.site.settings
    if settings.ping_after_idle is not None and lc.needs_ping(
        state, call.site.clock(), settings.ping_after_idle
    ):
        return None
    if call.by_value and python_mismatch(call.entry.spec.key, process) is not None:
        return None  # the thread path raises the clear error
    if process.idle_channel_state() != "quiet":
        return None  # the thread path retires it and starts a fresh one
    return process


def _loop_sendable(channel: Channel, body: bytes, buffers: list[memoryview]) -> bool:
    """Whether a request with out-of-band ``buffers`` is cheap enough to send from the loop:
    into shared memory and at most _OOB_LOOP_MAX bytes, or few enough bytes to go inline in
    one small write. Inline streaming of more (shared memory off or unavailable) could block
    the loop on a full socket, so it stays on the thread path."""
    total = sum(b.nbytes for b in buffers)
    blocks = channel.loans.blocks
    if (
        blocks is not None
        and channel.loans.shm_state == "on"
        and use_shm(buffers, channel.config.shm_threshold_bytes)
    ):
        # A fresh block costs far more than the copy (create, reserve, fault in): above
        # _FRESH_LOOP_MAX only an idle block of the pool is written from the loop.
        if total > _FRESH_LOOP_MAX and not blocks.has_idle(shm.block_bytes(buffers)):
            return False
        return total <= _OOB_LOOP_MAX
    return total + len(body) <= _SMALL


class _ReplyReader:
    """Parses the frames of one call as they arrive on the loop (non-blocking reads).

    Each readiness callback does one read. Frames that arrive whole are parsed from that read;
    a frame whose header has come but whose payload has not is then received in place into
    one buffer of the frame's size (``FrameBuffer``), so a large frame costs one copy and a
    callback at most one read's worth of work (joining every read to what came before instead
    re-copied the whole reply at each 64 KiB read: quadratic, seconds of blocked loop for tens
    of MiB). Only an incomplete header (under ``HEADER_SIZE`` bytes) is ever joined.

    It stops at the header of a reply to its call of _BIG_REPLY bytes or more: outcome
    ``("big", (type, flags, length, the payload's start))``; the rest stays on the channel for
    ``_BigReply``."""

    __slots__ = (
        "buf",
        "call_id",
        "deadline",
        "done",
        "emit_log",
        "frame",
        "head",
        "limit",
        "outcome",
        "reader",
        "sink",
    )

    def __init__(
        self,
        reader: FrameReader,
        emit_log: Callable[[Payload], None],
        call_id: int,
        sink: Callable[[int, Any], None] | None,
        deadline: float | None = None,
    ) -> None:
        self.reader = reader
        self.deadline = deadline  # the call's (``time.monotonic()``), checked per side frame
        self.limit = reader.limit
        self.emit_log = emit_log  # LOG frames (the worker's ``LogSink.emit_frame``)
        self.call_id = call_id
        self.sink = sink
        self.outcome: tuple[str, Any] | None = None  # (kind, value) once the call ended
        # What the coroutine awaits when it has to wait through the loop (created only then;
        # replaced if a cancellation of the task cancelled it).
        self.done: asyncio.Future[None] | None = None
        self.buf = b""  # the start of a frame header (under HEADER_SIZE bytes)
        self.frame: FrameBuffer | None = None  # the payload being received in place
        self.head = (0, 0, 0)  # that frame's (type, flags, call id)

    def finish(self, kind: str, value: Any = None) -> None:
        if self.outcome is None:
            self.outcome = (kind, value)
            if self.done is not None:
                _resolve(self.done)

    def on_readable(self) -> None:
        if self.outcome is not None:
            return
        try:
            self._read_some()
        except Exception as exc:  # noqa: BLE001 - handed to the coroutine
            # The host's own failure (no memory for a frame's buffer): left registered, the
            # next callback would read on from the middle of a frame and call it garbage.
            self.finish("error", exc)

    def _read_some(self) -> None:
        frame = self.frame
        try:
            if frame is not None:
                with frame.space() as view:
                    n = self.reader.recv_into_nowait(view)
                if not n:
                    self.finish("eof")
                elif frame.wrote(n):
                    self.frame = None
                    self.dispatch(*self.head, frame.data, b"")
                return
            data = self.reader.recv_nowait()
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionResetError:
            self.finish("reset")
            return
        except OSError:
            self.finish("eof")
            return
        self.feed(data)

    def feed(self, data: bytes) -> None:
        """Parse what one ``recv`` returned (b"": EOF) after what was buffered."""
        if not data:
            self.finish("eof")
            return
        buf = self.buf + data if self.buf else data  # (self.buf: under HEADER_SIZE bytes)
        start = 0
        size = len(buf)
        while size - start >= HEADER_SIZE:
            try:
                ftype, flags, length, frame_call_id = decode_header(buf, start)
            except FrameError as exc:  # a bad magic: the stream is out of step
                self.finish("bad", str(exc))
                return
            if length > self.limit:
                self.finish("bad", f"frame of {length} bytes exceeds the limit of {self.limit}")
                return
            end = start + HEADER_SIZE + length
            if size < end:
                if (
                    length >= _BIG_REPLY
                    and frame_call_id == self.call_id
                    and (ftype == FrameType.REPLY_OK or ftype == FrameType.REPLY_ERR)
                ):
                    # Our large reply: the loop reads no more of it; the coroutine hands the
                    # rest to a thread of the call's own (``_BigReply``). It is the call's
                    # last frame, so nothing after it is ours to read.
                    self.buf = b""
                    self.finish("big", (ftype, flags, length, buf[start + HEADER_SIZE :]))
                    return
                # The rest of this payload is read straight into its own buffer (on_readable).
                self.head = (ftype, flags, frame_call_id)
                self.frame = FrameBuffer(length, buf[start + HEADER_SIZE :])
                self.buf = b""
                return
            payload = buf[start + HEADER_SIZE : end]
            start = end
            if self.dispatch(ftype, flags, frame_call_id, payload, buf[start:]):
                return
        self.buf = buf[start:]

    def dispatch(
        self, ftype: int, flags: int, frame_call_id: int, payload: Payload, rest: bytes
    ) -> bool:
        """Hand on one whole frame; True if it ended the call (``rest``: the bytes after it,
        which the channel's own reader gets back). A LOG or EVENT handler that raises (a
        host logging filter, say, or an ``on_event`` raising ``CancelledError``, which
        ``deliver`` lets through) ends the call with that error ("error"), as the sync read
        does: raised out of a loop callback it would only be logged, the frames after it in
        the same read would be lost, and the call would wait for a reply its reader no
        longer reads.

        The deadline is looked at after each such frame: one read may hold many, and a slow
        ``on_event`` (it runs on the loop) would otherwise keep the deadline's timer from
        running until the whole read is handled, by which time the reply may be readable and
        win over the timer (asyncio runs I/O callbacks before due timers): a call could then
        run far past its deadline and succeed."""
        if ftype == FrameType.LOG or ftype == FrameType.EVENT:
            try:
                if ftype == FrameType.LOG:
                    self.emit_log(payload)
                elif self.sink is not None:
                    self.sink(frame_call_id, payload)
            except BaseException as exc:  # noqa: BLE001 - handed to the call
                self.finish("error", exc)
                return True
            deadline = self.deadline
            if deadline is not None and time.monotonic() >= deadline:
                self.finish("deadline")
                return True
        else:
            self.finish("frame", (ftype, flags, frame_call_id, payload, rest))
            return True
        return False


class _MappedFrame:
    """A large reply's payload, received in place into private anonymous memory: the kernel
    hands out zeroed pages as ``recv_into`` first writes them, with the GIL released, where a
    ``bytearray`` is zero-filled by ``memset`` with the GIL held (0.6-0.9 ms per MiB of fresh
    pages here, a stall of the loop from any thread). Memory is taken only as bytes arrive, as
    with ``FrameBuffer`` beyond its eager size. ``FrameBuffer``'s ``space``/``wrote``/``data``."""

    __slots__ = ("data", "have", "length", "memory")

    def __init__(self, length: int, head: bytes) -> None:
        self.memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
        self.data = memoryview(self.memory)  # the payload once whole (no copy)
        self.data[: len(head)] = head
        self.have = len(head)
        self.length = length

    def space(self) -> memoryview:
        return self.data[self.have :]

    def wrote(self, n: int) -> bool:
        self.have += n
        return self.have >= self.length


class _BigReply:
    """The rest of one large reply frame, received and opened on a thread of the call's own.

    The loop read the frame's header (``_ReplyReader.feed``: a reply to this call of at least
    _BIG_REPLY bytes) and reads no more of the channel. Data flow::

        loop: wait()            starts the thread; arms the deadline (``stop``); a cancel of
                                the task asks the worker (``_lease.cancel``) and marks the reply
                                dropped, and the coroutine waits on (as on the loop)
        thread: run()           poll(channel, stop pipe) -> recv_into the payload's buffer
                                (``_MappedFrame``), until whole, EOF, reset or stopped; then
                                ``open_reply`` (out-of-band table) and, unless dropped, the
                                unpickling (``decode_reply``); hands its outcome to the loop
                                (``call_soon_threadsafe``) and ends
        loop: wait() returns    ("opened", (replied_at, retained or the open's error,
                                (ok, value) or None)) or ("eof" | "reset" | "deadline", None):
                                ``_warm_call`` settles the call, exactly as on the loop

    The thread owns the channel until it ends, and the coroutine never returns before it has
    (``join``): a retired worker's sockets are disposed of only once its slot is released
    (``settle``), after that. The stop pipe is the coroutine's: it closes it after the join,
    so no byte is ever written to a closed (or reused) descriptor. A stop that comes once the
    payload is whole is ignored: the reply arrived before the deadline was acted on, as a
    reply read on the loop wins over a timer that has not run yet. The unpickling itself is
    one C call where a result is one big object (a ``str``, ``bytes``): it holds the GIL, so
    the loop still waits for it (HISTORY.md, fifteenth round)."""

    __slots__ = (
        "call",
        "channel",
        "done",
        "dropped",
        "flags",
        "ftype",
        "head",
        "length",
        "loop",
        "stop_r",
        "stop_w",
        "stopped",
    )

    def __init__(
        self, call: Exchange, channel: Channel, dropped: bool, header: tuple[int, int, int, bytes]
    ) -> None:
        self.call = call  # its target, call id, process; the site's clock (replied_at)
        self.channel = channel
        self.dropped = dropped  # the task was cancelled: the reply is opened, not unpickled
        # The frame's type, flags, payload length and the start of the payload, read on the
        # loop with the header.
        self.ftype, self.flags, self.length, self.head = header
        self.stopped: str | None = None  # why the loop stopped the receiving ("deadline")
        self.stop_r = self.stop_w = -1
        self.loop: asyncio.AbstractEventLoop | None = None
        self.done: asyncio.Future[tuple[str, Any]] | None = None

    async def wait(self, cancels: _Cancels | None) -> tuple[tuple[str, Any], _Cancels]:
        """Run the thread and wait for its outcome (and the thread's end); the deadline and
        cancellation of the task act as on the loop. Returns (the outcome, cancels). Whatever
        raises here (the thread could not start or failed, the coroutine was closed while it
        read) leaves the channel out of step: the caller's ``settle`` then finds the slot
        still in this call with no reply and stops the worker."""
        loop = self.loop = asyncio.get_running_loop()
        done = self.done = loop.create_future()
        if cancels is None:
            cancels = _Cancels()
        self.stop_r, self.stop_w = os.pipe()
        thread = threading.Thread(target=self.run, name="comfy-env-acall-reply", daemon=True)
        started = False
        timer = None
        try:
            thread.start()
            started = True
            deadline = self.call.deadline
            if deadline is not None:
                delay = max(0.0, deadline - time.monotonic())
                timer = loop.call_later(delay, self.stop, "deadline")
            while True:
                try:
                    kind, value = await asyncio.shield(done)
                    break
                except asyncio.CancelledError as exc:
                    # As on the loop: ask the worker, keep waiting for the call's end (the
                    # grace kills a worker that does not end it); a second cancel kills now.
                    self.dropped = True
                    call = self.call
                    call.cancel(force=cancels.add(exc))
        finally:
            if timer is not None:
                timer.cancel()
            if started:
                self.stop("closed")  # (ignored by a thread that has ended or is unpickling)
                thread.join()
            os.close(self.stop_r)
            os.close(self.stop_w)
            self.stop_r = self.stop_w = -1
        if kind == "raised":  # not the call's outcome: the thread itself failed (MemoryError)
            raise value
        return (kind, value), cancels

    def stop(self, why: str) -> None:
        """Loop thread: end the receiving now (the thread polls the stop pipe); no-op once
        the payload is whole."""
        if self.stopped is None and self.stop_w >= 0:
            self.stopped = why
            os.write(self.stop_w, b"x")

    def run(self) -> None:
        """The thread: receive and open the reply, then hand the outcome to the loop."""
        try:
            outcome = self.receive()
        except BaseException as exc:  # noqa: BLE001 - handed to the coroutine
            outcome = ("raised", exc)
        loop, done = self.loop, self.done
        assert loop is not None and done is not None
        try:
            loop.call_soon_threadsafe(_resolve, done, outcome)
        except RuntimeError:  # the loop is closed: its coroutine will never run again
            pass

    def receive(self) -> tuple[str, Any]:
        length, head = self.length, self.head
        frame: _MappedFrame | FrameBuffer | None = None
        if length >= _MAPPED_REPLY:
            try:
                frame = _MappedFrame(length, head)
            except (OSError, OverflowError, ValueError):  # no address space (overcommit)
                pass
        if frame is None:
            frame = FrameBuffer(length, head)
        self.head = b""
        reader = self.channel.reader
        channel = self.channel.reply_sock
        assert reader is not None and channel is not None
        stop_r = self.stop_r
        poller = select.poll()
        poller.register(channel.fileno(), select.POLLIN)
        poller.register(stop_r, select.POLLIN)
        recv_into = reader.recv_into_nowait
        while True:
            # Poll first: a reply that streams for long still sees the stop at once.
            for fd, _events in poller.poll():
                if fd == stop_r:
                    return (self.stopped or "closed", None)
            with frame.space() as view:
                try:
                    n = recv_into(view)
                except (BlockingIOError, InterruptedError):
                    continue
                except ConnectionResetError:
                    return ("reset", None)
                except OSError:
                    return ("eof", None)
            if not n:
                return ("eof", None)
            if frame.wrote(n):
                break
        call = self.call
        replied_at = call.site.clock()
        payload: Any = frame.data
        del frame
        buffers = None
        opened: list[str] | Exception = []
        if self.flags:
            process = call.process
            assert process is not None
            try:
                payload, buffers, opened = process.open_reply(call.call_id, self.flags, payload)
            except (FrameError, HostResourceError) as exc:  # told by ``Exchange.not_opened``
                return ("opened", (replied_at, exc, None))
        if self.dropped:
            return ("opened", (replied_at, opened, None))
        try:
            decoded: tuple[bool, Any] = (
                True,
                decode_reply(self.ftype, payload, call.target, buffers),
            )
        except BaseException as exc:  # noqa: BLE001 - the call's outcome, raised on the loop
            decoded = (False, exc)
        return ("opened", (replied_at, opened, decoded))


async def _warm_call(call: Exchange, process: WorkerGeneration) -> tuple[bool, Any]:
    """Run the call on the loop: its start, send and waiting here, every decision the
    exchange's. (False, None) if nothing was sent (the worker died idle under our feet): the
    caller moves the call to the thread path, which starts a fresh worker."""
    site, entry = call.site, call.entry
    if call.process is None:  # not started in the lease: ``CallStarted`` now
        try:
            if not call.begin(process):
                return False, None
        except CallCancelled:
            _lease.settle(site, entry, call, "cancelled", None)
            raise
    try:
        # Loans given back ride in front; buffers go into a pooled shared-memory block.
        call.block = process.send_request(call.call_id, call.body, call.buffers, None)
    except (BrokenPipeError, ConnectionResetError):
        entry.apply(call.slot, lc.ChannelClosed(process.generation))  # type: ignore[arg-type]
        call.process = None
        return False, None  # not one byte went out: the call never ran
    except OSError:
        pass  # the read below reports the crash
    except BaseException:
        # Nothing was sent (``SerializationError``: shared memory failed and the inline frame
        # is over the limit, or the copy itself failed): end the call as the sync path does.
        _lease.settle(site, entry, call, "failed", None)
        raise
    outcome: _lease.Outcome = "failed"
    cancels: _Cancels | None = None  # made once the call waits through the loop
    try:
        (kind, value), cancels = await _await_reply(call)
        if kind == "frame" or kind == "opened":
            ok, result = _replied(call, kind, value, cancels)
            outcome = "raised"
            if not ok:
                raise result
            outcome = "ok"
            return True, result
        if kind == "bad":
            raise call.protocol_broken(value)
        if kind == "error":
            # The host's own failure while reading (a side frame's handler raised, no memory
            # for a frame's buffer): the reply can no longer be read in order. ``settle``
            # (below) finds the slot still in this call with no reply and stops the worker,
            # as after any error before the reply (the sync read stops it the same way).
            raise value
        timed_out = call.deadline_hit() if kind == "deadline" else None
        if timed_out is not None:
            raise timed_out
        # EOF, reset, or a deadline that lost to another retirement: compose the crash report
        # (it waits, bounded, for the exit status) off the loop.
        raise await _blocking(call.crashed)
    except CallCancelled as exc:
        outcome = "cancelled"
        if cancels:
            raise cancels.error() from exc
        if exc.env is None:
            exc.env, exc.generation, exc.pid = entry.spec.key, call.generation, process.pid
        raise
    except CallTimeout:
        outcome = "timed_out"
        raise
    except WorkerCrashed:
        outcome = "crashed"
        raise
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        if outcome == "ok" and call.replied_at is not None:
            _lease.settle_ok(site, entry, call, call.replied_at)
        else:
            _lease.settle(site, entry, call, outcome, call.replied_at)


def _replied(call: Exchange, kind: str, value: Any, cancels: _Cancels | None) -> tuple[bool, Any]:
    """The reply, opened by the exchange: (True, result) or (False, the call's own error);
    the errors of a reply that cannot be opened, or of a task cancelled meanwhile (the reply
    crossed the cancel: dropped, counted once as cancelled), raised."""
    if kind == "opened":  # a large reply, received, opened and decoded on its own thread
        replied_at, opened, decoded = value
        if not isinstance(opened, list):  # open_reply's error
            call.not_opened(opened, replied_at)
        process = call.process
        assert process is not None
        process.finish_request(call.block, opened)
        call.replied_at = replied_at
        if cancels:
            raise cancels.error()
        assert decoded is not None  # (not decoded only once cancelled)
        return decoded  # type: ignore[no-any-return]
    ftype, _, reply_id, payload = value
    if (ftype != _REPLY_OK and ftype != _REPLY_ERR) or reply_id != call.call_id:
        raise call.protocol_broken(not_the_reply(ftype, reply_id, call.call_id, payload))
    ftype, payload, reply_buffers = call.open(value)
    if cancels:
        cause: CallCancelled | None = None
        if ftype == _REPLY_ERR:
            # The call stopped on the cancel: its CallCancelled is the cause, saying so, as
            # on the thread path. Another error (or a result) is dropped.
            try:
                decode_reply(ftype, payload, call.target, reply_buffers)
            except CallCancelled as exc:
                cause = exc
            except Exception:  # noqa: BLE001 - the function's own error: dropped
                pass
        raise cancels.error() from cause
    try:
        return True, decode_reply(ftype, payload, call.target, reply_buffers)
    except FrameError as exc:  # an error record that is not the runtime's
        raise call.protocol_broken(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the call's own error, raised by the caller
        return False, exc


async def _await_reply(call: Exchange) -> tuple[tuple[str, Any], _Cancels | None]:
    """Wait for the sent call's end: on the spot first (``_spin_for_reply``), then through
    the loop (``_await_on_loop``), a large reply's rest on a thread (``_BigReply``). Returns
    (kind, value) and the task's cancellations: ("frame", (type, flags, call id, payload)),
    ("opened", ...) for a large reply, or "bad", "error", "deadline", "eof", "reset"."""
    process = call.process
    channel = process.channel if process is not None else None
    assert channel is not None and channel.reader is not None and channel.reply_sock is not None
    frames = channel.reader
    fd = channel.reply_sock.fileno()
    now = time.monotonic()
    ended, reader = _spin_for_reply(call, frames, fd, now)
    cancels: _Cancels | None = None
    if ended is None:
        assert reader is not None
        ended, cancels = await _await_on_loop(call, reader, fd)
    kind, value = ended
    if kind == "big":
        # A large reply: its rest is received and unpickled on a thread of the call's own,
        # while the coroutine keeps the deadline and answers cancellation as on the loop.
        big = _BigReply(call, channel, bool(cancels), value)
        ended, cancels = await big.wait(cancels)
        if ended[0] == "opened":
            frames.note_wait(time.monotonic() - now)
    elif kind == "frame":
        ftype, flags, reply_id, payload, rest = value
        if rest:
            frames.unread(rest)
        ended = (kind, (ftype, flags, reply_id, payload))
        if reply_id == call.call_id and (ftype == _REPLY_OK or ftype == _REPLY_ERR):
            frames.note_wait(time.monotonic() - now)  # polls next time only if it would pay
    return ended, cancels


def _spin_for_reply(
    call: Exchange, frames: FrameReader, fd: int, now: float
) -> tuple[tuple[str, Any] | None, _ReplyReader | None]:
    """A quick call replies within tens of microseconds: wait for that on the spot (at most
    _REPLY_SPIN, GIL released) rather than pay for a reader registration and two turns of the
    loop. When this thread and the worker share one single CPU, the reply is often there
    already (the request woke the worker, which ran at once): one non-blocking recv first; if
    nothing yet, the worker cannot reply before it runs, so give it the CPU (sched_yield)
    rather than sleep in select and be woken by the reply. Otherwise (the worker runs
    elsewhere, its reply takes at least a cross-CPU wake-up) wait in select at once.

    Returns how the call ended, or the reader that parsed what came (the caller goes on
    through the loop)."""
    data: bytes | None = None
    spin_end = now + _REPLY_SPIN
    try:
        if _shares_one_cpu(call.process, now):  # type: ignore[arg-type]
            try:
                data = frames.recv_nowait()
            except (BlockingIOError, InterruptedError):
                os.sched_yield()
                try:
                    data = frames.recv_nowait()
                except (BlockingIOError, InterruptedError):
                    pass
        elif frames.spins():
            # Across CPUs: poll rather than sleep in select, as the sync path does (the
            # wake-up is most of the round trip; FrameReader.spin_wait).
            if frames.poll_until(min(spin_end, now + frames.spin_budget)):
                data = frames.recv_nowait()
        if data is None and fd < 1024:  # select()'s FD_SETSIZE
            left = spin_end - time.monotonic()
            if left > 0 and select.select((fd,), (), (), left)[0]:
                data = frames.recv_nowait()
    except (BlockingIOError, InterruptedError):
        pass
    except ConnectionResetError:
        return ("reset", None), None
    except OSError:
        return ("eof", None), None
    if data is not None and len(data) >= HEADER_SIZE:
        try:
            ftype, flags, length, reply_id = decode_header(data)
        except FrameError:
            ftype = length = -1  # a bad magic: the general parser below ends the call
        # The common case: exactly one whole frame, the reply itself (LOG and EVENT frames,
        # partial or oversize frames and anything odd take the general parser).
        if (
            len(data) == HEADER_SIZE + length
            and length <= frames.limit
            and (ftype == _REPLY_OK or ftype == _REPLY_ERR)
        ):
            return ("frame", (ftype, flags, reply_id, data[HEADER_SIZE:], b"")), None
    sink = None
    if call.on_event is not None:
        sink = event_handler(call.on_event, call.call_id, call.generation)
    assert call.process is not None
    emit_log = call.process.log.emit_frame
    reader = _ReplyReader(frames, emit_log, call.call_id, sink, call.deadline)
    if data is not None:  # a partial frame, or frames before the reply
        reader.feed(data)
        if reader.outcome is None and fd < 1024:  # select()'s FD_SETSIZE
            while reader.outcome is None:
                left = spin_end - time.monotonic()
                if left <= 0 or not select.select((fd,), (), (), left)[0]:
                    break
                reader.on_readable()
    ended = reader.outcome
    return ended, (reader if ended is None else None)


async def _await_on_loop(
    call: Exchange, reader: _ReplyReader, fd: int
) -> tuple[tuple[str, Any], _Cancels]:
    """Read the call's frames through the loop (``add_reader``) until its end, with the
    deadline's timer and the task's cancellation: the first asks the worker (a grace timer
    kills one that does not stop), a second kills it at once, and the wait goes on for the
    call's end either way (it is settled once, by its caller)."""
    loop = asyncio.get_running_loop()
    reader.done = loop.create_future()
    loop.add_reader(fd, reader.on_readable)
    timer = None
    try:
        if call.deadline is not None:
            delay = max(0.0, call.deadline - time.monotonic())
            timer = loop.call_later(delay, reader.finish, "deadline")
        cancels = _Cancels()
        while reader.outcome is None:
            assert reader.done is not None
            try:
                await reader.done
            except asyncio.CancelledError as exc:
                force = cancels.add(exc)
                if reader.outcome is not None:
                    break  # it ended as the cancel came: the reply is dropped by the caller
                reader.done = loop.create_future()
                call.cancel(force=force)
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()
    assert reader.outcome is not None
    return reader.outcome, cancels


# How long an answer of ``_shares_one_cpu`` stands: the reader's own period (one answer per
# worker, shared with the sync path's polling rule). A stale answer costs a few microseconds:
# one yield that returns at once, or one select.
_AFFINITY_TTL = SPIN_RECHECK


def _shares_one_cpu(process: WorkerGeneration, now: float) -> bool:
    """True if this thread and the worker's main thread are both confined to the same single
    CPU (``taskset``, a one-CPU cpuset or container): the reply to a request just sent cannot
    come before the worker gets that CPU. The worker's reader keeps the answer
    (``FrameReader.on_one_cpu``)."""
    channel = process.channel
    reader = channel.reader if channel is not None else None
    return reader is not None and reader.on_one_cpu(now)


# ---- everything else: a thread of its own -----------------------------------------------------


def _start_thread(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]
) -> asyncio.Future[tuple[bool, Any]]:
    """Run ``fn`` on a short-lived thread of its own (never the loop's default executor); the
    future returned is resolved on ``loop`` with ``(True, result)`` or ``(False, error)``
    (``_blocking``, ``_on_thread``)."""
    done: asyncio.Future[tuple[bool, Any]] = loop.create_future()

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the coroutine
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(_resolve, done, outcome)
        except RuntimeError:  # the loop is closed: its coroutine will never run again
            pass

    threading.Thread(target=run, name="comfy-env-acall", daemon=True).start()
    return done


async def _blocking(fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread of its own (``_start_thread``) and return its result;
    cancellation waits for it (it is bounded)."""
    done = _start_thread(asyncio.get_running_loop(), fn)
    while True:
        try:
            ok, value = await asyncio.shield(done)
            break
        except asyncio.CancelledError:
            continue
    if ok:
        return value  # type: ignore[no-any-return]
    raise value


async def _on_thread(call: Exchange) -> Any:
    """Run the call's exchange (``Exchange.run``: a worker to start, a ping due, large
    buffers, RemoteRefs, an actor) on a thread of its own; the coroutine keeps the deadline
    and answers cancellation of the task."""
    loop = asyncio.get_running_loop()
    callback = call.on_event
    if callback is not None:

        def on_loop(event: Any) -> None:
            # Events run on the loop, in order, before the result (both go through the
            # same FIFO of call_soon_threadsafe).
            try:
                loop.call_soon_threadsafe(deliver, callback, event)
            except RuntimeError:
                pass

        call.on_event = on_loop
    done = _start_thread(loop, call.run)
    # The deadline: a timer that resolves ``done`` first (the thread's own outcome then finds
    # it settled), not ``asyncio.wait_for``, which before Python 3.12 loses a cancel that comes
    # in the same turn of the loop as the outcome (``_queued``). The thread ends the call with
    # the same deadline (and counts it); the caller does not wait for a worker still starting.
    timer = None
    if call.deadline is not None:
        delay = max(0.0, call.deadline - time.monotonic())
        timer = loop.call_later(delay, _resolve, done, _PAST_DEADLINE)
    cancels = _Cancels()
    while True:
        try:
            outcome = await asyncio.shield(done)
            break
        except asyncio.CancelledError as exc:
            if timer is not None:
                timer.cancel()  # cancelled: wait for the call's end (the thread's deadline holds)
            call.cancel(force=cancels.add(exc))
    if timer is not None:
        timer.cancel()
    if cancels:
        # From the thread's CallCancelled, if that is how the call ended: it says whether the
        # worker stopped in time or was killed, and why (as on the loop).
        ended = outcome is not _PAST_DEADLINE and not outcome[0]
        raise cancels.error() from (
            outcome[1] if ended and isinstance(outcome[1], CallCancelled) else None
        )
    if outcome is _PAST_DEADLINE:
        raise _past_deadline(call)
    ok, value = outcome
    if ok:
        return value
    raise value


def _past_deadline(call: Exchange) -> CallTimeout:
    """The error of a call on the thread path whose deadline passed before the thread ended
    it: sent (the thread's own deadline stops its worker), or still waiting for a worker."""
    env = call.entry.spec.key
    if not call.call_id:
        return not_reached(env, "; the worker still starting goes on and serves the next call")
    label = target_label(call.target)
    pid = pid_of(call.ran_on, call.generation)
    return missed_deadline(env, call.call_id, label, pid, call.generation)
