"""Worker output in the host's ``logging``.

Three sources feed one ``WorkerLog`` per worker process:

- LOG frames read by the caller during a call (in band, so they are emitted before the call
  returns, in order);
- LOG frames from the worker's log pipe between calls, read by the reactor (within
  milliseconds, without waiting for a call);
- raw lines from the worker's fd 1 and fd 2 (native output: C ``printf``, library warnings,
  ``faulthandler``), read by the reactor, streams ``native-stdout`` / ``native-stderr``.

Each becomes a ``LogRecord`` on logger ``comfy_env.worker.<env name>`` with the original level,
and attributes ``worker_logger`` (the worker-side logger name), ``stream``, ``pid``,
``generation`` and ``env``; the worker's own timestamp is kept as ``created``. Ordinary logging
configuration controls it::

    logging.getLogger("comfy_env.worker").setLevel(logging.WARNING)

**Unconfigured hosts.** When no handler is configured for a worker's logger (a plain script
that never set up logging, where Python's last-resort handler would show warnings only and
without env or pid), lines at INFO and above are printed on the host's stderr as
``(<env name> pid=<pid>) <line>`` (the launched process's pid until the worker's hello names
its interpreter's; ``(<env name>) <line>`` while no pid is known at all). Once any handler is
configured (``logging.basicConfig``, or a ``NullHandler`` on ``comfy_env.worker`` to silence
them), records go only through logging.

**Long lines.** Native output without newlines (a binary dump) is cut into pieces of
``LINE_CAP`` bytes as it arrives, in linear time; each piece is a line. A line overwritten with
carriage returns (a progress bar: ``"\r" + bar`` per update) keeps only its latest state, emitted
at most every ``PROGRESS_INTERVAL`` seconds, and its final state when its newline comes (the
worker does the same for ``sys.stdout``/``sys.stderr``).

**Floods.** A token bucket per worker (lines and bytes per second, with a burst) bounds what is
emitted; lines over budget are dropped and counted, with one warning per worker. Reading never
stops, so a worker printing megabytes can neither block on a full pipe nor starve a reply.

The last lines of all streams are kept (``tail``) for crash reports, ordered for them: a
record logged just before a segfault travels in band (read by the caller) while
``faulthandler``'s dump travels on fd 2 (read by the reactor), so the dump can arrive first and
the record would end the tail. Each tail line keeps a time (a record's own ``created``; a native
line's arrival, which is later than its writing); a record goes before the native lines at the
tail's end that arrived after it was written, by at most ``TAIL_REORDER_WINDOW`` seconds, so
the dump ends the tail. Arrival cannot tell a native line written after the record from one
written just before it and read late, so the latter may be shown after the record: across the
two channels the order of lines written within a few milliseconds is a best effort (the
records themselves reach ``logging`` as they arrive). The window bounds what a worker clock
behind the host's (a remote backend) could reorder.

**Package names shown.** ``comfy_env.comfyui`` imports a pack in its worker under a hashed
package name (``comfy_env_pack_<hash>``) and registers, per env key, the name to show instead
(``show_package_as``: the pack directory's name); a record whose ``worker_logger`` is that
package or one of its modules gets the shown name (``my_pack.impl.nodes``). Envs nobody
registered are untouched. The table is replaced whole under a lock and read without one (a
reader sees the old or the new table, never a half-built one).
"""

from __future__ import annotations

import collections
import logging
import math
import pickle
import sys
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from comfy_env_worker.protocol import (
    HEADER_SIZE,
    FrameError,
    FrameType,
    Payload,
    decode_header,
)

_log = logging.getLogger("comfy_env")

LINES_PER_SECOND = 2000.0
LINE_BURST = 20000.0
BYTES_PER_SECOND = 4.0 * 1024 * 1024
BYTE_BURST = 16.0 * 1024 * 1024
_MAX_PIPE_FRAME = 16 * 1024 * 1024
_print_lock = threading.Lock()  # lines of different workers never interleave mid-line
LINE_CAP = 64 * 1024  # native output lines are cut into pieces of this many bytes
PROGRESS_INTERVAL = 2.0  # a progress line's latest state is emitted at most this often
TAIL_REORDER_WINDOW = 1.0  # seconds: how far back a late record may move in the tail


def _final_state(line: bytes | bytearray) -> bytes:
    """What a terminal would leave of ``line``: the bytes after its last carriage return (a
    trailing one, as in ``\r\n`` line ends, is not a new state)."""
    return bytes(line.rstrip(b"\r").rpartition(b"\r")[2])


# env key -> {package name in the worker: name shown}; see "Package names shown" above.
_shown_names: dict[str, dict[str, str]] = {}
_shown_names_lock = threading.Lock()


def show_package_as(env_key: str, package: str, shown: str) -> None:
    """Show records that env ``env_key``'s workers log on ``package`` or its modules as logged
    on ``shown`` (same module path below it), in ``worker_logger``: for a package whose name
    in the worker is an internal one. Idempotent; applies to workers already running too."""
    global _shown_names
    with _shown_names_lock:
        table = dict(_shown_names)
        table[env_key] = {**table.get(env_key, {}), package: shown}
        _shown_names = table  # replaced whole: ``WorkerLog.emit`` reads it without the lock


def shown_logger_name(env_key: str, name: str) -> str:
    """``name`` as ``show_package_as`` asked records of ``env_key`` to show it."""
    names = _shown_names.get(env_key)
    if names:
        head = name.partition(".")[0]
        shown = names.get(head)
        if shown is not None:
            return shown + name[len(head) :]
    return name


def _printed_from(logger: logging.Logger) -> int:
    """The level from which an unconfigured host prints a worker's lines: INFO, or the level
    set on the worker's logger or the nearest of its parents below the root (so
    ``logging.getLogger("comfy_env.worker").setLevel(logging.WARNING)`` quiets them here as
    it does once logging is configured). The root's own level (WARNING by default) is not
    asked: the printing exists because an unconfigured root shows warnings only."""
    node: logging.Logger | None = logger
    while node is not None and node.parent is not None:  # (the root has no parent)
        if node.level:
            return node.level
        node = node.parent
    return logging.INFO


class LogLine(NamedTuple):
    """One line of a worker's output as the host logs it: a LOG frame's record, or a line
    its native code wrote to stdout/stderr (logger ``native``, stream ``native-stderr``)."""

    level: int
    worker_logger: str  # the worker-side logger's name
    message: str
    exc_text: str | None  # the formatted traceback, if the record had one
    created: float | None  # the worker's time.time() of the record; None: the host's clock
    stream: str  # "log", or "native-stdout"/"native-stderr"


class WorkerLog:
    """Emits one worker's output records, within budget, and keeps its tail."""

    def __init__(self, env_key: str, env_name: str, generation: int, tail_lines: int) -> None:
        self.logger = logging.getLogger(f"comfy_env.worker.{env_name}")
        self.name = env_name
        self.env = env_key
        self.generation = generation
        self.pid: int | None = None
        # (time written or arrived, from a native stream, text); see "tail" in the docstring
        self._tail: collections.deque[tuple[float, bool, str]] = collections.deque(
            maxlen=max(1, tail_lines)
        )
        self._lock = threading.Lock()
        self._lines = LINE_BURST
        self._bytes = BYTE_BURST
        self._refilled = time.monotonic()
        self.dropped = 0
        self._warned = False
        self._partial: dict[str, bytearray] = {}
        self._progress_at: dict[str, float] = {}  # stream -> when its progress was emitted
        self._pipe_buf = bytearray()
        self._pipe_warned = False  # junk on the log pipe was reported (once per worker)
        self._record_warned = False  # an unreadable log record was reported (once per worker)

    # ---- budget and emission ----

    def _admit(self, size: int) -> bool:
        with self._lock:
            now = time.monotonic()
            elapsed = now - self._refilled
            self._refilled = now
            self._lines = min(LINE_BURST, self._lines + elapsed * LINES_PER_SECOND)
            self._bytes = min(BYTE_BURST, self._bytes + elapsed * BYTES_PER_SECOND)
            if self._lines >= 1 and self._bytes >= size:
                self._lines -= 1
                self._bytes -= size
                return True
            self.dropped += 1
            warn = not self._warned
            self._warned = True
        if warn:
            _log.warning(
                "comfy-env: worker of env %s (pid %s, generation %d) is flooding its output; "
                "lines over %d/s are dropped and counted",
                self.env,
                self.pid,
                self.generation,
                int(LINES_PER_SECOND),
            )
        return False

    def emit(self, line: LogLine) -> None:
        """One line the worker logged or printed, to the host's ``logging`` (or printed, when
        the host configured none) and to the output tail."""
        level, worker_logger, message, exc_text, created, stream = line
        self._keep(message if not exc_text else f"{message}\n{exc_text}", created, stream)
        if not self.logger.hasHandlers():
            # The host never configured logging: Python would show warnings only, without
            # env or pid. Print the line ourselves, prefixed (INFO and up), unless the host
            # turned logging off (``logging.disable``), as it would for its own records.
            if (
                level >= _printed_from(self.logger)
                and level > self.logger.manager.disable
                and self._admit(len(message))
            ):
                self._print(message, exc_text)
            return
        if not self.logger.isEnabledFor(level):
            return
        if not self._admit(len(message) + (len(exc_text) if exc_text else 0)):
            return
        record = self.logger.makeRecord(
            self.logger.name,
            level,
            "(worker)",
            0,
            "%s",
            (message,),
            None,
            extra={
                "worker_logger": shown_logger_name(self.env, worker_logger),
                "stream": stream,
                "pid": self.pid,
                "generation": self.generation,
                "env": self.env,
            },
        )
        if exc_text:
            record.exc_text = exc_text
        if created is not None:
            record.created = created
            record.msecs = (created - int(created)) * 1000
        self.logger.handle(record)

    def _print(self, message: str, exc_text: str | None) -> None:
        stream = sys.stderr
        if stream is None:
            return
        # No pid yet (a backend that learns it from the worker's hello): none is named.
        prefix = f"({self.name}) " if self.pid is None else f"({self.name} pid={self.pid}) "
        text = message if not exc_text else f"{message}\n{exc_text}"
        lines = "".join(prefix + line + "\n" for line in text.split("\n"))
        with _print_lock:
            try:
                stream.write(lines)
                stream.flush()
            except (OSError, ValueError):  # a closed stderr: nothing to do
                pass

    def read_past_side_frames(
        self,
        read: Callable[[float | None], tuple[int, int, int, Payload]],
        deadline: float | None,
        pending: tuple[int, int, Payload] | None = None,
        on_event: Callable[[int, Payload], None] | None = None,
    ) -> tuple[int, int, int, Payload]:
        """The next frame from ``read`` that is not a log record or a call event: LOG frames
        met on the way are emitted here and EVENT frames handed to ``on_event(call id,
        payload)`` (dropped without one), so whatever a call logged or emitted is handled
        before its reply is returned. ``pending`` is such a frame (type, call id, payload)
        the caller already read. Shared by every backend's ``read_frame``."""
        if pending is not None:
            self._side_frame(*pending, on_event)
        while True:
            frame = read(deadline)
            ftype = frame[0]
            if ftype != FrameType.LOG and ftype != FrameType.EVENT:
                return frame
            self._side_frame(ftype, frame[2], frame[3], on_event)

    def _side_frame(
        self,
        ftype: int,
        call_id: int,
        payload: Payload,
        on_event: Callable[[int, Payload], None] | None,
    ) -> None:
        if ftype == FrameType.LOG:
            self.emit_frame(payload)
        elif on_event is not None:
            on_event(call_id, payload)

    def emit_frame(self, payload: bytes | bytearray | memoryview) -> None:
        """A LOG frame's payload: (level, logger, message, exc text, created, stream).

        A record that does not unpickle (a ``SystemExit`` from a reducer in it included) or
        has fields of the wrong types is dropped, with one warning per worker: never an
        exception for the thread or loop that reads the frame (a caller's reply read, the
        asyncio reader, the reactor on the log pipe), which would leave its call hanging or
        unwind it."""
        try:
            level, name, message, exc_text, created, stream = pickle.loads(payload)
            level, name, message, stream = int(level), str(name), str(message), str(stream)
            exc_text = None if exc_text is None else str(exc_text)
            when = None if created is None else float(created)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - dropped, never fatal
            self._bad_record(exc)
            return
        if when is not None and not math.isfinite(when):
            when = None  # no such time: the record takes the host's clock
        self.emit(LogLine(level, name, message, exc_text, when, stream))

    def _bad_record(self, exc: BaseException) -> None:
        if self._record_warned:
            return
        self._record_warned = True
        try:
            why = f"{type(exc).__name__}: {exc}"[:200]
        except Exception:  # noqa: BLE001 - an exception whose __str__ raises
            why = type(exc).__name__
        _log.warning(
            "comfy-env: worker of env %s (pid %s, generation %d) sent a log record that "
            "could not be read (%s); it and any other such record of this worker are dropped",
            self.env,
            self.pid,
            self.generation,
            why,
        )

    # ---- native output (reactor thread) ----

    def feed_native(self, stream: str, data: bytes) -> None:
        """Complete lines of ``data`` (after what is pending) are emitted; a line longer than
        ``LINE_CAP`` bytes is emitted in pieces as it arrives. Only new bytes are searched and
        the pending part never exceeds ``LINE_CAP``: linear time, bounded memory, whatever
        the worker writes (output without newlines included). A line overwritten with
        carriage returns (a progress bar) is emitted as its final state when it ends, and
        meanwhile as its latest state at most every ``PROGRESS_INTERVAL`` seconds."""
        pending = self._partial.setdefault(stream, bytearray())
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            pending += data[start:end]
            if b"\r" in pending:
                pending[:] = _final_state(pending)
                self._progress_at.pop(stream, None)  # a bar ended: the next shows at once
            for piece in range(0, max(1, len(pending)), LINE_CAP):
                self._native_line(stream, bytes(pending[piece : piece + LINE_CAP]))
            pending.clear()
            start = end + 1
        if data.find(b"\r", start) >= 0:
            self._native_progress(stream, pending, data[start:])
            return
        pending += data[start:]
        while len(pending) >= LINE_CAP:
            self._native_line(stream, bytes(pending[:LINE_CAP]))
            del pending[:LINE_CAP]

    def _native_progress(self, stream: str, pending: bytearray, data: bytes) -> None:
        """``data`` (no newline in it) updates a progress line: ``pending`` keeps only its
        latest state (bounded memory, however long the bar runs), emitted now if no state of
        this stream was for ``PROGRESS_INTERVAL``."""
        pending += data
        state = _final_state(pending)
        if len(state) >= LINE_CAP:  # one state too long to keep: cut as any long line
            pending[:] = state
            while len(pending) >= LINE_CAP:
                self._native_line(stream, bytes(pending[:LINE_CAP]))
                del pending[:LINE_CAP]
            return
        pending[:] = b"\r" + state + (b"\r" if pending.endswith(b"\r") else b"")
        now = time.monotonic()
        if state.strip() and now - self._progress_at.get(stream, -math.inf) >= PROGRESS_INTERVAL:
            self._progress_at[stream] = now
            self._native_line(stream, state)

    def finish_native(self, stream: str) -> None:
        rest = self._partial.pop(stream, b"")
        state = _final_state(rest)
        if state.strip() or (state and len(state) == len(rest)):  # a bar cleared to blanks
            self._native_line(stream, state)

    def _native_line(self, stream: str, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace")
        level = logging.WARNING if stream == "stderr" else logging.INFO
        self.emit(LogLine(level, "native", line, None, None, f"native-{stream}"))

    # ---- the log pipe (reactor thread) ----

    def feed_pipe(self, data: bytes) -> bool:
        """Parse LOG frames from the log pipe. False if what is buffered is not a LOG frame
        (something in the worker wrote on the pipe's descriptor): it is dropped, with one
        warning per worker, and parsing starts again with the next read (the worker writes a
        frame in one write, so the stream usually falls back in step there; a read that does
        not start a frame is dropped the same way). The channel, not this pipe, decides the
        worker's fate: junk here retires nothing."""
        buf = self._pipe_buf
        buf += data
        while len(buf) >= HEADER_SIZE:
            try:
                ftype, _flags, length, _call = decode_header(buf)
            except FrameError:
                ftype = -1  # (a bad magic: junk, dropped as below)
            if ftype != FrameType.LOG or length > _MAX_PIPE_FRAME:
                dropped = len(buf)
                buf.clear()
                if not self._pipe_warned:
                    self._pipe_warned = True
                    _log.warning(
                        "comfy-env: worker of env %s (pid %s, generation %d) wrote %d bytes "
                        "that are not log records on its log pipe (code in the worker writing "
                        "on a descriptor it does not own?); they and any record among them "
                        "were dropped",
                        self.env,
                        self.pid,
                        self.generation,
                        dropped,
                    )
                return False
            end = HEADER_SIZE + length
            if len(buf) < end:
                break
            self.emit_frame(bytes(buf[HEADER_SIZE:end]))
            del buf[:end]
        return True

    def _keep(self, text: str, created: float | None, stream: str) -> None:
        """``text`` into the tail, before the native lines at its end that arrived after
        ``created`` (by at most ``TAIL_REORDER_WINDOW``): see "tail" in the module docstring."""
        now = time.time()
        native = stream.startswith("native-")
        with self._lock:
            tail = self._tail
            later: list[tuple[float, bool, str]] = []
            if created is not None and not native:
                while tail and tail[-1][1] and 0 < tail[-1][0] - created <= TAIL_REORDER_WINDOW:
                    later.append(tail.pop())
            tail.append((now if created is None or native else created, native, text))
            tail.extend(reversed(later))

    def tail(self) -> str:
        with self._lock:
            return "\n".join(text for _, _, text in self._tail)
