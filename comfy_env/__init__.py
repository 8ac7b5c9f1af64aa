"""comfy-env: run functions in long-lived, crash-isolated worker processes, one per env.

Quick use::

    import comfy_env
    w = comfy_env.get_worker("/path/to/venv")        # nothing is spawned yet
    w.call("numpy:add", 1, 2)                        # spawns, verifies, calls
    w.run("pkg.mod:slow", (x,), timeout=5.0)         # per-call deadline

Importing this package starts no thread, registers no atexit handler and touches no file; all of
that happens when a pool is first used.
"""

from __future__ import annotations

import _thread
import os

from ._errors import (
    ArgumentError,
    ArgumentImportError,
    ArgumentModuleNotFound,
    CallCancelled,
    CallTimeout,
    ComfyEnvError,
    ConfigError,
    EnvAbandonedError,
    EnvBuildError,
    EnvError,
    HostResourceError,
    PoolClosedError,
    ProtocolError,
    RefReleasedError,
    RemoteError,
    RemoteTraceback,
    RuntimeRootError,
    SerializationError,
    StaleGenerationError,
    WorkerCrashed,
    WorkerError,
    WorkerOutOfMemory,
    WorkerStartError,
)

# Not ``typing.TYPE_CHECKING``: typing is a large import, and neither this package nor
# ``comfy-env status`` needs it at run time (``Any`` and the lazy names are for the checker).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from concurrent.futures import Future
    from typing import Any

    from ._build import build_env
    from ._call import Call, CallEvent
    from ._config import PoolConfig
    from ._envs import EnvSpec, resolve_env
    from ._events import (
        EnvAbandoned,
        EnvReset,
        ShmSwept,
        WorkerReady,
        WorkerRetired,
        WorkerSpawned,
    )
    from ._executor import Executor
    from ._pool import Pool
    from ._recipe import CudaWheels, Recipe
    from ._refs import RemoteRef
    from ._stats import EnvStats, WorkerStats
    from ._sweep import SweepReport, sweep
    from ._worker import Worker

# Public names whose modules are imported on first access (module ``__getattr__``): importing
# the package costs only the error classes; pydantic, psutil and the pool's machinery load
# when a program first uses them (a ComfyUI server imports this once per isolated pack, and
# the CLI on every command).
_LAZY = {
    "Call": "._call",
    "CallEvent": "._call",
    "PoolConfig": "._config",
    "EnvSpec": "._envs",
    "resolve_env": "._envs",
    "EnvAbandoned": "._events",
    "EnvReset": "._events",
    "ShmSwept": "._events",
    "WorkerReady": "._events",
    "WorkerRetired": "._events",
    "WorkerSpawned": "._events",
    "Pool": "._pool",
    "Recipe": "._recipe",
    "CudaWheels": "._recipe",
    "build_env": "._build",
    "RemoteRef": "._refs",
    "EnvStats": "._stats",
    "Executor": "._executor",
    "WorkerStats": "._stats",
    "SweepReport": "._sweep",
    "sweep": "._sweep",
    "Worker": "._worker",
}


def __getattr__(name: str) -> Any:
    import importlib

    module = _LAZY.get(name)
    if module is None:
        if name.startswith("_") and not name.startswith("__"):
            # A private submodule not imported yet (``comfy_env._pool``, as tests and tools
            # spell it): import it, as eager imports used to.
            try:
                return importlib.import_module(f".{name}", __name__)
            except ModuleNotFoundError:
                pass
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentImportError",
    "ArgumentModuleNotFound",
    "Call",
    "CallCancelled",
    "CallEvent",
    "CallTimeout",
    "ComfyEnvError",
    "ConfigError",
    "CudaWheels",
    "EnvAbandoned",
    "EnvAbandonedError",
    "EnvBuildError",
    "EnvError",
    "EnvReset",
    "EnvSpec",
    "EnvStats",
    "Executor",
    "HostResourceError",
    "Pool",
    "PoolClosedError",
    "PoolConfig",
    "ProtocolError",
    "Recipe",
    "RefReleasedError",
    "RemoteError",
    "RemoteRef",
    "RemoteTraceback",
    "RuntimeRootError",
    "SerializationError",
    "ShmSwept",
    "StaleGenerationError",
    "SweepReport",
    "Worker",
    "WorkerCrashed",
    "WorkerError",
    "WorkerOutOfMemory",
    "WorkerReady",
    "WorkerRetired",
    "WorkerSpawned",
    "WorkerStartError",
    "WorkerStats",
    "build_env",
    "default_pool",
    "get_worker",
    "resolve_env",
    "shutdown",
    "start",
    "sweep",
]

_default_pool: Pool | None = None
_default_lock = _thread.allocate_lock()  # (not threading's: a lighter import)
_fork_hook_installed = False


def _reset_default_after_fork() -> None:
    # The inherited default pool is inert in the child (see Pool); the child's first
    # get_worker() builds its own. The lock may have been held by a thread that is gone.
    global _default_pool, _default_lock
    _default_pool = None
    _default_lock = _thread.allocate_lock()


def default_pool() -> Pool:
    """The process-wide pool behind ``get_worker``, created (from ``COMFY_ENV_*`` settings) on
    first use. After ``shutdown()`` the next use creates a fresh one."""
    global _default_pool, _fork_hook_installed
    with _default_lock:
        if _default_pool is None or _default_pool.closed:
            if not _fork_hook_installed and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_reset_default_after_fork)
                _fork_hook_installed = True
            from ._pool import Pool

            # No PoolConfig here: a pool of defaults does not load pydantic (see _settings);
            # COMFY_ENV_* settings are still read and checked when one is set.
            _default_pool = Pool()
        return _default_pool


def get_worker(env: str | os.PathLike[str] | Recipe | None = None) -> Worker:
    """A handle on ``env`` (None: the current interpreter; a ``Recipe``: its env, built on
    first use) in the default pool. Spawns nothing; the first call does. Raises ``EnvError`` if
    the env has no interpreter (``EnvBuildError`` if a recipe's build failed)."""
    return default_pool().get_worker(env)


def start(
    *envs: str | os.PathLike[str] | Recipe | None,
    preload: Iterable[str] | str = (),
    timeout: float | None = None,
) -> list[Future[Worker]]:
    """Start ``envs``' workers in the default pool in the background and import ``preload`` in
    each (``Pool.start``); returns one ``Future[Worker]`` per env (no env: the current
    interpreter). A call made meanwhile waits for the start."""
    return default_pool().start(*envs, preload=preload, timeout=timeout)


def shutdown() -> None:
    """Close the default pool (it also closes at interpreter exit)."""
    global _default_pool
    with _default_lock:
        pool, _default_pool = _default_pool, None
    if pool is not None:
        pool.close()
