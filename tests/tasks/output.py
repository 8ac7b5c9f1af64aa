"""What real libraries write in a worker, for tests/test_output.py: progress bars (tqdm's
``\\r`` updates), lines without newlines, ``warnings``, odd bytes, odd log records; and a log
flood from a thread beside a large reply, for tests/test_outside_faults.py.

Importable on both sides (the ``config`` fixture puts ``tests/`` on the worker's ``sys.path``);
the functions run in the worker.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import warnings
from typing import Any

from tasks import fault as fault_tasks


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


def bar_after_a_bar(native: bool) -> None:
    """A closed bar, then at once a second one drawn and left open (its first state)."""
    progress(5, native)
    if native:
        os.write(2, b"\rsecond bar 0/5")
    else:
        sys.stderr.write("\rsecond bar 0/5")
        sys.stderr.flush()


def partial_line_then_crash(how: str, text: str) -> None:
    """Write ``text`` without a newline (``native``: on fd 1; ``flushed``: ``print(end="",
    flush=True)``), then segfault. Only inside a worker (see tests/tasks/fault.py)."""
    if not fault_tasks.in_worker():
        raise RuntimeError("refusing to crash outside a worker")
    if how == "native":
        os.write(1, text.encode())
    else:
        print(text, end="", flush=True)
    ctypes.string_at(0)


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


def warn_three_times(category: str) -> int:
    """The same warning from one place, three times (Python shows it once)."""
    cls = {"user": UserWarning, "deprecation": DeprecationWarning}[category]
    for _ in range(3):
        warnings.warn(f"careful with {category}", cls, stacklevel=1)
    return 3


def log_odd_records() -> str:
    """Records beyond a plain message: an exception, a stack, extra fields, arguments that
    fail to format, an argument that cannot be pickled."""
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


def count_with_cr(n: int) -> int:
    """A counter overwritten in place, then a newline: ``print(i, end="\\r")`` as scripts do."""
    for i in range(1, n + 1):
        print(f"{i}/{n}", end="\r")
    print()
    return n


def flood_while_returning(lines: int, nbytes: int) -> Any:
    """Start a thread that logs ``lines`` records, and return a large array at once."""
    import logging

    import numpy as np

    log = logging.getLogger("flooder")

    def spam() -> None:
        for i in range(lines):
            log.warning("flood line %d of %d", i, lines)

    threading.Thread(target=spam, daemon=True).start()
    return np.arange(nbytes // 8, dtype=np.int64)
