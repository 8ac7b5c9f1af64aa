"""Call targets for the peers' workers (stdlib only, importable by name from benchmarks/).

comfy_env's own workers use the built-in ``comfy_env_worker.tasks``; these are the same
functions for the peer pools, which pickle a function by reference and so need it importable in
their workers. The old comfy-env takes keyword arguments only, hence the parameter names.
"""

from __future__ import annotations

import os
import time
from typing import Any


def echo(x: Any = None) -> Any:
    """Return the argument unchanged."""
    return x


def sleep(seconds: float = 0.0) -> float:
    """Sleep, then return the seconds slept."""
    time.sleep(seconds)
    return seconds


def getpid() -> int:
    """The worker's process id."""
    return os.getpid()


def touch_pages(array: Any) -> int:
    """Read one byte of every 4 KiB page of a (contiguous) numpy array: what a caller that uses
    a result pays at least. A result whose pages are not mapped in yet (a lazily faulted
    mapping) pays its page faults here, inside the timing, as a copy into fresh memory pays
    them while it copies. Needs only the array's own methods (no numpy import)."""
    return int(array.reshape(-1).view("u1")[::4096].sum())
