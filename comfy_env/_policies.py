"""Policies: decisions about workers that read the core and act only through its gate.

Data flow (each policy observes, decides with the pure ``_lifecycle`` helpers, and submits an
event; none of them assigns a state)::

    idle reaper   reactor timer -> reap_idle(entries, now)  (Pool.retire_idle(env): one env, now)
                    under entry lock: lc.idle_expired(state, now) -> IdleExpired(idle_since)
                    refs held?  -> ReapHooks.run(env, generation) outside every lock
                    under entry lock again: gate(IdleExpired) -> KillWorker(ASK) -> run_effects
    health ping   call path, before an idle worker that idled ping_after_idle gets a call:
                    ping(entry, slot, process) -> False: gate(PingFailed), a fresh worker runs it
    breaker       reactor, once a death's exit code and output are final:
                    record_death(...) -> lc.record_death -> EnvAbandoned (event + log) or not
                    (the env's own ``Pool.set_breaker`` settings, else the pool's; with
                    ``abandon_for`` the block carries its end, and the call path's
                    ``EnvEntry.abandoned_locked(now)`` lifts it on the first look after it)
    dropped refs  reactor, woken by a dropped ref (RemoteRef.__del__/discard, lock-free) or
                    by a slot freed with refs still queued (``_lease.settle``), through
                    ``Spawner.refs_dropped``:
                    release_idle(entry) -> under entry lock: idle, not leased -> one
                    release frame, written without blocking
                  call path, before a call on the worker holding them (the slot was handed
                    from call to call with refs queued):
                    release_dropped_refs(entry, slot, process) -> one release frame

**Races these prevent**: the reaper's decision names the ``idle_since`` it saw, so a worker
that ran a call in between (or is leased by a caller right now) is never reaped: the gate drops
the stale ``IdleExpired``. Reap hooks run outside every pool lock (a hook may take its own
locks, and ``RemoteRef.discard`` takes the entry lock), so the reaper re-checks under the lock
afterwards. Garbage-collected refs are appended to ``dropped_refs`` lock-free (``__del__`` may
run anywhere, even under a pool lock) and drained here under the lock; refs of a generation
that is gone are dropped with it. The background release writes its frame only to a worker that
is idle and not leased, under the entry lock: no call's frames can interleave with it, and no
caller, reaper or close ever sees the slot taken by it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from comfy_env_worker.protocol import PartialSend

from . import _lifecycle as lc
from ._entry import holds, run_effects
from ._errors import ArgumentError, signal_name
from ._events import Dispatcher, EnvAbandoned
from ._failures import abandoned_error
from ._settings import check_timeout

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._entry import EnvEntry, Slot
    from ._settings import Settings

_log = logging.getLogger("comfy_env")

ReapHook = Callable[[str, int], object]


class ReapHooks:
    """Host-side owners of RemoteRefs, asked before the idle reaper retires a worker holding
    refs (``Pool.add_reap_hook``). A tuple, replaced whole: the reaper reads it without a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: tuple[ReapHook, ...] = ()

    def add(self, hook: ReapHook) -> Callable[[], None]:
        """Add ``hook``; returns a function that removes it."""
        with self._lock:
            self._hooks = (*self._hooks, hook)

        def remove() -> None:
            with self._lock:
                self._hooks = tuple(h for h in self._hooks if h is not hook)

        return remove

    def run(self, env: str, generation: int) -> bool:
        """Run the reap hooks; False if there are none (nothing can change)."""
        hooks = self._hooks
        for hook in hooks:  # every hook runs: each lets go of its own refs
            try:
                hook(env, generation)
            except Exception:  # noqa: BLE001 - a hook's bug keeps the worker, never breaks the reaper
                _log.exception(
                    "comfy-env: reap hook %r failed for %s generation %d", hook, env, generation
                )
        return bool(hooks)


def reap_time(now: float | None, clock: Callable[[], float]) -> float:
    """The time ``Pool.reap_idle(now)`` reaps as of: ``now``, or the pool's ``clock()`` for
    None. A ``now`` that is no finite number (a bool, a str, NaN, which compared as "idle long
    enough" for every worker) is an ``ArgumentError``: callers without a type checker get a
    typed error, not a wrong reap."""
    if now is None:
        return clock()
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ArgumentError(
            f"now must be a finite time on the pool's clock (time.monotonic() unless the "
            f"pool was given another) or None, not {now!r}"
        )
    return float(now)


def held_refs(entry: EnvEntry, slot: Slot) -> set[int]:
    """The slot's refs that someone in the host still holds (entry lock held): live refs minus
    those garbage collected and queued for release (``dropped_refs``, released by the reactor
    in a moment, ``release_idle``), which must not keep an idle worker from being reaped."""
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


def reap_idle(entries: Iterable[EnvEntry], now: float, config: Settings, hooks: ReapHooks) -> int:
    """Retire workers idle longer than their env's ``idle_timeout`` (``entry.settings``: the
    pool's, or the env's own) as of ``now``; returns how many.

    The decision and its application happen under the env's lock, and the decision names the
    ``idle_since`` it observed, so a worker that ran a call in between (or is leased by a caller
    right now) is never reaped."""
    reaped = 0
    for entry in entries:
        idle_timeout = entry.settings.idle_timeout
        if idle_timeout is not None:
            keep = not config.reap_with_refs
            reaped += _retire_expired((entry,), now, idle_timeout, keep, hooks)
    return reaped


def retire_idle(entry: EnvEntry, now: float) -> int:
    """Retire every idle worker of one env now, as the reaper would once its ``idle_timeout``
    passed (``Pool.retire_idle``); returns how many. A worker in a call, leased by a caller or
    holding live ``RemoteRef`` s is kept, and no reap hook is asked: what someone still holds
    or uses is never taken from them. Same gate, same race rule as ``reap_idle``."""
    return _retire_expired((entry,), now, 0.0, True, None)


def _retire_expired(
    entries: Iterable[EnvEntry],
    now: float,
    idle_timeout: float,
    keep_with_refs: bool,
    hooks: ReapHooks | None,
) -> int:
    reaped = 0
    for entry in entries:
        for slot in entry.slots:
            with entry.lock:
                if slot.leased:
                    continue
                decision = lc.idle_expired(slot.state, now, idle_timeout)
                if decision is None:
                    continue
                held = bool(held_refs(entry, slot)) and keep_with_refs
            if held:
                # Outside the lock: a hook may take its own locks (ComfyUI's queue mutex)
                # and discards its refs (RemoteRef.discard takes the entry lock).
                if hooks is None or not hooks.run(entry.spec.key, decision.generation):
                    continue
            with entry.lock:
                if slot.leased or (held_refs(entry, slot) and keep_with_refs):
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


def ping(entry: EnvEntry, slot: Slot, process: WorkerGeneration, timeout: float) -> bool:
    """Health-check a worker that sat idle a long time, before trusting it with a call; a
    silent one is retired through the gate (``PingFailed``)."""
    ok = process.ping(timeout)
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


def release_dropped_refs(entry: EnvEntry, slot: Slot, process: WorkerGeneration) -> None:
    """Release dropped refs of the worker the caller holds the lease of (before its call);
    requeue the others."""
    with entry.lock:
        mine = _take_locked(entry, slot, process.generation)
        # Garbage-collected refs are still counted live; discarded ones (RemoteRef.discard)
        # were uncounted at once. Both are released here.
        slot.live_refs.difference_update(mine)
    if mine:
        try:
            process.release_refs(mine)
        except OSError:
            pass  # the worker is gone, and its objects with it


# Ids per release frame sent by ``release_idle``: its pickle stays a few KiB, far below what a
# non-blocking send writes whole (on Linux a stream socket writes a message under half its
# buffer, ~100 KiB, whole or not at all).
_RELEASE_BATCH = 1024


def release_idle(entry: EnvEntry) -> int:
    """The background release of dropped refs (the reactor runs it, woken by
    ``RemoteRef.__del__``/``discard`` or by a slot freed with refs still queued): the refs of
    an idle worker nobody leases go to it now; returns how many.

    The release frame is written under the entry's lock, without blocking: a slot that is
    idle and not leased has nobody writing on its channel, and nobody can lease it (or retire
    it and write SHUTDOWN, or dispose of its channel) until the lock is released, so the frame
    can neither interleave with a call's frames nor be seen half-done by a caller, the reaper
    or ``close``. Refs of a slot in a call (or starting) stay queued: the call's end wakes this
    again (``Pool.settle``), and a call handed the slot directly releases them before it is
    sent (``release_dropped_refs``). Refs of a generation that is gone are dropped: the object
    died with it, and a frame must never reach a later generation that reuses the id. A full
    channel (a stopped worker) leaves them queued for the next call."""
    released = 0
    torn: list[tuple[tuple[lc.Effect, ...], WorkerGeneration]] = []
    with entry.lock:
        for slot in entry.slots:
            state = slot.state
            process = slot.process
            if (
                slot.leased
                or type(state) is not lc.Idle
                or process is None
                or process.generation != state.generation
            ):
                continue
            generation = state.generation
            mine = _take_locked(entry, slot, generation)
            sent = 0
            try:
                while sent < len(mine):
                    batch = mine[sent : sent + _RELEASE_BATCH]
                    if not process.release_refs_now(batch):
                        break  # the channel is full: the next call releases them
                    sent += len(batch)
            except PartialSend:
                # Never seen (see _RELEASE_BATCH): the worker holds part of a frame, so its
                # stream is torn. Retired like any torn stream, the objects with it, before
                # the lock is released: no caller may lease it and write after the fragment.
                effects = entry.apply_locked(slot, lc.ProtocolViolated(generation))
                if effects is not None:
                    torn.append((effects, process))
                continue
            slot.live_refs.difference_update(mine[:sent])
            released += sent
            entry.dropped_refs.extend((slot, generation, i) for i in mine[sent:])
        _take_locked(entry, None, 0)  # purges refs of generations that are gone
    for effects, process in torn:  # (as ``EnvEntry.apply``: nobody leases these slots)
        run_effects(effects, process, False)
        process.dispose()
    return released


def _take_locked(entry: EnvEntry, slot: Slot | None, generation: int) -> list[int]:
    """Take the ids of the dropped refs of ``(slot, generation)`` out of ``entry.dropped_refs``
    (entry lock held); refs of a generation that is gone are dropped, the rest stay queued, in
    order. ``RemoteRef.__del__`` appends without the lock meanwhile (even on this thread, from
    a gc pass in this loop): the loop pops from the left, it appends on the right, nothing is
    lost."""
    taken: list[int] = []
    others: list[tuple[Slot, int, int]] = []
    queue = entry.dropped_refs
    while queue:
        ref_slot, ref_generation, ref_id = queue.popleft()
        if ref_slot is slot and ref_generation == generation:
            taken.append(ref_id)
        elif holds(ref_slot, ref_generation):
            others.append((ref_slot, ref_generation, ref_id))
        # else: its generation is gone, and the object with it
    queue.extend(others)
    return taken


def breaker_for(
    settings: Settings,
    max_restarts: int | None,
    restart_window: float | None,
    abandon_for: float | None,
) -> lc.Breaker:
    """``Pool.set_breaker``'s breaker: each value given, else the pool's (``settings``). A
    value ``PoolConfig`` would refuse is an ``ArgumentError``."""
    if max_restarts is not None and (
        isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0
    ):
        raise ArgumentError(f"max_restarts must be an int >= 0, not {max_restarts!r}")
    window = check_timeout(restart_window, "restart_window", "the pool's value")
    lasting = check_timeout(abandon_for, "abandon_for", "the pool's value")
    return lc.Breaker(
        settings.max_restarts if max_restarts is None else max_restarts,
        settings.restart_window if window is None else window,
        settings.abandon_for if lasting is None else lasting,
    )


def reset_env(entry: EnvEntry) -> bool:
    """``Pool.reset``'s bookkeeping: the breaker back to active and the "too old Python" mark
    forgotten (the env's Python may have been replaced). Returns whether the env was
    abandoned (``EnvReset`` is due)."""
    with entry.lock:
        was_abandoned = isinstance(entry.env_state, lc.EnvAbandoned)
        entry.set_env_state(lc.EnvActive())
        entry.unsupported = None
    return was_abandoned


def death_of(
    generation: int, reason: lc.RetireReason, returncode: int | None, tail: str, at: float
) -> lc.Death:
    """The breaker's record of generation ``generation``'s death (``at`` on the pool's
    clock; the wall time is now)."""
    return lc.Death(
        at=at,
        when=time.time(),
        generation=generation,
        reason=reason,
        exitcode=returncode,
        signal=signal_name(returncode),
        stderr_tail=tail,
    )


def record_death(entry: EnvEntry, death: lc.Death, config: Settings, events: Dispatcher) -> None:
    """The crash-loop breaker's bookkeeping: count ``death`` (``death_of``); too many in the
    window abandon the env (logged, and ``EnvAbandoned`` emitted once)."""
    at = death.at
    breaker = entry.breaker or lc.Breaker(
        config.max_restarts, config.restart_window, config.abandon_for
    )
    with entry.lock:
        before = lc.lift_expired(entry.env_state, at)  # a timed block that ran out is over
        entry.set_env_state(
            lc.record_death(
                before, death, breaker.max_restarts, breaker.restart_window, breaker.abandon_for
            )
        )
        tripped = entry.env_state if before is not entry.env_state else None
    if isinstance(tripped, lc.EnvAbandoned) and not isinstance(before, lc.EnvAbandoned):
        _log.error(
            "comfy-env: %s", abandoned_error(entry.spec.key, tripped, entry.breaker is not None)
        )
        events.emit(EnvAbandoned(entry.spec.key, tripped.deaths))
