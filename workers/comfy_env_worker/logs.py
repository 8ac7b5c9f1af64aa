"""Worker output as log frames: ``logging`` records and ``sys.stdout``/``sys.stderr`` writes.

Where a record goes depends on whether a call is running:

- **during a call** it travels in band, as a LOG frame on the channel, so the host emits it
  before the call's reply: every record and every complete line a call writes through these
  streams arrives before the call returns, in order;
- **between calls** it goes to a separate log pipe that the host's reactor reads all the time,
  so output of background threads arrives promptly, never waiting for the next call.

``Outbox`` makes that switch atomic: the serve loop marks a call started when it reads the CALL
frame and ended in the same locked section that sends the reply, and every record is sent under
the same lock, so a record can neither slip in after the reply (where no caller would read it)
nor interleave with the bytes of another frame.

``sys.stdout`` and ``sys.stderr`` are replaced by line-buffered text streams that emit records
(``builtins.print`` is left alone, so ``print(x, file=fh)`` still writes ``fh``). A line
overwritten with carriage returns (tqdm writes ``"\r" + bar`` and flushes, with no newline
until the bar closes) is a progress line: it is sent as its latest state at most every
``PROGRESS_INTERVAL`` seconds and as its final state when its newline comes, never one record
per update (a log is not a terminal). The raw file
descriptors 1 and 2 stay what the host gave: pipes it reads line by line as native output (C
``printf``, ``os.write(2, ...)``, library warnings, child processes, faulthandler). Those bytes
never travel in band: the host's reactor reads them apart from the channel, so they may reach
the host's logging after the call has returned, with no order against the reply.

Stdlib only; Python 3.8+.
"""

from __future__ import annotations

import _socket
import _thread
import io
import os
import pickle
import sys
import time

from .protocol import MSG_NOSIGNAL, FrameType, encode_header

# Bound at import: the env's code may replace ``pickle.dumps`` or ``time.time`` (a frozen
# clock, a patched pickler); a record must still go out.
_dumps = pickle.dumps
_time = time.time
_monotonic = time.monotonic

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Optional, Tuple

# A record on the wire: (level, logger name, message, exception text, created, stream).
# stream: "logging", "stdout" or "stderr".

# A line of stdout/stderr is cut into pieces of this many characters: output without newlines
# (progress bars, a native library's dump) is forwarded as it comes, in linear time.
LINE_CAP = 64 * 1024
# The largest record payload on either path. The host reads the log pipe with a 16 MiB frame
# limit and the channel with max_frame_bytes; a record is clipped to the smaller budget.
RECORD_CAP = 8 * 1024 * 1024
_CUT = "\n[... comfy-env: %d characters cut ...]\n"
# A progress bar (tqdm and the like: ``"\r" + bar``, flushed, no newline until it closes)
# shows its latest state at most this often, and its final state when its line ends.
PROGRESS_INTERVAL = 2.0


def final_state(line: str) -> str:
    """What a terminal would leave of ``line``: the text after its last carriage return
    (a trailing one, as in ``\r\n`` line ends, is not a new state)."""
    if "\r" not in line:
        return line
    return line.rstrip("\r").rpartition("\r")[2]


def clip(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters, else its head and tail with a
    visible marker saying how much was cut between them."""
    if len(text) <= max_chars:
        return text
    keep = max(0, max_chars - 64)
    head = keep // 2
    tail = keep - head
    return text[:head] + _CUT % (len(text) - keep) + (text[len(text) - tail :] if tail else "")


class Outbox:
    """Sends log records in band during a call and to the log pipe between calls."""

    def __init__(self, sock: _socket.socket, log_fd: Optional[int]) -> None:
        self.sock = sock
        self.log_fd = log_fd
        self.lock = _thread.allocate_lock()  # every write on the channel or the log pipe
        self.in_call = False
        self.max_payload = RECORD_CAP  # lowered by the host's max_frame_bytes (CONFIG)

    def send_record(self, record: Tuple[Any, ...]) -> None:
        try:
            payload = _dumps(record, protocol=4)
            if len(payload) > self.max_payload:
                payload = _dumps(self._clipped(record), protocol=4)
        except Exception:  # noqa: BLE001 - never let logging break the worker
            return
        frame = encode_header(FrameType.LOG, 0, len(payload)) + payload
        del payload
        with self.lock:
            if self.in_call:
                self.sock.sendall(frame, MSG_NOSIGNAL)
            elif self.log_fd is not None:
                _write_all(self.log_fd, frame)

    def _clipped(self, record: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """The record with message and exception text clipped so that its payload fits (UTF-8
        takes up to 4 bytes a character; both texts share the budget)."""
        level, name, message, exc_text, created, stream = record
        chars = max(256, (self.max_payload - 4096) // 8)
        message = clip(str(message), chars)
        if exc_text is not None:
            exc_text = clip(str(exc_text), chars)
        return (level, clip(str(name), 256), message, exc_text, created, stream)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # the host closed the pipe: it is going away
        view = view[n:]


def _forwarding_handler(logging: Any, outbox: Outbox) -> Any:
    """Root handler: every record becomes a log frame with its level and logger name. Built
    when ``logging`` is imported (see ``install``), so the class is defined then."""

    class ForwardingHandler(logging.Handler):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(logging.NOTSET)
            self.outbox = outbox
            self._formatter = logging.Formatter()

        def emit(self, record: Any) -> None:
            try:
                message = record.getMessage()
                exc_text = None
                if record.exc_info:
                    exc_text = self._formatter.formatException(record.exc_info)
                elif record.exc_text:
                    exc_text = record.exc_text
                if record.stack_info:
                    exc_text = (exc_text + "\n" if exc_text else "") + record.stack_info
                self.outbox.send_record(
                    (record.levelno, record.name, message, exc_text, record.created, "logging")
                )
            except Exception:  # noqa: BLE001
                self.handleError(record)

    return ForwardingHandler()


class LineStream(io.TextIOBase):
    """A text stream that turns each complete line into a record (``stdout`` at INFO,
    ``stderr`` at WARNING)."""

    def __init__(self, outbox: Outbox, stream: str, level: int, original: Any) -> None:
        self.outbox = outbox
        self.stream = stream
        self.level = level
        self.original = original
        self._parts: "list[str]" = []  # text written since the last complete line
        self._size = 0
        self._lock = _thread.allocate_lock()
        self._progress_at = float("-inf")  # when a progress state was last sent (_monotonic)

    def renew_lock(self) -> None:
        """A new lock, in a process forked while another thread may have held the old one."""
        self._lock = _thread.allocate_lock()
        buffer = self.__dict__.get("_buffer")
        if buffer is not None:
            buffer._lock = _thread.allocate_lock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        # Code that asks for the fd (faulthandler, subprocess) gets the real one.
        return int(self.original.fileno())

    @property
    def buffer(self) -> "_BytesToLines":
        """What ``sys.stdout.buffer.write(b"...")`` writes to (as a real ``sys.stdout`` has):
        UTF-8 decoded as it comes, a character split across writes included, invalid bytes
        replaced, then the same lines as text written here."""
        buffer = self.__dict__.get("_buffer")
        if buffer is None:
            buffer = self.__dict__["_buffer"] = _BytesToLines(self)
        return buffer

    def reconfigure(self, **_options: Any) -> None:
        """Accepted and ignored (``sys.stdout.reconfigure(encoding="utf-8")`` at a module's
        import must not fail): this stream is UTF-8 text, sent line by line, already."""

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        with self._lock:
            # Only new text is searched, pending text is joined once per LINE_CAP, and a line
            # never grows past LINE_CAP: output without newlines (one character at a time,
            # or megabytes at once) costs linear time and bounded memory.
            self._parts.append(text)
            self._size += len(text)
            if "\n" not in text:
                if "\r" in text:  # print(..., end="\r"): a terminal would show it now
                    pieces = self._progress_locked()
                elif self._size < LINE_CAP:
                    return len(text)
                else:
                    pieces = self._lines_locked()
            else:
                pieces = self._lines_locked()
        for line in pieces:
            self._emit(line)
        return len(text)

    def _lines_locked(self) -> "list[str]":
        """The complete lines (and LINE_CAP pieces) of what is pending; the rest stays."""
        *lines, rest = "".join(self._parts).split("\n")
        # A line overwritten with carriage returns (a progress bar) is sent as its final
        # state, never as every state it went through.
        pieces = [piece for line in lines for piece in _pieces(final_state(line))]
        if any("\r" in line for line in lines):
            # A bar ended: the next one's first state is sent at once, not up to
            # PROGRESS_INTERVAL later (back-to-back bars would show nothing while they ran).
            self._progress_at = float("-inf")
        tail = _pieces(rest)
        keep = tail.pop() if len(tail[-1]) < LINE_CAP else ""
        pieces.extend(tail)
        self._parts = [keep] if keep else []
        self._size = len(keep)
        return pieces

    def _progress_locked(self) -> "list[str]":
        """A progress update (``\r`` + a state, tqdm's way): the pending line is reduced to
        its latest state, which its newline sends as the final one. That state is returned to
        be sent now only if none was for PROGRESS_INTERVAL: a bar makes a few records, not
        one per update. A state too long to keep is cut into lines as any text is."""
        rest = "".join(self._parts)
        state = final_state(rest)
        if len(state) >= LINE_CAP:
            self._parts = [state]
            return self._lines_locked()
        self._parts = ["\r" + state + ("\r" if rest.endswith("\r") else "")]
        self._size = len(self._parts[0])
        now = _monotonic()
        if not state.strip() or now - self._progress_at < PROGRESS_INTERVAL:
            return []
        self._progress_at = now
        return [state]

    def flush(self) -> None:
        with self._lock:
            if any("\r" in part for part in self._parts):
                pieces = self._progress_locked()
            else:
                pieces = ["".join(self._parts)]
                self._parts = []
                self._size = 0
        for line in pieces:
            if line:
                self._emit(line)

    def end_line(self) -> None:
        """Send what is pending as a line, a progress bar's latest state included (the
        worker is exiting: no newline will come)."""
        with self._lock:
            rest = "".join(self._parts)
            self._parts = []
            self._size = 0
        state = final_state(rest)
        if state.strip() or (state and state == rest):  # a bar cleared to blanks says nothing
            self._emit(state)

    def _emit(self, line: str) -> None:
        self.outbox.send_record((self.level, self.stream, line, None, _time(), self.stream))


class _BytesToLines(io.BufferedIOBase):
    """The binary side of a ``LineStream`` (its ``buffer``)."""

    def __init__(self, text: LineStream) -> None:
        import codecs  # loaded at interpreter start-up already (the encodings need it)

        self.text = text
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self._lock = _thread.allocate_lock()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.text.fileno()

    def write(self, data: Any) -> int:
        view = memoryview(data)  # bytes-like only, as a real buffer: str is a TypeError
        with self._lock:
            text = self._decode(view.tobytes())
        if text:
            self.text.write(text)
        return view.nbytes

    def flush(self) -> None:
        self.text.flush()


def _pieces(line: str) -> "list[str]":
    """``line`` cut into pieces of at most LINE_CAP characters (one piece if it is short)."""
    if len(line) <= LINE_CAP:
        return [line]
    return [line[i : i + LINE_CAP] for i in range(0, len(line), LINE_CAP)]


# Levels of the stdout/stderr records (logging.INFO and logging.WARNING).
_INFO = 20
_WARNING = 30


def _route_logging(logging: Any, outbox: Outbox, level: str) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_forwarding_handler(logging, outbox))
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


class _LoggingImportHook:
    """A ``sys.meta_path`` entry that routes ``logging`` through the outbox the moment the
    module is first imported (by the env's code or a library), before any caller can log.

    Importing ``logging`` costs the worker 5-6 ms at start-up (it pulls in ``traceback``,
    ``string``, ``weakref``...), and a worker whose calls never log does not need it. The hook
    finds the module with the finders after it, lets it execute, then installs the handler in
    the same import, under the import lock: no record can be emitted in between."""

    def __init__(self, outbox: Outbox, level: str) -> None:
        self.outbox = outbox
        self.level = level

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "logging":
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run_module: Any = getattr(loader, "exec_module", None)
        if run_module is None:
            return spec  # an unusual loader: logging stays unrouted rather than broken
        hook = self

        class _Loader:
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                run_module(module)
                hook.remove()  # found-but-not-loaded specs (importlib.util.find_spec) keep it
                _route_logging(module, hook.outbox, hook.level)

        spec.loader = _Loader()
        return spec

    def remove(self) -> None:
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass


def install(outbox: Outbox, level: str) -> None:
    """Route the worker's logging and sys.stdout/sys.stderr through ``outbox``. ``logging``
    is routed now if it is already imported, else when it first is (``_LoggingImportHook``)."""
    logging = sys.modules.get("logging")
    if logging is not None:
        _route_logging(logging, outbox, level)
    else:
        sys.meta_path.insert(0, _LoggingImportHook(outbox, level))
    sys.stdout = LineStream(outbox, "stdout", _INFO, sys.__stdout__)
    sys.stderr = LineStream(outbox, "stderr", _WARNING, sys.__stderr__)
