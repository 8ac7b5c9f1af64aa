"""Worker output as log frames: ``logging`` records and ``sys.stdout``/``sys.stderr`` writes.

Where a record goes depends on whether a call is running:

- **during a call** it travels in band, as a LOG frame on the channel, so the host emits it
  before the call's reply: everything a call logs arrives before the call returns, in order;
- **between calls** it goes to a separate log pipe that the host's reactor reads all the time,
  so output of background threads arrives promptly, never waiting for the next call.

``Outbox`` makes that switch atomic: the serve loop marks a call started when it reads the CALL
frame and ended in the same locked section that sends the reply, and every record is sent under
the same lock, so a record can neither slip in after the reply (where no caller would read it)
nor interleave with the bytes of another frame.

``sys.stdout`` and ``sys.stderr`` are replaced by line-buffered text streams that emit records
(``builtins.print`` is left alone, so ``print(x, file=fh)`` still writes ``fh``). The raw file
descriptors 1 and 2 stay what the host gave: pipes it reads line by line as native output (C
``printf``, library warnings, faulthandler).

Stdlib only; Python 3.8+.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import socket
import sys
import threading
import time
from typing import Any, Optional, Tuple

from .protocol import FrameType, encode_header

# A record on the wire: (level, logger name, message, exception text, created, stream).
# stream: "logging", "stdout" or "stderr".


class Outbox:
    """Sends log records in band during a call and to the log pipe between calls."""

    def __init__(self, sock: socket.socket, log_fd: Optional[int]) -> None:
        self.sock = sock
        self.log_fd = log_fd
        self.lock = threading.Lock()  # every write on the channel or the log pipe
        self.in_call = False

    def send_record(self, record: Tuple[Any, ...]) -> None:
        try:
            payload = pickle.dumps(record, protocol=4)
        except Exception:  # noqa: BLE001 - never let logging break the worker
            return
        frame = encode_header(FrameType.LOG, 0, len(payload)) + payload
        with self.lock:
            if self.in_call:
                self.sock.sendall(frame)
            elif self.log_fd is not None:
                _write_all(self.log_fd, frame)


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


class ForwardingHandler(logging.Handler):
    """Root handler: every record becomes a log frame with its level and logger name."""

    def __init__(self, outbox: Outbox) -> None:
        super().__init__(logging.NOTSET)
        self.outbox = outbox
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
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


class LineStream(io.TextIOBase):
    """A text stream that turns each complete line into a record (``stdout`` at INFO,
    ``stderr`` at WARNING)."""

    def __init__(self, outbox: Outbox, stream: str, level: int, original: Any) -> None:
        self.outbox = outbox
        self.stream = stream
        self.level = level
        self.original = original
        self._buf = ""
        self._lock = threading.Lock()

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

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError("write() argument must be str, not %s" % type(text).__name__)
        with self._lock:
            self._buf += text
            if "\n" not in self._buf:
                return len(text)
            *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self._emit(line)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            rest, self._buf = self._buf, ""
        if rest:
            self._emit(rest)

    def _emit(self, line: str) -> None:
        self.outbox.send_record((self.level, self.stream, line, None, time.time(), self.stream))


def install(outbox: Outbox, level: str) -> None:
    """Route the worker's logging and sys.stdout/sys.stderr through ``outbox``."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(ForwardingHandler(outbox))
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    sys.stdout = LineStream(outbox, "stdout", logging.INFO, sys.__stdout__)
    sys.stderr = LineStream(outbox, "stderr", logging.WARNING, sys.__stderr__)
