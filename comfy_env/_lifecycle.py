"""The worker lifecycle as data: states, events, and the pure transition function ``step``.

A *slot* is a place for one worker process in an env. Each process that occupies it gets a new
*generation* (counted per env) and runs through::

    (empty) --SpawnBegan--> Starting --HandshakeOk--> Idle <--CallStarted/Replied--> InCall
                                |                      |                              |
                                +------ StartFailed, Exited, ChannelClosed, DeadlineHit,
                                        CallCancelled, CancelGraceExpired, ProtocolViolated,
                                        CloseRequested, IdleExpired --------------> Retired

Cancellation is cooperative first: ``CancelRequested(call id, grace)`` keeps the slot
``InCall`` but marks it asked (``cancel_requested_at``) and returns the ``SendCancel`` effect
(CANCEL frame + grace timer). If the worker stops the call in time its reply arrives as
``Replied`` and the worker goes back to ``Idle`` in the same generation, caches intact; if not,
``CancelGraceExpired`` (naming the call id and the request time it is about) retires it. Both
name their call id, so a cancel or a late grace timer of call N never touches call N+1.

``Retired`` is terminal for its generation: no event moves it back. The slot only moves on by
``SpawnBegan`` of a *newer* generation, which is how "never restart a process inside an existing
generation" is made structural.

Every event carries the generation it is about. ``step`` drops an event whose generation is
not the slot's current one (a late frame, a late exit notice, a late timer decision), or that
does not apply to the current state; it returns ``Dropped`` with the reason, and the caller (the
pool's gate) counts it. Observations carry what they observed: ``IdleExpired`` names the
``idle_since`` it saw, so it cannot retire a worker that ran a call in between; ``Replied`` and
``DeadlineHit`` name their call id.

``step`` reads no clock and touches no process: timestamps come in on events, and effects
(``KillWorker``) go out as values for the gate to run after it released its lock. Every
(state, event) pair is therefore a table test.
"""

from __future__ import annotations

import enum
from typing import NoReturn

from ._values import value


def assert_never(unhandled: NoReturn) -> NoReturn:
    """Exhaustiveness check: mypy proves this line unreachable."""
    raise AssertionError(f"unhandled state {unhandled!r}")


class RetireReason(str, enum.Enum):
    """Why a generation ended."""

    START_FAILED = "start_failed"
    CRASHED = "crashed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    PROTOCOL_ERROR = "protocol_error"
    PING_FAILED = "ping_failed"
    IDLE = "idle"
    CLOSED = "closed"


class CancelKill(str, enum.Enum):
    """How a cancel ended in the kill of its worker (a ``CANCELLED`` retirement); the caller's
    ``CallCancelled`` tells which, since only the first says anything about the grace."""

    GRACE_EXPIRED = "grace_expired"  # asked to stop, it did not within cancel_grace
    SECOND_CANCEL = "second_cancel"  # cancelled again while the first cancel was pending
    FORCED = "forced"  # a cancel that asked for the kill at once, none pending before it
    NO_GRACE = "no_grace"  # cancel_grace 0: no asking first


# Retirements that count as deaths for the crash-loop breaker: the worker broke. Timeouts,
# cancellations, reaping and closing are the pool's own decisions and do not count.
DEATHS = frozenset(
    {
        RetireReason.START_FAILED,
        RetireReason.CRASHED,
        RetireReason.PROTOCOL_ERROR,
        RetireReason.PING_FAILED,
    }
)


class Stop(str, enum.Enum):
    """How a retired generation's process is stopped."""

    ASK = "ask"  # an idle worker: SHUTDOWN frame (its release hooks run), SIGKILL after grace
    TERMINATE = "terminate"  # a busy worker: SIGTERM to its group, SIGKILL after grace
    KILL = "kill"  # dead or misbehaving: SIGKILL to its group at once


# ---- states ---------------------------------------------------------------------------------


@value
class Starting:
    """The process is being launched, handshaken and canaried; not yet trusted."""

    generation: int


@value
class Idle:
    """Verified and waiting for a call since ``idle_since`` (a monotonic time)."""

    generation: int
    pid: int
    idle_since: float


@value
class InCall:
    """Running call ``call_id`` since ``started_at``. ``cancel_requested_at`` is set once the
    worker was asked to stop the call (a CANCEL frame went out; the grace timer runs)."""

    generation: int
    pid: int
    call_id: int
    started_at: float
    cancel_requested_at: float | None = None


@value
class Retired:
    """Terminal: this generation is over. ``pid`` is None if it never reported one."""

    generation: int
    reason: RetireReason
    pid: int | None


State = Starting | Idle | InCall | Retired
LiveState = Starting | Idle | InCall

# ---- events ---------------------------------------------------------------------------------


@value
class SpawnBegan:
    """A caller claimed the empty slot to launch generation ``generation``."""

    generation: int


@value
class HandshakeOk:
    """Handshake and canary passed; ``pid`` is the interpreter's own pid (from its hello)."""

    generation: int
    pid: int
    at: float


@value
class StartFailed:
    """Launch, handshake or canary failed."""

    generation: int


@value
class CallStarted:
    generation: int
    call_id: int
    at: float


@value
class Replied:
    """A complete reply frame for ``call_id`` arrived."""

    generation: int
    call_id: int
    at: float


@value
class Exited:
    """The process exited (seen by the exit watcher)."""

    generation: int
    returncode: int | None


@value
class ChannelClosed:
    """EOF on the channel (the process may still be alive)."""

    generation: int


@value
class DeadlineHit:
    generation: int
    call_id: int


@value
class CallCancelled:
    """Stop the worker running ``call_id`` now (a cancel with no grace, or the escalation of a
    second cancel while the first one is pending)."""

    generation: int
    call_id: int


@value
class CancelRequested:
    """Someone cancelled running call ``call_id`` at ``at``: ask the worker first, and kill it
    if the call has not ended ``grace`` seconds later (``grace`` 0: kill at once)."""

    generation: int
    call_id: int
    at: float
    grace: float


@value
class CancelGraceExpired:
    """The grace timer of the cancel requested at ``requested_at`` for ``call_id`` fired."""

    generation: int
    call_id: int
    requested_at: float


@value
class ProtocolViolated:
    """A malformed frame arrived (or was about to be sent)."""

    generation: int


@value
class CloseRequested:
    generation: int


@value
class IdleExpired:
    """The reaper saw the worker idle since ``idle_since`` for longer than allowed."""

    generation: int
    idle_since: float


@value
class PingFailed:
    """The health ping before a call on a long-idle worker got no answer in time."""

    generation: int


Event = (
    SpawnBegan
    | HandshakeOk
    | StartFailed
    | CallStarted
    | Replied
    | Exited
    | ChannelClosed
    | DeadlineHit
    | CallCancelled
    | CancelRequested
    | CancelGraceExpired
    | ProtocolViolated
    | CloseRequested
    | IdleExpired
    | PingFailed
)

# ---- effects and results --------------------------------------------------------------------


@value
class KillWorker:
    """Stop generation ``generation``'s process group, as ``stop`` says."""

    generation: int
    stop: Stop


@value
class SendCancel:
    """Send a CANCEL frame for ``call_id`` to generation ``generation``'s worker and start its
    grace timer: ``CancelGraceExpired(generation, call_id, requested_at)`` after ``grace``."""

    generation: int
    call_id: int
    requested_at: float
    grace: float


Effect = KillWorker | SendCancel


@value
class Transition:
    state: State
    effects: tuple[Effect, ...] = ()


@value
class Dropped:
    """The event changed nothing; ``reason`` says why (for stats and debugging)."""

    reason: str


STALE = "stale generation"
OUTDATED = "observation out of date"  # right generation, but about another call or idle period
TERMINAL = "generation already retired"
NOT_APPLICABLE = "does not apply in this state"
NO_WORKER = "slot is empty"

# How each retiring event ends a live generation in any state: (reason, how to stop it).
_RETIRING: dict[type, tuple[RetireReason, Stop]] = {
    Exited: (RetireReason.CRASHED, Stop.KILL),
    ChannelClosed: (RetireReason.CRASHED, Stop.KILL),
    ProtocolViolated: (RetireReason.PROTOCOL_ERROR, Stop.KILL),
}


def _retire(state: LiveState, reason: RetireReason, stop: Stop) -> Transition:
    if isinstance(state, Starting):
        # A death during start-up is a failed start (the breaker counts it); a close is not.
        if reason in (RetireReason.CRASHED, RetireReason.PROTOCOL_ERROR):
            reason = RetireReason.START_FAILED
        pid = None
    else:
        pid = state.pid
    return Transition(Retired(state.generation, reason, pid), (KillWorker(state.generation, stop),))


_STALE = Dropped(STALE)
_OUTDATED = Dropped(OUTDATED)
_TERMINAL = Dropped(TERMINAL)
_NOT_APPLICABLE = Dropped(NOT_APPLICABLE)
_NO_WORKER = Dropped(NO_WORKER)


def call_started(state: State | None, generation: int, call_id: int, at: float) -> InCall | None:
    """``step(state, CallStarted(generation, call_id, at))`` for the per-call pair, without the
    event and the ``Transition`` (on every call's path): the new state when it is the pair
    (an ``Idle`` of that generation), else None, and ``step`` decides."""
    if type(state) is Idle and generation == state.generation:
        return InCall(generation, state.pid, call_id, at)
    return None


def call_replied(state: State | None, generation: int, call_id: int, at: float) -> Idle | None:
    """``step(state, Replied(generation, call_id, at))`` for the per-call pair, as
    ``call_started``: the new state when ``state`` is that call in that generation, else None
    (and ``step`` decides: a late reply of a retired worker is dropped)."""
    if type(state) is InCall and generation == state.generation and call_id == state.call_id:
        return Idle(generation, state.pid, at)
    return None


def step(state: State | None, event: Event) -> Transition | Dropped:
    """The next state of a slot (``None``: never used) after ``event``, or why it was dropped.

    The call path asks ``call_started`` and ``call_replied`` for the two per-call pairs,
    (Idle, CallStarted) and (InCall, Replied) of the current generation and call, which build
    no event; the rules below give the same answers. Drops return preallocated ``Dropped``
    values."""
    if isinstance(event, SpawnBegan):
        if state is None or (isinstance(state, Retired) and event.generation > state.generation):
            return Transition(Starting(event.generation))
        if event.generation <= state.generation:
            return _STALE
        return _NOT_APPLICABLE  # a live worker occupies the slot
    if state is None:
        return _NO_WORKER
    if event.generation != state.generation:
        return _STALE
    if isinstance(state, Retired):
        return _TERMINAL
    if isinstance(state, Idle):
        if isinstance(event, CallStarted):
            return Transition(InCall(state.generation, state.pid, event.call_id, event.at))
        if isinstance(event, IdleExpired):
            if event.idle_since != state.idle_since:
                return _OUTDATED  # the worker ran a call after the reaper looked
            return _retire(state, RetireReason.IDLE, Stop.ASK)
        if isinstance(event, PingFailed):
            return _retire(state, RetireReason.PING_FAILED, Stop.KILL)
        if isinstance(event, CloseRequested):
            return _retire(state, RetireReason.CLOSED, Stop.ASK)
    elif isinstance(state, InCall):
        if isinstance(event, (Replied, DeadlineHit, CallCancelled, CancelRequested)):
            if event.call_id != state.call_id:
                return _OUTDATED  # late news about another call: a cancel of N never hits N+1
            if isinstance(event, Replied):
                # Also the end of a cancelled call the worker stopped in time: it lives on.
                return Transition(Idle(state.generation, state.pid, event.at))
            if isinstance(event, DeadlineHit):
                return _retire(state, RetireReason.TIMEOUT, Stop.TERMINATE)
            if isinstance(event, CancelRequested):
                if state.cancel_requested_at is not None:
                    return _NOT_APPLICABLE  # already asked; the grace timer runs
                if event.grace <= 0:
                    return _retire(state, RetireReason.CANCELLED, Stop.KILL)
                asked = InCall(
                    state.generation, state.pid, state.call_id, state.started_at, event.at
                )
                cancel = SendCancel(state.generation, state.call_id, event.at, event.grace)
                return Transition(asked, (cancel,))
            return _retire(state, RetireReason.CANCELLED, Stop.KILL)
        if isinstance(event, CancelGraceExpired):
            if event.call_id != state.call_id or event.requested_at != state.cancel_requested_at:
                return _OUTDATED  # the call ended in time (and maybe another one runs now)
            return _retire(state, RetireReason.CANCELLED, Stop.KILL)
        if isinstance(event, CloseRequested):
            return _retire(state, RetireReason.CLOSED, Stop.TERMINATE)
    elif isinstance(state, Starting):
        if isinstance(event, HandshakeOk):
            return Transition(Idle(state.generation, event.pid, event.at))
        if isinstance(event, StartFailed):
            return _retire(state, RetireReason.START_FAILED, Stop.KILL)
        if isinstance(event, CloseRequested):
            return _retire(state, RetireReason.CLOSED, Stop.TERMINATE)
    else:
        assert_never(state)
    rule = _RETIRING.get(type(event))
    if rule is not None:
        return _retire(state, *rule)
    return _NOT_APPLICABLE


def cancel_kill(state: State | None, event: Event) -> CancelKill | None:
    """How ``event`` ends ``state`` if ``step`` retires it as ``CANCELLED``, read from the state
    *before* the event (whether a cancel was pending is lost once it is retired); None for an
    event that is no cancel's kill. The gate records it on the retired generation."""
    if not isinstance(state, InCall):
        return None
    if isinstance(event, CancelGraceExpired):
        return CancelKill.GRACE_EXPIRED
    if isinstance(event, CallCancelled):
        if state.cancel_requested_at is not None:
            return CancelKill.SECOND_CANCEL
        return CancelKill.FORCED
    if isinstance(event, CancelRequested) and event.grace <= 0:
        return CancelKill.NO_GRACE
    return None


# ---- policy decisions (pure: the pool's reaper and caller apply them) ------------------------


def idle_expired(state: State | None, now: float, idle_timeout: float | None) -> IdleExpired | None:
    """The reaper's observation: ``IdleExpired`` naming the ``idle_since`` it saw, if the slot's
    worker has been idle for at least ``idle_timeout``; else None."""
    if idle_timeout is None or not isinstance(state, Idle):
        return None
    if now - state.idle_since < idle_timeout:
        return None
    return IdleExpired(state.generation, state.idle_since)


def needs_ping(state: State | None, now: float, ping_after_idle: float | None) -> bool:
    """Whether a call about to run on this slot must ping its worker first."""
    return (
        ping_after_idle is not None
        and isinstance(state, Idle)
        and now - state.idle_since >= ping_after_idle
    )


# ---- the env's own typestate: the crash-loop breaker -----------------------------------------


@value
class Death:
    """One worker death the breaker counts. ``at`` is on the pool's clock (monotonic), ``when``
    wall time for people."""

    at: float
    when: float
    generation: int
    reason: RetireReason
    exitcode: int | None
    signal: str | None
    stderr_tail: str


@value
class EnvActive:
    """Calls are served. ``deaths``: those still inside the restart window."""

    deaths: tuple[Death, ...] = ()


@value
class EnvAbandoned:
    """The env died too often; calls fail fast. Terminal until reset when ``until`` is None
    (the default); else the block lifts by itself once the pool's clock reaches ``until``
    (``PoolConfig.abandon_for`` seconds after the death that tripped the breaker)."""

    deaths: tuple[Death, ...]
    at: float
    until: float | None = None


@value
class Breaker:
    """One env's crash-loop breaker settings (``PoolConfig.max_restarts``, ``restart_window``,
    ``abandon_for``, or an env's own from ``Pool.set_breaker``)."""

    max_restarts: int
    restart_window: float
    abandon_for: float | None = None


EnvState = EnvActive | EnvAbandoned


def lift_expired(state: EnvState, now: float) -> EnvState:
    """``state``, or a fresh ``EnvActive`` if it is an abandonment whose ``until`` has come
    (the deaths that tripped it are forgotten, as ``Pool.reset`` forgets them: one more death
    must not trip the breaker again at once)."""
    if isinstance(state, EnvAbandoned) and state.until is not None and now >= state.until:
        return EnvActive()
    return state


def record_death(
    state: EnvState,
    death: Death,
    max_restarts: int,
    restart_window: float,
    abandon_for: float | None = None,
) -> EnvState:
    """The breaker: more than ``max_restarts`` deaths within ``restart_window`` seconds abandon
    the env (for ``abandon_for`` seconds, None: until reset). Abandoned is sticky while it is
    in force: later deaths (late exit notices) change nothing."""
    state = lift_expired(state, death.at)
    if isinstance(state, EnvAbandoned):
        return state
    recent = (*(d for d in state.deaths if death.at - d.at <= restart_window), death)
    if len(recent) > max_restarts:
        until = None if abandon_for is None else death.at + abandon_for
        return EnvAbandoned(recent, death.at, until)
    return EnvActive(recent)
