"""``Executor``: a ``concurrent.futures.Executor`` whose calls run in one env's workers.

Code written against ``concurrent.futures`` switches with one line::

    with ProcessPoolExecutor(max_workers=4) as ex:        # before
    with comfy_env.Executor(env, max_workers=4) as ex:    # after

Data flow (the same picture as ``concurrent.futures.thread``, with the work done in a worker
process instead of on the thread)::

    caller thread                  dispatcher thread (at most max_workers)   worker process
    -------------                  ---------------------------------------   --------------
    submit(fn, *args):             queue.get()
      Future(); queue.put(item)    future.set_running_or_notify_cancel()
      start a dispatcher if none   Worker.call(target, *args) -- leases a --> runs fn(*args)
      is idle and fewer than          slot of the private Pool, writes the
      max_workers run                 request, reads the reply itself
      return future                future.set_result / set_exception
                                   (done callbacks run here)

**The private pool.** Each ``Executor`` owns a ``Pool`` whose env allows ``max_workers``
worker processes (``PoolConfig.max_workers_per_env``), so ``max_workers`` means processes, as
in ``ProcessPoolExecutor``, and ``shutdown()`` has one meaning: the executor's workers stop,
and no other code's calls (the default pool's, another executor's) are touched. Workers start
on first use, one per dispatcher that needs one.

**Dispatchers.** A dispatcher thread is a caller like any other: it takes the pool's sync hot
path (the request written and the reply read on its own thread), so there is no thread per
call and no hand-off between the dispatcher and the channel. ``max_workers`` dispatchers can
keep ``max_workers`` workers busy; they are started lazily, as ``ThreadPoolExecutor`` starts
its threads.

**Races this prevents**:
- a future cancelled while queued never runs: a dispatcher calls
  ``set_running_or_notify_cancel()`` before sending anything, and skips a cancelled one; once
  that returns True the future is running and ``cancel()`` returns False, as documented.
- submit racing shutdown: both take ``_lock``; a submit that loses raises ``RuntimeError``, one
  that wins has its item in the queue ahead of the shutdown sentinel, so it runs (or is
  cancelled by ``cancel_futures=True``, which drains the queue under the same lock).
- a crash: the worker's death fails the call that was running on it with ``WorkerCrashed``;
  the pool starts a fresh worker for the next call, so later futures run (where
  ``ProcessPoolExecutor`` marks itself broken and fails every pending future).
- shutdown(wait=False): the last dispatcher to leave closes the pool, so the workers stop
  once the queued calls are done, and never under a running call.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from comfy_env_worker.shm import SCALARS
from comfy_env_worker.tasks import pack, unpack

from ._codec import reference_name

if TYPE_CHECKING:
    from ._config import PoolConfig
    from ._pool import Pool
    from ._recipe import Recipe
    from ._worker import Worker

_T = TypeVar("_T")

# The worker-side helper that runs a chunk of ``map`` in one call (stdlib, in every env).
STARMAP_TARGET = "comfy_env_worker.tasks:starmap"

# ``PoolConfig.spin_wait`` is 0 in an executor's pool unless the config (or this variable)
# sets it: a dispatcher polling for its reply holds the GIL between polls, against the caller
# reading results and the other dispatchers, and takes a CPU the workers need. Measured with
# bench_executor.py (2 CPUs, 2 workers, 10,000 items): map 1.3-1.9x faster without polling at
# chunksize 1 and 100 (benchmarks/README.md, the lead's RESULTS.md).
_SPIN_WAIT_VARIABLE = "COMFY_ENV_SPIN_WAIT"

# A queued item: the future and what to call. ``None`` on the queue is the shutdown sentinel.
_Item = tuple[
    "concurrent.futures.Future[Any]", "str | Callable[..., Any]", tuple[Any, ...], dict[str, Any]
]

# Executors not shut down yet, woken at interpreter exit (see ``_at_exit``).
_live: weakref.WeakSet[Executor] = weakref.WeakSet()
_exit_hook_installed = False
_exit_hook_lock = threading.Lock()


def _at_exit() -> None:
    """At interpreter exit, before non-daemon threads are joined (``threading``'s own exit
    hooks, which ``ThreadPoolExecutor`` uses too): let every executor's dispatchers run out
    the queue and leave, instead of waiting on it forever."""
    for executor in list(_live):
        executor.shutdown(wait=False)


def _install_exit_hook() -> None:
    global _exit_hook_installed
    with _exit_hook_lock:
        if _exit_hook_installed:
            return
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_at_exit)
        else:  # pragma: no cover - CPython has had it since 3.9
            import atexit

            atexit.register(_at_exit)
        _exit_hook_installed = True


def _max_workers(max_workers: object) -> int:
    if max_workers is None:
        return max(1, min(os.cpu_count() or 1, 256))
    if isinstance(max_workers, bool) or not isinstance(max_workers, int):
        from ._errors import ArgumentError

        raise ArgumentError(f"max_workers must be an int or None, not {max_workers!r}")
    if not 1 <= max_workers <= 256:
        from ._errors import ArgumentError

        # (ValueError, as ProcessPoolExecutor raises; 256 is PoolConfig.max_workers_per_env's
        # bound.)
        raise ArgumentError(f"max_workers must be between 1 and 256, not {max_workers}")
    return max_workers


def _wire_target(fn: str | Callable[..., Any]) -> str | Callable[..., Any]:
    """What a call sends for ``fn``: its ``"module:name"`` when it can be found by that name
    (the worker imports it once and caches it; and a string takes the pool's straight-line
    path), else the callable itself (by value, as ``Worker.call`` sends it)."""
    if type(fn) is str:
        return fn
    if not callable(fn):
        from ._errors import ArgumentError

        raise ArgumentError(
            f"fn must be a callable or a 'module:function' string, not {type(fn).__name__}"
        )
    return reference_name(fn) or fn


def _chunks(iterables: tuple[Iterable[Any], ...], size: int) -> Iterator[list[Any]]:
    """``size`` items at a time: the values of the one iterable, or tuples of the values of
    several (``zip``: the shortest ends them)."""
    items: Iterator[Any] = (
        iter(iterables[0]) if len(iterables) == 1 else zip(*iterables, strict=False)
    )
    while chunk := list(itertools.islice(items, size)):
        yield chunk


def _chunk_payload(chunk: list[Any], star: bool) -> str | bytes | list[Any]:
    """What a chunk travels as: packed (one C-speed pickle, as a latin-1 ``str`` when small,
    see ``comfy_env_worker.tasks.pack``) when every value is a scalar, where the call path
    would scan every item for buffers and refs (about half the cost of a chunk of 100 small
    items, measured); else the list itself, so arrays and large buffers in it take the call
    path's shared memory, version-neutral arrays and refs."""
    if star:
        for args in chunk:
            for value in args:
                if type(value) not in SCALARS:
                    return chunk
    else:
        for value in chunk:
            if type(value) not in SCALARS:
                return chunk
    return pack(chunk)


def _chunk_results(reply: Any) -> list[Any]:
    # ``starmap`` packs scalar results (a str, bytes, or a buffer if it came out of band).
    return reply if isinstance(reply, list) else unpack(reply)


def _result_or_cancel(future: concurrent.futures.Future[_T], timeout: float | None = None) -> _T:
    # (concurrent.futures' own helper: a future given up on by map is cancelled.)
    try:
        return future.result(timeout)
    finally:
        future.cancel()


class Executor(concurrent.futures.Executor):
    """A ``concurrent.futures.Executor`` that runs each call in a worker process of ``env``.

    ``env``: None (the current interpreter), an env directory, an interpreter path or a
    ``Recipe``, as ``get_worker`` takes it. ``max_workers``: worker processes (default: the
    CPU count). ``config``: the ``PoolConfig`` of the executor's own pool (``sys_path``,
    ``env_vars``, ``call_timeout``, ...); its ``max_workers_per_env`` is replaced by
    ``max_workers``.

    Callables travel as ``Worker.call`` sends them: by reference when importable by name
    (across Python versions), else by value with cloudpickle (same Python major.minor only;
    ``SerializationError`` otherwise); ``"module:function"`` strings work too. A function that
    raises fails its future with the same exception; a worker that crashes fails only the
    future it was running with ``WorkerCrashed``, and the next call gets a fresh worker."""

    def __init__(
        self,
        env: str | os.PathLike[str] | Recipe | None = None,
        max_workers: int | None = None,
        *,
        config: PoolConfig | None = None,
    ) -> None:
        from ._config import PoolConfig
        from ._pool import Pool

        self._max_workers = _max_workers(max_workers)
        base = config if config is not None else PoolConfig()
        if not isinstance(base, PoolConfig):
            from ._errors import ArgumentError

            raise ArgumentError(f"config must be a PoolConfig or None, not {type(base).__name__}")
        update: dict[str, Any] = {"max_workers_per_env": self._max_workers}
        if "spin_wait" not in base.model_fields_set and not os.environ.get(_SPIN_WAIT_VARIABLE):
            update["spin_wait"] = 0.0  # see _SPIN_WAIT_VARIABLE
        self._pool: Pool = Pool(base.model_copy(update=update))
        try:
            self._worker: Worker = self._pool.get_worker(env)
        except BaseException:
            self._pool.close()
            raise
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Semaphore(0)  # one release per dispatcher waiting for work
        self._threads: set[threading.Thread] = set()
        self._shutdown = False
        _install_exit_hook()
        _live.add(self)

    @property
    def env(self) -> str:
        """The env key of the executor's workers."""
        return self._worker.env

    @property
    def pool(self) -> Pool:
        """The executor's own pool (``stats()``, ``subscribe``); closed by ``shutdown``."""
        return self._pool

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        """Schedule ``fn(*args, **kwargs)`` in a worker; returns a ``Future``. ``fn`` is a
        callable or a ``"module:function"`` string. ``RuntimeError`` after ``shutdown``."""
        return self._submit(_wire_target(fn), args, kwargs)

    def _submit(
        self, target: str | Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queue.put((future, target, args, kwargs))
            self._adjust_dispatchers()
        return future

    def _adjust_dispatchers(self) -> None:
        # (Under _lock.) An idle dispatcher takes the item; else start one, up to max_workers.
        if self._idle.acquire(blocking=False):
            return
        if len(self._threads) < self._max_workers:
            thread = threading.Thread(
                target=self._dispatch, name=f"comfy-env-executor-{len(self._threads)}"
            )
            self._threads.add(thread)
            thread.start()

    def _dispatch(self) -> None:
        worker, get, get_nowait, idle = (
            self._worker,
            self._queue.get,
            self._queue.get_nowait,
            self._idle,
        )
        try:
            while True:
                try:
                    item = get_nowait()
                except queue.Empty:
                    # About to wait: a submit may count on this dispatcher instead of starting
                    # one. (Said only here, not after every call: a busy map saves the
                    # semaphore's lock and notify per item. Counted loosely, as
                    # ThreadPoolExecutor counts: at worst a dispatcher fewer starts.)
                    idle.release()
                    item = get()
                if item is None:
                    self._queue.put(None)  # wake the next dispatcher too
                    return
                future, target, args, kwargs = item
                del item
                if future.set_running_or_notify_cancel():
                    try:
                        result = worker.call(target, *args, **kwargs)
                    except BaseException as exc:  # noqa: BLE001 - the future's outcome
                        future.set_exception(exc)
                        del exc
                    else:
                        future.set_result(result)
                        del result
                # (Dropped before waiting: a result must not live on in an idle dispatcher.)
                del future, target, args, kwargs
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())
                last = not self._threads and self._shutdown
            if last:
                self._pool.close()

    def map(
        self,
        fn: Callable[..., _T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
    ) -> Iterator[_T]:
        """``map(fn, *iterables)`` run in the workers, results in order, as
        ``concurrent.futures.Executor.map``: every call is submitted now; the iterator raises
        ``TimeoutError`` if a result is not ready ``timeout`` seconds after this call, and
        cancels the calls not yet run when it is given up or closed. ``chunksize`` items go
        in one call (as ``ProcessPoolExecutor`` batches them): far fewer round trips for many
        small items; an exception then ends its chunk and is raised at the chunk's first item."""
        if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        end_time = None if timeout is None else timeout + time.monotonic()
        target = _wire_target(fn)
        if chunksize == 1 or not iterables:  # (no iterables: no calls, as concurrent.futures)
            fs = [self._submit(target, args, {}) for args in zip(*iterables, strict=False)]
        else:
            star = len(iterables) > 1
            fs = [
                self._submit(STARMAP_TARGET, (target, _chunk_payload(c, star), star), {})
                for c in _chunks(iterables, chunksize)
            ]
        return self._results(fs, end_time, chunksize > 1)

    @staticmethod
    def _results(
        fs: list[concurrent.futures.Future[Any]], end_time: float | None, chunked: bool
    ) -> Iterator[Any]:
        # A generator apart from map, so that map submits everything at once (as
        # concurrent.futures does), not at the first next().
        try:
            fs.reverse()  # popped from the end: each result is dropped once yielded
            while fs:
                if end_time is None:
                    outcome = _result_or_cancel(fs.pop())
                else:
                    outcome = _result_or_cancel(fs.pop(), end_time - time.monotonic())
                if chunked:
                    yield from _chunk_results(outcome)
                else:
                    yield outcome
        finally:
            for future in fs:
                future.cancel()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls; ``cancel_futures``: cancel the queued ones (they never run);
        ``wait``: return once the calls left have run and the workers are stopped (without
        ``wait`` that happens in the background). Idempotent."""
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            self._queue.put(None)
            threads = list(self._threads)
        _live.discard(self)
        if not threads:
            self._pool.close()  # (no dispatcher will: none runs)
            return
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()
            self._pool.close()

    def __repr__(self) -> str:
        state = "shut down" if self._shutdown else f"{len(self._threads)} dispatchers"
        return f"<comfy_env.Executor env={self.env!r} max_workers={self._max_workers} {state}>"
