"""The backend-agnostic core of the pool: env entries, slots, tickets, FIFO leasing, the gate.

Data flow (what each piece holds, and who writes it)::

    EnvEntry (one per env key; its ``lock`` guards everything below)
      slots[i]: Slot                  state (a ``_lifecycle`` State), process (the
                                      ``WorkerGeneration`` of state.generation), ending
                                      (the core's ``GenerationEnd`` of that generation:
                                      why the gate retired it, whether its death was
                                      reported), leased, live_refs (RemoteRef ids of that
                                      generation)
      waiters: deque[Ticket]          FIFO of calls waiting for a slot
      counters                        submitted/ok/raised/..., read by ``snapshot()``
      env_state                       the crash-loop breaker (``_lifecycle.EnvActive``/
                                      ``EnvAbandoned``), written only by
                                      ``set_env_state`` (for ``_policies.record_death``,
                                      ``Pool.reset`` and ``abandoned_locked``)
      breaker                         this env's own breaker settings (``Pool.set_breaker``),
                                      None: the pool's
      dropped_refs                    RemoteRefs garbage collected or discarded, appended
                                      lock-free; ``refs_dropped()`` wakes their release

    any thread --event--> EnvEntry.apply(slot, event)      the gate, the only writer of
                          |- under lock: lc.step(state, event) -> new state, effects
                          `- outside the lock: run_effects(...) (kill, cancel, grace timer)

**The gate** (``EnvEntry.apply``/``apply_locked``) applies an event to a slot under the entry's
lock using the pure ``_lifecycle.step``, and returns the effects (kill) that the caller then
runs *outside* the lock. Nothing else assigns ``slot.state``: the per-call pair has methods of
its own that ask ``_lifecycle`` without an event object, and all of them store through
``_store``. Events are tagged with the generation they are about, so a late exit notice of
generation g, a late deadline decision or a late frame cannot touch generation g+1: ``step``
drops them and the gate counts them (``stale_events_dropped``).

**Leasing** (``_lease``, which asks the gate here for every change of a slot's state): a call
holds a ``Ticket``; ``free_slot`` picks a slot nobody leases (a verified idle worker first),
and ``release_locked`` hands a slot to the first waiter in FIFO order (a call bound to one slot
by a RemoteRef lets others pass). A channel is disposed of only by the
slot's lease holder, or by the gate when nobody holds the lease, so a descriptor is never
closed under a thread that still reads it.

Nothing here knows how a worker runs: a slot's process is a ``_backend.WorkerGeneration``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _lifecycle as lc
from ._errors import WorkerStartError
from ._settings import Settings
from ._stats import EnvStats, WorkerStats

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._call import EventCallback, Stage
    from ._envs import EnvSpec
    from ._generation import GenerationEnd
    from ._interrupts import Deferred

STATE_NAMES: dict[type, str] = {
    lc.Starting: "starting",
    lc.Idle: "idle",
    lc.InCall: "in_call",
    lc.Retired: "retired",
}

# ---- slots, tickets, entries ----------------------------------------------------------------


class Slot:
    """One worker place of an env: the lifecycle state of its current generation, that
    generation's worker and the core's record of its end (``process`` and ``ending``, written
    together by the spawner), whether a call leases it, and the RemoteRefs its worker keeps."""

    __slots__ = ("ending", "index", "leased", "live_refs", "process", "state")

    def __init__(self, index: int) -> None:
        self.index = index
        self.state: lc.State | None = None
        self.process: WorkerGeneration | None = None  # the process of state.generation
        self.ending: GenerationEnd | None = None  # how that generation ended (the core's)
        self.leased = False
        self.live_refs: set[int] = set()  # RemoteRef ids kept by this generation's worker


class Ticket:
    """One call's place in the pool: queued, then holding a slot; cancellable from any thread.

    The fields are class-level defaults (all immutable), so a ticket costs one allocation and
    only the fields a call actually sets: the common call sets about five."""

    event: threading.Event | None = None
    waker: Callable[[], None] | None = None  # wakes a waiter that is not a thread
    woken: Any = None  # the asyncio future an async waiter awaits (see _acall)
    on_event: EventCallback | None = None  # the caller's callback
    sink: Callable[[int, Any], None] | None = None  # EVENT frames of the current call
    interrupted = False  # Ctrl-C during the call; the worker stopped it in time
    slot: Slot | None = None
    wanted: Slot | None = None  # the one slot this call must run on (it uses a RemoteRef)
    bound_generation = 0  # ... and the generation that must still occupy it
    ran_on: Slot | None = None  # the slot the call was sent to
    held: Deferred | None = None  # the call holds Ctrl-C back outside its waits (_interrupts)
    replied_at: float | None = None  # when the whole reply arrived (``Replied`` at settling)
    stage: Stage = "new"  # "queued" -> "in_flight" -> "done"
    generation = 0
    call_id = 0
    timeout: float | None = None  # the call's timeout in seconds, if it has a deadline
    cancelled = False
    closed = False

    def __init__(self, wanted: Slot | None = None) -> None:
        if wanted is not None:
            self.wanted = wanted

    def start_idle_locked(self, slot: Slot) -> None:
        """Start the call on ``slot``'s idle worker in the lease's lock section, if it can
        take it as it is (``_lease.lease_now``, lock held). A bare ticket starts nothing; the
        call's own object does (``_exchange.Exchange``)."""

    def wake(self) -> None:
        """The waiter's slot was handed over, or it must give up (closed, cancelled)."""
        if self.waker is not None:
            self.waker()
        elif self.event is not None:
            self.event.set()


def _no_timer(delay: float, fn: Callable[[], None]) -> None:
    raise AssertionError("a cancel's grace timer needs the pool's reactor")


def _no_release() -> None:
    """An entry outside a pool: its dropped refs wait for its next call."""


class EnvEntry:
    """An env's slots, waiters and counters. Its lock guards all of them."""

    def __init__(self, spec: EnvSpec, max_workers: int, settings: Settings | None = None) -> None:
        self.spec = spec
        # What this env's workers and calls run with: the pool's settings, or a copy with the
        # env's own (``Pool.configure``). Replaced whole, never changed in place: a reader
        # without the lock sees the old or the new one.
        self.settings = settings if settings is not None else Settings()
        self.own_settings: dict[str, Any] = {}  # what ``configure`` gave, field by field
        self.lock = threading.Lock()
        self.slots = [Slot(i) for i in range(max_workers)]
        self.waiters: deque[Ticket] = deque()
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
        self.breaker: lc.Breaker | None = None  # set_breaker's, e.g. a ComfyUI pack's own
        self.log_lines_dropped = 0  # of processes no longer in a slot
        self.unsupported: WorkerStartError | None = None  # its Python can never run a worker
        self.python: tuple[int, ...] = ()  # the Python version its last ready worker ran
        # RemoteRefs garbage-collected or discarded, not yet released: (slot, generation, id).
        # Appended without the lock (from __del__), drained under it.
        self.dropped_refs: deque[tuple[Slot, int, int]] = deque()
        # Asks the pool's reactor to release them soon (``Spawner.refs_dropped``): called right
        # after an append, from a finaliser too, so it takes no lock and never raises.
        self.refs_dropped: Callable[[], None] = _no_release
        # Runs a function on the pool's reactor after a delay (the cancel grace timers).
        self.call_later: Callable[[float, Callable[[], None]], object] = _no_timer

    # ---- the gate ----

    def apply_locked(self, slot: Slot, event: lc.Event) -> tuple[lc.Effect, ...] | None:
        """Apply ``event`` to ``slot`` (lock held). Returns the effects to run after unlocking,
        or None if the event was dropped."""
        before = slot.state  # (what ``cancel_kill`` reads, below)
        result = lc.step(slot.state, event)
        if isinstance(result, lc.Dropped):
            self.stale_events_dropped += 1
            return None
        self._store(slot, result.state)
        if isinstance(result.state, lc.Retired):
            ending = slot.ending
            if ending is not None and ending.generation == result.state.generation:
                ending.retire_reason = result.state.reason
                if result.state.reason is lc.RetireReason.CANCELLED:
                    # Read from the state before the event: the retired one no longer says
                    # whether a cancel was pending (a second cancel, or the grace running out).
                    ending.cancel_kill = lc.cancel_kill(before, event)
            slot.live_refs.clear()  # they died with this generation
        return result.effects

    @staticmethod
    def _store(slot: Slot, state: lc.State) -> None:
        """The one write of a slot's state, of a value the lifecycle module computed (lock
        held; only the gate's methods call it)."""
        slot.state = state

    def start_call_locked(self, slot: Slot, generation: int, call_id: int, at: float) -> bool:
        """``CallStarted`` (lock held), the per-call pair without an event object
        (``lc.call_started``). True if the call started; False if the gate dropped it (the
        worker is not idle in that generation any more)."""
        started = lc.call_started(slot.state, generation, call_id, at)
        if started is not None:
            self._store(slot, started)
            return True
        return self.apply_locked(slot, lc.CallStarted(generation, call_id, at)) is not None

    def replied_locked(self, slot: Slot, generation: int, call_id: int, at: float) -> None:
        """``Replied`` (lock held), as ``start_call_locked``: the worker goes back to idle, or a
        late reply of a retired worker is dropped (and counted)."""
        idle = lc.call_replied(slot.state, generation, call_id, at)
        if idle is not None:
            self._store(slot, idle)
        else:
            self.apply_locked(slot, lc.Replied(generation, call_id, at))

    # The plain call's start and a replied call's end (``Pool.start_plain``, ``_lease.settle_ok``)
    # are one call of the gate each on every small call's path, where each Python call costs
    # about 0.2-0.3 us on one CPU (benchmarks/HISTORY.md, eleventh round): each does without an
    # event object what ``start_call_locked`` and ``replied_locked`` do; the lease and the
    # counters are ``_lease``'s, in the same lock section.

    def start_plain_locked(
        self, ticket: Ticket, slot: Slot, idle: lc.Idle, call_id: int, at: float
    ) -> None:
        """Start the plain call (lock held): ``CallStarted`` on ``slot``, free, whose state is
        ``idle`` (read under this lock); ``_lease.lease_plain`` leases and counts it in
        the same lock section."""
        # Never None: the per-call pair, an Idle of its own generation (no assert on this path).
        started = lc.call_started(idle, idle.generation, call_id, at)
        self._store(slot, started)  # type: ignore[arg-type]
        ticket.ran_on = slot
        ticket.generation = idle.generation
        ticket.call_id = call_id

    def settle_ok_locked(self, ticket: Ticket, slot: Slot, at: float) -> bool:
        """``Replied`` at ``at`` for a call that holds its slot and replied ok (lock held), as
        ``replied_locked``; ``_lease.settle_ok`` releases and counts in the same lock section.
        True if the worker is idle again; False if the gate dropped the late reply (it was
        retired meanwhile). ``slot`` is the one the call holds."""
        idle = lc.call_replied(slot.state, ticket.generation, ticket.call_id, at)
        if idle is not None:
            self._store(slot, idle)
            return True
        self.apply_locked(slot, lc.Replied(ticket.generation, ticket.call_id, at))
        return False

    def apply(self, slot: Slot, event: lc.Event) -> bool:
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

    def arm_grace(self, slot: Slot, effect: lc.SendCancel) -> None:
        """After the grace, the gate decides: the call still running is killed; a call that
        ended (or any other call) is left alone, since the event names call id and request."""
        expired = lc.CancelGraceExpired(effect.generation, effect.call_id, effect.requested_at)

        def fire() -> None:
            self.apply(slot, expired)

        self.call_later(effect.grace, fire)

    def recover_stuck(self) -> int:
        """Retire every stuck slot (``stuck_locked``) through the gate (``StartFailed``: its
        process, if one was forked, is stopped), so the next call starts a fresh worker there.
        Returns how many."""
        recovered = 0
        for slot in self.slots:
            with self.lock:  # (no ``continue`` in here: mypyc cannot compile one in a ``with``)
                state = slot.state
                stuck = state is not None and stuck_locked(slot)
            if stuck and state is not None and self.apply(slot, lc.StartFailed(state.generation)):
                recovered += 1
        return recovered

    def set_env_state(self, state: lc.EnvState) -> None:
        """The one write of the crash-loop breaker's state, of a value ``_lifecycle`` computed
        (lock held): ``abandoned_locked`` lifts a timed block that ran out,
        ``_policies.record_death`` counts a death, ``Pool.reset`` brings the env back."""
        self.env_state = state

    def abandoned_locked(self, now: float) -> lc.EnvAbandoned | None:
        """The abandonment in force as of ``now`` (entry lock held), or None. A timed one
        (``abandon_for``) whose time has come is lifted here, on the first look after it: no
        timer, and the check and the next spawn happen under the same lock, so two callers
        cannot both see the block and one of them start a worker."""
        state = self.env_state
        if not isinstance(state, lc.EnvAbandoned):
            return None
        self.set_env_state(lc.lift_expired(state, now))
        return self.env_state if isinstance(self.env_state, lc.EnvAbandoned) else None

    def snapshot(self, now: float | None = None, restart_window: float | None = None) -> EnvStats:
        """Frozen counters; ``now`` (the pool's clock) lifts a timed abandonment that ran out,
        so ``abandoned`` says what the next call would meet, and with ``restart_window`` (the
        pool's; the env's own ``breaker`` wins) ``restarts_in_window`` counts only the deaths
        the breaker would still count now."""
        with self.lock:
            if now is not None:
                self.abandoned_locked(now)
            workers = tuple(worker_stats(s) for s in self.slots)
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
                restarts_in_window=self._deaths_in_window(now, restart_window),
                live_refs=sum(w.live_refs for w in workers),
                abandoned=isinstance(self.env_state, lc.EnvAbandoned),
                log_lines_dropped=self.log_lines_dropped
                + sum(s.process.log.dropped for s in self.slots if s.process is not None),
                shared_memory=primary.shared_memory,
                settings=self.settings,
                own_settings=tuple(self.own_settings),
            )

    def _deaths_in_window(self, now: float | None, restart_window: float | None) -> int:
        """Deaths the breaker counts as of ``now`` (lock held). The deaths kept are pruned only
        when the next one is recorded, so an old one would otherwise count for ever. An
        abandonment keeps the deaths that tripped it, all of them."""
        state = self.env_state
        if self.breaker is not None:
            restart_window = self.breaker.restart_window
        if isinstance(state, lc.EnvAbandoned) or now is None or restart_window is None:
            return len(state.deaths)
        return sum(1 for death in state.deaths if now - death.at <= restart_window)


def worker_stats(slot: Slot) -> WorkerStats:
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
        STATE_NAMES[type(state)],
        reason,
        startup,
        idle_since,
        len(slot.live_refs),
        slot.process.shm_state if slot.process is not None else None,
        stuck_locked(slot),
    )


def stuck_locked(slot: Slot) -> bool:
    """A slot starting with no start in progress (lock held): only the caller that leases a
    slot starts its worker, and it records the start's outcome before it lets go of the
    lease, so a slot starting and not leased was left by a start that never ended (an
    interrupt the pool did not hold back). Nothing moves it on by itself; ``recover_stuck``
    (``Pool.reset``, the reaper) does."""
    return type(slot.state) is lc.Starting and not slot.leased


def run_effects(
    effects: tuple[lc.Effect, ...],
    process: WorkerGeneration | None,
    leased: bool,
    entry: EnvEntry | None = None,
    slot: Slot | None = None,
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


def holds(slot: Slot, generation: int) -> bool:
    """Is ``generation`` still the live occupant of ``slot``?"""
    state = slot.state
    return (
        state is not None and state.generation == generation and not isinstance(state, lc.Retired)
    )
