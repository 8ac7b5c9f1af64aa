"""Table tests for the worker lifecycle (``comfy_env._lifecycle``): no process, no clock.

What this file proves:

* ``EXPECTED`` is an explicit, auditable table of the outcome of ``step`` for every
  (state, event class) pair -- the never-used slot (``None``), ``Starting``, ``Idle``,
  ``InCall`` and ``Retired`` against every member of the ``Event`` union -- each with the
  event's generation equal to, older than, and newer than the state's.  The outcome is the
  exact next state (generation, pid, ``idle_since`` ...), the exact effects (``KillWorker``
  with its generation and ``Stop`` mode) or the exact ``Dropped`` reason.
* The table is complete: a test fails if an event class (or state class) is added to the
  module without a table row.
* Named promises of the module's docstring are tested one by one (``Retired`` is terminal,
  stale generations change nothing, observations carry what they observed, start-up failures
  are reported as such, ``SpawnBegan`` needs a newer generation, ``step`` is pure).
* The "one writer" rule: the only code in the package that assigns a slot's ``state`` is the
  gate ``EnvEntry.apply_locked`` in ``comfy_env/_entry.py`` (plus ``Slot.__init__`` setting
  the initial ``None``).
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, get_args

import pytest

from comfy_env import _lifecycle as lc
from comfy_env._lifecycle import RetireReason as R
from comfy_env._values import FrozenValueError

# ---- fixed values of the representative states and events ----------------------------------

G = 7  # the generation of every representative state
PID = 4242  # the pid the Idle / InCall / Retired states carry
IDLE_SINCE = 100.0  # Idle's idle_since
CALL_ID = 3  # InCall's call id
STARTED_AT = 200.0  # InCall's started_at
AT = 300.0  # the timestamp every event with an ``at`` carries
HELLO_PID = 5151  # the pid HandshakeOk reports (differs from PID so the table shows its source)
NEXT_CALL_ID = 4  # the call id CallStarted carries
REQUESTED_AT = 250.0  # when the representative cancel of CALL_ID was requested
GRACE = 2.0  # the grace every CancelRequested of the table carries

STATES: dict[str, lc.State | None] = {
    "None": None,
    "Starting": lc.Starting(G),
    "Idle": lc.Idle(G, PID, IDLE_SINCE),
    "InCall": lc.InCall(G, PID, CALL_ID, STARTED_AT),
    # The same call once its worker was asked to stop it (CANCEL frame sent, grace running).
    "Cancelling": lc.InCall(G, PID, CALL_ID, STARTED_AT, REQUESTED_AT),
    "Retired": lc.Retired(G, R.CRASHED, PID),
}

# How each event class is built for a given generation. Observations match the representative
# states: Replied / DeadlineHit / CallCancelled name InCall's call id, IdleExpired names Idle's
# idle_since. Mismatching observations are tested separately below.
EVENT_FACTORIES: dict[type, Callable[[int], lc.Event]] = {
    lc.SpawnBegan: lambda g: lc.SpawnBegan(g),
    lc.HandshakeOk: lambda g: lc.HandshakeOk(g, pid=HELLO_PID, at=AT),
    lc.StartFailed: lambda g: lc.StartFailed(g),
    lc.CallStarted: lambda g: lc.CallStarted(g, call_id=NEXT_CALL_ID, at=AT),
    lc.Replied: lambda g: lc.Replied(g, call_id=CALL_ID, at=AT),
    lc.Exited: lambda g: lc.Exited(g, returncode=-9),
    lc.ChannelClosed: lambda g: lc.ChannelClosed(g),
    lc.DeadlineHit: lambda g: lc.DeadlineHit(g, call_id=CALL_ID),
    lc.CallCancelled: lambda g: lc.CallCancelled(g, call_id=CALL_ID),
    lc.CancelRequested: lambda g: lc.CancelRequested(g, call_id=CALL_ID, at=AT, grace=GRACE),
    lc.CancelGraceExpired: lambda g: lc.CancelGraceExpired(
        g, call_id=CALL_ID, requested_at=REQUESTED_AT
    ),
    lc.ProtocolViolated: lambda g: lc.ProtocolViolated(g),
    lc.CloseRequested: lambda g: lc.CloseRequested(g),
    lc.IdleExpired: lambda g: lc.IdleExpired(g, idle_since=IDLE_SINCE),
    lc.PingFailed: lambda g: lc.PingFailed(g),
}
EVENT_CLASSES: tuple[type, ...] = get_args(lc.Event)

# The event's generation relative to the state's (``None`` has no generation: G is used).
GENERATIONS: dict[str, int] = {"same": G, "older": G - 1, "newer": G + 1}


def make_event(cls: type, generation: int) -> lc.Event:
    return EVENT_FACTORIES[cls](generation)


# ---- the expected outcomes ------------------------------------------------------------------

Outcome = lc.Transition | lc.Dropped

STALE = lc.Dropped(lc.STALE)
OUTDATED = lc.Dropped(lc.OUTDATED)
TERMINAL = lc.Dropped(lc.TERMINAL)
N_A = lc.Dropped(lc.NOT_APPLICABLE)
NO_WORKER = lc.Dropped(lc.NO_WORKER)


class Row(NamedTuple):
    """The outcome with the event's generation equal to, older and newer than the state's."""

    same: Outcome
    older: Outcome
    newer: Outcome


def to(state: lc.State) -> lc.Transition:
    """A transition without effects."""
    return lc.Transition(state)


def retire(reason: lc.RetireReason, stop: lc.Stop, pid: int | None = PID) -> lc.Transition:
    """Retire generation G and stop its process as ``stop`` says."""
    return lc.Transition(lc.Retired(G, reason, pid), (lc.KillWorker(G, stop),))


ASK, TERMINATE, KILL = lc.Stop.ASK, lc.Stop.TERMINATE, lc.Stop.KILL


def current(outcome: Outcome) -> Row:
    """``outcome`` for the slot's own generation; any other generation is stale."""
    return Row(same=outcome, older=STALE, newer=STALE)


EMPTY = Row(NO_WORKER, NO_WORKER, NO_WORKER)
SPAWN_ON_LIVE = Row(same=STALE, older=STALE, newer=N_A)  # a live worker occupies the slot
GONE = current(TERMINAL)  # Retired, for every event but SpawnBegan

EXPECTED: dict[tuple[str, type], Row] = {
    # -- never-used slot: only SpawnBegan (of any generation) applies.
    ("None", lc.SpawnBegan): Row(
        to(lc.Starting(G)), to(lc.Starting(G - 1)), to(lc.Starting(G + 1))
    ),
    ("None", lc.HandshakeOk): EMPTY,
    ("None", lc.StartFailed): EMPTY,
    ("None", lc.CallStarted): EMPTY,
    ("None", lc.Replied): EMPTY,
    ("None", lc.Exited): EMPTY,
    ("None", lc.ChannelClosed): EMPTY,
    ("None", lc.DeadlineHit): EMPTY,
    ("None", lc.CallCancelled): EMPTY,
    ("None", lc.CancelRequested): EMPTY,
    ("None", lc.CancelGraceExpired): EMPTY,
    ("None", lc.ProtocolViolated): EMPTY,
    ("None", lc.CloseRequested): EMPTY,
    ("None", lc.IdleExpired): EMPTY,
    ("None", lc.PingFailed): EMPTY,
    # -- Starting(G): whatever ends a start-up (but a close) is a failed start; no pid yet.
    ("Starting", lc.SpawnBegan): SPAWN_ON_LIVE,
    ("Starting", lc.HandshakeOk): current(to(lc.Idle(G, HELLO_PID, AT))),
    ("Starting", lc.StartFailed): current(retire(R.START_FAILED, KILL, pid=None)),
    ("Starting", lc.CallStarted): current(N_A),
    ("Starting", lc.Replied): current(N_A),
    ("Starting", lc.Exited): current(retire(R.START_FAILED, KILL, pid=None)),
    ("Starting", lc.ChannelClosed): current(retire(R.START_FAILED, KILL, pid=None)),
    ("Starting", lc.DeadlineHit): current(N_A),
    ("Starting", lc.CallCancelled): current(N_A),
    ("Starting", lc.CancelRequested): current(N_A),
    ("Starting", lc.CancelGraceExpired): current(N_A),
    ("Starting", lc.ProtocolViolated): current(retire(R.START_FAILED, KILL, pid=None)),
    ("Starting", lc.CloseRequested): current(retire(R.CLOSED, TERMINATE, pid=None)),
    ("Starting", lc.IdleExpired): current(N_A),
    ("Starting", lc.PingFailed): current(N_A),
    # -- Idle(G, PID, IDLE_SINCE)
    ("Idle", lc.SpawnBegan): SPAWN_ON_LIVE,
    ("Idle", lc.HandshakeOk): current(N_A),
    ("Idle", lc.StartFailed): current(N_A),
    ("Idle", lc.CallStarted): current(to(lc.InCall(G, PID, NEXT_CALL_ID, AT))),
    ("Idle", lc.Replied): current(N_A),
    ("Idle", lc.Exited): current(retire(R.CRASHED, KILL)),
    ("Idle", lc.ChannelClosed): current(retire(R.CRASHED, KILL)),
    ("Idle", lc.DeadlineHit): current(N_A),
    ("Idle", lc.CallCancelled): current(N_A),
    ("Idle", lc.CancelRequested): current(N_A),
    ("Idle", lc.CancelGraceExpired): current(N_A),
    ("Idle", lc.ProtocolViolated): current(retire(R.PROTOCOL_ERROR, KILL)),
    ("Idle", lc.CloseRequested): current(retire(R.CLOSED, ASK)),
    ("Idle", lc.IdleExpired): current(retire(R.IDLE, ASK)),
    ("Idle", lc.PingFailed): current(retire(R.PING_FAILED, KILL)),
    # -- InCall(G, PID, CALL_ID, STARTED_AT)
    ("InCall", lc.SpawnBegan): SPAWN_ON_LIVE,
    ("InCall", lc.HandshakeOk): current(N_A),
    ("InCall", lc.StartFailed): current(N_A),
    ("InCall", lc.CallStarted): current(N_A),
    ("InCall", lc.Replied): current(to(lc.Idle(G, PID, AT))),
    ("InCall", lc.Exited): current(retire(R.CRASHED, KILL)),
    ("InCall", lc.ChannelClosed): current(retire(R.CRASHED, KILL)),
    ("InCall", lc.DeadlineHit): current(retire(R.TIMEOUT, TERMINATE)),
    ("InCall", lc.CallCancelled): current(retire(R.CANCELLED, KILL)),
    # Cooperative first: the call stays InCall, marked asked; a CANCEL frame and the grace
    # timer go out as one effect.
    ("InCall", lc.CancelRequested): current(
        lc.Transition(
            lc.InCall(G, PID, CALL_ID, STARTED_AT, AT),
            (lc.SendCancel(G, CALL_ID, AT, GRACE),),
        )
    ),
    # A grace timer for a cancel this call never had (another request time) is out of date.
    ("InCall", lc.CancelGraceExpired): current(OUTDATED),
    ("InCall", lc.ProtocolViolated): current(retire(R.PROTOCOL_ERROR, KILL)),
    ("InCall", lc.CloseRequested): current(retire(R.CLOSED, TERMINATE)),
    ("InCall", lc.IdleExpired): current(N_A),
    ("InCall", lc.PingFailed): current(N_A),
    # -- InCall(G, PID, CALL_ID, STARTED_AT, REQUESTED_AT): asked to stop call CALL_ID.
    ("Cancelling", lc.SpawnBegan): SPAWN_ON_LIVE,
    ("Cancelling", lc.HandshakeOk): current(N_A),
    ("Cancelling", lc.StartFailed): current(N_A),
    ("Cancelling", lc.CallStarted): current(N_A),
    # The worker stopped the call in time (or its reply crossed the cancel): it lives on.
    ("Cancelling", lc.Replied): current(to(lc.Idle(G, PID, AT))),
    ("Cancelling", lc.Exited): current(retire(R.CRASHED, KILL)),
    ("Cancelling", lc.ChannelClosed): current(retire(R.CRASHED, KILL)),
    ("Cancelling", lc.DeadlineHit): current(retire(R.TIMEOUT, TERMINATE)),
    ("Cancelling", lc.CallCancelled): current(retire(R.CANCELLED, KILL)),  # escalation
    ("Cancelling", lc.CancelRequested): current(N_A),  # already asked; the timer runs
    ("Cancelling", lc.CancelGraceExpired): current(retire(R.CANCELLED, KILL)),
    ("Cancelling", lc.ProtocolViolated): current(retire(R.PROTOCOL_ERROR, KILL)),
    ("Cancelling", lc.CloseRequested): current(retire(R.CLOSED, TERMINATE)),
    ("Cancelling", lc.IdleExpired): current(N_A),
    ("Cancelling", lc.PingFailed): current(N_A),
    # -- Retired(G, CRASHED, PID): terminal; only a newer generation's SpawnBegan moves on.
    ("Retired", lc.SpawnBegan): Row(same=STALE, older=STALE, newer=to(lc.Starting(G + 1))),
    ("Retired", lc.HandshakeOk): GONE,
    ("Retired", lc.StartFailed): GONE,
    ("Retired", lc.CallStarted): GONE,
    ("Retired", lc.Replied): GONE,
    ("Retired", lc.Exited): GONE,
    ("Retired", lc.ChannelClosed): GONE,
    ("Retired", lc.DeadlineHit): GONE,
    ("Retired", lc.CallCancelled): GONE,
    ("Retired", lc.CancelRequested): GONE,
    ("Retired", lc.CancelGraceExpired): GONE,
    ("Retired", lc.ProtocolViolated): GONE,
    ("Retired", lc.CloseRequested): GONE,
    ("Retired", lc.IdleExpired): GONE,
    ("Retired", lc.PingFailed): GONE,
}

# How each retiring event stops the process, by the state it retires (a close asks an idle
# worker to leave, so its release hooks run; it terminates a busy or starting one).
STOP: dict[tuple[str, type], lc.Stop] = {
    **{(name, lc.Exited): KILL for name in ("Starting", "Idle", "InCall")},
    **{(name, lc.ChannelClosed): KILL for name in ("Starting", "Idle", "InCall")},
    **{(name, lc.ProtocolViolated): KILL for name in ("Starting", "Idle", "InCall")},
    ("Starting", lc.StartFailed): KILL,
    ("Starting", lc.CloseRequested): TERMINATE,
    ("Idle", lc.CloseRequested): ASK,
    ("Idle", lc.IdleExpired): ASK,
    ("Idle", lc.PingFailed): KILL,
    ("InCall", lc.DeadlineHit): TERMINATE,
    ("InCall", lc.CallCancelled): KILL,
    ("InCall", lc.CancelRequested): KILL,  # with grace 0 (tested below)
    ("InCall", lc.CancelGraceExpired): KILL,
    ("InCall", lc.CloseRequested): TERMINATE,
}

LIVE = ("Starting", "Idle", "InCall", "Cancelling")


def _table_cases() -> Iterator[object]:
    """Every table row, at every generation."""
    for (state_name, cls), row in EXPECTED.items():
        for relation, generation in GENERATIONS.items():
            yield pytest.param(
                STATES[state_name],
                make_event(cls, generation),
                getattr(row, relation),
                id=f"{state_name}-{cls.__name__}-{relation}",
            )


def _all_pairs() -> Iterator[object]:
    """Every representative state against every event class, at every generation.

    A class without a factory is left out here so that collection still succeeds and
    ``test_table_covers_every_state_and_event`` reports it by name."""
    for state_name, state in STATES.items():
        for cls in (c for c in EVENT_CLASSES if c in EVENT_FACTORIES):
            for relation, generation in GENERATIONS.items():
                yield pytest.param(
                    state,
                    make_event(cls, generation),
                    id=f"{state_name}-{cls.__name__}-{relation}",
                )


TABLE_CASES = list(_table_cases())
ALL_PAIRS = list(_all_pairs())


def name_of(cls: type) -> str:
    return cls.__name__


# ---- the table --------------------------------------------------------------------------------


def test_table_covers_every_state_and_event() -> None:
    assert set(EVENT_FACTORIES) == set(EVENT_CLASSES), "every Event needs a factory"
    state_classes = {type(s) for s in STATES.values() if s is not None}
    assert state_classes == set(get_args(lc.State)), "every State needs a representative"
    assert None in STATES.values(), "the never-used slot needs a representative"
    expected_keys = {(name, cls) for name in STATES for cls in EVENT_CLASSES}
    missing = expected_keys - set(EXPECTED)
    extra = set(EXPECTED) - expected_keys
    assert not missing, f"no table row for {sorted((n, c.__name__) for n, c in missing)}"
    assert not extra, f"rows for unknown pairs {sorted((n, c.__name__) for n, c in extra)}"


@pytest.mark.parametrize(("state", "event", "expected"), TABLE_CASES)
def test_step_matches_the_table(state: lc.State | None, event: lc.Event, expected: Outcome) -> None:
    assert lc.step(state, event) == expected


@pytest.mark.parametrize(("state", "event"), ALL_PAIRS)
def test_the_call_paths_shortcuts_agree_with_step(state: lc.State | None, event: lc.Event) -> None:
    # The call path asks call_started / call_replied for the two per-call pairs (no event
    # object): where they answer, it is step's new state with no effects; where they do not,
    # step decides. Every representative state against both events, at every generation and
    # for another call id.
    if isinstance(event, lc.CallStarted):
        shortcut = lc.call_started(state, event.generation, event.call_id, event.at)
    elif isinstance(event, lc.Replied):
        shortcut = lc.call_replied(state, event.generation, event.call_id, event.at)
    else:
        return
    full = lc.step(state, event)
    if shortcut is not None:
        assert full == lc.Transition(shortcut)
    else:
        # Left to step: never the per-call pair itself.
        assert not (
            isinstance(full, lc.Transition)
            and not full.effects
            and type(full.state) is {lc.CallStarted: lc.InCall, lc.Replied: lc.Idle}[type(event)]
        )


def test_a_reply_for_another_call_is_not_a_shortcut() -> None:
    in_call = STATES["InCall"]
    assert isinstance(in_call, lc.InCall)
    assert lc.call_replied(in_call, G, CALL_ID + 1, AT) is None
    assert lc.call_replied(in_call, G, CALL_ID, AT) == lc.Idle(G, PID, AT)
    assert lc.call_started(STATES["Idle"], G + 1, NEXT_CALL_ID, AT) is None


# ---- named promises ---------------------------------------------------------------------------


@pytest.mark.parametrize("reason", list(R), ids=lambda r: r.name)
@pytest.mark.parametrize("pid", [None, PID], ids=["no-pid", "pid"])
@pytest.mark.parametrize("cls", [c for c in EVENT_CLASSES if c is not lc.SpawnBegan], ids=name_of)
def test_retired_is_terminal_for_every_event(
    cls: type, pid: int | None, reason: lc.RetireReason
) -> None:
    retired = lc.Retired(G, reason, pid)
    assert lc.step(retired, make_event(cls, G)) == TERMINAL
    for generation in (G - 1, G + 1, 0):
        assert lc.step(retired, make_event(cls, generation)) == STALE
    # Only a newer generation's SpawnBegan moves the slot on, to a fresh Starting.
    assert lc.step(retired, lc.SpawnBegan(G)) == STALE
    assert lc.step(retired, lc.SpawnBegan(G + 1)) == to(lc.Starting(G + 1))


@pytest.mark.parametrize("generation", [0, G - 1, G + 1, G + 1000], ids=lambda g: f"gen{g}")
@pytest.mark.parametrize("cls", [c for c in EVENT_CLASSES if c is not lc.SpawnBegan], ids=name_of)
@pytest.mark.parametrize("state_name", [*LIVE, "Retired"])
def test_stale_generation_events_change_nothing(
    state_name: str, cls: type, generation: int
) -> None:
    state = STATES[state_name]
    assert lc.step(state, make_event(cls, generation)) == STALE


def test_idle_expired_with_an_old_idle_since_is_dropped() -> None:
    # The reaper observed the worker idle since IDLE_SINCE, then a call ran and replied.
    idle = lc.Idle(G, PID, IDLE_SINCE)
    seen_by_reaper = lc.IdleExpired(G, idle_since=IDLE_SINCE)
    in_call = lc.step(idle, lc.CallStarted(G, call_id=NEXT_CALL_ID, at=150.0))
    assert isinstance(in_call, lc.Transition)
    assert lc.step(in_call.state, seen_by_reaper) == N_A  # busy: not idle at all
    idle_again = lc.step(in_call.state, lc.Replied(G, call_id=NEXT_CALL_ID, at=160.0))
    assert idle_again == to(lc.Idle(G, PID, 160.0))
    assert isinstance(idle_again, lc.Transition)
    # The late decision must not retire the worker that has just been used.
    assert lc.step(idle_again.state, seen_by_reaper) == OUTDATED
    # A decision based on the current idle_since does.
    assert lc.step(idle_again.state, lc.IdleExpired(G, idle_since=160.0)) == lc.Transition(
        lc.Retired(G, R.IDLE, PID), (lc.KillWorker(G, lc.Stop.ASK),)
    )


@pytest.mark.parametrize("observed", [IDLE_SINCE - 1, IDLE_SINCE + 1, 0.0])
def test_idle_expired_needs_the_current_idle_since(observed: float) -> None:
    assert lc.step(STATES["Idle"], lc.IdleExpired(G, idle_since=observed)) == OUTDATED


@pytest.mark.parametrize("other_call", [CALL_ID - 1, CALL_ID + 1, 0], ids=lambda c: f"call{c}")
def test_replied_for_another_call_id_is_dropped(other_call: int) -> None:
    assert lc.step(STATES["InCall"], lc.Replied(G, call_id=other_call, at=AT)) == OUTDATED


@pytest.mark.parametrize(
    "event",
    [lc.DeadlineHit(G, call_id=CALL_ID + 1), lc.CallCancelled(G, call_id=CALL_ID + 1)],
    ids=lambda e: type(e).__name__,
)
def test_deadline_and_cancel_for_another_call_id_are_dropped(event: lc.Event) -> None:
    assert lc.step(STATES["InCall"], event) == OUTDATED


@pytest.mark.parametrize("state_name", ["InCall", "Cancelling"])
@pytest.mark.parametrize(
    "event",
    [
        lc.CancelRequested(G, call_id=CALL_ID + 1, at=AT, grace=GRACE),
        lc.CancelRequested(G, call_id=CALL_ID - 1, at=AT, grace=0.0),
        lc.CancelGraceExpired(G, call_id=CALL_ID + 1, requested_at=REQUESTED_AT),
        lc.CancelGraceExpired(G, call_id=CALL_ID - 1, requested_at=REQUESTED_AT),
    ],
    ids=["request-next", "kill-previous", "timer-next", "timer-previous"],
)
def test_a_cancel_for_call_n_never_affects_another_call(state_name: str, event: lc.Event) -> None:
    assert lc.step(STATES[state_name], event) == OUTDATED


def test_cancel_with_no_grace_kills_at_once() -> None:
    assert lc.step(STATES["InCall"], lc.CancelRequested(G, CALL_ID, AT, grace=0.0)) == retire(
        R.CANCELLED, KILL
    )


@pytest.mark.parametrize(
    ("state_name", "event", "how"),
    [
        ("Cancelling", make_event(lc.CancelGraceExpired, G), lc.CancelKill.GRACE_EXPIRED),
        ("Cancelling", make_event(lc.CallCancelled, G), lc.CancelKill.SECOND_CANCEL),
        ("InCall", make_event(lc.CallCancelled, G), lc.CancelKill.FORCED),
        ("InCall", lc.CancelRequested(G, CALL_ID, AT, grace=0.0), lc.CancelKill.NO_GRACE),
    ],
)
def test_a_cancels_kill_says_whether_it_waited_for_the_grace(
    state_name: str, event: lc.Event, how: lc.CancelKill
) -> None:
    # Only the state before the event knows whether a cancel was pending: the retired one
    # does not, so the gate records this with the retirement.
    state = STATES[state_name]
    assert lc.step(state, event) == retire(R.CANCELLED, KILL)
    assert lc.cancel_kill(state, event) is how


@pytest.mark.parametrize(
    ("state_name", "event"),
    [
        ("InCall", make_event(lc.CancelRequested, G)),  # asks first: nothing killed yet
        ("InCall", make_event(lc.DeadlineHit, G)),
        ("Idle", make_event(lc.CallCancelled, G)),
        ("Retired", make_event(lc.CallCancelled, G)),
        ("None", make_event(lc.CallCancelled, G)),
    ],
)
def test_no_cancel_kill_where_no_cancel_killed(state_name: str, event: lc.Event) -> None:
    assert lc.cancel_kill(STATES[state_name], event) is None


def test_a_grace_timer_of_an_earlier_request_is_out_of_date() -> None:
    # Call CALL_ID was asked at REQUESTED_AT; a timer naming another request time is not its.
    late = lc.CancelGraceExpired(G, CALL_ID, requested_at=REQUESTED_AT - 1.0)
    assert lc.step(STATES["Cancelling"], late) == OUTDATED


def test_a_cancelled_call_that_ends_in_time_keeps_its_worker_and_generation() -> None:
    events: list[lc.Event] = [
        lc.CancelRequested(G, CALL_ID, at=AT, grace=GRACE),
        lc.Replied(G, CALL_ID, at=AT + 0.5),  # the worker stopped the call by itself
        lc.CancelGraceExpired(G, CALL_ID, requested_at=AT),  # the timer fires late: no effect
        lc.CallStarted(G, NEXT_CALL_ID, at=AT + 3.0),
        lc.CancelGraceExpired(G, CALL_ID, requested_at=AT),  # ... not even on call N+1
    ]
    state: lc.State | None = STATES["InCall"]
    outcomes = []
    for event in events:
        result = lc.step(state, event)
        outcomes.append(result)
        if isinstance(result, lc.Transition):
            state = result.state
    assert outcomes[2] == N_A and outcomes[4] == OUTDATED
    assert state == lc.InCall(G, PID, NEXT_CALL_ID, AT + 3.0)


@pytest.mark.parametrize(
    "event",
    [lc.Exited(G, returncode=1), lc.ChannelClosed(G), lc.ProtocolViolated(G), lc.StartFailed(G)],
    ids=lambda e: type(e).__name__,
)
def test_start_failures_report_start_failed_reason(event: lc.Event) -> None:
    assert lc.step(lc.Starting(G), event) == lc.Transition(
        lc.Retired(G, R.START_FAILED, None), (lc.KillWorker(G, KILL),)
    )


def test_close_while_starting_is_a_close_not_a_failed_start() -> None:
    assert lc.step(lc.Starting(G), lc.CloseRequested(G)) == lc.Transition(
        lc.Retired(G, R.CLOSED, None), (lc.KillWorker(G, lc.Stop.TERMINATE),)
    )


@pytest.mark.parametrize("returncode", [0, 1, -9, None], ids=lambda r: f"rc={r}")
@pytest.mark.parametrize("state_name", ["Idle", "InCall"])
def test_any_exit_of_a_started_worker_is_a_crash(state_name: str, returncode: int | None) -> None:
    assert lc.step(STATES[state_name], lc.Exited(G, returncode)) == retire(R.CRASHED, KILL)


def test_spawn_began_needs_a_newer_generation() -> None:
    # From a never-used slot, any generation starts.
    for generation in (0, 1, G):
        assert lc.step(None, lc.SpawnBegan(generation)) == to(lc.Starting(generation))
    # From Retired(G), only a newer generation.
    for reason in R:
        retired = lc.Retired(G, reason, PID)
        assert lc.step(retired, lc.SpawnBegan(G + 1)) == to(lc.Starting(G + 1))
        assert lc.step(retired, lc.SpawnBegan(G + 5)) == to(lc.Starting(G + 5))
        for generation in (G, G - 1, 0):
            assert lc.step(retired, lc.SpawnBegan(generation)) == STALE
    # A live worker occupies the slot: a newer generation may not take it over.
    for name in LIVE:
        assert lc.step(STATES[name], lc.SpawnBegan(G + 1)) == N_A
        assert lc.step(STATES[name], lc.SpawnBegan(G)) == STALE
        assert lc.step(STATES[name], lc.SpawnBegan(G - 1)) == STALE


@pytest.mark.parametrize(("state", "event"), ALL_PAIRS)
def test_effects_are_a_kill_exactly_when_retiring(state: lc.State | None, event: lc.Event) -> None:
    result = lc.step(state, event)
    if not isinstance(result, lc.Transition):
        return
    if isinstance(result.state, lc.Retired):
        assert state is not None and not isinstance(state, lc.Retired)
        assert result.state.generation == state.generation == event.generation
        stop = STOP[(type(state).__name__, type(event))]
        assert result.effects == (lc.KillWorker(state.generation, stop),)
        expected_pid = None if isinstance(state, lc.Starting) else state.pid
        assert result.state.pid == expected_pid
    elif isinstance(event, lc.CancelRequested):
        # The one non-retiring effect: ask the worker, start the grace timer.
        assert result.effects == (
            lc.SendCancel(event.generation, event.call_id, event.at, event.grace),
        )
    else:
        assert result.effects == ()
        assert result.state.generation == event.generation


def test_every_killing_event_retires_from_some_state() -> None:
    retiring = {
        cls
        for (name, cls), row in EXPECTED.items()
        if isinstance(row.same, lc.Transition) and isinstance(row.same.state, lc.Retired)
    }
    assert retiring | {lc.CancelRequested} == {cls for _, cls in STOP}


@pytest.mark.parametrize(("state", "event"), ALL_PAIRS)
def test_step_is_pure(state: lc.State | None, event: lc.Event) -> None:
    state_before, event_before = copy.deepcopy(state), copy.deepcopy(event)
    first = lc.step(state, event)
    second = lc.step(state, event)
    assert first == second
    assert state == state_before and event == event_before


@pytest.mark.parametrize(
    "value",
    [
        *(s for s in STATES.values() if s is not None),
        *(factory(G) for factory in EVENT_FACTORIES.values()),
        lc.KillWorker(G, lc.Stop.ASK),
        lc.SendCancel(G, CALL_ID, AT, GRACE),
        lc.Transition(lc.Starting(G)),
        STALE,
    ],
    ids=lambda v: type(v).__name__,
)
def test_values_are_frozen(value: object) -> None:
    field = type(value).__slots__[0]  # type: ignore[attr-defined]
    before = getattr(value, field)
    with pytest.raises(FrozenValueError):
        setattr(value, field, None)
    with pytest.raises(FrozenValueError):
        delattr(value, field)
    assert getattr(value, field) == before
    assert not hasattr(value, "__dict__")


def test_a_whole_lifetime() -> None:
    events: list[lc.Event] = [
        lc.SpawnBegan(1),
        lc.HandshakeOk(1, pid=PID, at=1.0),
        lc.CallStarted(1, call_id=1, at=2.0),
        lc.Replied(1, call_id=1, at=3.0),
        lc.IdleExpired(1, idle_since=3.0),
        lc.Exited(1, returncode=-15),  # the exit of the reaped worker arrives late
        lc.SpawnBegan(2),
    ]
    states: list[lc.State | None] = [None]
    for event in events:
        result = lc.step(states[-1], event)
        states.append(result.state if isinstance(result, lc.Transition) else states[-1])
    assert states[1:] == [
        lc.Starting(1),
        lc.Idle(1, PID, 1.0),
        lc.InCall(1, PID, 1, 2.0),
        lc.Idle(1, PID, 3.0),
        lc.Retired(1, R.IDLE, PID),
        lc.Retired(1, R.IDLE, PID),
        lc.Starting(2),
    ]


# ---- the one-writer rule ----------------------------------------------------------------------

PACKAGE = Path(lc.__file__).resolve().parent
STATE_WRITE = re.compile(r"\.state\s*(?::[^=\n]+)?(?:[-+*/|&^%@]|//|<<|>>|\*\*)?=(?!=)")


def _state_writes() -> list[tuple[str, str, ast.AST]]:
    """(file name, enclosing function qualname, assignment node) of every ``x.state = ...``."""
    found: list[tuple[str, str, ast.AST]] = []

    def targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            return node.targets
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return [node.target]
        if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            return [node.target]
        if isinstance(node, (ast.With, ast.AsyncWith)):
            return [i.optional_vars for i in node.items if i.optional_vars is not None]
        return []

    def writes_state(target: ast.expr) -> bool:
        return any(
            isinstance(n, ast.Attribute) and n.attr == "state" and isinstance(n.ctx, ast.Store)
            for n in ast.walk(target)
        )

    def visit(node: ast.AST, scope: str, file: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if any(writes_state(t) for t in targets(child)):
                found.append((file, inner, child))
            visit(child, inner, file)

    for path in sorted(PACKAGE.glob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), "", path.name)
    return found


def test_only_the_gate_assigns_a_slot_state_by_regex() -> None:
    hits = [
        (path.name, line.strip())
        for path in sorted(PACKAGE.glob("*.py"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if STATE_WRITE.search(line)
    ]
    assert sorted(hits) == [
        ("_entry.py", "self.state: lc.State | None = None"),  # Slot.__init__: the initial value
        ("_entry.py", "slot.state = state"),  # EnvEntry._store: the gate's one write
    ]


def test_only_the_gate_assigns_a_slot_state_by_ast() -> None:
    writes = _state_writes()
    where = sorted((file, scope) for file, scope, _ in writes)
    assert where == [("_entry.py", "EnvEntry._store"), ("_entry.py", "Slot.__init__")]
    for _, scope, node in writes:
        if scope == "Slot.__init__":
            # The initial value only: a never-used slot.
            assert isinstance(node, ast.AnnAssign)
            assert isinstance(node.value, ast.Constant) and node.value.value is None
        else:
            assert isinstance(node, ast.Assign)
            assert ast.unparse(node) == "slot.state = state"


def test_the_gate_stores_only_what_the_lifecycle_module_computed() -> None:
    # ``_store`` is called by the gate's methods only, each with the value a pure function of
    # _lifecycle returned: ``step``'s new state, or a per-call shortcut's (the plain call's
    # start and a replied call's end do their pair's transition themselves, with the same
    # functions).
    tree = ast.parse((PACKAGE / "_entry.py").read_text(encoding="utf-8"))
    stores: list[tuple[str, str]] = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "_store"
                ):
                    stores.append((fn.name, ast.unparse(node.args[1])))
    assert sorted(stores) == [
        ("apply_locked", "result.state"),
        ("replied_locked", "idle"),
        ("settle_ok_locked", "idle"),
        ("start_call_locked", "started"),
        ("start_plain_locked", "started"),
    ]
    source = (PACKAGE / "_entry.py").read_text(encoding="utf-8")
    assert "result = lc.step(slot.state, event)" in source
    assert "started = lc.call_started(slot.state, generation, call_id, at)" in source
    assert "idle = lc.call_replied(slot.state, generation, call_id, at)" in source
    assert "started = lc.call_started(idle, idle.generation, call_id, at)" in source
    assert "idle = lc.call_replied(slot.state, ticket.generation, ticket.call_id, at)" in source
    other = [p.name for p in PACKAGE.glob("*.py") if p.name != "_entry.py"]
    assert not [name for name in other if "._store(" in (PACKAGE / name).read_text("utf-8")]


def test_no_state_write_through_setattr() -> None:
    pattern = re.compile(r"setattr\([^)]*[\"']state[\"']")
    for path in sorted(PACKAGE.glob("*.py")):
        assert not pattern.search(path.read_text(encoding="utf-8")), path.name


# ---- policy decisions with a fake clock ---------------------------------------------------------


def test_the_reaper_observes_idle_since_and_a_call_in_between_makes_it_stale() -> None:
    idle = lc.Idle(G, PID, idle_since=100.0)
    assert lc.idle_expired(idle, now=129.9, idle_timeout=30.0) is None
    decision = lc.idle_expired(idle, now=130.0, idle_timeout=30.0)
    assert decision == lc.IdleExpired(G, idle_since=100.0)
    # Before the decision is applied, a call runs and replies: the worker is idle anew.
    busy = lc.step(idle, lc.CallStarted(G, call_id=9, at=131.0))
    assert isinstance(busy, lc.Transition)
    assert lc.step(busy.state, decision) == N_A  # busy: not reaped
    again = lc.step(busy.state, lc.Replied(G, call_id=9, at=132.0))
    assert isinstance(again, lc.Transition)
    assert lc.step(again.state, decision) == OUTDATED  # the old observation is ignored


@pytest.mark.parametrize("state_name", ["None", "Starting", "InCall", "Retired"])
def test_the_reaper_only_considers_idle_workers(state_name: str) -> None:
    assert lc.idle_expired(STATES[state_name], now=1e9, idle_timeout=1.0) is None


def test_no_idle_timeout_means_no_reaping() -> None:
    assert lc.idle_expired(STATES["Idle"], now=1e9, idle_timeout=None) is None


def test_a_ping_is_due_only_after_the_idle_window() -> None:
    idle = lc.Idle(G, PID, idle_since=100.0)
    assert not lc.needs_ping(idle, now=159.0, ping_after_idle=60.0)
    assert lc.needs_ping(idle, now=160.0, ping_after_idle=60.0)
    assert not lc.needs_ping(idle, now=1e9, ping_after_idle=None)
    assert not lc.needs_ping(STATES["InCall"], now=1e9, ping_after_idle=1.0)


def _death(at: float, generation: int = G) -> lc.Death:
    return lc.Death(at, at, generation, R.CRASHED, -11, "SIGSEGV", "tail")


def test_the_breaker_trips_on_more_than_max_restarts_deaths_in_the_window() -> None:
    state: lc.EnvState = lc.EnvActive()
    for i in range(3):
        state = lc.record_death(state, _death(10.0 + i), max_restarts=3, restart_window=60.0)
        assert isinstance(state, lc.EnvActive)
    state = lc.record_death(state, _death(13.0), max_restarts=3, restart_window=60.0)
    assert isinstance(state, lc.EnvAbandoned)
    assert len(state.deaths) == 4 and state.at == 13.0


def test_deaths_outside_the_window_are_forgotten() -> None:
    state: lc.EnvState = lc.EnvActive()
    for at in (0.0, 10.0, 20.0, 100.0):  # none of the first three is within 60 s of 100.0
        state = lc.record_death(state, _death(at), max_restarts=3, restart_window=60.0)
    assert isinstance(state, lc.EnvActive)
    assert [d.at for d in state.deaths] == [100.0]


def test_a_timed_abandonment_lifts_at_its_end_and_forgets_its_deaths() -> None:
    state: lc.EnvState = lc.EnvActive()
    for at in (10.0, 11.0):
        state = lc.record_death(state, _death(at), 1, 60.0, abandon_for=30.0)
    assert isinstance(state, lc.EnvAbandoned) and state.until == 41.0
    assert lc.lift_expired(state, 40.9) is state
    assert lc.record_death(state, _death(40.0), 1, 60.0, 30.0) is state  # sticky while in force
    assert lc.lift_expired(state, 41.0) == lc.EnvActive()
    after = lc.record_death(state, _death(50.0), 1, 60.0, 30.0)  # a death after its end
    assert after == lc.EnvActive((_death(50.0),))
    untimed = lc.record_death(lc.EnvActive((_death(1.0),)), _death(2.0), 1, 60.0)
    assert isinstance(untimed, lc.EnvAbandoned) and untimed.until is None
    assert lc.lift_expired(untimed, 1e9) is untimed


def test_abandoned_is_sticky() -> None:
    abandoned = lc.EnvAbandoned((_death(1.0),), at=1.0)
    assert lc.record_death(abandoned, _death(2.0), 0, 60.0) is abandoned
