"""Built-in call targets every env has (the runtime directory is on every worker's path).

They serve the start-up canary (``echo``), the demo and the CLI (``crash``, ``sleep``), and
tests that need a worker to misbehave on purpose. Stdlib only.
"""

from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Sequence, Union


def echo(value: Any) -> Any:
    """Return the argument unchanged (the canary round-trips it through the real codec)."""
    return value


def sleep(seconds: float) -> float:
    """Sleep, then return the seconds slept."""
    time.sleep(seconds)
    return seconds


def getpid() -> int:
    """The worker's process id."""
    return os.getpid()


def info() -> Dict[str, Any]:
    """What this interpreter is: version, executable, prefix and path."""
    return {
        "pid": os.getpid(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "prefix": sys.prefix,
        "sys_path": list(sys.path),
    }


def preload(names: List[str], host_has_numpy: bool = False) -> Any:
    """Import the named modules (a warm start: ``Worker.start(preload=...)``), in order, on the
    worker's main thread as a call would; an import that fails raises as it would in a call.

    Where numpy is loaded here and in the host, the reply is a one-element array: the first
    array a process pickles or unpickles makes the codec's array pickler, numpy's scalar-type
    set and the dtype (about 0.1 ms in the worker, 0.05 ms in the host, once per process), so
    the first real call that returns an array finds both ends ready. Otherwise the names."""
    import importlib

    for name in names:
        importlib.import_module(name)
    np = sys.modules.get("numpy")
    if host_has_numpy and np is not None and getattr(np, "ndarray", None) is not None:
        return np.zeros(1)
    return list(names)


def crash() -> None:
    """Dereference a null pointer through ctypes: a real SIGSEGV, as a buggy native library
    would cause. ``faulthandler`` prints the Python stack to stderr on the way down."""
    import ctypes

    ctypes.string_at(0)


def exit_now(code: int = 0) -> None:
    """Leave the process at once, without cleanup, as ``os._exit`` in native code would."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shm_stats() -> Dict[str, int]:
    """This worker's shared-memory state: reply blocks pinned until the host acks them, blocks
    alive, idle blocks kept for reuse."""
    from . import main

    worker = main.WORKER
    return worker.shm_stats() if worker is not None else {}


def starmap(
    fn: Union[str, Callable[..., Any]], chunk: Union[str, bytes, Sequence[Any]], star: bool = True
) -> Union[str, bytes, List[Any]]:
    """One call of ``comfy_env.Executor.map``'s chunks (its ``chunksize``, as
    ``ProcessPoolExecutor`` batches items): ``[fn(*args) for args in chunk]`` (``star``) or
    ``[fn(x) for x in chunk]``. ``fn`` is a ``"module:name"`` target (imported and cached as a
    call's own target is) or a callable that came with the arguments.

    ``chunk`` is a list, or, when every item is a scalar, the host's pickle of one: as a
    latin-1 ``str`` (so the call is all scalars and takes the pool's straight-line path) up to
    ``PACKED_MAX`` bytes, as bytes above. The results come back the same way: packed here when
    every result is a scalar, else the list itself (whose arrays and large buffers then travel
    as any result's do). One pickle each way is much cheaper than the call path's scan of every
    item. The first exception ends the chunk and is the call's error."""
    if isinstance(fn, str):
        from .main import resolve_target

        fn = resolve_target(fn)
    items = chunk if isinstance(chunk, (list, tuple)) else unpack(chunk)
    results = [fn(*args) for args in items] if star else [fn(x) for x in items]
    from .shm import SCALARS

    for result in results:
        if type(result) not in SCALARS:
            return results
    return pack(results)


# Packed chunks up to this size travel as a latin-1 ``str`` (a scalar argument: the pool's
# straight-line path), larger ones as bytes (which may go out of band, through shared memory).
PACKED_MAX = 64 * 1024


def pack(values: List[Any]) -> Union[str, bytes]:
    """``values`` (all scalars) pickled, as ``starmap`` sends and takes them."""
    import pickle

    data = pickle.dumps(values, protocol=5)
    return data.decode("latin-1") if len(data) <= PACKED_MAX else data


def unpack(packed: Any) -> Any:
    """The values ``pack`` packed (``packed`` may also be a buffer that came out of band)."""
    import pickle

    if isinstance(packed, str):
        return pickle.loads(packed.encode("latin-1"))
    return pickle.loads(packed)
