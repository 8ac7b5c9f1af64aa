"""Mechanism: the host end of one worker generation's channel.

Data flow, one call (the lease holder's thread)::

    send_request         loans returned since the last request (CONSUMED frames) + CALL header
                         + body in one ``sendall``; big out-of-band buffers go into one of our
                         shared-memory blocks (``blocks``) or stream inline
    read_frame           the next frame that is not a log record or an EVENT (``reader``)
    open_reply           a reply's out-of-band table -> views of loan roots over the worker's
                         reply blocks (``mappings``); CONSUMED queued in ``returned`` once the
                         last view dies (a finalizer, any thread)
    finish_request       our request's block back in our pool, unless a result views it

The channel is two socketpairs, one per direction (``sock``: the requests, the host only
writes; ``reply_sock``: the replies, read by ``reader``), plus the cancel pipe (CANCEL frames,
read by the worker's watchdog while its main thread runs a call). Nothing here decides policy:
a broken frame is a ``FrameError``, a lost reply block a ``HostResourceError``, an EOF a
``ChannelClosed``; what they mean is the caller's business.

Races it prevents: ``shut`` (any thread, to wake a reader with EOF) and ``close_sockets``
(``dispose``) run under ``lock``, so a descriptor number is never shut after its close; the
cancel pipe's descriptor is never closed under a writer (``_cancel_lock``); a result never
aliases memory the worker will reuse (it keeps a lent block pinned until CONSUMED), and our
own argument block a result views stays out of our pool until that view dies (``Loans``);
the worker's blocks are unlinked only once the worker has exited *and* the host is done with
the channel (``worker_blocks_orphaned``), so a caller can still open a reply written just
before a crash.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import socket
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from comfy_env_worker import shm
from comfy_env_worker.protocol import (
    FLAG_GONE,
    FLAG_OOB,
    HEADER_SIZE,
    MSG_NOSIGNAL,
    ChannelClosed,
    FrameError,
    FrameReader,
    FrameType,
    PartialSend,
    Payload,
    encode_header,
    send_parts,
)

from . import _sigpipe
from ._codec import use_shm
from ._errors import HostResourceError, SerializationError
from ._identity import host_id
from ._logs import WorkerLog
from ._settings import Settings
from ._watchdog import supported as thread_watch_supported

_log = logging.getLogger("comfy_env")

# Reply mappings one worker process may have lent out at a time (see ``open_reply``).
MAX_LOANS = 64
# Replies with less shared memory than this are copied out. Lending wins from here up, results
# dropped or kept: a copy faults in fresh private pages. Measured with a fresh mapping per loan
# (echo round trip, interleaved): 3 MiB 1.04 ms lent vs 2.27 ms copied (2.56 vs 1.13 with 16
# results kept), 1 MiB 0.71 vs 0.79, 256 KiB 0.31 vs 0.34. With loan roots (no mapping per
# loan) 64-512 KiB showed no difference either way within this machine's noise, so small
# replies still go back at once instead of pinning a 1 MiB block each. (A ComfyUI 512x512
# IMAGE is 3 MiB.)
LOAN_MIN = 256 << 10
# What failing to open a reply's blocks means the *host* ran out of (``open_reply``: the worker
# is kept); any other error opening them is a block the worker named that is none.
_HOST_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
# Seconds a caller waits for a reply in one blocking read before it watches the worker's
# named threads itself (``FrameReader.set_read_timeout``, ``set_alarms``; at least two clock
# ticks: the socket's receive timeout counts in ticks). A call that ends sooner pays nothing.
_ALARM_AFTER = 0.05
# States of our argument blocks lent to a result (see ``_lend_own``).
_LENT, _FINISHED, _RETURNED = 1, 2, 3

_warned: set[str] = set()


def _warn_once(message: str, key: str | None = None) -> None:
    """Shared memory trouble is said loudly, but once per process (per ``key``, by default
    the message), not once per call."""
    key = message if key is None else key
    if key not in _warned:
        _warned.add(key)
        _log.warning("comfy-env: %s", message)


def shm_failure_hint(err: int | None) -> str:
    """What a failure to create a block with errno ``err`` probably means (None: the worker
    failed, and its errno did not travel)."""
    if err == errno.EEXIST:
        return (
            f"a block name was taken by someone else: another user may be creating files "
            f"named like comfy-env's in {shm.SHM_DIR}"
        )
    if err in (errno.ENOSPC, errno.ENOMEM, None):
        return f"is {shm.SHM_DIR} full or too small?"
    if err in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
        return f"is {shm.SHM_DIR} missing or not writable?"
    return "the error above says why"


def host_fault(key: str, call_id: int, exc: BaseException) -> HostResourceError:
    """Out of descriptors or address space *here* (EMFILE, ENOMEM): the host's fault. The
    frame was read whole, so the channel is in sync; the worker got its blocks back
    (``send_consumed``) and stays, and only this call fails."""
    return HostResourceError(
        f"the host could not open the reply of call {call_id} from env "
        f"{key}: {exc} (out of file descriptors or memory in the host? see "
        "ulimit -n); the worker is fine and was kept",
        errno=getattr(exc, "errno", None),
    )


def reply_block_gone(key: str, ttl: float, call_id: int, exc: OSError) -> HostResourceError:
    """A shared-memory block of the reply of ``call_id`` no longer exists when the host
    opens it. The channel is in sync and the worker broke no rule: it is kept."""
    name = os.path.basename(str(exc.filename)) if exc.filename else "?"
    return HostResourceError(
        f"the reply of call {call_id} from env {key} was lost: its shared-memory "
        f"block {name} was gone before the host opened it (removed from /dev/shm by "
        "something else, or given up by the worker after "
        f"shm_pinned_ttl={ttl:g}s of this host running without "
        "taking it); the worker is fine and was kept",
        errno=exc.errno,
    )


def _names_a_block_of(mappings: shm.PeerMappings | None, path: object) -> bool:
    """Whether ``path`` (an ``OSError``'s file) is shaped like a block of this worker."""
    if mappings is None or not isinstance(path, str):
        return False
    if os.path.dirname(path) != shm.SHM_DIR:
        return False
    return shm.names_a_block_of(os.path.basename(path), mappings.prefix)


class Loans:
    """The shared memory of one channel: our argument blocks (``blocks``), our mappings of
    the worker's reply blocks (``mappings``), and what results hold of either (loans)."""

    def __init__(self, config: Settings, disposed: Callable[[], bool]) -> None:
        self._disposed = disposed  # the channel's ``disposed`` (no spare made after it)
        # Set up at the handshake when both sides can use it.
        self.shm_wanted = config.shared_memory and shm.shm_available()
        if config.shared_memory and not self.shm_wanted:
            _warn_once(f"{shm.SHM_DIR} is not usable here; large buffers are streamed inline")
        self.blocks: shm.BlockPool | None = None
        self.mappings: shm.PeerMappings | None = None
        # "on" (the last large transfer went through shared memory), "off" (configured off),
        # "unavailable" (wanted, but /dev/shm is missing or full: buffers stream inline).
        self.shm_state = "on" if self.shm_wanted else "off"
        if config.shared_memory and not self.shm_wanted:
            self.shm_state = "unavailable"
        # Loaned reply blocks whose last view died (call ids), appended by finalizers on any
        # thread; the lease holder sends their CONSUMED frames ahead of its next request.
        self.returned: deque[int] = deque()
        # Reply mappings lent out and still alive (each may hold a descriptor), in a list so
        # that the finalizers need no reference to this object.
        self.count = [0]
        self.lock = threading.Lock()
        # Our argument blocks a result holds (the worker echoed them back), by name: LENT
        # until finish_request, then FINISHED until the last view dies (its finalizer puts
        # the block back in the pool); RETURNED when the views died before finish_request.
        self._own_lent: dict[str, int] = {}
        # Threads faulting in a spare argument block (joined before our blocks go).
        self.spares: list[threading.Thread] = []

    def lend(self, call_id: int, roots: list[Any]) -> None:
        """Queue ``CONSUMED(call_id)`` for when every loan root of the reply has died."""
        left = [len(roots)]
        lock, loans, returned = self.lock, self.count, self.returned
        with lock:
            loans[0] += len(roots)

        def gone() -> None:  # any thread, at any time (garbage collection)
            with lock:
                left[0] -= 1
                loans[0] -= 1
                last = left[0] == 0
            if last:
                returned.append(call_id)

        for root in roots:
            weakref.finalize(root, gone)

    def lend_own(self, block: shm.Block, root: Any) -> None:
        """The result views our own argument block ``block`` (through the loan root ``root``):
        keep the block out of our pool until the root dies, so that no later request writes
        into memory a result still shows."""
        lock, loans, lent, pool = self.lock, self.count, self._own_lent, self.blocks
        name = block.name
        with lock:
            loans[0] += 1
            lent[name] = _LENT

        def gone() -> None:  # any thread, at any time (garbage collection)
            with lock:
                loans[0] -= 1
                state = lent.get(name)
                if state == _LENT:
                    lent[name] = _RETURNED  # finish_request puts it back
                    return
                if state is None:
                    return
                del lent[name]
            if pool is not None:
                pool.release(block)  # a no-op once the block was given up

        weakref.finalize(root, gone)

    def take_returns(self) -> bytes:
        """CONSUMED frames of the loans returned so far (lease holder only)."""
        frames = []
        while True:
            try:
                call_id = self.returned.popleft()
            except IndexError:
                break
            frames.append(encode_header(FrameType.CONSUMED, call_id, 0))
        return b"".join(frames)

    def shm_unavailable(self, why: str, err: int | None = None) -> None:
        """Shared memory failed (``err``: the errno, where this side saw it): stream inline,
        and warn once per process, whichever side failed first."""
        self.shm_state = "unavailable"
        _log.debug("comfy-env: shared memory failed: %s", why)
        _warn_once(
            f"shared memory is unavailable ({why}); large buffers are streamed inline "
            f"until it works again ({shm_failure_hint(err)})",
            key="shm-unavailable",
        )

    def finish_request(self, block: shm.Block | None, retained: list[str]) -> None:
        """The request's block may be reused, unless the worker kept a view of it."""
        blocks = self.blocks
        if block is None or blocks is None:
            return
        name = block.name
        lent = False
        if self._own_lent:
            with self.lock:
                state = self._own_lent.get(name)
                if state == _LENT:
                    self._own_lent[name] = _FINISHED  # the loan's finalizer puts it back
                    lent = True
                elif state == _RETURNED:
                    del self._own_lent[name]
        if name in retained:
            blocks.give_up(block)  # the result's mapping keeps its memory
        elif not lent:
            blocks.release(block)
        elif blocks.wants_spare(block.size):
            self._spare_soon(block.size)

    def _spare_soon(self, size: int) -> None:
        """A result holds our last idle argument block of its size (``shm.BlockPool.
        wants_spare``): fault in a spare on a helper thread, so that the next request of that
        size (results kept) finds one ready instead of faulting fresh pages on its path (about
        175 ms per 256 MiB)."""
        blocks = self.blocks
        assert blocks is not None
        with self.lock:
            self.spares = [t for t in self.spares if t.is_alive()]
            if self.spares or self._disposed():
                return  # one at a time: a caller keeping results gets one per call anyway

            def make() -> None:
                try:
                    if not blocks.has_idle(size):
                        blocks.add_spare(size)
                except OSError:
                    pass  # /dev/shm full: the next request makes its own or goes inline

            thread = threading.Thread(target=make, name="comfy-env-spare", daemon=True)
            self.spares.append(thread)
        thread.start()

    # ---- the idle channel, side frames ----


class Channel:
    """The host end of one generation's channel: frames, replies, the cancel pipe, and its
    shared memory (``loans``). Made by ``WorkerProcess``; opened by its launch, filled in by
    the handshake (``pid``, ``loans.blocks``, ``loans.mappings``)."""

    def __init__(self, key: str, config: Settings, log: WorkerLog) -> None:
        self.key = key  # the env key, for error messages
        self.config = config
        self.log = log
        self.sock: socket.socket | None = None  # requests (the host only writes here)
        self.reply_sock: socket.socket | None = None  # replies (``reader`` reads them)
        self.reader: FrameReader | None = None
        self.pid: int | None = None  # the interpreter's own pid, from its hello
        # ``close_sockets`` (dispose) closes the sockets under it, and a shutdown from another
        # thread (``shut``) runs under it: a descriptor number is never shut after its close.
        self.lock = threading.Lock()
        self.disposed = False
        self._cancel_fd: int | None = None  # write end of the cancel pipe (CANCEL frames)
        self._cancel_lock = threading.Lock()  # a descriptor is never closed under a writer
        self.loans = loans = Loans(config, lambda: self.disposed)
        self.returned = loans.returned  # (the same deque: read before every request)
        self.finish_request = loans.finish_request
        self._orphan_lock = threading.Lock()
        self._orphans = [False, False, False]  # exit seen, dispose seen, unlinked

    def open(self, sock: socket.socket, reply_sock: socket.socket, cancel_fd: int) -> None:
        """Take the host's ends: the requests and replies sockets and the cancel pipe."""
        self._cancel_fd = cancel_fd
        os.set_blocking(cancel_fd, False)
        self.sock = sock
        self.reply_sock = reply_sock
        self.reader = FrameReader(reply_sock, self.config.max_frame_bytes)
        if thread_watch_supported():
            # Before any read: a ``recv`` keeps the timeout it began with, and the first call
            # may begin before the named threads are found (``ExitWatch._watch_threads``).
            try:
                self.reader.set_read_timeout(_ALARM_AFTER)
            except OSError:
                pass  # no caller alarms on this channel: the reactor watches alone

    # ---- requests and replies (the caller thread holding the slot) ----

    def read_frame(
        self,
        deadline: float | None,
        pending: tuple[int, int, Payload] | None = None,
        on_event: Callable[[int, Payload], None] | None = None,
    ) -> tuple[int, int, int, Payload]:
        """The next frame that is not a log record or a call event; log records met on the way
        are emitted and EVENT frames handed to ``on_event(call id, payload)`` (dropped without
        one), so whatever a call logged or emitted is handled before its reply is returned.
        ``pending`` is such a frame (type, call id, payload) the caller already read."""
        reader = self.reader
        assert reader is not None
        return self.log.read_past_side_frames(reader.read, deadline, pending, on_event)

    def send_request(
        self, call_id: int, body: bytes, buffers: list[memoryview], deadline: float | None
    ) -> shm.Block | None:
        """Send a CALL frame. Out-of-band buffers go into one of our shared-memory blocks (one
        memcpy) or, without shared memory, inline from the caller's memory. Returns the block,
        to be released when the reply arrives (``finish_request``).

        Raises ``SerializationError`` (nothing sent) if the frame would exceed the limit, the
        socket's own error if the first write fails (nothing sent), ``PartialSend`` if a later
        one does, and ``TimeoutError`` when a large write passes ``deadline``."""
        sock = self.sock
        assert sock is not None
        # Loans returned since the last request ride in front of it, in the same write.
        returns = self.loans.take_returns() if self.returned else b""
        if not buffers:
            if len(body) <= 65536:
                sock.sendall(
                    returns + encode_header(FrameType.CALL, call_id, len(body)) + body,
                    MSG_NOSIGNAL,
                )
                return None
            parts: list[Any] = [returns + encode_header(FrameType.CALL, call_id, len(body)), body]
            self.send_large(parts, deadline)
            return None
        block = None
        loans = self.loans
        if loans.blocks is not None and use_shm(buffers, self.config.shm_threshold_bytes):
            try:
                parts, block, length = shm.pack(body, buffers, loans.blocks)
                loans.shm_state = "on"
            except OSError as exc:  # /dev/shm full (ENOSPC at reservation): inline this time
                loans.shm_unavailable(f"cannot create a block ({exc})", exc.errno)
                parts, block, length = shm.pack(body, buffers, None)
        else:
            parts, block, length = shm.pack(body, buffers, None)
        if length + HEADER_SIZE > self.config.max_frame_bytes:
            self.finish_request(block, [])
            raise SerializationError(
                f"the call's payload is {length} bytes, over PoolConfig.max_frame_bytes="
                f"{self.config.max_frame_bytes} (shared memory is off or full)"
            )
        parts.insert(0, returns + encode_header(FrameType.CALL, call_id, length, FLAG_OOB))
        try:
            self.send_large(parts, deadline)
        except BaseException:
            self.finish_request(block, [])
            raise
        return block

    def send_large(self, parts: list[Any], deadline: float | None) -> None:
        """Write ``parts`` whole, by ``deadline`` (``TimeoutError``) if one is given."""
        sock = self.sock
        assert sock is not None
        if deadline is None:
            send_parts(sock, parts)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(remaining)
        try:
            send_parts(sock, parts)
        finally:
            sock.settimeout(None)

    def open_reply(
        self, call_id: int, flags: int, payload: Payload
    ) -> tuple[Payload | memoryview, list[Any] | None, list[str]]:
        """Split a reply into (body, out-of-band buffers, our blocks the worker retained).

        Shared-memory buffers are *loaned*: they are views of a loan root (``shm.loan_root``:
        a new exporter of the worker's reply block, over our cached mapping of it), so the
        result is built on them without a copy, a system call or a page fault. The worker
        keeps that block pinned (out of its pool) until ``CONSUMED`` for the call arrives,
        which is sent only once the last view of the root is gone (a finalizer queues the
        call id in ``returned``; the next request carries it). A result therefore never
        aliases memory the worker will reuse: a block the worker gives up after its TTL is
        unlinked, never reused, and the root keeps its mapping. Buffers the worker sent back
        in our own argument block (``echo`` entries) are views of a loan root of that block,
        which stays out of our pool until they die (``Loans.lend_own``, ``finish_request``). A
        forged or malformed table raises ``FrameError``."""
        if flags & ~FLAG_OOB:
            raise FrameError(f"unknown frame flags 0x{flags:x} on the reply of call {call_id}")
        if not flags & FLAG_OOB:
            return payload, None, []
        # Beyond MAX_LOANS live loans (a caller collecting many results) replies are copied
        # out and returned at once: every loan pins a block of the worker's (and, where ctypes
        # is missing, a fresh mapping that keeps a descriptor before Python 3.13).
        loans = self.loans
        loaned: list[Any] | None = [] if loans.count[0] < MAX_LOANS else None
        echoed: list[tuple[shm.Block, Any]] = []
        try:
            body, buffers, sources, retained = shm.unpack(
                payload,
                loans.mappings,
                copy_out=loaned is None,
                loaned=loaned,
                loan_min=LOAN_MIN,
                own=loans.blocks,
                echoed=echoed,
            )
        except ValueError as exc:
            raise FrameError(f"bad out-of-band reply: {exc}") from None
        except OSError as exc:
            if exc.errno == errno.ENOENT and _names_a_block_of(loans.mappings, exc.filename):
                # The frame was read whole and its table is well formed, naming a block of the
                # worker's own shape: the block is gone, not forged. Something removed it from
                # /dev/shm, or the worker gave it up after its TTL (it counts only time this
                # host was seen running: a host starved of CPU that long). Nothing the worker
                # sent was invalid, so it is kept; the result is lost and the call says so.
                self.send_consumed(call_id, FLAG_GONE)  # (the worker gives the block up)
                ttl = self.config.shm_pinned_ttl
                raise reply_block_gone(self.key, ttl, call_id, exc) from None
            if exc.errno not in _HOST_OUT_OF_RESOURCES:
                # A name no block of the worker can have (ENOENT), or a name it planted that
                # is no block: a directory (EISDIR), a symlink (ELOOP), another's file (EACCES).
                raise FrameError(f"bad out-of-band reply: {exc}") from None
            self.send_consumed(call_id)
            raise host_fault(self.key, call_id, exc) from None
        except MemoryError as exc:
            self.send_consumed(call_id)
            raise host_fault(self.key, call_id, exc) from None
        if loans.mappings is not None and buffers:
            if echoed or any(source is not None for source in sources):
                loans.shm_state = "on"
            elif use_shm(buffers, self.config.shm_threshold_bytes):
                # Enough for shared memory (the worker's rule too), yet inline: the worker could
                # not create a reply block. (Under the threshold inline is the rule, not a
                # failure: a pool whose threshold is above its messages, say.)
                loans.shm_unavailable("the worker cannot create a block")
        for block, root in echoed:
            if root is not None:
                loans.lend_own(block, root)
        if loaned:
            loans.lend(call_id, loaned)
        elif any(source is not None for source in sources):
            self.send_consumed(call_id)  # copied out (few bytes, or too many loans)
        return body, buffers, retained

    def send_consumed(self, call_id: int, flags: int = 0) -> None:
        """CONSUMED for ``call_id`` now (the reply's blocks were not lent)."""
        sock = self.sock
        assert sock is not None
        try:
            sock.sendall(encode_header(FrameType.CONSUMED, call_id, 0, flags), MSG_NOSIGNAL)
        except OSError:
            pass  # the worker is gone; its blocks go with it (see dispose)

    def idle_channel_state(self) -> str:
        """Before a call: ``"quiet"`` if nothing is waiting on the idle channel (the normal
        case: one ``poll`` syscall), ``"closed"`` if the worker hung up, ``"dirty"`` if it
        wrote something nobody asked for (a stray thread, garbage): such a worker must not get
        the call, or its bytes would be taken for the reply."""
        reader = self.reader
        assert reader is not None and self.reply_sock is not None
        if reader.quiet():
            return "quiet"
        if reader.buffered:
            return "dirty"
        try:
            peek = self.reply_sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return "quiet"
        except OSError:
            return "closed"
        return "dirty" if peek else "closed"

    def ping(self, timeout: float) -> bool:
        """Health check of an idle worker: PING, then PONG within ``timeout`` seconds."""
        assert self.sock is not None and self.reader is not None
        try:
            self.sock.sendall(encode_header(FrameType.PING, 0, 0), MSG_NOSIGNAL)
            ftype, _, _, _ = self.read_frame(time.monotonic() + timeout)
        except (OSError, ChannelClosed, FrameError):
            return False
        return ftype == FrameType.PONG

    def send_cancel(self, call_id: int) -> bool:
        """Ask the worker to stop call ``call_id`` (any thread; never blocks). False if the
        frame could not be written (the worker is gone; the grace timer settles it)."""
        with self._cancel_lock:
            fd = self._cancel_fd
            if fd is None:
                return False
            try:
                # 20 bytes, under PIPE_BUF: written whole or not at all. A pipe takes no
                # MSG_NOSIGNAL: a worker gone is EPIPE here, never SIGPIPE (``_sigpipe``).
                frame = encode_header(FrameType.CANCEL, call_id, 0)
                return _sigpipe.write(fd, frame) == HEADER_SIZE
            except OSError:
                return False

    def release_refs(self, ref_ids: list[int]) -> None:
        """Tell the worker to drop kept objects (no reply)."""
        assert self.sock is not None
        payload = pickle.dumps(ref_ids, protocol=5)
        self.sock.sendall(
            encode_header(FrameType.RELEASE_REFS, 0, len(payload)) + payload, MSG_NOSIGNAL
        )

    def release_refs_now(self, ref_ids: list[int]) -> bool:
        """``WorkerProcess.release_refs_now``'s write: never blocks; True if the frame went
        out whole or the worker is gone, False if nothing could be written now."""
        sock = self.sock
        if sock is None:
            return True
        payload = pickle.dumps(ref_ids, protocol=5)
        frame = encode_header(FrameType.RELEASE_REFS, 0, len(payload)) + payload
        try:
            sent = sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        if sent != len(frame):
            raise PartialSend(f"{sent} of a {len(frame)}-byte release frame written")
        return True

    def ask_shutdown(self) -> bool:
        """SHUTDOWN, without blocking (the worker runs its release hooks and exits). False if
        it could not be written."""
        try:
            assert self.sock is not None
            self.sock.send(
                encode_header(FrameType.SHUTDOWN, 0, 0), socket.MSG_DONTWAIT | MSG_NOSIGNAL
            )
        except (OSError, AssertionError):
            return False
        return True

    def request_unread(self) -> bool:
        """After an EOF on the replies: whether the worker is gone with bytes we sent it still
        unread (the call never ran, and may run on a fresh worker). Its exit tells that as a
        reset, but on the *requests* socket, not on the replies we read: the reply end of a
        dead worker reads a plain EOF. So the requests socket is asked.

        ``SIOCOUTQ``: what we sent that the worker has not read yet, while its socket lives.
        Once its exit has released that socket (0.5 ms after the kill for a bare worker: this
        thread may look later), our unread bytes are dropped and the count is 0, but the
        kernel has left the reset pending on our socket (``SO_ERROR``: ``ECONNRESET`` only if
        bytes were unread; set before the bytes are dropped); it is read second, so one of the
        two always tells."""
        sock = self.sock
        if sock is None:
            return False
        import fcntl  # (loaded by ``ExitWatch._watch_threads`` already, off the crash path)
        import termios

        try:
            unread = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            if int.from_bytes(unread, sys.byteorder) > 0:
                return True
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET
        except OSError:
            return False

    # ---- shutting and closing ----

    def shut(self) -> None:
        """Shut the channel down (any thread), which wakes a thread blocked reading it with
        EOF (the replies), and makes the worker read EOF and our writes fail (the requests);
        never after ``dispose`` closed it."""
        with self.lock:
            if self.disposed:
                return
            for end in (self.reply_sock, self.sock):
                if end is not None:
                    try:
                        end.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def close_sockets(self) -> None:
        """Close both of the host's channel sockets (kept as closed objects: ``fileno()``
        reads -1)."""
        for end in (self.sock, self.reply_sock):
            if end is not None:
                end.close()

    def close_cancel_pipe(self) -> None:
        """Close the cancel pipe's write end (never under a writer)."""
        with self._cancel_lock:
            fd, self._cancel_fd = self._cancel_fd, None
        if fd is not None:
            os.close(fd)

    def release_shm(self) -> None:
        """Unlink our argument blocks, close mappings of the worker's blocks, and unlink the
        worker's blocks by name prefix (a dead worker cannot unlink its own)."""
        loans = self.loans
        if loans.blocks is not None:
            loans.blocks.destroy_all()  # a spare still being made is destroyed when done
            with loans.lock:
                spares, loans.spares = loans.spares, []
            for thread in spares:
                thread.join()
        if loans.mappings is not None:
            loans.mappings.close_all()
        self.worker_blocks_orphaned(disposed=True)

    def worker_blocks_orphaned(self, exited: bool = False, disposed: bool = False) -> None:
        """Unlink the blocks the worker created (pinned replies, its pool) once it has exited
        *and* the host is done with it: a caller may still have to open the block of a
        complete reply the worker wrote just before it died. Whichever comes last unlinks."""
        seen = self._orphans
        with self._orphan_lock:
            seen[0] |= exited
            seen[1] |= disposed
            due = seen[0] and seen[1] and not seen[2]
            if due:
                seen[2] = True
        if due and self.pid is not None and self.loans.blocks is not None:
            shm.unlink_blocks(f"{shm.NAME_PREFIX}{host_id()}-w{self.pid}-")

    def abandon(self) -> None:
        """In a forked child: close the inherited descriptors."""
        self.disposed = True
        self.close_sockets()
        self.close_cancel_pipe()
