"""The pool: the public API (``Pool``); it holds the env entries and wires the call's parts.

Data flow of one call (its own ``_exchange.Exchange``, run by ``_exchange``: a ``Worker``
enters it directly, a ``RemoteRef`` through ``Pool.call``; the pool holds what it uses)::

    caller thread                                   reactor thread (one per pool)
    ------------------------------------------      ------------------------------
    prepare: encode (pickle) -- bad input raises here
    lease a slot (FIFO; wait if all are leased)
    [slot empty or retired] spawn generation g+1:
        backend.new_generation -> launch ->          pidfd readable: reap, gate(Exited)
        handshake + canary (caller reads)            pipes readable: output tail + logging
    gate(CallStarted) -> send CALL frame
    read REPLY frame (deadline) -> open it -> decode
    settle: gate(Replied), release the slot (hand it to the next waiter) -> return or raise

The caller writes its request and reads its reply itself: no thread hand-off on the hot path.

The common call (a target string, scalar arguments, an idle worker ready, nobody waiting)
takes the same steps in a straight line (``Worker.call`` -> ``_exchange.run_plain``):
``Exchange.start_plain`` encodes, leases and applies ``CallStarted`` in one lock section, then
the call runs as any other (``Exchange.run``), so whatever it meets is answered by the general
path's rules in the same object. It declines before anything is counted when the call needs
more.

Where the rest lives (each module's docstring draws its part)::

    _entry      EnvEntry, Slot, Ticket, the gate (the only writer of state), stats
                snapshots: backend-agnostic, imports no other part of the pool
    _lease      FIFO leasing and the call counters: lease_now/acquire, leave_queue,
                settle/settle_ok, cancel (the only writer of a call's stage and counters)
    _exchange   Exchange, one call's own object: prepare, start (checks, CallStarted),
                send, read (LOG/EVENT frames, the Ctrl-C drain), open the reply, decode,
                settle; the errors of a broken exchange; its two ways in (``run_plain``,
                the common call; ``run_prepared``, any prepared call, also ``Pool.call``'s)
    _spawner    Spawner: a generation's birth (reactor and runtime dir on first use,
                activation, launch, handshake) and the report of its end (WorkerRetired,
                the breaker); the reaper's timer; the lock-free wake-up of the release of
                dropped refs (``refs_dropped``); disposing of retired workers later
    _status     StatusThrottle: the status file kept current, throttled, on the reactor
    _callsite   CallSite: what Worker, RemoteRef and the asyncio path (_acall) may ask of
                the pool; they import it, never this module
    _policies   idle reaper, health ping, crash-loop breaker (and ``set_breaker``/``reset``'s
                bookkeeping), dropped-ref release (on the reactor, woken lock-free by
                ``Spawner.refs_dropped``): they decide with ``_lifecycle`` and act through
                the gate
    _config     PoolConfig, and ``configure``'s checks and writes (``configure_env``)
    _start      ``start``: the warm starts, one thread per env
    _failures   the errors a broken call ends with (crash, timeout, protocol, abandoned)
    _shutdown   close (``stop_pool``): stop every worker with shared deadlines; pools at
                exit; after fork (``abandon_pool``)
    _backend    Backend/WorkerGeneration: what starts, talks to and stops one generation

**Races this prevents**:
- worker dies while idle: the reactor's ``Exited`` retires it; the next caller finds the slot
  retired and spawns g+1 *before* sending, so it never sees the dead worker. If the death lands
  between the check and the send, the send fails with EPIPE before a byte went out, and the call
  moves to a fresh worker (it was never sent, so this is not a replay).
- worker dies mid-call: the caller's read sees EOF; the call fails with ``WorkerCrashed`` after
  a bounded wait for the exit status (so the message can name the signal). The call is never
  replayed. Whoever retires first (reader's ``ChannelClosed`` or reactor's ``Exited``) wins; the
  other is dropped as terminal.
- a complete reply followed by death: the reply is in the socket buffer and is read and returned.
- deadline: the caller applies ``DeadlineHit`` for its own (generation, call id); the kill
  effect shuts the channel down and signals the process group.
- cancellation (``Call.cancel``, a cancelled ``arun`` task, Ctrl-C): any thread applies
  ``CancelRequested`` for the call's (generation, call id); its ``SendCancel`` effect writes a
  CANCEL frame on the cancel pipe (never the channel, which only the lease holder touches) and
  arms a grace timer on the reactor. The lease holder keeps reading: a reply within the grace
  (``CallCancelled`` raised in the worker, or a result that crossed the cancel) moves the slot
  back to ``Idle`` in the same generation; otherwise ``CancelGraceExpired`` kills the worker
  and the reader sees EOF. Both events name the call id, so a late cancel or a late timer of
  call N is dropped when call N+1 runs; the call is settled (and counted) once, by its caller.
- a burst of Ctrl-C (``_interrupts``): a worker's start holds Ctrl-C back from ``SpawnBegan``
  to its outcome except in its waits, so no interrupt leaves a slot starting with no start in
  progress; a sync call leases inside the ``try`` whose safety net (``settle_interrupted``)
  settles it, held, whatever its own path left undone; for a few seconds after a Ctrl-C,
  calls hold it back across their bookkeeping too. A slot stuck starting all the same is
  shown (``WorkerStats.stuck``) and retired by ``reset`` and the reaper.
- close during a spawn: the reactor refuses to fork once the pool is closing, and ``close`` first
  runs a barrier on the reactor, so every process that was forked is known and gets killed.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _lifecycle as lc
from . import _policies, _shutdown
from ._backend import Backend, WorkerGeneration, backend_for
from ._codec import oob_threshold
from ._entry import EnvEntry, Slot
from ._envs import EnvSpec, resolve_env, same_interpreter
from ._errors import (
    EnvError,
    PoolClosedError,
)
from ._events import (
    Dispatcher,
    EnvReset,
    Event,
)
from ._exchange import Exchange, run_prepared
from ._reactor import Reactor
from ._settings import Settings, environment_overrides, warn_unknown_variables
from ._spawner import Spawner
from ._stats import CALL_COUNTERS, EnvStats
from ._status import Snapshot, StatusThrottle, host_publisher

# Imported with the pool, not on first use: a first call made when the host is out of
# descriptors must fail as WorkerStartError, not as an import's EMFILE.
from ._worker import Worker, check_plain_callable

if TYPE_CHECKING:
    from collections.abc import Iterable
    from concurrent.futures import Future

    from ._callsite import PendingCall
    from ._config import PoolConfig
    from ._exchange import ReportDeath
    from ._recipe import Recipe
    from ._sweep import SweepReport

_log = logging.getLogger("comfy_env")

# ---- the pool --------------------------------------------------------------------------------


_UNSET = object()  # (no value: a setting an env's own settings do not hold yet)


class Pool:
    """Workers keyed by env. Create with a ``PoolConfig``; use as a context manager or call
    ``close()``. Workers spawn lazily, on an env's first call.

    The methods that take an ``EnvEntry`` (``call``, ``prepare``, ``settle``, ``cancel``,
    ...) and ``clock``/``call_ids`` are the ``_callsite.CallSite`` that ``Worker``,
    ``RemoteRef`` and the asyncio path use; they are not for users."""

    def __init__(
        self, config: PoolConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``clock`` (monotonic seconds) times idleness, the reaper and the breaker; tests
        inject a fake one. Call deadlines always use real time."""
        # Validated again (``model_copy`` skips pydantic's checks); the defaults need neither
        # pydantic nor a model: the pool runs on plain Settings (see _settings).
        self.settings: Settings
        self._config: PoolConfig | None
        if config is None and not environment_overrides():
            # The environment is read here too: a misspelled variable must not pass unseen
            # (PoolConfig warns the same way when it reads the environment).
            warn_unknown_variables()
            self.settings, self._config = Settings(), None
        else:
            from ._config import settings_for

            self.settings, self._config = settings_for(config)
        self.oob_threshold = oob_threshold(self.settings.shm_threshold_bytes)  # once, not per call
        self.backend: Backend = backend_for(self.settings)
        self.clock = clock
        self.events = Dispatcher()
        self._reap_hooks = _policies.ReapHooks()  # see add_reap_hook
        self._lock = threading.Lock()
        self._entries: dict[str, EnvEntry] = {}
        self.closed = False  # (read it; close() sets it. A plain attribute: read on every call)
        self._close_done = threading.Event()
        # Starts generations and reports their ends; holds the reactor and the runtime dir.
        self._spawner = Spawner(self, self._lock, self._entries)
        self.report_death: ReportDeath = self._spawner.report_death  # (ExchangeSite: no hop)
        self.dispose_later = self._spawner.dispose_later  # (CallSite: one call, no hop)
        self.call_ids = itertools.count(2)  # call id 1 is the canary's
        self._owner_pid = os.getpid()
        # Keeps this host's status file current (throttled); on every call's end.
        throttle = StatusThrottle(live_pool_snapshots, self._spawner.status_timer)
        self.status_changed = throttle.changed
        self._registration = _shutdown.register(self)
        _shutdown.install_process_hooks()

    # ---- public API ----

    def get_worker(self, env: str | os.PathLike[str] | Recipe | None = None) -> Worker:
        """A handle on ``env``'s workers (None: the current interpreter; a ``Recipe``: its
        env, built first if it was not yet). Spawns nothing."""
        entry = self._entry(resolve_env(env))
        own = getattr(env, "settings", None) if type(env).__name__ == "Recipe" else None
        if own and any(entry.own_settings.get(k, _UNSET) != v for k, v in own.items()):
            self.configure(entry.spec.key, **own)  # a recipe's own settings, once per change
        return Worker(self, entry)

    def start(
        self,
        *envs: str | os.PathLike[str] | Recipe | None,
        preload: Iterable[str] | str = (),
        timeout: float | None = None,
    ) -> list[Future[Worker]]:
        """Start each env's worker in the background, side by side, and import ``preload`` in
        each (``Worker.start``); no env: the current interpreter. A ``Recipe`` is built first,
        on the start's thread (its failure is an ``EnvBuildError`` from ``result()``); an env
        path that does not resolve raises ``EnvError`` here, as ``get_worker``. Returns
        one ``concurrent.futures.Future`` per env, in order, whose result is the env's
        ``Worker``; ``concurrent.futures.wait`` waits for several."""
        from ._start import start_envs

        return start_envs(self, envs, preload, timeout)

    def subscribe(self, callback: Callable[[Event], object]) -> Callable[[], None]:
        """Deliver lifecycle events (``WorkerSpawned``, ``WorkerReady``, ``WorkerRetired``,
        ``EnvAbandoned``, ``EnvReset``, ``ShmSwept``) to ``callback``, in order, on the pool's
        event thread, outside every pool lock. Returns a function that unsubscribes."""
        if self.closed:
            raise self.closed_error()
        check_plain_callable(callback, "a subscribe callback")
        return self.events.subscribe(callback)

    def add_reap_hook(self, hook: Callable[[str, int], object]) -> Callable[[], None]:
        """Call ``hook(env, generation)`` before the idle reaper skips an expired worker because
        it holds live RemoteRefs (``reap_with_refs`` False). A hook lets go of what it holds in
        that generation (``RemoteRef.discard()``, no call to the worker); when no live ref is
        left afterwards, the worker is retired now. Refs of owners without a hook keep the
        worker as before. A hook that raises is logged. Hooks run on the reaper's thread (the
        reactor, or the caller of ``reap_idle``) outside every pool lock: keep them short and do
        not call workers from them. A call that starts meanwhile keeps the worker (the reaper's
        decision names the ``idle_since`` it saw). Returns a function that removes the hook."""
        check_plain_callable(hook, "a reap hook")
        return self._reap_hooks.add(hook)

    def reset(self, env: str | os.PathLike[str] | None = None) -> None:
        """Bring an env the crash-loop breaker abandoned back into service (no-op otherwise);
        also forget that its Python was found too old (it may have been replaced), and retire
        a slot stuck starting with no start in progress (``WorkerStats.stuck``), so the next
        call starts a fresh worker there."""
        entry = self._entry(resolve_env(env))
        if entry.recover_stuck():
            self.status_changed()
        if _policies.reset_env(entry):
            self.events.emit(EnvReset(entry.spec.key))

    def set_breaker(
        self,
        env: str | os.PathLike[str] | None = None,
        *,
        max_restarts: int | None = None,
        restart_window: float | None = None,
        abandon_for: float | None = None,
    ) -> None:
        """Give ``env`` crash-loop breaker settings of its own, in place of the pool's
        ``PoolConfig.max_restarts``, ``restart_window`` and ``abandon_for`` (each argument left
        None keeps the pool's value). They count from the next death; deaths already counted
        stay, an abandonment in force keeps its end. ``comfy_env.comfyui.isolate`` uses it for a
        pack's own settings. Raises ``ArgumentError`` for a value ``PoolConfig`` would refuse."""
        breaker = _policies.breaker_for(self.settings, max_restarts, restart_window, abandon_for)
        entry = self._entry(resolve_env(env))
        with entry.lock:
            entry.breaker = breaker

    def configure(
        self, env: str | os.PathLike[str] | Recipe | None = None, **settings: Any
    ) -> None:
        """Give ``env`` settings of its own, in place of the pool's: ``env_vars`` (added to the
        pool's, the env's winning), ``call_timeout``, ``cancel_grace``, ``idle_timeout``,
        ``memory_limit``, ``max_restarts``, ``restart_window``, ``abandon_for``, with the
        meanings of ``PoolConfig``'s fields (None is a value here: ``call_timeout=None`` is no
        deadline for this env). A later call adds to what an earlier one gave. Bad values are a
        ``ConfigError`` naming the field, as in ``PoolConfig``, and change nothing; a field an
        env cannot set (the channel, shared memory, the backend: the pool's) is an
        ``ArgumentError``. The env's next calls take the new deadlines and grace; workers
        started from now on take the variables and the memory limit (running ones keep theirs:
        ``retire_idle(env)`` replaces idle ones now); the breaker counts from the next death.
        ``stats()[env].settings`` shows what the env runs with."""
        from ._config import configure_env

        configure_env(self._entry(resolve_env(env)), self.settings, settings)
        reactor = self._spawner.reactor
        if "idle_timeout" in settings and reactor is not None:
            reactor.call_later(0, self._spawner.reschedule_reaper)

    def retire_idle(self, env: str | os.PathLike[str] | None = None) -> int:
        """Retire ``env``'s idle workers now instead of after ``idle_timeout`` (None: the
        current interpreter's env); returns how many. For a worker nobody will call again soon
        (``comfy_env.comfyui`` retires the worker of a pack whose scan failed). Workers in a
        call, leased by a caller or holding live ``RemoteRef`` s are kept; retired ones count in
        ``reaped`` with retire reason ``idle``, and the env's next call spawns a fresh one."""
        if self.closed:
            raise self.closed_error()
        with self._lock:
            entry = self._entries.get(resolve_env(env).key)
        if entry is None:
            return 0
        return _policies.retire_idle(entry, self.clock())

    def stats(self) -> dict[str, EnvStats]:
        """Frozen per-env snapshots, keyed by env key."""
        with self._lock:
            entries = list(self._entries.values())
        now, window = self.clock(), self.settings.restart_window
        return {e.spec.key: e.snapshot(now, window) for e in entries}

    @property
    def config(self) -> PoolConfig:
        """The pool's ``PoolConfig``: the one given (checked), or, for a pool that took the
        defaults, one holding them, built on first read (pydantic loads then)."""
        config = self._config
        if config is None:
            from ._config import config_of_defaults

            # Two threads reading at once may both build one: equal values, one is kept.
            config = self._config = config_of_defaults()
        return config

    @property
    def last_sweep(self) -> SweepReport | None:
        """What the pool's start-up sweep removed (None until it ran)."""
        return self._spawner.last_sweep

    def entries(self) -> list[EnvEntry]:
        """The env entries as of now (a copy: one may be added meanwhile)."""
        with self._lock:
            return list(self._entries.values())

    def closed_error(self) -> PoolClosedError:
        """The error of a call to this pool once it is closed (or inherited by fork)."""
        if self._owner_pid != os.getpid():
            return PoolClosedError(
                f"this Pool belongs to process {self._owner_pid} and was inherited by fork into "
                f"process {os.getpid()}, where it owns no workers; create a new Pool here "
                "(comfy_env.get_worker() starts a fresh default pool in a forked child)"
            )
        return PoolClosedError("the pool is closed")

    def close(self) -> None:
        """Stop every worker (in parallel, one bounded wait), then refuse further calls.

        Queued calls fail with ``PoolClosedError``; calls running on a worker fail with
        ``PoolClosedError`` as their worker is stopped. Idempotent and thread-safe."""
        with self._lock:
            if self.closed:
                first = False
            else:
                self.closed = True
                first = True
            entries = list(self._entries.values())
            reactor = self._spawner.reactor
        if not first:
            self._close_done.wait(self.settings.close_timeout + 10.0)
            return
        try:
            self._stop_everything(entries, reactor)
        finally:
            _shutdown.live_pools.discard(self._registration)
            self._close_done.set()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<comfy_env.Pool {state} envs={len(self._entries)}>"

    # ---- entries and leasing ----

    def _entry(self, spec: EnvSpec) -> EnvEntry:
        with self._lock:
            if self.closed:
                raise self.closed_error()
            entry = self._entries.get(spec.key)
            if entry is None:
                entry = EnvEntry(spec, self.settings.max_workers_per_env, self.settings)
                entry.call_later = self._call_later
                entry.refs_dropped = self._spawner.refs_dropped
                self._entries[spec.key] = entry
            elif entry.spec.interpreter != spec.interpreter and not same_interpreter(
                entry.spec.interpreter, spec.interpreter
            ):  # (the same spelling, the common case, costs no realpath)
                # Never hand out an entry that runs another interpreter than the one asked
                # for (the env changed on disk since, or two spellings met on one key).
                raise EnvError(
                    f"env {spec.key} is already in this pool with the interpreter "
                    f"{entry.spec.interpreter}, which is not {spec.interpreter} (the env "
                    "changed on disk?); a new Pool starts it afresh",
                    env=spec.key,
                    tried=(spec.interpreter,),
                )
            return entry

    def _call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the reactor after ``delay`` seconds (a running call implies a
        reactor); if the pool is closing, its workers are being stopped anyway."""
        reactor = self._spawner.reactor
        if reactor is not None and reactor.running:
            reactor.call_later(delay, fn)

    # ---- the call: its own object and module (``_exchange``) ----

    def exchange(self, entry: EnvEntry) -> Exchange:
        """A new call of ``entry``, nothing prepared yet (a handle keeps it as its ticket)."""
        return Exchange(self, entry)

    def call(self, prepared: PendingCall) -> Any:
        """A prepared call (``exchange(entry).prepare(...)``) to its end: leased (waiting in
        the queue), run, settled once (``_exchange.run_prepared``)."""
        return run_prepared(self, prepared)

    def live_process(self, entry: EnvEntry, slot: Slot) -> WorkerGeneration:
        """The slot's verified process, spawning generation g+1 if the slot is empty or retired."""
        state = slot.state
        if isinstance(state, lc.Idle) and slot.process is not None:
            return slot.process
        return self._spawner.spawn(entry, slot)

    def reap_idle(self, now: float | None = None) -> int:
        """Retire workers idle longer than ``idle_timeout`` (the reaper runs this on a timer;
        ``now`` defaults to the pool's clock). Returns how many were retired.

        The decision and its application happen under the env's lock, and the decision names
        the ``idle_since`` it observed, so a worker that ran a call in between (or is leased by
        a caller right now) is never reaped. A ``now`` that is no finite number is an
        ``ArgumentError`` (NaN compared as "idle long enough" for every worker)."""
        at = _policies.reap_time(now, self.clock)
        return _policies.reap_idle(self.entries(), at, self.settings, self._reap_hooks)

    # ---- shutdown ----

    def abandon_in_forked_child(self) -> None:
        """In a forked child: close inherited descriptors, signal nothing, own nothing (the
        fork hook of ``_shutdown`` calls it; not for users)."""
        self.closed = True
        self._lock = self._spawner.lock = threading.Lock()
        self._close_done.set()
        _shutdown.abandon_pool(self._spawner, list(self._entries.values()))

    def _stop_everything(self, entries: list[EnvEntry], reactor: Reactor | None) -> None:
        _shutdown.stop_pool(self._spawner, entries, reactor)
        if reactor is None:
            self.events.close()
            return
        try:
            # Without this pool (the file goes with the last pool). A status directory that
            # cannot be written is a warning, never raised: the close must end.
            host_publisher(live_pool_snapshots).publish_or_warn()
        finally:
            self.events.close()


# ---- status snapshots (written by _status's publisher) -----------------------------------


def snapshot_pool(pool: Pool) -> Snapshot:
    """A JSON-able description of one pool: per env the interpreter, counters and per-slot
    workers (pid, generation, state, idle or busy since when, start-up seconds).

    Reads ``pool.stats()`` (which locks each entry briefly) and, read-only, each entry's spec,
    slot states and the pool's clock (idle and busy times are kept on it; they are converted to
    wall time here). Must not be called with one of the pool's locks held."""
    # Lifecycle times come from the pool's clock (monotonic unless a test injected another).
    clock = pool.clock
    now_wall = time.time()
    now_mono = clock()

    def wall(mono: Any) -> float | None:
        if isinstance(mono, (int, float)) and not isinstance(mono, bool):
            return round(now_wall - (now_mono - float(mono)), 3)
        return None

    stats = pool.stats()
    entries = dict(pool._entries)  # a copy: the dict may grow while we read it
    envs: list[Snapshot] = []
    for key, env_stats in stats.items():
        entry = entries.get(key)
        interpreter = entry.spec.interpreter if entry is not None else None
        workers: list[Snapshot] = []
        for ws in env_stats.workers:
            # The slot's lifecycle state as of now; its times count only if it is still the
            # generation the stats describe.
            state: Any = None
            if entry is not None and ws.slot < len(entry.slots):
                state = entry.slots[ws.slot].state
            same = state is not None and getattr(state, "generation", None) == ws.generation
            workers.append(
                {
                    "slot": ws.slot,
                    "pid": ws.pid,
                    "generation": ws.generation,
                    "state": ws.state,
                    "retire_reason": ws.retire_reason,
                    "startup_seconds": ws.startup_seconds,
                    "stuck": ws.stuck,
                    "idle_since": wall(getattr(state, "idle_since", None)) if same else None,
                    "busy_since": wall(getattr(state, "started_at", None)) if same else None,
                }
            )
        env: Snapshot = {"env": key, "interpreter": interpreter, "generation": env_stats.generation}
        for name in CALL_COUNTERS:
            env[name] = getattr(env_stats, name)
        env["workers"] = workers
        if entry is not None and entry.own_settings:
            env["settings"] = own_settings_shown(entry.settings, entry.own_settings)
        envs.append(env)
    return {"pool": f"{id(pool):x}", "envs": envs}


def own_settings_shown(settings: Settings, own: dict[str, Any]) -> dict[str, Any]:
    """An env's own settings as the status file shows them: the effective value of each field
    the env set, ``env_vars`` by name only (their values may be secrets; the status file is
    readable by the user's other processes)."""
    shown: dict[str, Any] = {}
    for name in sorted(own):
        value = getattr(settings, name)
        shown[name] = sorted(own[name]) if name == "env_vars" else value
    return shown


def live_pool_snapshots() -> list[Snapshot]:
    """Snapshots of every open pool of this process (the default pool included)."""
    for _ in range(3):
        try:
            pools = [registration.pool for registration in list(_shutdown.live_pools)]
            break
        except RuntimeError:  # another thread created a pool while we listed them
            continue
    else:  # pragma: no cover
        return []
    # The registry holds every live pool (typed by what the exit and fork hooks need).
    return [snapshot_pool(p) for p in pools if isinstance(p, Pool) and not p.closed]
