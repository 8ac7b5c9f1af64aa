"""Worker code that misbehaves on purpose, for the frame-limit, hostile-exception, descendant,
crash and spin tests: huge exceptions, log records and output, exceptions whose ``str``,
``repr`` or ``__reduce__`` raise, setsid descendants, deaths mid-line, a spinning loop.

Imported by name in workers (``tasks.hostile:<function>``; see ``tests/tasks/__init__.py``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any


def in_worker() -> bool:
    return "comfy_env_worker.main" in sys.modules and "comfy_env" not in sys.modules


def raise_big(n: int) -> None:
    raise ValueError("x" * n)


def log_big(n: int) -> str:
    logging.getLogger("hardening").warning("L" * n)
    return "logged"


def print_big_no_newline(n: int, chunk: int) -> str:
    for _ in range(n // chunk):
        sys.stdout.write("p" * chunk)
    return "printed"


def native_no_newline(n: int) -> str:
    block = b"n" * (1 << 20)
    for _ in range(n // len(block)):
        os.write(1, block)
    return "written"


class StrRaises(Exception):
    def __str__(self) -> str:
        raise SystemExit("str fights back")

    def __repr__(self) -> str:
        raise KeyboardInterrupt


class ReduceRaises(Exception):
    def __reduce__(self) -> Any:
        raise KeyboardInterrupt


class BaseEverythingRaises(BaseException):
    def __str__(self) -> str:
        raise SystemExit(3)

    def __repr__(self) -> str:
        raise SystemExit(4)

    def __reduce__(self) -> Any:
        raise SystemExit(5)


def raise_fighting(kind: str) -> None:
    if kind == "str":
        raise StrRaises("hidden")
    if kind == "reduce":
        raise ReduceRaises("reduce text")
    raise BaseEverythingRaises()


def _rebuild_in_host(kind: str) -> Exception:
    if not in_worker():
        if kind == "exit":
            raise SystemExit(7)
        raise KeyboardInterrupt
    return ValueError("never")


class HostRebuildRaises(Exception):
    """Pickles fine in the worker; unpickling it in the host raises SystemExit or
    KeyboardInterrupt."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind

    def __reduce__(self) -> Any:
        return (_rebuild_in_host, (self.kind,))


def raise_host_rebuild(kind: str) -> None:
    raise HostRebuildRaises(kind)


def add(a: int, b: int) -> int:
    return a + b


def spawn_setsid_sleeper(clear_env: bool) -> int:
    """A descendant that left the worker's process group (and, with ``clear_env``, its
    environment); it inherits the worker's stdout and stderr."""
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        env={} if clear_env else None,
    )
    return child.pid


def die(code: int) -> None:
    os._exit(code)


def die_mid_line(code: int) -> None:
    """Last words without a newline on both streams, then an exit."""
    os.write(1, b"half a line on stdout")
    os.write(2, b"half a line on stderr")
    os._exit(code)


def spin_state() -> tuple[float, bool]:
    """The worker's ``PoolConfig.spin_wait`` as it arrived, and whether its serve loop polls
    for the next frame now (see ``FrameReader.spin_wait``)."""
    from comfy_env_worker import main

    worker = main.WORKER
    assert worker is not None
    return worker.spin_wait, worker.reader.spins()
