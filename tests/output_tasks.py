"""What real libraries write in a worker, for tests/test_output.py: progress bars (tqdm's
``\\r`` updates), lines without newlines, ``warnings``, odd bytes, odd log records.

Importable on both sides (the ``config`` fixture puts ``tests/`` on the worker's ``sys.path``);
the functions run in the worker.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any


def progress(n: int, native: bool, close: bool = True) -> int:
    """A tqdm-like bar: ``\\r`` + the bar, flushed, no newline until the end."""
    for i in range(n + 1):
        text = f"\r{100 * i // n:3d}%|{'#' * (10 * i // n)}| {i}/{n}"
        if native:
            os.write(2, text.encode())
        else:
            sys.stderr.write(text)
            sys.stderr.flush()
    if close:
        if native:
            os.write(2, b"\n")
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()
    return n


def partial_then(how: str, text: str) -> str:
    """Write ``text`` without a newline (``print(end="")``), then return or crash."""
    if how == "native":
        os.write(1, text.encode())
    else:
        print(text, end="")
    if how == "segfault":
        ctypes.string_at(0)
    elif how == "abort":
        os.abort()
    return how


def bytes_and_reconfigure() -> list[str]:
    """What libraries do to ``sys.stdout`` beyond ``write(str)``: ``reconfigure`` at import,
    bytes through ``.buffer`` (a character split across writes, an invalid byte), and a str
    given to ``.buffer`` (a TypeError, as in CPython)."""
    sys.stdout.reconfigure(encoding="utf-8")  # type: ignore[union-attr]
    out = sys.stdout.buffer
    out.write(b"caf\xc3")
    out.write(b"\xa9 split\n")
    out.write(memoryview(b"bad \xff byte\n"))
    out.flush()
    try:
        out.write("text")  # type: ignore[arg-type]
    except TypeError as exc:
        return [type(exc).__name__]
    return ["accepted"]


def write_non_str(value: Any) -> str:
    try:
        sys.stdout.write(value)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    return "accepted"


def stream_facts() -> dict[str, Any]:
    out = sys.stdout
    return {
        "encoding": out.encoding,
        "errors": getattr(out, "errors", "<none>"),
        "isatty": out.isatty(),
        "fileno": out.fileno(),
        "line_buffering": getattr(out, "line_buffering", "<none>"),
        "has_buffer": hasattr(out, "buffer"),
        "closed": out.closed,
        "readable": out.readable(),
        "seekable": out.seekable(),
    }


def native_text(chunks: list[bytes], stream: int = 2) -> int:
    for chunk in chunks:
        os.write(stream, chunk)
        time.sleep(0.01)  # separate reads in the host
    return len(chunks)


def python_text(chunks: list[str]) -> int:
    for chunk in chunks:
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return len(chunks)


def warn_twice(category: str) -> int:
    cls = {"user": UserWarning, "deprecation": DeprecationWarning}[category]
    for _ in range(3):
        warnings.warn(f"careful with {category}", cls, stacklevel=1)
    return 3


def log_odd_records() -> str:
    log = logging.getLogger("odd")
    try:
        raise ValueError("exc boom")
    except ValueError:
        log.exception("with exception")
    log.info("with stack", stack_info=True)
    log.info("with extra", extra={"request_id": "r-17"})
    log.info("bad format %d", "not a number")
    log.info("a lock as arg %s", threading.Lock())
    return "ok"


def log_from_thread_after_return(delay: float) -> str:
    def later() -> None:
        time.sleep(delay)
        logging.getLogger("late.thread").warning("after the return")

    threading.Thread(target=later, name="late-logger").start()
    logging.getLogger("in.thread").info("during the call")
    return "ok"


def own_handler_no_propagate(path: str) -> str:
    log = logging.getLogger("private")
    log.propagate = False
    handler = logging.FileHandler(path)
    log.addHandler(handler)
    log.warning("kept private")
    handler.close()
    log.removeHandler(handler)
    return "ok"


def set_root_debug() -> str:
    logging.getLogger().setLevel(logging.DEBUG)
    logging.getLogger("dbg").debug("debug after setLevel")
    return "ok"


def mixed_order(n: int) -> int:
    log = logging.getLogger("order")
    for i in range(n):
        print(f"print {i}")
        log.info("log %d", i)
        sys.stderr.write(f"err {i}\n")
    return n


def count_with_cr(n: int) -> int:
    """A counter overwritten in place, then a newline: ``print(i, end="\\r")`` as scripts do."""
    for i in range(1, n + 1):
        print(f"{i}/{n}", end="\r")
    print()
    return n
