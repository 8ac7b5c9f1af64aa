"""Functions the Executor tests run inside workers (importable there via PoolConfig.sys_path).

Stdlib only and Python 3.8-compatible: the same module runs in envs of other Python versions.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def square(x: int) -> int:
    return x * x


def add(a: int, b: int) -> int:
    return a + b


def identity(x: object) -> object:
    return x


def version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def pid(_: object = None) -> int:
    return os.getpid()


def sleep_then(seconds: float, value: object) -> object:
    time.sleep(seconds)
    return value


def touch(path: str, seconds: float = 0.0) -> str:
    """Sleep, then create ``path``: the side effect that proves a call ran."""
    time.sleep(seconds)
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    return path


def fail(text: str) -> None:
    raise KeyError(text)


def crash_if(x: int, bad: int) -> int:
    """Kill this worker with SIGSEGV when ``x == bad`` (as a native library would), else x."""
    if x == bad:
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(10)
    return x


def abort() -> None:
    os.abort()
