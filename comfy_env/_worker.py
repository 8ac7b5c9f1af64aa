"""``Worker``: the handle a caller uses to run functions in one env.

A handle names an env in a pool; it holds no process. Every call leases one of the env's slots,
so a handle never points at a dead worker: after a crash the next call simply lands on the
fresh generation. ``generation`` is the latest generation spawned for the env and ``pid`` the
env's first slot's, as of now.

Data flow: ``Worker`` holds the pool (typed as the ``ExchangeSite`` its calls need, a
``_callsite.CallSite``) and the env's ``EnvEntry`` (``_entry``). Each call is its own object
(``_exchange.Exchange``), run by the call's module with no frame of the pool's: ``call``/``run``
try the common call first (``_exchange.run_plain``), else prepare the call and run it
(``run_prepared``); ``submit``: the call prepared now, run on the ``Call``'s thread;
``call_ref``/``arun_ref``: ``_refs.call_ref``; ``acall``/``arun``: ``_acall.arun``. It never
imports ``_pool``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import _lifecycle as lc
from ._callsite import GENERAL_PATH
from ._codec import check_target
from ._errors import ArgumentError, CallCancelled
from ._exchange import Exchange, run_plain, run_prepared
from ._refs import call_ref
from ._settings import check_timeout

if TYPE_CHECKING:
    from collections.abc import Iterable
    from concurrent.futures import Future

    from ._call import Call, CallEvent
    from ._entry import EnvEntry
    from ._exchange import ExchangeSite
    from ._refs import RemoteRef
    from ._stats import EnvStats


# The asyncio side (``_acall``, and asyncio itself: about 30 ms to import) loads with the first
# async call, not with the pool: a program that never awaits a call never pays for it.
_acall: ModuleType | None = None


def _load_acall() -> ModuleType:
    global _acall
    from . import _acall as module

    _acall = module
    return module


def call_arguments(
    args: Any, kwargs: Any, timeout: Any = None, on_event: object = None
) -> tuple[tuple[Any, ...], dict[str, Any], float | None]:
    """``run``'s (``submit``'s, ``arun``'s, ``arun_ref``'s) inputs checked before anything
    runs: ``args`` and ``kwargs`` as the tuple and the (copied) dict a call sends, and the
    ``timeout`` in seconds (``_settings.check_timeout``; the call's object takes it checked),
    or ``ArgumentError`` naming what is wrong (``on_event`` too: ``check_on_event``).

    ``args`` is any iterable of positional arguments (a tuple, a list) except a string, bytes
    or a mapping: ``run(f, "abc")`` would send three characters and ``run(f, {"a": 1})`` its
    keys, never what was meant. ``kwargs`` is None or a mapping whose keys are strings (the
    worker would fail the call later with a plain ``TypeError``)."""
    if type(args) is not tuple:
        if isinstance(args, (str, bytes, bytearray, Mapping)):
            hint = "keyword arguments go in kwargs" if isinstance(args, Mapping) else None
            raise ArgumentError(
                f"args must be a tuple or list of positional arguments, not "
                f"{type(args).__name__} ({hint or 'for one argument write (value,)'})"
            )
        try:
            items = iter(args)
        except TypeError:
            raise ArgumentError(
                f"args must be a tuple or list of positional arguments, not "
                f"{type(args).__name__} (for one argument write (value,))"
            ) from None
        args = tuple(items)
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, Mapping):
        raise ArgumentError(
            f"kwargs must be a mapping of argument names to values (a dict) or None, "
            f"not {type(kwargs).__name__}"
        )
    else:
        kwargs = dict(kwargs)
        for name in kwargs:
            if type(name) is not str:
                raise ArgumentError(
                    f"kwargs keys must be argument names (strings), not "
                    f"{type(name).__name__} {name!r}"
                )
    if timeout is not None:
        timeout = check_timeout(timeout)
    if on_event is not None:
        check_on_event(on_event)
    return args, kwargs, timeout


def check_on_event(on_event: object) -> None:
    """``ArgumentError`` unless ``on_event`` is None or a plain callable. An ``async def``
    (or an object whose ``__call__`` is one) is refused: calling it only makes a coroutine,
    which nothing would await, so every event would be lost without a word. Events are
    delivered synchronously, in order, before the result; a callback that must await can
    hand each event on (``loop.create_task``, ``queue.put_nowait``)."""
    if on_event is None:
        return
    check_plain_callable(on_event, "on_event", " or None")


def check_plain_callable(fn: object, what: str, alternative: str = "") -> None:
    """``ArgumentError`` naming ``what`` unless ``fn`` is a plain (not ``async def``)
    callable: a callback the pool calls and does not await (``on_event``, a ``subscribe``
    callback, a reap hook). Refused when it is given, not when the first event finds out."""
    if not callable(fn):
        raise ArgumentError(f"{what} must be a callable{alternative}, not {type(fn).__name__}")
    import inspect

    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        type(fn).__call__  # an instance whose __call__ is an async def
    ):
        raise ArgumentError(
            f"{what} must be a plain function, not a coroutine function ({fn!r}): "
            "it is called synchronously and a coroutine would never be awaited; "
            "from a plain callback, schedule the work (loop.create_task(handle(ev)))"
        )


class Worker:
    """Runs calls in one env of a pool. Obtain with ``Pool.get_worker`` or
    ``comfy_env.get_worker``; cheap to create, safe to share between threads."""

    __slots__ = ("_entry", "_pool")

    def __init__(self, pool: ExchangeSite, entry: EnvEntry) -> None:
        self._pool = pool
        self._entry = entry

    @property
    def env(self) -> str:
        """The env key (the env directory)."""
        return self._entry.spec.key

    @property
    def interpreter(self) -> str:
        """The interpreter path that is launched for this env."""
        return self._entry.spec.interpreter

    @property
    def generation(self) -> int:
        """The latest generation spawned for this env; 0 before the first spawn."""
        return self._entry.generation

    @property
    def pid(self) -> int | None:
        """The interpreter pid of the env's first worker if it is live, else None."""
        state = self._entry.slots[0].state
        if isinstance(state, (lc.Idle, lc.InCall)):
            return state.pid
        return None

    def stats(self) -> EnvStats:
        """A frozen snapshot of this env's counters."""
        return self._entry.snapshot(self._pool.clock(), self._pool.settings.restart_window)

    def call(self, target: str | Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``target(*args, **kwargs)`` in a worker and return its result.

        ``target`` is ``"package.module:function"`` (imported in the worker) or a callable
        (by reference when importable by name, else by value with cloudpickle, which needs the
        same Python major.minor in the env). Uses ``PoolConfig.call_timeout``.
        """
        if type(target) is str:  # the common call first, in a straight line
            result = run_plain(self._pool, self._entry, target, args, kwargs)
            if result is not GENERAL_PATH:
                return result
        pool = self._pool
        return run_prepared(pool, Exchange(pool, self._entry).prepare(target, args, kwargs))

    def run(
        self,
        target: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        on_event: Callable[[CallEvent], object] | None = None,
    ) -> Any:
        """Explicit form of ``call`` with a per-call total deadline in seconds (queue wait
        included; None: ``PoolConfig.call_timeout``). ``on_event`` receives the call's
        ``CallEvent``s (``comfy_env_worker.progress``/``emit`` in the worker) on this thread,
        in order, before the result is returned; it must be a plain callable (an ``async def``
        raises ``ArgumentError``). Ctrl-C while waiting asks the worker to stop
        the call (killed after ``PoolConfig.cancel_grace``), then raises ``KeyboardInterrupt``.
        """
        args, kwargs, timeout = call_arguments(args, kwargs, timeout, on_event)
        if timeout is None and on_event is None and type(target) is str:
            result = run_plain(self._pool, self._entry, target, args, kwargs)
            if result is not GENERAL_PATH:
                return result
        call = Exchange(self._pool, self._entry).prepare(target, args, kwargs, timeout)
        call.on_event = on_event
        return run_prepared(self._pool, call)

    def submit(
        self,
        target: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        on_event: Callable[[CallEvent], object] | None = None,
    ) -> Call:
        """Start ``run(target, args, kwargs, timeout=..., on_event=...)`` and return a
        ``Call`` at once (a ``concurrent.futures.Future``-like handle; ``call.cancel()``
        cancels it queued or running). Bad input raises here, before anything runs.
        ``on_event`` runs on the call's own thread."""
        from ._call import Call

        pool, entry = self._pool, self._entry
        args, kwargs, timeout = call_arguments(args, kwargs, timeout, on_event)
        exchange = Exchange(pool, entry).prepare(target, args, kwargs, timeout)  # bad input raises
        exchange.on_event = on_event
        call = Call(entry.spec.key, exchange, exchange.cancel)
        call._start(lambda: run_prepared(pool, exchange))
        return call

    def start(
        self, preload: Iterable[str] | str = (), *, timeout: float | None = None
    ) -> Future[Worker]:
        """Start this env's worker in the background (spawn, handshake, canary) and import the
        ``preload`` modules in it (e.g. ``("bpy",)``); return at once a
        ``concurrent.futures.Future`` whose result is this ``Worker`` once the worker is ready
        with the modules imported. A call made meanwhile waits for the start and runs on the
        warmed worker. A failure is the error a call would get (``ImportError``,
        ``WorkerCrashed``, ``CallTimeout``, ...), raised by ``future.result()``. ``timeout``:
        deadline of the start and the imports, in seconds (None: ``PoolConfig.call_timeout``).
        Bad ``preload`` names or ``timeout`` raise ``ArgumentError`` here."""
        from ._start import describe, module_names, start_in_background

        names = module_names(preload)
        return start_in_background(lambda: self, names, timeout, describe(self.env))

    def call_ref(self, target: str | Callable[..., Any], /, *args: Any, **kwargs: Any) -> RemoteRef:
        """Run ``target(*args, **kwargs)`` and keep the result alive inside the worker; return
        a ``RemoteRef`` to it. Pass the ref as an argument to later calls (it resolves to the
        live object there) or use ``ref.call_method``; ``ref.release()`` frees it. Once the
        worker's generation is gone, using the ref raises ``StaleGenerationError``."""
        return call_ref(Exchange(self._pool, self._entry), target, args, kwargs)

    async def arun_ref(
        self,
        target: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        on_event: Callable[[CallEvent], object] | None = None,
    ) -> RemoteRef:
        """``call_ref`` for asyncio, with ``arun``'s deadline, events and cancellation. The call
        runs on a thread of its own (never the loop's default executor); ``on_event`` runs on
        that thread. Cancelling the task removes a queued call or asks the worker to stop a
        running one (killed after ``PoolConfig.cancel_grace``; a second cancellation kills at
        once), waits for the call's end, and raises ``CancelledError``; nothing is kept (a
        result that crossed the cancel is released)."""
        import asyncio

        pool, entry = self._pool, self._entry
        # Checked here, before the thread starts, so bad input raises in the awaiting task.
        args, kwargs, timeout = call_arguments(args, kwargs, timeout, on_event)
        check_target(target)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[RemoteRef] = loop.create_future()
        ticket = Exchange(pool, entry)  # kept here to cancel it
        ticket.on_event = on_event

        def settle(outcome: Any, failed: bool) -> None:
            if done.done():
                return
            if failed:
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

        def body() -> None:
            ref: RemoteRef | None = None
            outcome: Any
            try:
                ref = call_ref(ticket, target, args, kwargs, timeout)
                outcome, failed = ref, False
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                outcome, failed = exc, True
            try:
                loop.call_soon_threadsafe(settle, outcome, failed)
            except RuntimeError:  # the loop is closed: nobody awaits the ref any more
                if ref is not None:
                    ref.release()

        threading.Thread(target=body, name="comfy-env-call-ref", daemon=True).start()
        cancels = (_acall or _load_acall())._Cancels()  # (as arun counts them)
        while True:
            try:
                ref = await asyncio.shield(done)
            except asyncio.CancelledError as exc:
                ticket.cancel(force=cancels.add(exc))
                continue
            except BaseException as exc:
                if cancels:
                    raise cancels.error() from (exc if isinstance(exc, CallCancelled) else None)
                raise
            if cancels:
                await loop.run_in_executor(None, ref.release)
                raise cancels.error()
            return ref

    async def acall(self, target: str | Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``call`` for asyncio; see ``arun``."""
        acall = _acall or _load_acall()
        return await acall.arun(Exchange(self._pool, self._entry), target, args, kwargs, None)

    async def arun(
        self,
        target: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,
        on_event: Callable[[CallEvent], object] | None = None,
    ) -> Any:
        """``run`` for asyncio, native: a queued call waits on a future (no thread), a warm
        call is sent and read on the event loop, ``on_event`` runs on the loop. The deadline
        starts now and holds while queued, while a worker starts and while the call runs.
        Cancelling the task removes a queued call, or asks the worker to stop a running one
        (killed after ``PoolConfig.cancel_grace``; a second cancellation kills at once) and
        raises ``CancelledError`` once the call has ended: ``asyncio.wait_for`` or
        ``asyncio.timeout`` around it can overrun by up to ``cancel_grace``, while ``timeout``
        is a strict deadline (the worker is stopped at once). ``on_event`` must be a plain
        callable (an ``async def`` raises ``ArgumentError``)."""
        args, kwargs, timeout = call_arguments(args, kwargs, timeout, on_event)
        acall = _acall or _load_acall()
        call = Exchange(self._pool, self._entry)
        call.on_event = on_event
        return await acall.arun(call, target, args, kwargs, timeout)

    def __repr__(self) -> str:
        return f"<comfy_env.Worker env={self.env!r} generation={self.generation} pid={self.pid}>"
