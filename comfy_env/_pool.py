"""The pool: env entries, slots, FIFO leasing, and the gate that is the only writer of state.

Data flow of one call (``Pool.call``)::

    caller thread                                   reactor thread (one per pool)
    ------------------------------------------      ------------------------------
    encode (pickle) -- bad input raises here
    lease a slot (FIFO; wait if all are leased)
    [slot empty or retired] spawn generation g+1:
        launch --run_sync--> Popen, watch pidfd ->   pidfd readable: reap, gate(Exited)
        handshake + canary (caller reads)            pipes readable: output tail + logging
    gate(CallStarted) -> send CALL frame
    read REPLY frame (deadline) -> gate(Replied)
    release the slot (hand it to the next waiter) -> decode -> return or raise

The caller writes its request and reads its reply itself: no thread hand-off on the hot path.

**The gate** (``_EnvEntry.apply``) applies an event to a slot under the entry's lock using the
pure ``_lifecycle.step``, and returns the effects (kill) that the caller then runs *outside* the
lock. Nothing else assigns ``slot.state``. Events are tagged with the generation they are about,
so a late exit notice of generation g, a late deadline decision or a late frame cannot touch
generation g+1: ``step`` drops them and the gate counts them (``stale_events_dropped``).

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
- close during a spawn: the reactor refuses to fork once the pool is closing, and ``close`` first
  runs a barrier on the reactor, so every process that was forked is known and gets killed.

A channel socket is closed (``dispose``) only by the slot's lease holder, or by the gate when no
one holds the lease, so a descriptor is never closed under a thread that still reads it.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from comfy_env_worker.protocol import (
    HEADER_SIZE,
    ChannelClosed,
    FrameError,
    FrameType,
    Payload,
)
from comfy_env_worker.shm import Block

from . import _lifecycle as lc
from ._backend import Backend, backend_for
from ._call import EventCallback, event_handler
from ._codec import decode_reply, encode_call, oob_threshold, target_label, use_shm
from ._envs import EnvSpec, resolve_env
from ._errors import (
    CallCancelled,
    CallTimeout,
    EnvAbandonedError,
    HostResourceError,
    PoolClosedError,
    ProtocolError,
    SerializationError,
    StaleGenerationError,
    WorkerCrashed,
    WorkerStartError,
    describe_exit,
    signal_name,
)
from ._events import (
    Dispatcher,
    EnvAbandoned,
    EnvReset,
    Event,
    ShmSwept,
    WorkerReady,
    WorkerRetired,
    WorkerSpawned,
)
from ._identity import host_id
from ._process import HOST_ID_VAR, WorkerProcess, make_runtime_dir, python_mismatch
from ._reactor import Reactor, TimerHandle
from ._refs import RemoteRef, released_error
from ._settings import Settings, check_timeout, settings_for
from ._stats import CALL_COUNTERS, EnvStats, WorkerStats
from ._status import Snapshot, host_publisher
from ._watcher import HostWatcher

# Imported with the pool, not on first use: a first call made when the host is out of
# descriptors must fail as WorkerStartError, not as an import's EMFILE.
from ._worker import Worker

if TYPE_CHECKING:
    from ._config import PoolConfig
    from ._sweep import SweepReport

_log = logging.getLogger("comfy_env")


class _NotDelivered(Exception):
    """The worker died without reading the request: the call may run on a fresh worker."""


_STATE_NAMES: dict[type, str] = {
    lc.Starting: "starting",
    lc.Idle: "idle",
    lc.InCall: "in_call",
    lc.Retired: "retired",
}

# ---- slots, tickets, entries ----------------------------------------------------------------


class _Slot:
    __slots__ = ("index", "leased", "live_refs", "process", "state")

    def __init__(self, index: int) -> None:
        self.index = index
        self.state: lc.State | None = None
        self.process: WorkerProcess | None = None  # the process of state.generation
        self.leased = False
        self.live_refs: set[int] = set()  # RemoteRef ids kept by this generation's worker


class _Ticket:
    """One call's place in the pool: queued, then holding a slot; cancellable from any thread.

    The fields are class-level defaults (all immutable), so a ticket costs one allocation and
    only the fields a call actually sets: the common call sets about five."""

    event: threading.Event | None = None
    waker: Callable[[], None] | None = None  # wakes a waiter that is not a thread
    woken: Any = None  # the asyncio future an async waiter awaits (see _acall)
    on_event: EventCallback | None = None  # the caller's callback
    sink: Callable[[int, Any], None] | None = None  # EVENT frames of the current call
    interrupted = False  # Ctrl-C during the call; the worker stopped it in time
    slot: _Slot | None = None
    wanted: _Slot | None = None  # the one slot this call must run on (it uses a RemoteRef)
    bound_generation = 0  # ... and the generation that must still occupy it
    ran_on: _Slot | None = None  # the slot the call was sent to
    started: WorkerProcess | None = None  # started in _acquire, not sent yet
    stage = "new"  # "queued" -> "in_flight" -> "done"
    generation = 0
    call_id = 0
    cancelled = False
    closed = False

    def __init__(self, wanted: _Slot | None = None) -> None:
        if wanted is not None:
            self.wanted = wanted

    def wake(self) -> None:
        """The waiter's slot was handed over, or it must give up (closed, cancelled)."""
        if self.waker is not None:
            self.waker()
        elif self.event is not None:
            self.event.set()


def _no_timer(delay: float, fn: Callable[[], None]) -> None:
    raise AssertionError("a cancel's grace timer needs the pool's reactor")


class _EnvEntry:
    """An env's slots, waiters and counters. Its lock guards all of them."""

    def __init__(self, spec: EnvSpec, max_workers: int) -> None:
        self.spec = spec
        self.lock = threading.Lock()
        self.slots = [_Slot(i) for i in range(max_workers)]
        self.waiters: deque[_Ticket] = deque()
        self.generation = 0  # last generation handed out in this env
        self.submitted = 0
        self.ok = 0
        self.raised = 0
        self.crashed = 0
        self.timed_out = 0
        self.cancelled = 0
        self.failed = 0
        self.in_flight = 0
        self.queued = 0
        self.spawns = 0
        self.stale_events_dropped = 0
        self.reaped = 0
        self.pings = 0
        self.ping_failures = 0
        self.env_state: lc.EnvState = lc.EnvActive()  # the crash-loop breaker
        self.log_lines_dropped = 0  # of processes no longer in a slot
        self.unsupported: WorkerStartError | None = None  # its Python can never run a worker
        # RemoteRefs garbage-collected since the last call: (slot, generation, id). Appended
        # without the lock (from __del__), drained under it.
        self.dropped_refs: deque[tuple[_Slot, int, int]] = deque()
        # Runs a function on the pool's reactor after a delay (the cancel grace timers).
        self.call_later: Callable[[float, Callable[[], None]], object] = _no_timer

    # ---- the gate ----

    def apply_locked(self, slot: _Slot, event: lc.Event) -> tuple[lc.Effect, ...] | None:
        """Apply ``event`` to ``slot`` (lock held). Returns the effects to run after unlocking,
        or None if the event was dropped."""
        result = lc.step(slot.state, event)
        if isinstance(result, lc.Dropped):
            self.stale_events_dropped += 1
            return None
        slot.state = result.state
        if isinstance(result.state, lc.Retired):
            process = slot.process
            if process is not None and process.generation == result.state.generation:
                process.retire_reason = result.state.reason
            slot.live_refs.clear()  # they died with this generation
        return result.effects

    def apply(self, slot: _Slot, event: lc.Event) -> bool:
        """Apply ``event`` and run its effects. True if it changed the slot's state."""
        with self.lock:
            effects = self.apply_locked(slot, event)
            process = slot.process
            leased = slot.leased
            dispose = not leased and isinstance(slot.state, lc.Retired)
        if effects is None:
            return False
        run_effects(effects, process, leased, self, slot)
        if dispose and process is not None:
            process.dispose()
        return True

    def arm_grace(self, slot: _Slot, effect: lc.SendCancel) -> None:
        """After the grace, the gate decides: the call still running is killed; a call that
        ended (or any other call) is left alone, since the event names call id and request."""
        expired = lc.CancelGraceExpired(effect.generation, effect.call_id, effect.requested_at)

        def fire() -> None:
            self.apply(slot, expired)

        self.call_later(effect.grace, fire)

    def snapshot(self) -> EnvStats:
        with self.lock:
            workers = tuple(_worker_stats(s) for s in self.slots)
            primary = workers[0]
            return EnvStats(
                env=self.spec.key,
                generation=self.generation,
                pid=primary.pid,
                state=primary.state,
                submitted=self.submitted,
                ok=self.ok,
                raised=self.raised,
                crashed=self.crashed,
                timed_out=self.timed_out,
                cancelled=self.cancelled,
                failed=self.failed,
                in_flight=self.in_flight,
                queued=self.queued,
                spawns=self.spawns,
                stale_events_dropped=self.stale_events_dropped,
                workers=workers,
                reaped=self.reaped,
                pings=self.pings,
                ping_failures=self.ping_failures,
                restarts_in_window=len(self.env_state.deaths),
                live_refs=sum(w.live_refs for w in workers),
                abandoned=isinstance(self.env_state, lc.EnvAbandoned),
                log_lines_dropped=self.log_lines_dropped
                + sum(s.process.log.dropped for s in self.slots if s.process is not None),
                shared_memory=primary.shared_memory,
            )


def _worker_stats(slot: _Slot) -> WorkerStats:
    state = slot.state
    if state is None:
        return WorkerStats(slot.index, 0, None, "empty", None, None)
    pid = None if isinstance(state, (lc.Starting, lc.Retired)) else state.pid
    reason = state.reason.value if isinstance(state, lc.Retired) else None
    startup = slot.process.startup_seconds if slot.process is not None else None
    idle_since = state.idle_since if isinstance(state, lc.Idle) else None
    return WorkerStats(
        slot.index,
        state.generation,
        pid,
        _STATE_NAMES[type(state)],
        reason,
        startup,
        idle_since,
        len(slot.live_refs),
        slot.process.shm_state if slot.process is not None else None,
    )


def run_effects(
    effects: tuple[lc.Effect, ...],
    process: WorkerProcess | None,
    leased: bool,
    entry: _EnvEntry | None = None,
    slot: _Slot | None = None,
) -> None:
    """Run the gate's effects (outside the lock). Asking a worker to leave means writing on
    its channel, which only the lease holder may do: a leased slot's worker is terminated
    instead. A cancel goes on the cancel pipe, which any thread may write."""
    for effect in effects:
        if isinstance(effect, lc.SendCancel):
            if process is not None and process.generation == effect.generation:
                process.send_cancel(effect.call_id)
            if entry is not None and slot is not None:
                entry.arm_grace(slot, effect)
        elif isinstance(effect, lc.KillWorker):
            if process is not None and process.generation == effect.generation:
                stop = effect.stop
                if stop is lc.Stop.ASK and leased:
                    stop = lc.Stop.TERMINATE
                process.kill(stop)


# ---- the pool --------------------------------------------------------------------------------


_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()
_hooks_lock = threading.Lock()
_hooks_installed = False


def _install_process_hooks() -> None:
    """Once, when the first pool is created (never at import): close pools at interpreter
    exit, and make every pool inert in a child created by ``fork``."""
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        import atexit

        atexit.register(_close_all_pools)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
        _hooks_installed = True


def _close_all_pools() -> None:
    for pool in list(_live_pools):
        try:
            pool.close()
        except Exception:  # noqa: BLE001 - exit must go on
            _log.exception("comfy-env: closing a pool at exit failed")


def _after_fork_in_child() -> None:
    """Runs in the child right after ``fork``, with only the forking thread alive.

    Every inherited pool is the parent's: the child must never send on, read from, kill or
    clean up the parent's workers, and must not keep the parent's channels open (a worker only
    notices its host's death when the last copy of the host's channel end is closed). So each
    pool drops its descriptors and becomes closed; locks other threads held at the fork are
    replaced."""
    global _hooks_lock
    _hooks_lock = threading.Lock()
    for pool in list(_live_pools):
        pool._abandon_in_forked_child()
    _live_pools.clear()


def _held_refs(entry: _EnvEntry, slot: _Slot) -> set[int]:
    """The slot's refs that someone in the host still holds (entry lock held): live refs minus
    those garbage collected and queued for release (``dropped_refs``, drained before the next
    call), which must not keep an idle worker from being reaped."""
    if not slot.live_refs or not entry.dropped_refs:
        return slot.live_refs
    for _ in range(8):
        try:
            queued = tuple(entry.dropped_refs)  # appended lock-free by RemoteRef.__del__
            break
        except RuntimeError:  # a __del__ appended during the copy: look again
            continue
    else:
        return slot.live_refs
    state = slot.state
    generation = state.generation if state is not None else None
    dropped = {rid for s, g, rid in queued if s is slot and g == generation}
    return slot.live_refs - dropped


class Pool:
    """Workers keyed by env. Create with a ``PoolConfig``; use as a context manager or call
    ``close()``. Workers spawn lazily, on an env's first call."""

    def __init__(
        self, config: PoolConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``clock`` (monotonic seconds) times idleness, the reaper and the breaker; tests
        inject a fake one. Call deadlines always use real time."""
        # Validated again (``model_copy`` skips pydantic's checks); the defaults need neither
        # pydantic nor a model: the pool runs on plain Settings (see _settings).
        self._settings: Settings
        self._config: PoolConfig | None
        self._settings, self._config = settings_for(config)
        self._backend: Backend = backend_for(self._settings)
        self._clock = clock
        self._events = Dispatcher()
        # Host-side owners of RemoteRefs asked before the reaper retires a worker holding refs
        # (``add_reap_hook``). A tuple, replaced whole: the reaper reads it without a lock.
        self._reap_hooks: tuple[Callable[[str, int], object], ...] = ()
        self._reaper: TimerHandle | None = None
        self._lock = threading.Lock()
        self._entries: dict[str, _EnvEntry] = {}
        self._closed = False
        self._close_done = threading.Event()
        self._reactor: Reactor | None = None
        self._runtime_dir: str | None = None
        self._watcher: HostWatcher | None = None  # stops setsid descendants if we die
        self._processes: set[WorkerProcess] = set()  # forked and not yet reaped
        self._call_ids = itertools.count(2)  # call id 1 is the canary's
        self._owner_pid = os.getpid()
        self.last_sweep: SweepReport | None = None  # what the start-up sweep removed
        self._sweep_queued = False
        self._status_pending = False
        self._status_dirty = False  # changed while a write was pending: write again after it
        _live_pools.add(self)
        _install_process_hooks()

    # ---- public API ----

    def get_worker(self, env: str | os.PathLike[str] | None = None) -> Worker:
        """A handle on ``env``'s workers (None: the current interpreter). Spawns nothing."""
        return Worker(self, self._entry(resolve_env(env)))

    def subscribe(self, callback: Callable[[Event], object]) -> Callable[[], None]:
        """Deliver lifecycle events (``WorkerSpawned``, ``WorkerReady``, ``WorkerRetired``,
        ``EnvAbandoned``, ``EnvReset``, ``ShmSwept``) to ``callback``, in order, on the pool's
        event thread, outside every pool lock. Returns a function that unsubscribes."""
        if self._closed:
            raise self._closed_error()
        return self._events.subscribe(callback)

    def add_reap_hook(self, hook: Callable[[str, int], object]) -> Callable[[], None]:
        """Call ``hook(env, generation)`` before the idle reaper skips an expired worker because
        it holds live RemoteRefs (``reap_with_refs`` False). A hook lets go of what it holds in
        that generation (``RemoteRef.discard()``, no call to the worker); when no live ref is
        left afterwards, the worker is retired now. Refs of owners without a hook keep the
        worker as before. A hook that raises is logged. Hooks run on the reaper's thread (the
        reactor, or the caller of ``reap_idle``) outside every pool lock: keep them short and do
        not call workers from them. A call that starts meanwhile keeps the worker (the reaper's
        decision names the ``idle_since`` it saw). Returns a function that removes the hook."""
        with self._lock:
            self._reap_hooks = (*self._reap_hooks, hook)

        def remove() -> None:
            with self._lock:
                self._reap_hooks = tuple(h for h in self._reap_hooks if h is not hook)

        return remove

    def _run_reap_hooks(self, env: str, generation: int) -> bool:
        """Run the reap hooks; False if there are none (nothing can change)."""
        hooks = self._reap_hooks
        for hook in hooks:  # every hook runs: each lets go of its own refs
            try:
                hook(env, generation)
            except Exception:  # noqa: BLE001 - a hook's bug keeps the worker, never breaks the reaper
                _log.exception(
                    "comfy-env: reap hook %r failed for %s generation %d", hook, env, generation
                )
        return bool(hooks)

    def reset(self, env: str | os.PathLike[str] | None = None) -> None:
        """Bring an env the crash-loop breaker abandoned back into service (no-op otherwise);
        also forget that its Python was found too old (it may have been replaced)."""
        entry = self._entry(resolve_env(env))
        with entry.lock:
            was_abandoned = isinstance(entry.env_state, lc.EnvAbandoned)
            entry.env_state = lc.EnvActive()
            entry.unsupported = None
        if was_abandoned:
            self._events.emit(EnvReset(entry.spec.key))

    def stats(self) -> dict[str, EnvStats]:
        """Frozen per-env snapshots, keyed by env key."""
        with self._lock:
            entries = list(self._entries.values())
        return {e.spec.key: e.snapshot() for e in entries}

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
    def closed(self) -> bool:
        return self._closed

    def _closed_error(self) -> PoolClosedError:
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
            if self._closed:
                first = False
            else:
                self._closed = True
                first = True
            entries = list(self._entries.values())
            reactor = self._reactor
        if not first:
            self._close_done.wait(self._settings.close_timeout + 10.0)
            return
        try:
            self._shutdown(entries, reactor)
        finally:
            _live_pools.discard(self)
            self._close_done.set()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<comfy_env.Pool {state} envs={len(self._entries)}>"

    # ---- entries and leasing ----

    def _entry(self, spec: EnvSpec) -> _EnvEntry:
        with self._lock:
            if self._closed:
                raise self._closed_error()
            entry = self._entries.get(spec.key)
            if entry is None:
                entry = _EnvEntry(spec, self._settings.max_workers_per_env)
                entry.call_later = self._call_later
                self._entries[spec.key] = entry
            return entry

    def _call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the reactor after ``delay`` seconds (a running call implies a
        reactor); if the pool is closing, its workers are being stopped anyway."""
        reactor = self._reactor
        if reactor is not None and reactor.running:
            reactor.call_later(delay, fn)

    def _acquire(
        self, entry: _EnvEntry, ticket: _Ticket, deadline: float | None, eager: bool = False
    ) -> _Slot:
        """Lease a slot for the call (FIFO; waits while all are leased).

        ``eager``: if the slot leased at once holds a verified idle worker that needs nothing
        before the call (no ping, no refs to release, a quiet channel, deadline not passed),
        the call is also started here, in the same lock section (``CallStarted`` through the
        gate; ``ticket.started`` names the process), which saves the common call a second
        lock round and the checks ``_exchange`` would repeat. Anything unusual leaves the
        start to ``_exchange``, which runs the general checks; nothing is counted twice."""
        with entry.lock:
            if self._closed:
                raise self._closed_error()
            entry.submitted += 1
            if isinstance(entry.env_state, lc.EnvAbandoned):
                ticket.stage = "in_flight"
                entry.in_flight += 1
                raise _abandoned_error(entry.spec.key, entry.env_state)
            if ticket.cancelled:  # a submitted call cancelled before its thread got here
                ticket.stage = "in_flight"
                entry.in_flight += 1
                raise CallCancelled(
                    "the call was cancelled before it was queued", env=entry.spec.key
                )
            if not entry.waiters:
                slot = _free_slot(entry, ticket.wanted)
                if slot is not None:
                    slot.leased = True
                    ticket.slot = slot
                    ticket.stage = "in_flight"
                    entry.in_flight += 1
                    if eager and ticket.wanted is None and not entry.dropped_refs:
                        self._start_locked(entry, slot, ticket, deadline)
                    return slot
            ticket.event = threading.Event()
            ticket.stage = "queued"
            entry.queued += 1
            entry.waiters.append(ticket)
        event = ticket.event
        try:
            if deadline is None:
                event.wait()
            else:
                event.wait(max(0.0, deadline - time.monotonic()))
        except BaseException:
            self._leave_queue(entry, ticket)
            raise
        if ticket.slot is not None:
            return ticket.slot
        self._leave_queue(entry, ticket)
        if ticket.closed:
            raise PoolClosedError("the pool was closed while the call was queued")
        if ticket.cancelled:
            raise CallCancelled("the call was cancelled while queued", env=entry.spec.key)
        raise CallTimeout(
            f"the call's deadline passed while it was queued for env {entry.spec.key}",
            env=entry.spec.key,
        )

    def _start_locked(
        self, entry: _EnvEntry, slot: _Slot, ticket: _Ticket, deadline: float | None
    ) -> None:
        """The eager start of ``_acquire`` (lock held): apply ``CallStarted`` if the slot's
        idle worker can take the call as it is; else leave everything to ``_exchange``."""
        state = slot.state
        process = slot.process
        if type(state) is not lc.Idle or process is None or process.generation != state.generation:
            return
        ping_after = self._settings.ping_after_idle
        if ping_after is not None and lc.needs_ping(state, self._clock(), ping_after):
            return
        if deadline is not None and time.monotonic() >= deadline:
            return
        # One poll(2) under the lock: the idle channel must be quiet (``_exchange`` retires a
        # worker that hung up or wrote unasked, and explains it).
        if process.idle_channel_state() != "quiet":
            return
        call_id = next(self._call_ids)
        event = lc.CallStarted(state.generation, call_id, self._clock())
        if entry.apply_locked(slot, event) is None:
            return  # cannot happen (Idle of this generation); the general path decides
        ticket.generation = state.generation
        ticket.call_id = call_id
        ticket.ran_on = slot
        ticket.started = process

    def _leave_queue(self, entry: _EnvEntry, ticket: _Ticket) -> None:
        """Called by a waiter that gives up; if a slot was handed over meanwhile, pass it on."""
        with entry.lock:
            slot = ticket.slot
            if slot is None:
                try:
                    entry.waiters.remove(ticket)
                except ValueError:
                    pass
                return
            ticket.slot = None
            retired = _release_locked(entry, slot)
        if retired is not None:
            retired.dispose()

    def _settle(
        self, entry: _EnvEntry, ticket: _Ticket, outcome: str, replied: lc.Replied | None
    ) -> None:
        """End of a call, in one lock section: apply its ``Replied``, release its slot (to the
        next waiter, if any) and count its outcome."""
        retired = None
        with entry.lock:
            slot = ticket.slot
            if slot is not None:
                if replied is not None:
                    # A reply that raced a kill is still delivered (the function completed);
                    # the gate drops this late Replied if the worker was retired meanwhile.
                    entry.apply_locked(slot, replied)
                ticket.slot = None
                retired = _release_locked(entry, slot)
            stage = ticket.stage
            if stage == "queued" or stage == "in_flight":
                if stage == "queued":
                    entry.queued -= 1
                else:
                    entry.in_flight -= 1
                ticket.stage = "done"
                setattr(entry, outcome, getattr(entry, outcome) + 1)
        if retired is not None:
            self._dispose_later(retired)
        self._status_changed()

    def _dispose_later(self, process: WorkerProcess) -> None:
        """Release a retired worker's socket and shared memory on the reactor thread, off the
        caller's path (a crash report should not wait for unlinking blocks)."""
        reactor = self._reactor
        if reactor is not None and reactor.running:
            reactor.call_soon(process.dispose)
        else:
            process.dispose()

    def _cancel(self, entry: _EnvEntry, ticket: _Ticket, force: bool = False) -> None:
        """Cancel a call from any thread: unqueue it, or ask the worker running it to stop
        (``CancelRequested``: CANCEL frame, then the kill after ``cancel_grace``); ``force``
        kills at once. A call holding a slot but not sent yet (its worker is starting) sees
        the flag before it is sent."""
        with entry.lock:
            ticket.cancelled = True
            if ticket.stage == "queued" and ticket.slot is None:
                try:
                    entry.waiters.remove(ticket)
                except ValueError:
                    pass
                ticket.wake()
                return
            slot = ticket.slot
            if slot is None or ticket.call_id == 0:
                return
            event: lc.Event
            if force:
                event = lc.CallCancelled(ticket.generation, ticket.call_id)
            else:
                grace = self._settings.cancel_grace
                event = lc.CancelRequested(ticket.generation, ticket.call_id, self._clock(), grace)
        entry.apply(slot, event)

    # ---- the call ----

    def call(
        self,
        entry: _EnvEntry,
        target: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        ticket: _Ticket | None = None,
        bound: tuple[_Slot, int] | None = None,
        on_event: EventCallback | None = None,
    ) -> Any:
        if ticket is None:
            ticket = _Ticket()
        body, buffers, by_value, deadline = self._prepare(
            entry, target, args, kwargs, timeout, ticket, bound
        )
        ticket.on_event = on_event
        return self._call_prepared(entry, ticket, target, body, buffers, by_value, deadline)

    def _call_prepared(
        self,
        entry: _EnvEntry,
        ticket: _Ticket,
        target: str | Callable[..., Any],
        body: bytes,
        buffers: list[memoryview],
        by_value: bool,
        deadline: float | None,
    ) -> Any:
        try:
            slot = self._acquire(entry, ticket, deadline, not by_value)
        except BaseException as exc:
            self._settle(entry, ticket, _outcome(exc), None)
            raise
        return self._run_leased(entry, slot, ticket, target, body, buffers, by_value, deadline)

    def _prepare(
        self,
        entry: _EnvEntry,
        target: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        ticket: _Ticket,
        bound: tuple[_Slot, int] | None,
    ) -> tuple[bytes, list[memoryview], bool, float | None]:
        """Everything a call checks before it queues: pickle it (bad input raises here),
        its size, its deadline (which starts now), the RemoteRefs that bind it to a slot."""
        if self._closed:
            raise self._closed_error()
        config = self._settings
        # One scan of the arguments: a call whose arguments are all scalars (the common small
        # call) can hold no RemoteRef and no out-of-band buffer, so both checks are skipped.
        plain = _all_scalars(args, kwargs)
        if bound is None and not plain:
            bound = _bound_by_refs(entry, args, kwargs)
        threshold = config.shm_threshold_bytes
        body, buffers, by_value = encode_call(target, args, kwargs, oob_threshold(threshold), plain)
        shm_used = config.shared_memory and use_shm(buffers, threshold)
        inline = len(body) + (0 if shm_used else sum(b.nbytes for b in buffers))
        if inline + HEADER_SIZE > config.max_frame_bytes:
            raise SerializationError(
                f"the call to {target_label(target)} pickles to {inline} bytes, over "
                f"PoolConfig.max_frame_bytes={config.max_frame_bytes}"
            )
        if timeout is not None:
            timeout = check_timeout(timeout)
        if timeout is None:
            timeout = config.call_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if bound is not None:
            ticket.wanted, ticket.bound_generation = bound
            _check_bound(entry, bound[0], bound[1])
        return body, buffers, by_value, deadline

    def _run_leased(
        self,
        entry: _EnvEntry,
        slot: _Slot | None,
        ticket: _Ticket,
        target: str | Callable[..., Any],
        body: bytes,
        buffers: list[memoryview],
        by_value: bool,
        deadline: float | None,
    ) -> Any:
        """The rest of a call once it holds ``slot`` (None: acquiring failed and raised in
        the caller, who still must settle): exchange, decode, settle, count once."""
        outcome = "failed"
        replied: lc.Replied | None = None
        try:
            assert slot is not None
            ftype, reply, reply_buffers, replied = self._exchange(
                entry, slot, ticket, target, body, buffers, by_value, deadline
            )
            del buffers
            if ticket.interrupted:
                raise KeyboardInterrupt  # Ctrl-C: the worker stopped the call in time
            outcome = "raised"
            result = decode_reply(ftype, reply, target, reply_buffers)
            outcome = "ok"
            return result
        except _HostFault as fault:
            replied = fault.replied  # the worker replied whole: it goes back to idle
            raise fault.error from None
        except CallTimeout:
            outcome = "timed_out"
            raise
        except CallCancelled as exc:
            outcome = "cancelled"
            if exc.env is None:  # stopped by the worker itself: it lives on
                exc.env = entry.spec.key
                exc.generation = ticket.generation
                exc.pid = self._pid_of(slot, ticket.generation)
            raise
        except KeyboardInterrupt:
            outcome = "cancelled"
            raise
        except WorkerCrashed:
            outcome = "crashed"
            raise
        finally:
            self._settle(entry, ticket, outcome, replied)

    @staticmethod
    def _pid_of(slot: _Slot | None, generation: int) -> int | None:
        process = slot.process if slot is not None else None
        return process.pid if process is not None and process.generation == generation else None

    def _exchange(
        self,
        entry: _EnvEntry,
        slot: _Slot,
        ticket: _Ticket,
        target: str | Callable[..., Any],
        body: bytes,
        buffers: list[memoryview],
        by_value: bool,
        deadline: float | None,
    ) -> tuple[int, Payload | memoryview, list[Any] | None, lc.Replied]:
        """Send the call to the leased slot's worker (spawning one if needed) and read the reply.

        Returns the reply's type, body and out-of-band buffers (private copies; the worker has
        been told it may reuse its blocks) and the ``Replied`` event, which ``_settle``
        applies."""
        started = ticket.started
        ticket.started = None
        while True:
            if started is not None:
                # Started in ``_acquire``'s lock section (the common call): checked there.
                process, started = started, None
                call_id = ticket.call_id
                generation = process.generation
            else:
                process, call_id = self._start(entry, slot, ticket, by_value, deadline)
                if call_id == 0:
                    continue
                generation = process.generation
            if ticket.on_event is not None:
                ticket.sink = event_handler(ticket.on_event, call_id, generation)
            sent, block = self._send(entry, slot, process, call_id, target, body, buffers, deadline)
            if not sent:
                continue  # EPIPE before a byte went out: it died idle; nothing was sent
            try:
                ftype, flags, reply = self._receive(
                    entry, slot, process, ticket, call_id, target, deadline
                )
            except _NotDelivered:
                continue  # it died with our request unread: the call never ran
            replied = lc.Replied(generation, call_id, self._clock())
            if not flags and block is None:
                return ftype, reply, None, replied  # the small-call path: nothing out of band
            try:
                reply_body, reply_buffers, retained = process.open_reply(call_id, flags, reply)
            except FrameError as exc:
                raise self._protocol_error(entry, slot, process, str(exc)) from None
            except HostResourceError as exc:  # the host's fault: the worker stays, idle
                process.finish_request(block, [block.name] if block is not None else [])
                raise _HostFault(replied, exc) from None
            process.finish_request(block, retained)
            return ftype, reply_body, reply_buffers, replied

    def _start(
        self,
        entry: _EnvEntry,
        slot: _Slot,
        ticket: _Ticket,
        by_value: bool,
        deadline: float | None,
    ) -> tuple[WorkerProcess, int]:
        """The general start of a call on the leased slot: a live worker (spawned if needed),
        checked (binding, idle channel, ping, refs, Python version, deadline), then
        ``CallStarted``. Returns the process and the call id, or call id 0 if the worker was
        replaced meanwhile (the caller loops and the call goes to a fresh worker)."""
        if ticket.wanted is not None:
            _check_bound(entry, slot, ticket.bound_generation)
        process = self._live_process(entry, slot)
        channel = process.idle_channel_state()
        if channel != "quiet":
            # Died idle (EOF) or wrote bytes nobody asked for: retire it before it gets
            # the call, which then runs on a fresh worker.
            stray = lc.ChannelClosed if channel == "closed" else lc.ProtocolViolated
            entry.apply(slot, stray(process.generation))
            return process, 0
        ping_after = self._settings.ping_after_idle
        if ping_after is not None and lc.needs_ping(slot.state, self._clock(), ping_after):
            if not self._ping(entry, slot, process):
                return process, 0  # replaced through the gate; a fresh worker runs it
        if entry.dropped_refs:
            self._release_dropped_refs(entry, slot, process)
        if by_value:
            why = python_mismatch(process)
            if why is not None:
                raise SerializationError(why)
        if deadline is not None and time.monotonic() >= deadline:
            raise CallTimeout(
                f"the call's deadline passed before it reached a worker of env "
                f"{entry.spec.key} (start-up took {process.startup_seconds:.2f}s)",
                env=entry.spec.key,
                pid=process.pid,
                generation=process.generation,
            )
        call_id = next(self._call_ids)
        generation = process.generation
        with entry.lock:
            if ticket.cancelled:
                raise CallCancelled("the call was cancelled", env=entry.spec.key)
            effects = entry.apply_locked(slot, lc.CallStarted(generation, call_id, self._clock()))
            ticket.generation = generation
            ticket.call_id = call_id
            ticket.ran_on = slot
        if effects is None:
            return process, 0  # died idle after we looked: a fresh worker takes it
        return process, call_id

    def _ping(self, entry: _EnvEntry, slot: _Slot, process: WorkerProcess) -> bool:
        """Health-check a worker that sat idle a long time, before trusting it with a call."""
        ok = process.ping(self._settings.ping_timeout)
        with entry.lock:
            entry.pings += 1
            if not ok:
                entry.ping_failures += 1
        if not ok:
            entry.apply(slot, lc.PingFailed(process.generation))
            _log.warning(
                "comfy-env: worker of env %s (pid %s, generation %d) did not answer a ping "
                "after idling; replacing it",
                entry.spec.key,
                process.pid,
                process.generation,
            )
        return ok

    def _release_dropped_refs(self, entry: _EnvEntry, slot: _Slot, process: WorkerProcess) -> None:
        """Release garbage-collected refs of the worker we hold; requeue the others."""
        mine, others = [], []
        with entry.lock:
            while entry.dropped_refs:
                ref_slot, generation, ref_id = entry.dropped_refs.popleft()
                if ref_slot is not slot:
                    others.append((ref_slot, generation, ref_id))
                elif generation == process.generation:
                    # Garbage-collected refs are still counted live; discarded ones
                    # (RemoteRef.discard) were uncounted at once. Both are released here.
                    slot.live_refs.discard(ref_id)
                    mine.append(ref_id)
                # else: its generation is gone, and the object with it
            entry.dropped_refs.extend(o for o in others if _holds(o[0], o[1]))
        if mine:
            try:
                process.release_refs(mine)
            except OSError:
                pass  # the worker is gone, and its objects with it

    # ---- remote objects ----

    def call_ref(
        self,
        entry: _EnvEntry,
        target: str | Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        ticket: _Ticket | None = None,
        on_event: EventCallback | None = None,
    ) -> RemoteRef:
        ticket = ticket or _Ticket()
        ref_id = self.call(
            entry,
            "comfy_env_worker.refs:call_and_keep",
            (target, args, kwargs),
            {},
            timeout,
            ticket,
            on_event=on_event,
        )
        slot = ticket.ran_on
        assert slot is not None
        generation = ticket.generation
        with entry.lock:
            if _holds(slot, generation):
                slot.live_refs.add(ref_id)
        return RemoteRef(self, entry, slot, generation, ref_id)

    def _ref_is_live(self, ref: RemoteRef) -> bool:
        with ref._entry.lock:
            return _holds(ref._slot, ref.generation) and ref.id in ref._slot.live_refs

    def _ref_released(self, ref: RemoteRef) -> None:
        with ref._entry.lock:
            ref._slot.live_refs.discard(ref.id)

    def _live_process(self, entry: _EnvEntry, slot: _Slot) -> WorkerProcess:
        """The slot's verified process, spawning generation g+1 if the slot is empty or retired."""
        state = slot.state
        if isinstance(state, lc.Idle) and slot.process is not None:
            return slot.process
        return self._spawn(entry, slot)

    def _spawn(self, entry: _EnvEntry, slot: _Slot) -> WorkerProcess:
        with self._lock:
            if self._closed:
                raise self._closed_error()
            try:
                if self._reactor is None:
                    self._reactor = Reactor()
                    self._reactor.start()
                    self._schedule_reaper()
                if self._runtime_dir is None:
                    self._runtime_dir = make_runtime_dir()
            except OSError as exc:  # out of descriptors or disk in the host: typed, nothing kept
                raise WorkerStartError(
                    f"cannot prepare to start a worker for env {entry.spec.key}: {exc} (is the "
                    "host out of file descriptors or disk space?)",
                    env=entry.spec.key,
                ) from exc
            reactor, runtime_dir = self._reactor, self._runtime_dir
        with entry.lock:
            if isinstance(entry.env_state, lc.EnvAbandoned):
                raise _abandoned_error(entry.spec.key, entry.env_state)
            if entry.unsupported is not None:  # said once; never started again
                raise WorkerStartError(str(entry.unsupported), env=entry.spec.key, unsupported=True)
            generation = entry.generation + 1
            effects = entry.apply_locked(slot, lc.SpawnBegan(generation))
            if effects is None:  # pragma: no cover - the lease makes this impossible
                raise AssertionError(f"slot {slot.index} of {entry.spec.key} is not free")
            entry.generation = generation
            entry.spawns += 1
            old = slot.process
            if old is not None:
                entry.log_lines_dropped += old.log.dropped
            process: WorkerProcess = self._backend.new_generation(
                entry.spec,
                generation,
                self._settings,
                reactor,
                runtime_dir,
                lambda p: self._on_exit(entry, slot, p),
                lambda p: self._on_finished(entry, p),
            )
            slot.process = process
        if old is not None:
            old.dispose()
        started = time.monotonic()
        try:
            process.launch(before_launch=self._refuse_if_closed, after_launch=self._track)
        except BaseException as exc:
            entry.apply(slot, lc.StartFailed(generation))
            if isinstance(exc, WorkerStartError) and not self._closed:
                # Nothing was forked, so no exit will be reported: count the death now.
                self._record_death(entry, generation, lc.RetireReason.START_FAILED, None, "")
                self._events.emit(
                    WorkerRetired(entry.spec.key, generation, None, "start_failed", None, None)
                )
            raise
        if process.popen is not None:
            self._events.emit(WorkerSpawned(entry.spec.key, generation, process.popen.pid))
        try:
            process.handshake(started + self._settings.start_timeout)
        except BaseException as exc:
            entry.apply(slot, lc.StartFailed(generation))
            if isinstance(exc, WorkerStartError) and exc.unsupported:
                with entry.lock:
                    entry.unsupported = exc
            if self._closed and isinstance(exc, WorkerStartError):
                raise PoolClosedError("the pool was closed while the worker started") from exc
            raise
        if not entry.apply(slot, lc.HandshakeOk(generation, process.pid or 0, self._clock())):
            # Retired while starting (the pool is closing, or it died right after the canary).
            if self._closed:
                raise PoolClosedError("the pool was closed while the worker started")
            rc = process.wait_exit(1.0)
            raise WorkerStartError(
                f"worker for env {entry.spec.key} (generation {generation}) {describe_exit(rc)} "
                "right after its start-up",
                env=entry.spec.key,
                pid=process.pid,
                generation=generation,
                stderr_tail=process.log.tail(),
            )
        _log.debug(
            "comfy-env: env %s generation %d ready (pid %s, %.1f ms)",
            entry.spec.key,
            generation,
            process.pid,
            process.startup_seconds * 1000,
        )
        self._events.emit(
            WorkerReady(entry.spec.key, generation, process.pid or 0, process.startup_seconds)
        )
        self._status_changed()
        if self._watcher is None and self._reactor is not None:
            # Started after the first worker is ready, on the reactor: off the first call's path
            # (an interpreter start competing with the worker's costs that call ~10 ms).
            self._reactor.call_soon(self._start_watcher)
        return process

    def _start_watcher(self) -> None:
        """Reactor thread: launch the host watcher once (see ``_watcher``). ``close`` reads
        ``_watcher`` after the reactor stopped, so no start races a close."""
        with self._lock:
            if self._watcher is not None or self._closed:
                return
            try:
                self._watcher = HostWatcher.start(HOST_ID_VAR, host_id())
            except OSError as exc:  # the sweep remains the backstop
                _log.warning(
                    "comfy-env: cannot start the host watcher (%s); setsid descendants of "
                    "workers outlive a killed host until the next sweep",
                    exc,
                )

    def _sweep(self) -> None:
        from ._sweep import sweep

        self.last_sweep = report = sweep()
        if report:
            self._events.emit(ShmSwept(report))

    # ---- the reaper and the breaker ----

    def _schedule_reaper(self) -> None:
        """One periodic timer on the reactor serves every env (no thread per worker)."""
        timeout = self._settings.idle_timeout
        if timeout is None or self._reactor is None:
            return
        interval = min(max(timeout / 4, 0.02), 5.0)
        self._reaper = self._reactor.call_later(interval, self._reap_tick)

    def _reap_tick(self) -> None:
        if self._closed:
            return
        self.reap_idle()
        self._schedule_reaper()

    def reap_idle(self, now: float | None = None) -> int:
        """Retire workers idle longer than ``idle_timeout`` (the reaper runs this on a timer;
        ``now`` defaults to the pool's clock). Returns how many were retired.

        The decision and its application happen under the env's lock, and the decision names
        the ``idle_since`` it observed, so a worker that ran a call in between (or is leased by
        a caller right now) is never reaped."""
        if now is None:
            now = self._clock()
        with self._lock:
            entries = list(self._entries.values())
        reaped = 0
        for entry in entries:
            for slot in entry.slots:
                with entry.lock:
                    if slot.leased:
                        continue
                    decision = lc.idle_expired(slot.state, now, self._settings.idle_timeout)
                    if decision is None:
                        continue
                    held = bool(_held_refs(entry, slot)) and not self._settings.reap_with_refs
                if held:
                    # Outside the lock: a hook may take its own locks (ComfyUI's queue mutex)
                    # and discards its refs (RemoteRef.discard takes the entry lock).
                    if not self._run_reap_hooks(entry.spec.key, decision.generation):
                        continue
                with entry.lock:
                    if slot.leased or (
                        _held_refs(entry, slot) and not self._settings.reap_with_refs
                    ):
                        continue
                    # A call in between moved idle_since: the gate drops this decision.
                    effects = entry.apply_locked(slot, decision)
                    if effects is None:
                        continue
                    entry.reaped += 1
                    process = slot.process
                run_effects(effects, process, leased=False)
                reaped += 1
        return reaped

    def _record_death(
        self,
        entry: _EnvEntry,
        generation: int,
        reason: lc.RetireReason,
        returncode: int | None,
        stderr_tail: str,
    ) -> None:
        death = lc.Death(
            at=self._clock(),
            when=time.time(),
            generation=generation,
            reason=reason,
            exitcode=returncode,
            signal=signal_name(returncode),
            stderr_tail=stderr_tail,
        )
        with entry.lock:
            before = entry.env_state
            entry.env_state = lc.record_death(
                before, death, self._settings.max_restarts, self._settings.restart_window
            )
            tripped = entry.env_state if before is not entry.env_state else None
        if isinstance(tripped, lc.EnvAbandoned) and not isinstance(before, lc.EnvAbandoned):
            _log.error("comfy-env: %s", _abandoned_error(entry.spec.key, tripped))
            self._events.emit(EnvAbandoned(entry.spec.key, tripped.deaths))

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise self._closed_error()

    def _track(self, process: WorkerProcess) -> None:
        """Reactor thread, right after a fork: know the process before anything can stop us."""
        with self._lock:
            self._processes.add(process)
            first = self.last_sweep is None and not self._sweep_queued
            self._sweep_queued = True
        if first and self._reactor is not None:
            # The pool starts: clear what dead hosts left behind, off every caller's path
            # (after this fork, on the reactor thread).
            self._reactor.call_soon(self._sweep)

    def _on_exit(self, entry: _EnvEntry, slot: _Slot, process: WorkerProcess) -> None:
        """Reactor thread: the process was reaped."""
        with self._lock:
            self._processes.discard(process)
        entry.apply(slot, lc.Exited(process.generation, process.returncode))
        self._status_changed()

    def _status_changed(self) -> None:
        """Keep this host's status file (``comfy-env status``) current, throttled, written on
        the reactor thread. On every call's path: one flag test (and one store) while a write
        is pending; a change inside the throttle window is written when the window ends, so
        the file is never more than about a second behind the last change."""
        if self._status_pending:
            self._status_dirty = True
            if self._status_pending:
                return  # the end of the window sees the flag
            # The window ended between the two tests and may have missed the flag: go on.
        if self._reactor is None or self._closed:
            return
        self._status_pending = True
        host_publisher(live_pool_snapshots).publish_soon(self._reactor.call_later)
        self._reactor.call_later(0.5, self._status_written)

    def _status_written(self) -> None:
        """Reactor thread: the throttle window ended; publish what changed inside it."""
        self._status_pending = False
        if self._status_dirty:
            self._status_dirty = False
            self._status_changed()

    def _on_finished(self, entry: _EnvEntry, process: WorkerProcess) -> None:
        """Reactor thread: reaped and output drained; exit code and last lines are final."""
        reason = process.retire_reason or lc.RetireReason.CRASHED
        rc = process.returncode
        if reason in lc.DEATHS and not self._closed:
            self._record_death(entry, process.generation, reason, rc, process.log.tail())
        self._events.emit(
            WorkerRetired(
                entry.spec.key, process.generation, process.pid, reason.value, rc, signal_name(rc)
            )
        )

    def _send(
        self,
        entry: _EnvEntry,
        slot: _Slot,
        process: WorkerProcess,
        call_id: int,
        target: str | Callable[..., Any],
        body: bytes,
        buffers: list[memoryview],
        deadline: float | None,
    ) -> tuple[bool, Block | None]:
        """Send the CALL frame. Returns (False, None) if the worker was already gone before any
        byte went out (safe to run the call elsewhere), else (True, the request's shared-memory
        block). Raises the call's error once part of it was sent."""
        try:
            block = process.send_request(call_id, body, buffers, deadline)
        except (BrokenPipeError, ConnectionResetError):
            entry.apply(slot, lc.ChannelClosed(process.generation))
            return False, None
        except TimeoutError:
            label = target_label(target)
            raise self._timeout_error(entry, slot, process, call_id, label, deadline) from None
        except SerializationError:
            raise
        except OSError:
            raise self._crash_error(entry, slot, process, call_id, target_label(target)) from None
        return True, block

    def _receive(
        self,
        entry: _EnvEntry,
        slot: _Slot,
        process: WorkerProcess,
        ticket: _Ticket,
        call_id: int,
        target: str | Callable[..., Any],
        deadline: float | None,
    ) -> tuple[int, int, Payload]:
        reader = process.reader
        assert reader is not None
        try:
            ftype, flags, reply_id, reply = reader.read(deadline)
            if ftype == FrameType.LOG or ftype == FrameType.EVENT:
                # What the call logged or reported: handle it, then read on to the reply.
                ftype, flags, reply_id, reply = process.read_frame(
                    deadline, (ftype, reply_id, reply), ticket.sink
                )
        except TimeoutError:
            label = target_label(target)
            raise self._timeout_error(entry, slot, process, call_id, label, deadline) from None
        except ConnectionResetError:
            # A Unix socket whose owner exits with unread data resets its peer instead of
            # giving EOF: the worker died before it read the whole request, so the call never
            # ran and may run on a fresh worker. Any reply bytes mean it did run.
            entry.apply(slot, lc.ChannelClosed(process.generation))
            reason = self._retire_reason(slot, process.generation)
            if reader.buffered == 0 and reason is lc.RetireReason.CRASHED:
                raise _NotDelivered from None
            raise self._crash_error(entry, slot, process, call_id, target_label(target)) from None
        except (ChannelClosed, ConnectionError, OSError):
            raise self._crash_error(entry, slot, process, call_id, target_label(target)) from None
        except FrameError as exc:
            raise self._protocol_error(entry, slot, process, str(exc)) from None
        except BaseException as exc:
            # KeyboardInterrupt (or another async exception) while waiting: the call's result
            # can no longer be delivered. Ctrl-C asks the worker first (it may keep its
            # caches); anything else, or a second Ctrl-C, stops the worker at once.
            if not isinstance(exc, KeyboardInterrupt) or self._settings.cancel_grace <= 0:
                entry.apply(slot, lc.CallCancelled(process.generation, call_id))
                raise
            frame = self._drain_cancelled(entry, slot, process, ticket, call_id)
            if frame is None:
                raise
            ticket.interrupted = True
            ftype, flags, reply_id, reply = frame
        if (ftype != FrameType.REPLY_OK and ftype != FrameType.REPLY_ERR) or reply_id != call_id:
            raise self._not_the_reply(entry, slot, process, ftype, reply_id, call_id, reply)
        return ftype, flags, reply

    def _not_the_reply(
        self,
        entry: _EnvEntry,
        slot: _Slot,
        process: WorkerProcess,
        ftype: int,
        reply_id: int,
        call_id: int,
        payload: Payload | memoryview,
    ) -> ProtocolError:
        """The error for a frame read where the reply to ``call_id`` belonged (both the sync
        and the asyncio path): the worker refused our frame, or said something out of turn."""
        if ftype == FrameType.ERROR:
            detail = bytes(payload).decode("utf-8", "replace")
            return self._protocol_error(entry, slot, process, f"worker refused a frame: {detail}")
        return self._protocol_error(
            entry,
            slot,
            process,
            f"expected the reply to call {call_id}, got frame type {ftype} for call {reply_id}",
        )

    def _drain_cancelled(
        self,
        entry: _EnvEntry,
        slot: _Slot,
        process: WorkerProcess,
        ticket: _Ticket,
        call_id: int,
    ) -> tuple[int, int, int, Payload] | None:
        """After Ctrl-C: ask the worker to stop ``call_id`` and read on until its reply (the
        grace timer kills it if it does not stop). The reply frame, or None if the worker was
        stopped (or the reader state was lost to the interrupt: then it is stopped now)."""
        self._cancel(entry, ticket)
        try:
            frame = process.read_frame(None, None, ticket.sink)
        except BaseException:  # noqa: BLE001 - EOF after the kill, a garbled read, a second Ctrl-C
            entry.apply(slot, lc.CallCancelled(process.generation, call_id))
            return None
        if frame[2] != call_id or frame[0] not in (FrameType.REPLY_OK, FrameType.REPLY_ERR):
            entry.apply(slot, lc.ProtocolViolated(process.generation))
            return None
        return frame

    # ---- errors ----

    def _retire_reason(self, slot: _Slot, generation: int) -> lc.RetireReason | None:
        state = slot.state
        if isinstance(state, lc.Retired) and state.generation == generation:
            return state.reason
        return None

    def _crash_error(
        self, entry: _EnvEntry, slot: _Slot, process: WorkerProcess, call_id: int, label: str
    ) -> Exception:
        entry.apply(slot, lc.ChannelClosed(process.generation))
        reason = self._retire_reason(slot, process.generation)
        if reason is lc.RetireReason.CLOSED or self._closed:
            return PoolClosedError(f"the pool was closed during the call to {label}")
        if reason is lc.RetireReason.CANCELLED:
            return CallCancelled(
                f"the call to {label} was cancelled and did not stop within "
                f"PoolConfig.cancel_grace={self._settings.cancel_grace:g}s; its worker "
                f"(generation {process.generation}) was killed",
                env=entry.spec.key,
                pid=process.pid,
                generation=process.generation,
            )
        # Wait (bounded) for the exit status, so the message can name the signal.
        rc = process.wait_exit(1.0)
        still_running = rc is None
        if still_running:
            process.kill(lc.Stop.KILL)
            rc = process.wait_exit(1.0)
        process.wait_output(0.5)
        tail = process.log.tail()
        what = (
            "closed its channel while still running (it was killed)"
            if still_running
            else describe_exit(rc)
        )
        message = (
            f"worker for env {entry.spec.key} (pid {process.pid}, generation "
            f"{process.generation}) {what} during call {call_id} to {label or '?'}; "
            f"the call was not retried, the next call starts generation {process.generation + 1}"
        )
        if tail:
            message += "\n--- worker output (last lines) ---\n" + tail
        return WorkerCrashed(
            message,
            env=entry.spec.key,
            pid=process.pid,
            generation=process.generation,
            exitcode=rc,
            signal=signal_name(rc),
            call_id=call_id,
            target=label or None,
            stderr_tail=tail,
        )

    def _timeout_error(
        self,
        entry: _EnvEntry,
        slot: _Slot,
        process: WorkerProcess,
        call_id: int,
        label: str,
        deadline: float | None,
    ) -> Exception:
        if not entry.apply(slot, lc.DeadlineHit(process.generation, call_id)):
            # Something else retired the worker first (crash, close, cancel): report that.
            return self._crash_error(entry, slot, process, call_id, label)
        return CallTimeout(
            f"call {call_id} to {label or '?'} on env {entry.spec.key} missed its deadline; "
            f"worker pid {process.pid} (generation {process.generation}) was stopped",
            env=entry.spec.key,
            pid=process.pid,
            generation=process.generation,
            call_id=call_id,
            target=label or None,
        )

    def _protocol_error(
        self, entry: _EnvEntry, slot: _Slot, process: WorkerProcess, detail: str
    ) -> ProtocolError:
        entry.apply(slot, lc.ProtocolViolated(process.generation))
        return ProtocolError(
            f"worker for env {entry.spec.key} (pid {process.pid}, generation "
            f"{process.generation}) broke the protocol and was retired: {detail}",
            env=entry.spec.key,
            pid=process.pid,
            generation=process.generation,
        )

    # ---- shutdown ----

    def _abandon_in_forked_child(self) -> None:
        """In a forked child: close inherited descriptors, signal nothing, own nothing."""
        self._closed = True
        self._lock = threading.Lock()
        self._close_done.set()
        processes = set(self._processes)
        for entry in self._entries.values():
            entry.lock = threading.Lock()
            entry.waiters.clear()
            processes.update(s.process for s in entry.slots if s.process is not None)
        for process in processes:
            process.abandon_in_forked_child()
        if self._reactor is not None:
            self._reactor.abandon_in_forked_child()
        if self._watcher is not None:
            self._watcher.forget_in_forked_child()

    def _shutdown(self, entries: list[_EnvEntry], reactor: Reactor | None) -> None:
        for entry in entries:
            with entry.lock:
                waiters = list(entry.waiters)
                entry.waiters.clear()
                for ticket in waiters:
                    ticket.closed = True
                    ticket.wake()
                live = [
                    (s, s.state.generation)
                    for s in entry.slots
                    if s.state is not None and not isinstance(s.state, lc.Retired)
                ]
            for slot, generation in live:
                entry.apply(slot, lc.CloseRequested(generation))
        if self._reaper is not None:
            self._reaper.cancel()
        if reactor is None:
            self._backend.close()
            self._events.close()
            return
        # Barrier: after this, no fork can start (before_launch refuses), and every process
        # forked so far is in self._processes.
        reactor.run_sync(lambda: None)
        with self._lock:
            processes = list(self._processes)
        for process in processes:
            if process.retire_reason is None:  # still starting: not asked by the gate above
                process.kill(lc.Stop.TERMINATE)
        deadline = time.monotonic() + self._settings.close_timeout
        for process in processes:
            process.wait_exit(max(0.0, deadline - time.monotonic()))
        stragglers = [p for p in processes if not p.exited.is_set()]
        for process in stragglers:
            process.kill(lc.Stop.KILL)
        # One shared deadline per phase, never one wait per worker: with many workers stuck
        # (or never launched) close() still takes close_timeout plus a bounded constant.
        killed_by = time.monotonic() + 2.0
        for process in stragglers:
            process.wait_exit(max(0.0, killed_by - time.monotonic()))
        drained_by = time.monotonic() + 0.5
        for entry in entries:
            for slot in entry.slots:
                if slot.process is not None and slot.process.popen is not None:
                    slot.process.wait_output(max(0.0, drained_by - time.monotonic()))
        all_processes = {s.process for e in entries for s in e.slots if s.process is not None}
        all_processes.update(processes)

        def release_all() -> None:
            for p in all_processes:
                p.force_close()

        reactor.run_sync(release_all)
        reactor.stop()
        for process in all_processes:
            with self._lock:
                leased = any(s.leased and s.process is process for e in entries for s in e.slots)
            if not leased:
                process.dispose()
        if self._watcher is not None:  # every worker is stopped: the watcher has nothing to do
            self._watcher.close(2.0)
        self._backend.close()
        if self._runtime_dir is not None:
            shutil.rmtree(self._runtime_dir, ignore_errors=True)
        host_publisher(
            live_pool_snapshots
        ).publish()  # without this pool (the file goes with the last pool)
        self._events.close()


class _HostFault(Exception):
    """Carries a ``HostResourceError`` out of ``_exchange`` with the call's ``Replied``, so the
    worker that replied whole is settled as idle (not retired) while the call fails."""

    def __init__(self, replied: lc.Replied, error: HostResourceError) -> None:
        super().__init__(str(error))
        self.replied = replied
        self.error = error


def _release_locked(entry: _EnvEntry, slot: _Slot) -> WorkerProcess | None:
    """Hand ``slot`` to the first waiter or mark it free (lock held). Returns its process if
    that is retired, for the caller to dispose of after unlocking (nobody reads it any more)."""
    # FIFO, except that a call bound to another slot (it uses a RemoteRef) lets others pass.
    nxt = next((t for t in entry.waiters if t.wanted is None or t.wanted is slot), None)
    if nxt is not None:
        entry.waiters.remove(nxt)
        nxt.slot = slot
        nxt.stage = "in_flight"
        entry.queued -= 1
        entry.in_flight += 1
        nxt.wake()
    else:
        slot.leased = False
    if isinstance(slot.state, lc.Retired):
        return slot.process
    return None


def _outcome(exc: BaseException) -> str:
    """The counter a call that ended with ``exc`` before it ran increments."""
    if isinstance(exc, CallTimeout):
        return "timed_out"
    if isinstance(exc, (CallCancelled, KeyboardInterrupt)):
        return "cancelled"
    return "failed"


def _free_slot(entry: _EnvEntry, wanted: _Slot | None = None) -> _Slot | None:
    """A slot no caller holds: a verified idle worker first, else an empty or retired slot.
    A call bound to one slot (``wanted``) takes that one or none."""
    if wanted is not None:
        return None if wanted.leased else wanted
    fallback = None
    for slot in entry.slots:
        if slot.leased:
            continue
        if isinstance(slot.state, lc.Idle):
            return slot
        if fallback is None and (slot.state is None or isinstance(slot.state, lc.Retired)):
            fallback = slot
    return fallback


def _abandoned_error(env: str, state: lc.EnvAbandoned) -> EnvAbandonedError:
    lines = []
    for d in state.deaths:
        how = f"signal {d.signal}" if d.signal else f"exit code {d.exitcode}"
        when = time.strftime("%H:%M:%S", time.localtime(d.when))
        tail = d.stderr_tail.strip().splitlines()[-3:] if d.stderr_tail else []
        detail = ("; last output: " + " | ".join(tail)) if tail else ""
        lines.append(f"  {when} generation {d.generation} {d.reason.value} ({how}){detail}")
    return EnvAbandonedError(
        f"env {env} was abandoned after {len(state.deaths)} worker deaths within the restart "
        "window (PoolConfig.max_restarts/restart_window); calls fail until pool.reset(env). "
        "Recent deaths:\n" + "\n".join(lines),
        env=env,
    )


def _holds(slot: _Slot, generation: int) -> bool:
    """Is ``generation`` still the live occupant of ``slot``?"""
    state = slot.state
    return (
        state is not None and state.generation == generation and not isinstance(state, lc.Retired)
    )


def _check_bound(entry: _EnvEntry, slot: _Slot, generation: int) -> None:
    """A call that uses a RemoteRef may only run on the generation that holds the object."""
    state = slot.state
    if _holds(slot, generation):
        return
    if state is None or state.generation == generation:
        now = f"generation {generation} was retired ({_retire_text(state)})"
    else:
        now = f"the env's worker is now generation {state.generation}"
    raise StaleGenerationError(
        f"a RemoteRef of env {entry.spec.key} belongs to worker generation {generation}, "
        f"which is gone: {now}; its object died with it",
        env=entry.spec.key,
        generation=generation,
    )


def _retire_text(state: lc.State | None) -> str:
    return state.reason.value if isinstance(state, lc.Retired) else "gone"


def _all_scalars(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether every argument is of an exact scalar type (int, str, None, ...): such a call
    holds no RemoteRef and nothing that could go out of band (bytes could)."""
    for value in args:
        if type(value) not in _PLAIN:
            return False
    if kwargs:
        for value in kwargs.values():
            if type(value) not in _PLAIN:
                return False
    return True


def _bound_by_refs(
    entry: _EnvEntry, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[_Slot, int] | None:
    """The (slot, generation) the call's RemoteRef arguments live in, if any. Looks at the
    arguments and one container level into them; anything scalar is skipped at once (the
    small-call hot path pays one type check per argument)."""
    found: RemoteRef | None = None
    values = (*args, *kwargs.values()) if kwargs else args
    for value in values:
        kind = type(value)
        if kind in _SCALARS:
            continue
        if kind is list or kind is tuple:
            candidates: Any = value
        elif kind is dict:
            candidates = value.values()
        else:
            candidates = (value,)
        for item in candidates:
            if not isinstance(item, RemoteRef):
                continue
            if item._released:
                raise released_error(item)
            if item._entry is not entry:
                raise StaleGenerationError(
                    f"a RemoteRef of env {item.env} cannot be used in a call to env "
                    f"{entry.spec.key}",
                    env=entry.spec.key,
                    generation=item.generation,
                )
            if found is not None and (item._slot, item.generation) != (
                found._slot,
                found.generation,
            ):
                raise StaleGenerationError(
                    "a call cannot use RemoteRefs of two different workers", env=entry.spec.key
                )
            found = item
    return None if found is None else (found._slot, found.generation)


_SCALARS = frozenset((int, float, bool, type(None), str, bytes))
_PLAIN = frozenset((int, float, bool, type(None), str, complex))


# ---- status snapshots (written by _status's publisher) -----------------------------------


def snapshot_pool(pool: Pool) -> Snapshot:
    """A JSON-able description of one pool: per env the interpreter, counters and per-slot
    workers (pid, generation, state, idle or busy since when, start-up seconds).

    Reads ``pool.stats()`` (which locks each entry briefly) and, read-only, each entry's spec,
    slot states and the pool's clock (idle and busy times are kept on it; they are converted to
    wall time here). Must not be called with one of the pool's locks held."""
    # Lifecycle times come from the pool's clock (monotonic unless a test injected another).
    clock: Callable[[], float] = getattr(pool, "_clock", time.monotonic)
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
                    "idle_since": wall(getattr(state, "idle_since", None)) if same else None,
                    "busy_since": wall(getattr(state, "started_at", None)) if same else None,
                }
            )
        env: Snapshot = {"env": key, "interpreter": interpreter, "generation": env_stats.generation}
        for name in CALL_COUNTERS:
            env[name] = getattr(env_stats, name)
        env["workers"] = workers
        envs.append(env)
    return {"pool": f"{id(pool):x}", "envs": envs}


def live_pool_snapshots() -> list[Snapshot]:
    """Snapshots of every open pool of this process (the default pool included)."""
    for _ in range(3):
        try:
            pools = list(_live_pools)
            break
        except RuntimeError:  # another thread created a pool while we listed them
            continue
    else:  # pragma: no cover
        return []
    return [snapshot_pool(p) for p in pools if not p.closed]
