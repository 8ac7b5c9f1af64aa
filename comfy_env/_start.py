"""Warm starts: a worker spawned, verified and its heavy modules imported before the first call.

The first real call to an env otherwise pays the worker's start and the env's heavy imports
(``bpy`` or OpenCASCADE: seconds). ``start`` moves that cost off the caller's path::

    Worker.start(preload=("bpy",), timeout=None)        (returns at once)
    Pool.start(env, ..., preload=..., timeout=None)     (one start per env, side by side)
      -> a concurrent.futures.Future[Worker], and a thread "comfy-env-start" per env:
           [a Recipe: build_env, as get_worker(recipe) would]
           worker.run("comfy_env_worker.tasks:preload", (names, host_has_numpy), timeout=timeout)
             (spawns, handshakes and canaries a worker if none is live, then imports the
              modules on the worker's main thread, as a call would)
           future.set_result(worker)  or  future.set_exception(the call's own error)

The preload is an ordinary call, so it takes no new path through the pool and every rule of a
call holds for it: a call made meanwhile waits in the env's queue for the slot the preload
holds (a worker serves one call at a time), so it never pays the start twice and runs on the
warmed worker; a preload that fails (a module that does not import: ``ImportError`` as the
worker raised it; a crash: ``WorkerCrashed``; a failed build: ``EnvBuildError``; a deadline:
``CallTimeout``; ``close()``: ``PoolClosedError``) is the error a call would have got, raised
where the caller waits (``future.result()``), and the next call starts a fresh worker as after
any failed call. Modules stay imported for the worker's life; a replacement worker (after a
crash, an idle reap) starts cold unless started again.

The threads are daemons: a start still running at interpreter exit is ended by the pool's
close (its call gets ``PoolClosedError``), not waited for.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ._errors import ArgumentError
from ._settings import check_timeout

if TYPE_CHECKING:
    from ._recipe import Recipe

PRELOAD_TARGET = "comfy_env_worker.tasks:preload"


class _Runs(Protocol):
    """What a start needs of a worker handle (``Worker``; not imported: ``_worker`` imports
    this module)."""

    def run(
        self, target: str, args: tuple[Any, ...] = ..., *, timeout: float | None = ...
    ) -> Any: ...


W = TypeVar("W", bound=_Runs)


def module_names(preload: Iterable[str] | str) -> tuple[str, ...]:
    """``preload`` as a tuple of dotted module names (one ``str`` is one name); anything else is
    an ``ArgumentError`` naming the bad entry, raised before anything starts."""
    names = (preload,) if isinstance(preload, str) else preload
    try:
        names = tuple(names)
    except TypeError:
        raise ArgumentError(
            f"preload must be module names (a str or an iterable of str), "
            f"not {type(preload).__name__}"
        ) from None
    for name in names:
        if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
            raise ArgumentError(
                f"preload: {name!r} is not a module name (dotted identifiers, e.g. 'bpy' or "
                f"'OCP.TopoDS')"
            )
    return names


def start_in_background(
    open_worker: Callable[[], W], names: tuple[str, ...], timeout: object, what: str
) -> Future[W]:
    """Run ``open_worker()`` (which may build an env) and the preload call on a daemon thread;
    return the future of the ready worker. A bad ``timeout`` is an ``ArgumentError`` here."""
    seconds = check_timeout(timeout)
    future: Future[W] = Future()
    future.set_running_or_notify_cancel()

    def body() -> None:
        try:
            worker = open_worker()
            # (numpy loaded in the host: the reply warms both ends' array codec; see preload)
            host_has_numpy = "numpy" in sys.modules
            worker.run(PRELOAD_TARGET, (names, host_has_numpy), timeout=seconds)
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the waiter
            future.set_exception(exc)
        else:
            future.set_result(worker)

    threading.Thread(target=body, name=f"comfy-env-start {what}", daemon=True).start()
    return future


def describe(env: str | os.PathLike[str] | Recipe | None) -> str:
    """A short name of ``env`` for the start thread's name."""
    if env is None:
        return "(this interpreter)"
    if isinstance(env, (str, os.PathLike)):
        return os.path.basename(os.fspath(env).rstrip("/")) or os.fspath(env)
    return "recipe"


class _Opens(Protocol):
    """What ``start_envs`` needs of a pool (``Pool``; not imported: the pool imports this
    module on ``start``)."""

    @property
    def closed(self) -> bool: ...

    def closed_error(self) -> Exception: ...

    def get_worker(self, env: str | os.PathLike[str] | Recipe | None = None) -> Any: ...


def start_envs(
    pool: _Opens,
    envs: tuple[str | os.PathLike[str] | Recipe | None, ...],
    preload: Iterable[str] | str,
    timeout: float | None,
) -> list[Future[Any]]:
    """``Pool.start``: one background start per env (None: the current interpreter), in
    order. A recipe is built on its start's thread; anything else resolves here, so an env
    path that does not resolve raises ``EnvError`` at once, as ``get_worker``."""
    names = module_names(preload)
    if pool.closed:
        raise pool.closed_error()
    starts = []
    for env in envs or (None,):
        # (By name, as resolve_env: the recipe machinery loads only in programs that use it.)
        if type(env).__name__ == "Recipe" and not isinstance(env, (str, os.PathLike)):
            open_worker: Callable[[], Any] = functools.partial(pool.get_worker, env)
        else:
            open_worker = functools.partial(_same, pool.get_worker(env))
        starts.append(start_in_background(open_worker, names, timeout, describe(env)))
    return starts


def _same(worker: W) -> W:
    return worker
