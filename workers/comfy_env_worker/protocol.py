"""Frames: the one wire format the host and its workers agree on.

Both sides import this module (the host as ``comfy_env_worker.protocol``, the worker from its
runtime directory), so the format is defined exactly once.

A frame is a fixed 20-byte header followed by ``length`` payload bytes::

    magic  b"CE"      2 bytes, catches a stream that is not ours (or lost sync)
    type   u8         one of the ``FrameType`` values below
    flags  u8         FLAG_OOB: the payload carries out-of-band buffers (see ``shm``);
                      FLAG_GONE (on CONSUMED): the reply's block was gone when the host
                      came to open it: the worker gives it up instead of reusing it
    length u64 LE     payload size, checked against the receiver's limit *before* reading
    call   u64 LE     call id the frame belongs to (0 for handshake and control frames)

Payloads are pickles (protocol 5). A channel carries frames only: the worker's raw fd 1/2 are
separate pipes, so native output can never corrupt a frame.

Any framing error (bad magic, unknown type, oversize length, EOF in the middle of a frame) raises
``FrameError``. The stream is never resynchronised: the caller retires the worker, because after
a partial or garbage frame there is no trustworthy boundary to resume from.

Writes never raise SIGPIPE: every send on a channel passes ``MSG_NOSIGNAL``, so a peer that
is gone is an ``EPIPE`` (``BrokenPipeError``) the writer reports, never a signal. A host that set
SIGPIPE to its default action (many command-line programs do) would otherwise be killed outright
by a worker that died while the host wrote a request to it (and a worker whose env's code did
the same, by a host that went away). Free on the hot path: the flag rides on the same syscall.

This module is stdlib-only and must parse under the oldest Python an env may run (3.8).
"""

from __future__ import annotations

import _socket
import os
import select
import struct
import time

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, List, Optional, Sized, Tuple, Union

PROTOCOL_VERSION = 1

# Bound at import: code in a worker may replace ``time.monotonic`` (a frozen test clock) or
# delete ``select.poll`` (green-thread monkeypatching) long after the channel was set up, and
# the serve loop must neither spin forever on a clock that never moves nor break.
_monotonic = time.monotonic
_poll = select.poll

# Pass with every send on a channel (see the module docstring). 0 where the platform has no
# such flag (macOS): there SIGPIPE is left to the process's disposition, as before.
MSG_NOSIGNAL = getattr(_socket, "MSG_NOSIGNAL", 0)

HEADER = struct.Struct("<2sBBQQ")
HEADER_SIZE = HEADER.size  # 20
MAGIC = b"CE"


class FrameType:
    """Frame types. Worker -> host: HELLO, READY, REPLY_OK, REPLY_ERR, PONG, ERROR, LOG, EVENT.

    Host -> worker: CONFIG, CALL, PING, SHUTDOWN, CONSUMED, RELEASE_REFS; CANCEL (on the cancel
    pipe, see ``control``).
    """

    HELLO = 1  # worker -> host: {"protocol", "pid", "python", "executable", "platform"}
    CONFIG = 2  # host -> worker: {"sys_path", "cwd", "env", "log_level", "max_frame_bytes"}
    READY = 3  # worker -> host: config applied, serving calls
    CALL = 4  # host -> worker: (target, args, kwargs)
    REPLY_OK = 5  # worker -> host: result
    REPLY_ERR = 6  # worker -> host: remote exception record (see ``main.error_record``)
    PING = 7  # host -> worker: liveness check
    PONG = 8  # worker -> host
    SHUTDOWN = 9  # host -> worker: exit cleanly now
    ERROR = 10  # worker -> host: a frame the worker could not understand (never silence)
    CONSUMED = 11  # host -> worker: the reply to call id was read; its blocks may be reused
    RELEASE_REFS = 12  # host -> worker: drop kept objects (pickled list of ids); no reply
    LOG = 13  # worker -> host: a log record or output line (see ``logs``); in band or log pipe
    CANCEL = 14  # host -> worker, on the cancel pipe: stop call id (no payload; see ``control``)
    EVENT = 15  # worker -> host, in band during call id: pickled (kind, data) for on_event


FLAG_OOB = 1
# On CONSUMED only. Without it the worker would put a block whose name someone removed from
# /dev/shm back in its pool, and every later reply in it would be lost the same way.
FLAG_GONE = 2

# The names (``/proc/<pid>/task/<tid>/comm``, at most 15 bytes) a worker gives its watchdog
# thread and its sentinel thread (which only waits): the host watches the end of either as the
# first sign of the worker's death (see ``comfy_env._watchdog``); ``ps -L`` shows them too.
WATCHDOG_THREAD_NAME = "comfy-watchdog"
SENTINEL_THREAD_NAME = "comfy-sentinel"

# The start-up canary's call target (the host sends it right behind CONFIG; the worker resolves
# it while it waits for CONFIG, see ``main.serve``).
CANARY_TARGET = "comfy_env_worker.tasks:echo"


# The largest frame either side accepts unless configured otherwise (PoolConfig.max_frame_bytes).
DEFAULT_MAX_FRAME_BYTES = 2 * 1024**3

# Reads go into one preallocated scratch buffer: a fresh ``recv(n)`` buffer of this size per
# frame would cost an allocation (an mmap above glibc's threshold) on every call.
_RECV_CHUNK = 64 * 1024

# See ``FrameReader.spin_wait``: seconds between two checks of where the two ends may run.
SPIN_RECHECK = 0.05
# While both ends share one pinned CPU: frames between two looks (no clock on that path).
SPIN_RECHECK_READS = 1000
# An alarm that rang without a death (see FrameReader._await_watched) is asked again this
# often, this many times.
ALARM_RECHECK = 0.001
ALARM_RECHECKS = 20
_spin_supported = hasattr(os, "sched_getaffinity") and hasattr(os, "sched_yield")


def shares_one_cpu(peer_pid: int) -> bool:
    """Whether this thread and ``peer_pid``'s main thread may only run on one and the same CPU
    (``taskset``, a one-CPU cpuset or container). False if the peer cannot be inspected
    (gone, or in another PID namespace): it may run elsewhere."""
    mine = os.sched_getaffinity(0)
    if len(mine) != 1:
        return False
    try:
        return os.sched_getaffinity(peer_pid) == mine
    except OSError:
        return False


if TYPE_CHECKING:
    Payload = Union[bytes, bytearray]
else:
    Payload = bytes  # names the type for hosts' annotations; never checked at run time


class FrameError(Exception):
    """The byte stream is not a valid frame sequence; the channel must be abandoned."""


class CallNotLoaded(Exception):
    """A call's target and arguments did not unpickle in the worker (a class or module the
    env lacks, a reducer that raises). The frame was whole, so the worker goes on; the host
    raises ``SerializationError`` naming the call, with this error's cause.

    ``args``: (the text; ``"ModuleNotFoundError"`` or ``"ImportError"`` when an import failed
    (subclasses included), ``"DtypeNotRepresentable"`` for an array whose dtype the env's numpy
    lacks (``arrays``), else ``""``; the module it names or None); the text alone is its
    ``str``."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ChannelClosed(Exception):
    """The peer closed the channel (EOF) at a frame boundary or inside a frame.

    ``partial`` is True when EOF arrived in the middle of a frame.
    """

    def __init__(self, partial: bool = False) -> None:
        super().__init__("channel closed mid-frame" if partial else "channel closed")
        self.partial = partial


def encode_header(ftype: int, call_id: int, length: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, ftype, flags, length, call_id)


_unpack_header = HEADER.unpack_from  # (bound once: no attribute lookup per frame)


def decode_header(buf: Any, offset: int = 0) -> Tuple[int, int, int, int]:
    """``(frame type, flags, payload length, call id)`` of the frame header at ``offset`` in
    ``buf`` (``HEADER_SIZE`` bytes from there must be present). A bad magic is a
    ``FrameError``: the stream is out of step, and is never resynchronised. The length is
    not checked against any limit: each reader has its own.

    Every frame header is read through here (the channel, the cancel pipe, the log pipe, the
    asyncio path); it is on every call's path, so it allocates nothing but its tuple."""
    magic, ftype, flags, length, call_id = _unpack_header(buf, offset)
    if magic != MAGIC:
        raise FrameError("bad frame magic %r (stream corrupted)" % (bytes(magic),))
    return ftype, flags, length, call_id


class PartialSend(OSError):
    """The channel failed after part of a frame was written (the peer saw a partial frame)."""


def send_parts(sock: _socket.socket, parts: List[Any]) -> None:
    """Write buffers back to back with ``sendmsg`` (no joining copy), resuming after partial
    writes. An error on the first write means nothing was sent and propagates as is; a later
    one is raised as ``PartialSend``."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    started = False
    while views:
        if not started:
            sent = sock.sendmsg(views[:512], (), MSG_NOSIGNAL)
            started = True
        else:
            try:
                sent = sock.sendmsg(views[:512], (), MSG_NOSIGNAL)
            except (BlockingIOError, TimeoutError):
                raise
            except OSError as exc:
                raise PartialSend(exc.errno, "channel failed mid-frame: %s" % exc) from exc
        while sent and views:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0


def send_frame(sock: _socket.socket, ftype: int, call_id: int, payload: bytes = b"") -> None:
    """Write one frame. Small frames go out in one ``sendall`` of a joined buffer (one syscall);
    large ones as header + payload via ``sendmsg`` to avoid copying the payload."""
    header = HEADER.pack(MAGIC, ftype, 0, len(payload), call_id)
    if len(payload) <= 65536:
        sock.sendall(header + payload, MSG_NOSIGNAL)
        return
    send_parts(sock, [header, payload])


# Frames up to this size get their whole buffer at once; larger ones grow as data arrives.
EAGER_FRAME_BYTES = 64 * 1024 * 1024


class FrameBuffer:
    """The payload of one frame, received in place: ``recv_into(space())``, then
    ``wrote(n)``, until ``complete``; ``data`` is then the payload (no further copy).

    The buffer is the frame's exact size up to ``eager`` bytes (``EAGER_FRAME_BYTES``), so a
    payload is copied once, however many reads it takes (joining the reads instead copies
    the whole payload again at every read: quadratic). Beyond ``eager`` it doubles as bytes
    actually arrive (``allocations`` counts the buffer and its growths: at most
    1 + log2(length / eager)): a peer that merely *announces* a huge frame (a fake
    interpreter's HELLO) gets no memory for it."""

    __slots__ = ("allocations", "data", "have", "length")

    def __init__(self, length: int, head: Any = b"", eager: int = EAGER_FRAME_BYTES) -> None:
        have = len(head)  # the start of the payload, read with the header
        self.data = bytearray(min(length, max(eager, have)))
        self.data[:have] = head
        self.have = have
        self.length = length
        self.allocations = 1

    @property
    def complete(self) -> bool:
        return self.have >= self.length

    def space(self) -> memoryview:
        """Where the next bytes go, up to the end of the frame, growing the buffer if it is
        full. Release the view (``with``) before the next call: a buffer still exported
        cannot grow."""
        data = self.data
        if self.have == len(data) and len(data) < self.length:
            data.extend(bytes(min(self.length, 2 * len(data)) - len(data)))
            self.allocations += 1
        return memoryview(data)[self.have :]

    def wrote(self, n: int) -> bool:
        """``n`` more bytes landed in the last ``space()``; True once the payload is whole."""
        self.have += n
        return self.have >= self.length


class FrameReader:
    """Reads frames from a stream socket, buffering what arrived beyond the current frame.

    Small frames usually arrive with their header in one ``recv``; a large payload is read
    straight into a buffer of its exact size, so it is copied once.
    """

    __slots__ = (
        "_alarm_after",
        "_alarm_fds",
        "_alarm_poller",
        "_alarm_rechecks",
        "_alarm_suspects",
        "_buf",
        "_calls",
        "_limit",
        "_on_alarm",
        "_one_cpu",
        "_poller",
        "_scratch",
        "_scratch_view",
        "_sock",
        "_spin",
        "_spin_budget",
        "_spin_peer",
        "_spin_pinned_reads",
        "_spin_recheck",
        "_spin_short",
        "_spin_since",
    )

    def __init__(self, sock: _socket.socket, limit: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._scratch = bytearray(_RECV_CHUNK)
        self._scratch_view = memoryview(self._scratch)
        self._limit = limit
        self._poller: Optional[select.poll] = None
        self._spin_budget = 0.0  # spin_wait's seconds (0: never poll)
        self._spin = 0.0  # the budget, or 0 while both ends share one pinned CPU
        self._spin_peer = 0
        self._spin_recheck = 0.0  # when to look at the affinity masks again (polling)
        self._spin_pinned_reads = 0  # reads until the next look (pinned: no clock read)
        self._spin_short = True  # the last wait ended within the budget
        self._spin_since = 0.0  # when a wait that did not poll began (0: none pending)
        self._one_cpu = False  # both ends pinned to one same CPU, as last looked at
        self._calls: Sized = ()  # the calls this process makes right now (spin_wait's)
        # Alarms (``set_alarms``): descriptors whose readiness may mean the peer is dead,
        # watched by waits that outlast a blocking read's timeout.
        self._alarm_poller: Optional[select.poll] = None
        self._alarm_fds: List[int] = []
        self._on_alarm: Optional[Callable[[], bool]] = None
        self._alarm_suspects: List[int] = []  # rang without a death: asked again for a while
        self._alarm_after = 0.0  # the socket's receive timeout (set_read_timeout); 0: none
        self._alarm_rechecks = 0  # times they will still be asked

    def set_read_timeout(self, after: float) -> None:
        """Give the socket a receive timeout of ``after`` seconds (``SO_RCVTIMEO``): a read
        still blocks in one ``recv``, and only one that has waited that long goes on to wait
        in ``poll``, on the socket and the alarms (``set_alarms``) together, or on the socket
        alone until there are any. Free for the common read; set before any read that alarms
        should reach (a ``recv`` already blocked keeps the timeout it began with)."""
        seconds = int(after)
        micros = int((after - seconds) * 1e6)
        self._sock.setsockopt(
            _socket.SOL_SOCKET, _socket.SO_RCVTIMEO, struct.pack("ll", seconds, micros)
        )
        self._alarm_after = after

    def set_alarms(self, fds: List[int], on_alarm: Callable[[], bool]) -> None:
        """Also wake a long wait for a frame (``set_read_timeout``) when one of ``fds`` (the
        host: pidfds of the worker's named threads, ``comfy_env._watchdog``) becomes
        readable, and ask ``on_alarm()`` whether the peer is gone: if it answers True, the
        read ends as at EOF (``ChannelClosed``); if not, it is asked again a few times, then
        that descriptor is no longer watched.

        The descriptors stay the owner's (closed by it once no thread reads any more). Any
        thread may call this while another waits: the wait picks the alarms up within
        ``after`` seconds."""
        poller = _poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        self._alarm_fds = list(fds)
        self._on_alarm = on_alarm
        self._alarm_poller = poller  # last: a wait that sees it sees the rest

    @property
    def read_timeout(self) -> float:
        """The socket's receive timeout in seconds (``set_read_timeout``); 0 if none."""
        return self._alarm_after

    @property
    def alarm_fds(self) -> List[int]:
        """The alarms still watched (``set_alarms``)."""
        return list(self._alarm_fds)

    def _recv_watched(self, view: memoryview, deadline: Optional[float], partial: bool) -> int:
        """The blocking read timed out (``set_read_timeout``): wait for the socket or an
        alarm, then read."""
        if not self._alarm_after:
            raise BlockingIOError("no frame yet")  # (a non-blocking socket; not ours)
        while True:
            self._await_watched(deadline, partial)
            try:
                return self._sock.recv_into(view)
            except BlockingIOError:
                continue  # (woken, but another reader took the bytes: wait again)

    def _await_watched(self, deadline: Optional[float], partial: bool) -> None:
        """Wait until the socket is readable (or at EOF), watching the alarms meanwhile.
        Raises ``ChannelClosed`` when an alarm tells that the peer is gone, ``TimeoutError``
        when ``deadline`` passes.

        An alarm whose answer is "not gone" may be early (the host: a killed worker's named
        thread can end before its main thread has begun to exit, on a busy machine): it is
        taken off the poll (it stays readable) and asked again every ``ALARM_RECHECK``
        seconds, ``ALARM_RECHECKS`` times, then forgotten (a thread that ended alone)."""
        sock_fd = self._sock.fileno()
        while True:
            poller = self._alarm_poller
            if poller is None:  # no alarms (yet): the socket alone, looking again now and then
                poller = self._sock_poller()
                cap = self._alarm_after
            else:
                cap = ALARM_RECHECK if self._alarm_rechecks else 0.0
            wait = -1.0 if deadline is None else deadline - _monotonic()
            if deadline is not None and wait <= 0:
                raise TimeoutError("deadline passed")
            if cap and (wait < 0 or wait > cap):
                wait = cap
            events = poller.poll(wait * 1000.0 + 1.0 if wait >= 0 else None)
            if not events:
                if self._alarm_rechecks:
                    self._alarm_rechecks -= 1
                    self._ask_alarm(partial)
                    if not self._alarm_rechecks:
                        self._forget_suspects()
                    continue
                if cap and (deadline is None or _monotonic() < deadline):
                    continue
                raise TimeoutError("deadline passed")
            rang = []
            for fd, _mask in events:
                if fd == sock_fd:
                    return  # bytes or EOF first: what was sent before a death is read
                rang.append(fd)
            for fd in rang:
                self._ask_alarm(partial)
                poller.unregister(fd)  # (readable for good now)
                self._alarm_suspects.append(fd)
                self._alarm_rechecks = ALARM_RECHECKS

    def _ask_alarm(self, partial: bool) -> None:
        """Ask ``on_alarm`` whether the peer is gone; raise ``ChannelClosed`` if it is."""
        on_alarm = self._on_alarm
        if on_alarm is not None and on_alarm():
            raise ChannelClosed(partial=partial)

    def _forget_suspects(self) -> None:
        """Alarms that rang without a death, rechecked enough: no longer watched."""
        for fd in self._alarm_suspects:
            if fd in self._alarm_fds:
                self._alarm_fds.remove(fd)
        self._alarm_suspects = []
        self._alarm_rechecks = 0

    def spin_wait(self, seconds: float, peer_pid: int, calls: Sized = ()) -> None:
        """Poll for up to ``seconds`` before a blocking read of a new frame (0: never).

        A process asleep in ``recv`` must be woken by the kernel when its peer writes, and
        across CPUs that wake-up (an inter-processor interrupt, a VM exit on a virtual
        machine) is most of a small call's round trip. A reader that is still awake,
        polling, sees the frame within a microsecond instead. Between two polls it yields
        the CPU (``sched_yield``), so a peer that shares the CPU runs at once.

        Spinning is skipped while this thread and ``peer_pid`` are both pinned to the same
        single CPU (looked at again every ``SPIN_RECHECK`` seconds while polling, every
        ``SPIN_RECHECK_READS`` frames while not, which costs that path no clock read): there
        the peer cannot run while we poll, and the yields only add to a plain sleep and
        wake-up (measured).
        A peer whose affinity cannot be read (another PID namespace) counts as movable.

        Adaptive, like a mutex that spins: a wait polls only if the previous one ended within
        ``seconds`` (a wait that slept is timed too). Calls that take longer than the budget,
        or a worker whose next call comes rarely, would only burn the budget in every wait,
        CPU that other workers and caller threads need on a loaded machine.

        And no wait polls while ``calls`` (the calls this process is making right now: the
        host's ``comfy_env._inflight.CALLS_IN_FLIGHT``, one entry per call; a worker makes none)
        holds more than one: each poll releases the GIL, and with more caller threads busy
        the poller would trade the GIL with them at every turn (measured with eight threads
        on two CPUs: throughput down by up to a fifth, tail latency up by half). The reader
        only takes its size, at each wait."""
        self._calls = calls
        self._spin_budget = self._spin = seconds if seconds > 0 and _spin_supported else 0.0
        self._spin_peer = peer_pid if _spin_supported else 0
        self._spin_recheck = 0.0
        self._spin_pinned_reads = 0
        self._spin_short = True
        self._spin_since = 0.0
        self._one_cpu = False

    def spins(self) -> bool:
        """Whether the next read of a new frame polls before it blocks (see ``spin_wait``)."""
        return (
            self._spin_budget > 0
            and self._spin_short
            and len(self._calls) <= 1
            and self._spin_allowed(_monotonic())
        )

    def on_one_cpu(self, now: float) -> bool:
        """Whether this thread and the peer (``spin_wait``'s ``peer_pid``; never without one)
        may only run on one and the same CPU; the masks are read at most every
        ``SPIN_RECHECK`` seconds (``now``: ``time.monotonic()``)."""
        if now >= self._spin_recheck:
            self._recheck_affinity(now)
        return self._one_cpu

    def _spin_allowed(self, now: float) -> bool:
        if now >= self._spin_recheck:
            self._recheck_affinity(now)
        return self._spin > 0

    def _recheck_affinity(self, now: float) -> None:
        self._spin_recheck = now + SPIN_RECHECK
        self._spin_pinned_reads = SPIN_RECHECK_READS
        self._one_cpu = bool(self._spin_peer) and shares_one_cpu(self._spin_peer)
        self._spin = 0.0 if self._one_cpu else self._spin_budget

    def _spin_until_readable(self, deadline: Optional[float]) -> None:
        """Poll the socket (never blocking) until it is readable, the spin budget is spent or
        ``deadline`` passes; the caller then reads (or waits) as usual. A wait that does not
        end here is timed (``_spin_since``) up to the read that ends it (``_waited``)."""
        now = _monotonic()
        if not self._spin_allowed(now):
            return  # one pinned CPU now: no polling, no timing
        if self._spin_short and len(self._calls) <= 1:
            end = now + self._spin
            if deadline is not None and deadline < end:
                end = deadline
            if self.poll_until(end):
                self._spin_since = 0.0  # (a wait cut short by a deadline left it set)
                return  # readable within the budget: the next wait polls too
        self._spin_since = now

    def poll_until(self, end: float) -> bool:
        """Poll the socket, never blocking and yielding the CPU between polls, until it is
        readable (True) or ``time.monotonic()`` reaches ``end`` (False)."""
        poller = self._poller
        if poller is None:
            poller = self._poller = _poll()
            poller.register(self._sock.fileno(), select.POLLIN)
        # poll(0), not a non-blocking recv: its EAGAIN exception costs 2 us a turn.
        poll = poller.poll
        while not poll(0):
            os.sched_yield()
            if _monotonic() >= end:
                return False
        return True

    @property
    def spin_budget(self) -> float:
        """Seconds a wait may poll (``spin_wait``; 0: never)."""
        return self._spin_budget

    def note_wait(self, seconds: float) -> None:
        """A wait for a frame on this channel that another reader did (the host's asyncio
        path) took ``seconds``: the next wait polls only if polling would have caught it."""
        self._spin_short = seconds <= self._spin_budget

    def _waited(self) -> None:
        """A wait that did not end while polling ended (see ``note_wait``)."""
        self.note_wait(_monotonic() - self._spin_since)
        self._spin_since = 0.0

    @property
    def buffered(self) -> int:
        """Bytes received beyond the last complete frame."""
        return len(self._buf)

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = value

    def recv_nowait(self) -> bytes:
        """What the socket holds now, up to 64 KiB (b"" at EOF; ``BlockingIOError`` if
        nothing), read into the reusable scratch buffer. For a reader driven by readiness
        callbacks (the host's asyncio path), which then owns the stream until ``unread``."""
        n = self._sock.recv_into(self._scratch_view, _RECV_CHUNK, _socket.MSG_DONTWAIT)
        return bytes(self._scratch_view[:n])

    def recv_into_nowait(self, view: memoryview) -> int:
        """Read what the socket holds now into ``view`` (0 at EOF; ``BlockingIOError`` if
        nothing): ``recv_nowait`` for a frame whose payload is received in place
        (``FrameBuffer``)."""
        return self._sock.recv_into(view, 0, _socket.MSG_DONTWAIT)

    def unread(self, data: bytes) -> None:
        """Put back bytes another reader took off the socket beyond the frame it wanted (the
        host's asyncio reader); the next ``read`` or idle check sees them first."""
        self._buf[:0] = data

    def readable_now(self) -> bool:
        """Whether bytes (or EOF) are waiting, without blocking."""
        poller = self._poller or self._sock_poller()
        return bool(poller.poll(0))

    def quiet(self) -> bool:
        """Nothing buffered and nothing (not even EOF) waiting: ``buffered`` and
        ``readable_now`` in one call (the host asks before every call)."""
        return not self._buf and not (self._poller or self._sock_poller()).poll(0)

    def _sock_poller(self) -> select.poll:
        """A poll object of the socket alone, made once."""
        if self._poller is None:
            self._poller = _poll()
            self._poller.register(self._sock.fileno(), select.POLLIN)
        return self._poller

    def _wait_readable(self, deadline: Optional[float], partial: bool = False) -> None:
        if deadline is None:
            return
        remaining = deadline - _monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        if self._alarm_after:
            self._await_watched(deadline, partial)
            return
        if not self._sock_poller().poll(remaining * 1000.0 + 1.0):
            raise TimeoutError("deadline passed")

    def _fill(self, deadline: Optional[float]) -> None:
        partial = bool(self._buf)
        self._wait_readable(deadline, partial)
        try:
            n = self._sock.recv_into(self._scratch_view)
        except BlockingIOError:
            n = -1
        if n < 0:
            # Waited for outside the handler: a Ctrl-C (or any error) while waiting would
            # otherwise show "During handling of the above exception (BlockingIOError ...)".
            n = self._recv_watched(self._scratch_view, deadline, partial)
        if not n:
            raise ChannelClosed(partial=bool(self._buf))
        self._buf += self._scratch_view[:n]

    def read(self, deadline: Optional[float] = None) -> Tuple[int, int, int, Payload]:
        """Return ``(frame type, flags, call id, payload)`` of the next frame.

        Raises ``ChannelClosed`` on EOF, ``FrameError`` on a bad magic or an oversize length,
        and ``TimeoutError`` when ``deadline`` (a ``time.monotonic()`` value) passes.
        """
        buf = self._buf
        if not buf:
            # Fast path: one recv that holds exactly one whole frame (every small call).
            if self._spin:
                self._spin_until_readable(deadline)
            elif self._spin_budget:
                # Both ends on one pinned CPU (or not known yet): no clock read per frame;
                # the masks are looked at again every SPIN_RECHECK_READS frames.
                self._spin_pinned_reads -= 1
                if self._spin_pinned_reads <= 0:
                    self._recheck_affinity(_monotonic())
            if deadline is not None:
                self._wait_readable(deadline)
            try:
                n = self._sock.recv_into(self._scratch_view)
            except BlockingIOError:  # only with a read timeout (set_read_timeout): a long wait
                n = -1
            if n < 0:  # waited for outside the handler (see _fill)
                n = self._recv_watched(self._scratch_view, deadline, False)
            if self._spin_since:
                self._waited()
            if not n:
                raise ChannelClosed()
            if n >= HEADER_SIZE:
                # ``decode_header`` inlined (every reply comes this way: one call fewer); a bad
                # magic goes on below, where ``decode_header`` raises.
                magic, ftype, flags, length, call_id = _unpack_header(self._scratch)
                if magic == MAGIC and n == HEADER_SIZE + length and length <= self._limit:
                    return ftype, flags, call_id, self._scratch[HEADER_SIZE:n]
            buf += self._scratch_view[:n]
        while len(buf) < HEADER_SIZE:
            self._fill(deadline)
        ftype, flags, length, call_id = decode_header(buf)
        # An unknown *type* with a sound header is not a framing error: the stream is still in
        # sync, and the receiver answers it (the worker with an ERROR frame, never silence).
        if length > self._limit:
            raise FrameError(
                "frame of %d bytes exceeds the limit of %d bytes" % (length, self._limit)
            )
        end = HEADER_SIZE + length
        if len(buf) >= end:
            payload = bytes(buf[HEADER_SIZE:end])
            del buf[:end]
            return ftype, flags, call_id, payload
        # A large frame: read the rest of the payload in place (``FrameBuffer``: one copy up
        # to EAGER_FRAME_BYTES, memory only as bytes arrive beyond).
        frame = FrameBuffer(length, buf[HEADER_SIZE:])
        buf.clear()
        sock = self._sock
        try:
            while not frame.complete:
                self._wait_readable(deadline, True)
                with frame.space() as view:
                    try:
                        n = sock.recv_into(view)
                    except BlockingIOError:
                        n = -1
                    if n < 0:  # waited for outside the handler (see _fill)
                        n = self._recv_watched(view, deadline, True)
                if n == 0:
                    raise ChannelClosed(partial=True)
                frame.wrote(n)
        except BaseException:
            # The traceback keeps this frame alive (a caller may hold the error for long):
            # it must not keep the partial payload too.
            del frame
            raise
        return ftype, flags, call_id, frame.data
