"""Cooperative cancellation, the kill after the grace, progress and events, ``Worker.submit``.

Every test uses real worker processes. What they prove:

* a cancelled call that stops within ``cancel_grace`` (by ``raise_if_cancelled``, by polling
  ``cancelled()``, or interrupted asynchronously in pure-Python code) leaves its worker alive in
  the same generation with its module caches, and the caller gets ``CallCancelled``;
* a call that does not stop is killed after the grace; ``cancel_grace=0`` kills at once;
* a queued call is removed from the queue; a reply that crosses a cancel is delivered once;
* a CANCEL for call N never touches call N+1 (the late-news rule), stats count each call once;
* events arrive in the order emitted, all before the result, progress coalesced;
* ``Call`` follows ``concurrent.futures.Future`` conventions; Ctrl-C asks the worker first.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
from conftest import TESTS_DIR, wait_until

import comfy_env
import comfy_env_worker
from comfy_env import CallCancelled, CallEvent
from comfy_env import _lifecycle as lc


def _started(w: comfy_env.Worker, call: comfy_env.Call) -> None:
    """Wait until ``call`` runs in the worker (it was sent; the worker reads it at once)."""
    assert wait_until(lambda: call.call_id != 0 and w.stats().in_flight == 1)
    time.sleep(0.1)  # let the worker read the CALL frame and enter the function


@pytest.mark.parametrize("target", ["cooperative_loop", "polite_loop", "busy_loop"])
def test_a_call_that_stops_in_time_keeps_its_worker_and_caches(
    apool: comfy_env.Pool, target: str
) -> None:
    w = apool.get_worker()
    assert w.call("tasks.remote:count_calls") == 1
    pid = w.pid
    call = w.submit(f"tasks.remote:{target}", (30,))
    _started(w, call)
    assert call.running()
    assert call.cancel() is True
    if target == "polite_loop":
        # It chose to return a partial result: a result that crosses the cancel is delivered.
        assert call.result(timeout=10) == "stopped early"
        assert not call.cancelled()
    else:
        with pytest.raises(CallCancelled, match="lives on") as info:
            call.result(timeout=10)
        assert call.cancelled()
        assert (info.value.env, info.value.generation, info.value.pid) == (w.env, 1, pid)
    # Same process, same generation, module state intact.
    assert w.call("tasks.remote:count_calls") == 2
    assert (w.pid, w.generation) == (pid, 1)
    stats = w.stats()
    assert (stats.cancelled + stats.ok, stats.in_flight, stats.crashed) == (3, 0, 0)
    assert stats.cancelled == (0 if target == "polite_loop" else 1)


def test_a_call_that_ignores_the_cancel_is_killed_after_the_grace(
    config: comfy_env.PoolConfig,
) -> None:
    cfg = config.model_copy(update={"cancel_grace": 0.6})
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        pid = w.call("tasks.remote:getpid")
        call = w.submit("tasks.remote:ignore_cancel", (30,))
        _started(w, call)
        call.cancel()
        with pytest.raises(CallCancelled, match="did not stop within") as info:
            call.result(timeout=10)
        assert info.value.generation == 1
        assert w.call("tasks.remote:getpid") != pid
        assert w.generation == 2
        stats = w.stats()
        assert (stats.cancelled, stats.crashed, stats.in_flight) == (1, 0, 0)


def test_cancel_grace_zero_kills_at_once(config: comfy_env.PoolConfig) -> None:
    cfg = config.model_copy(update={"cancel_grace": 0.0})
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:getpid")
        call = w.submit("tasks.remote:cooperative_loop", (30,))
        _started(w, call)
        call.cancel()
        with pytest.raises(CallCancelled, match="was killed"):
            call.result(timeout=10)
        w.call("tasks.remote:getpid")
        assert w.generation == 2


def test_a_second_cancel_kills_at_once(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    call = w.submit("tasks.remote:ignore_cancel", (30,))
    _started(w, call)
    call.cancel()
    call.cancel()  # escalation: no grace
    with pytest.raises(CallCancelled, match="was killed") as info:
        call.result(timeout=2.5)  # well inside the 3 s grace
    # It says why: the grace never ran out, the second cancel killed the worker.
    assert "killed at once on a second cancel" in str(info.value)
    assert "cancel_grace" not in str(info.value)
    w.call("tasks.remote:getpid")
    assert w.generation == 2


def test_a_forced_cancel_says_it_killed_at_once(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    call = w.submit("tasks.remote:ignore_cancel", (30,))
    _started(w, call)
    call._cancel(True)  # what a cancel with force=True does: no asking first
    with pytest.raises(CallCancelled, match="killed at once on a forced cancel") as info:
        call.result(timeout=2.5)
    assert "cancel_grace" not in str(info.value)
    assert w.stats().cancelled == 1


def test_the_kill_with_cancel_grace_zero_names_the_setting(config: comfy_env.PoolConfig) -> None:
    cfg = config.model_copy(update={"cancel_grace": 0.0})
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        call = w.submit("tasks.remote:cooperative_loop", (30,))
        _started(w, call)
        call.cancel()
        with pytest.raises(CallCancelled, match=r"killed at once \(PoolConfig.cancel_grace=0\)"):
            call.result(timeout=10)


def test_an_interrupted_calls_cancel_message_has_no_empty_parentheses(
    apool: comfy_env.Pool,
) -> None:
    # Pure Python that never checks is interrupted after half the grace by a bare
    # ``Cancelled`` with no text of its own.
    w = apool.get_worker()
    call = w.submit("tasks.remote:busy_loop", (30,))
    _started(w, call)
    call.cancel()
    with pytest.raises(CallCancelled, match="lives on with its caches") as info:
        call.result(timeout=10)
    assert "()" not in str(info.value)
    assert str(info.value).endswith("with its caches")
    assert w.generation == 1


def test_cancelling_a_queued_call_removes_it_from_the_queue(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    first = w.submit("tasks.remote:cooperative_loop", (1.0,))
    _started(w, first)
    queued = w.submit("tasks.remote:count_calls")
    assert wait_until(lambda: w.stats().queued == 1)
    assert queued.cancel()
    with pytest.raises(CallCancelled, match="queued"):
        queued.result(timeout=5)
    assert first.result(timeout=10) == "finished"  # the running call is not touched
    assert w.call("tasks.remote:count_calls") == 1  # the cancelled call never ran
    stats = w.stats()
    assert (stats.cancelled, stats.ok, stats.queued, stats.in_flight) == (1, 2, 0, 0)


def test_cancelling_a_queued_call_settles_it_before_cancel_returns(
    apool: comfy_env.Pool,
) -> None:
    # As concurrent.futures promises: once cancel() returned True for a call that had not
    # started, the call is cancelled and done, its callbacks ran, result() raises at once.
    w = apool.get_worker()
    first = w.submit("tasks.remote:cooperative_loop", (1.0,))
    _started(w, first)
    queued = w.submit("tasks.remote:count_calls")
    assert wait_until(lambda: w.stats().queued == 1)
    settled_on: list[int] = []
    queued.add_done_callback(lambda call: settled_on.append(threading.get_ident()))
    assert queued.cancel() is True
    assert settled_on == [threading.get_ident()]  # ran inside cancel(), not later elsewhere
    assert queued.cancelled() and queued.done() and not queued.running()
    with pytest.raises(CallCancelled, match="queued"):
        queued.result(timeout=0)
    stats = w.stats()  # counted at once too, exactly once
    assert (stats.cancelled, stats.queued, stats.submitted) == (1, 0, 2)
    assert queued.cancel() is False  # done: nothing more to cancel
    assert first.result(timeout=10) == "finished"  # the running call is not touched
    assert w.call("tasks.remote:count_calls") == 1  # the cancelled call never ran
    stats = w.stats()
    assert (stats.cancelled, stats.ok, stats.queued, stats.in_flight) == (1, 2, 0, 0)


def test_a_late_cancel_never_affects_the_next_call(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    done = w.submit("tasks.remote:cooperative_loop", (0.05,))
    assert done.result(timeout=10) == "finished"
    old_call_id = done.call_id
    running = w.submit("tasks.remote:cooperative_loop", (0.8,))
    _started(w, running)
    assert running.call_id > old_call_id
    entry = w._entry
    slot = entry.slots[0]
    process = slot.process
    assert process is not None
    # The cancel of call N arrives late, while call N+1 runs: the gate drops it ...
    late = lc.CancelRequested(1, old_call_id, time.monotonic(), 3.0)
    dropped_before = w.stats().stale_events_dropped
    assert entry.apply(slot, late) is False
    assert w.stats().stale_events_dropped == dropped_before + 1
    # ... and so does the worker, should a CANCEL frame for call N reach it now.
    assert process.send_cancel(old_call_id)
    assert running.result(timeout=10) == "finished"
    assert (w.generation, w.stats().cancelled, w.stats().ok) == (1, 0, 2)


def test_a_cancel_that_arrives_before_its_call_is_read_still_applies(
    apool: comfy_env.Pool,
) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:count_calls")
    process = w._entry.slots[0].process
    assert process is not None
    # The CANCEL frame for the next call id reaches the worker before the CALL frame does.
    next_id = int(repr(w._pool.call_ids)[len("count(") : -1])  # the next call id
    assert process.send_cancel(next_id)
    time.sleep(0.2)
    with pytest.raises(CallCancelled, match="before it started"):
        w.call("tasks.remote:count_calls")
    assert w.call("tasks.remote:count_calls") == 2  # the cancelled call never ran
    assert w.generation == 1


def test_events_arrive_in_order_before_the_result(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    seen: list[CallEvent] = []
    assert w.run("tasks.remote:events_in_order", (5,), on_event=seen.append) == 5
    kinds = [(e.kind, e.data if e.kind == "step" else e.data["done"]) for e in seen]
    assert kinds == [x for i in range(5) for x in (("step", i), ("progress", i + 1))]
    call_ids = {e.call_id for e in seen}
    assert len(call_ids) == 1 and call_ids != {0}
    assert {e.generation for e in seen} == {1}
    with pytest.raises(AttributeError):
        seen[0].kind = "x"  # type: ignore[misc]  # frozen


def test_a_progress_flood_is_coalesced_and_the_latest_wins(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    seen: list[CallEvent] = []
    assert w.run("tasks.remote:report", (20000, ("done",)), on_event=seen.append) == 20000
    progress = [e.data for e in seen if e.kind == "progress"]
    assert 1 <= len(progress) < 20000
    assert progress[-1] == {"done": 20000, "total": 20000, "stage": "loop"}
    dones = [p["done"] for p in progress]
    assert dones == sorted(dones)
    assert seen[-1].kind == "done"  # the emit after the flood comes after its last progress


@pytest.mark.parametrize("progress", [False, True])
def test_an_event_too_large_for_a_frame_raises_in_the_worker_and_keeps_it(
    progress: bool,
) -> None:
    """An ``emit``/``progress`` whose data pickles to more than ``max_frame_bytes`` raises
    ``OverflowError`` in the env's code, as a result that large does; it was sent anyway, and
    the host retired the worker with a ``ProtocolError`` (a death for the breaker)."""
    cfg = comfy_env.PoolConfig(sys_path=(str(TESTS_DIR),), max_frame_bytes=1024 * 1024)
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        seen: list[CallEvent] = []
        outcome = w.run(
            "tasks.remote:emit_too_big", (2 * 1024 * 1024, progress), on_event=seen.append
        )
        assert outcome.startswith("OverflowError") and "max_frame_bytes" in outcome, outcome
        assert [e.kind for e in seen] == ["small"]
        stats = w.stats()
        assert (stats.generation, stats.ok, stats.failed, stats.restarts_in_window) == (1, 1, 0, 0)
        assert w.call("tasks.remote:add", 1, 2) == 3 and w.generation == 1


def test_a_failing_event_callback_does_not_break_the_call(
    apool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    w = apool.get_worker()

    def broken(event: CallEvent) -> None:
        raise RuntimeError("callback bug")

    assert w.run("tasks.remote:events_in_order", (2,), on_event=broken) == 2
    assert "on_event callback failed" in caplog.text
    assert w.call("tasks.remote:add", 1, 2) == 3


def test_events_are_dropped_outside_a_call_and_helpers_are_inert_in_the_host() -> None:
    # In the host (no worker), the helpers do nothing and nothing is cancelled.
    assert comfy_env_worker.cancelled() is False
    comfy_env_worker.raise_if_cancelled()
    comfy_env_worker.progress(1, 2)
    comfy_env_worker.emit("kind", {"x": 1})


def test_submit_follows_future_conventions(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    call = w.submit("tasks.remote:add", (2,), {"b": 3})
    assert call.result(timeout=10) == 5
    assert call.done() and not call.running() and not call.cancelled()
    assert call.exception() is None
    assert call.cancel() is False  # done: nothing to cancel
    finished: list[comfy_env.Call] = []
    call.add_done_callback(finished.append)  # done: runs at once
    assert finished == [call]
    failing = w.submit("tasks.remote:raise_custom", (7,))
    exc = failing.exception(timeout=10)
    assert exc is not None and type(exc).__name__ == "CustomError"
    with pytest.raises(type(exc)):
        failing.result()
    with pytest.raises(TypeError):
        w.submit(42)  # type: ignore[arg-type]  # bad input raises at once
    slow = w.submit("tasks.remote:cooperative_loop", (0.5,))
    with pytest.raises(TimeoutError, match=r"has not ended within this wait \(0.01s\)") as info:
        slow.result(timeout=0.01)  # bounds the wait only
    assert not isinstance(info.value, comfy_env.CallTimeout)  # nothing was stopped
    with pytest.raises(TimeoutError, match="it goes on"):
        slow.exception(timeout=0)
    assert slow.result(timeout=10) == "finished"


def test_submit_with_events_and_a_deadline(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    seen: list[CallEvent] = []
    call = w.submit("tasks.remote:events_in_order", (3,), on_event=seen.append)
    assert call.result(timeout=10) == 3 and len(seen) == 6
    late = w.submit("tasks.remote:cooperative_loop", (30,), timeout=0.5)
    with pytest.raises(comfy_env.CallTimeout):
        late.result(timeout=10)


def test_a_wait_for_a_call_takes_any_number_and_refuses_what_is_no_time(
    apool: comfy_env.Pool,
) -> None:
    """``call.result(timeout)`` and ``call.exception(timeout)`` bound the wait only: a
    timeout too long for the clock (inf, 1e300, past ``threading.TIMEOUT_MAX``) waits for
    the call, as None does (it raised ``OverflowError``); one that is no number (NaN, a
    string, a bool) is an ``ArgumentError`` (it raised ``TypeError`` or timed out at once).
    The call itself goes on untouched."""
    w = apool.get_worker()
    for forever in (math.inf, 1e300, threading.TIMEOUT_MAX * 2):
        call = w.submit("tasks.remote:sleep_then", (0.2, "done"))
        assert call.exception(timeout=forever) is None
        assert call.result(timeout=forever) == "done"
    call = w.submit("tasks.remote:sleep_then", (0.2, "late"))
    for bad in (math.nan, "1", True):
        with pytest.raises(comfy_env.ArgumentError, match="timeout"):
            call.result(timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(comfy_env.ArgumentError, match="timeout"):
            call.exception(timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        call.result(timeout=0)  # a zero or negative wait still just looks, as in futures
    assert call.result(timeout=10) == "late"
    stats = w.stats()
    assert (stats.ok, stats.in_flight, stats.generation) == (4, 0, 1)


def test_ctrl_c_while_waiting_asks_the_worker_first(apool: comfy_env.Pool, ctrl_c: None) -> None:
    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            w.call("tasks.remote:cooperative_loop", 30)
    finally:
        timer.join()
    assert w.call("tasks.remote:getpid") == pid  # the worker stopped the call and lives on
    assert w.generation == 1
    stats = w.stats()
    assert (stats.cancelled, stats.in_flight) == (1, 0)


def test_a_ctrl_c_that_kills_the_call_shows_no_internal_error(
    config: comfy_env.PoolConfig, ctrl_c: None
) -> None:
    """With no grace (or a second Ctrl-C) the ``KeyboardInterrupt`` leaves the wait itself.
    It was raised while the reader handled its ``BlockingIOError``, so the traceback read
    "BlockingIOError: [Errno 11] ... During handling of the above exception ..."."""
    with comfy_env.Pool(config.model_copy(update={"cancel_grace": 0.0})) as pool:
        w = pool.get_worker()
        pid = w.call("tasks.remote:getpid")
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt) as info:
                w.call("tasks.remote:ignore_cancel", 30)
        finally:
            timer.join()
        assert info.value.__context__ is None, repr(info.value.__context__)
        assert w.call("tasks.remote:getpid") != pid  # killed at once, replaced
