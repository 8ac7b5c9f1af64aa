"""``arun``/``acall`` against the ways asyncio programs end a call: a cancel in the same turn of
the loop as the call's progress, an ``on_event`` that raises what ``deliver`` lets through or
blocks the loop, and a cancel injected at each await point of a call.

What they prove, with real workers:

* a cancel that comes in the same turn of the loop as the slot's hand-over (queued call) or as
  the thread's outcome (a call on the thread path) is never lost, with a deadline or without
  (``asyncio.wait_for`` before Python 3.12 returns the result and drops the cancel);
* an ``on_event`` that raises ``CancelledError`` on the loop path ends the call at once (the
  frames after it in the read are never silently lost: the call would wait for its deadline);
* a slow ``on_event`` cannot carry a call past its deadline;
* a cancel after any number of turns of the loop (sampled) leaves the pool sound: the next
  call works, on the same generation unless the call was killed, the stats count every call
  once, no slot stays busy and nothing leaks (the leak guard, ``conftest.py``).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import run_small

import comfy_env
from comfy_env import CallEvent, CallTimeout, _acall


def _counts(w: comfy_env.Worker) -> tuple[int, ...]:
    s = w.stats()
    assert s.submitted == (
        s.ok + s.raised + s.crashed + s.timed_out + s.cancelled + s.failed + s.in_flight + s.queued
    )
    return (s.ok, s.raised, s.crashed, s.timed_out, s.cancelled, s.failed, s.in_flight, s.queued)


@pytest.mark.parametrize("timeout", [None, 60.0])
def test_a_cancel_in_the_turn_a_queued_call_gets_its_slot_is_never_lost(
    apool: comfy_env.Pool, timeout: float | None
) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:add", 0)

    async def main() -> None:
        blocker = asyncio.ensure_future(w.acall("tasks.remote:cooperative_loop", 0.1))
        await asyncio.sleep(0.02)
        queued = asyncio.ensure_future(
            w.arun("tasks.remote:cooperative_loop", (1.0,), timeout=timeout)
        )
        await asyncio.sleep(0.02)
        assert w.stats().queued == 1
        # The blocker's end hands the slot to the queued call (its future resolves first, in
        # the blocker's coroutine); the cancel comes in the same turn, before it resumes.
        blocker.add_done_callback(lambda _: queued.cancel())
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert await blocker == "finished"

    run_small(main)
    assert w.generation == 1
    # ok: the warm-up and the blocker; the queued call never ran (or was stopped at once).
    assert _counts(w) == (2, 0, 0, 0, 1, 0, 0, 0)
    assert w.call("tasks.remote:add", 1, 2) == 3


def test_a_cancel_in_the_turn_the_thread_path_ends_is_never_lost(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cold worker: the call (with a deadline) runs on a thread of its own. The cancel is
    # made to land right after the thread hands its outcome to the loop, before the coroutine
    # resumes: the task must end cancelled, as a reply crossing a cancel does on the loop.
    w = apool.get_worker()
    task: asyncio.Task[Any] | None = None
    resolve = _acall._resolve

    def resolve_then_cancel(future: asyncio.Future[Any], value: Any = None) -> None:
        resolve(future, value)
        if task is not None and isinstance(value, tuple):
            task.cancel()

    monkeypatch.setattr(_acall, "_resolve", resolve_then_cancel)

    async def main() -> None:
        nonlocal task
        task = asyncio.ensure_future(w.arun("tasks.remote:add", (1, 2), timeout=60.0))
        with pytest.raises(asyncio.CancelledError):
            await task

    run_small(main)
    monkeypatch.undo()
    assert w.generation == 1
    assert w.call("tasks.remote:add", 1, 2) == 3
    s = w.stats()
    assert (s.in_flight, s.queued, s.submitted) == (0, 0, 2)


def test_an_on_event_raising_cancelled_error_on_the_loop_ends_the_call_at_once(
    apool: comfy_env.Pool,
) -> None:
    # ``deliver`` logs an Exception from on_event; a CancelledError (a BaseException) goes
    # through, out of the loop's read. The events and the reply come in one read: none of
    # them may be lost, or the call waits for its deadline.
    w = apool.get_worker()
    w.call("tasks.remote:add", 0)
    seen: list[int] = []

    def on_event(event: CallEvent) -> None:
        seen.append(event.data)
        raise asyncio.CancelledError

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await w.arun("tasks.remote:events_later", (0.05, 3), on_event=on_event, timeout=30)
        assert await w.acall("tasks.remote:add", 1, 2) == 3

    run_small(main)
    assert seen == [0]
    s = w.stats()
    assert (s.timed_out, s.in_flight, s.queued) == (0, 0, 0)


def test_a_slow_on_event_cannot_carry_a_call_past_its_deadline(apool: comfy_env.Pool) -> None:
    # 100 events handled at 20 ms each hold the loop for 2 s; the worker replies at 0.5 s.
    # The deadline (0.2 s) must stop the call, not lose to a reply read after it.
    w = apool.get_worker()
    w.call("tasks.remote:add", 0)
    seen: list[int] = []

    def on_event(event: CallEvent) -> None:
        time.sleep(0.02)
        seen.append(event.data)

    async def main() -> None:
        with pytest.raises(CallTimeout, match="missed its deadline"):
            await w.arun(
                "tasks.remote:report_then_wait", (100, 0.5), on_event=on_event, timeout=0.2
            )

    run_small(main)
    assert len(seen) < 100
    assert w.call("tasks.remote:add", 1, 2) == 3
    assert w.generation == 2
    assert _counts(w)[3] == 1  # timed out, once


def _sampled_turns() -> Iterator[int]:
    """0, 1, 2, 3, then about 1.5 times more each time: every early await point, sampled
    later ones (a call of tens of milliseconds takes thousands of turns)."""
    turns = 0
    while turns < 1_000_000:
        yield turns
        turns = turns + 1 if turns < 3 else turns * 3 // 2


async def _cancel_after(turns: int, make: Callable[[], Awaitable[Any]]) -> str:
    task = asyncio.ensure_future(make())
    for _ in range(turns):
        await asyncio.sleep(0)
    if task.done():
        task.result()
        return "completed"
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "ran despite the cancel"


def test_a_cancel_at_any_await_point_leaves_the_pool_sound(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:add", 0)
    array = np.ones(1 << 18)  # 2 MiB: out of band, through shared memory, on the loop

    async def blocked_for_a_moment() -> asyncio.Future[Any]:
        # Another call holds the only worker: the call under test queues behind it.
        blocker = asyncio.ensure_future(w.acall("tasks.remote:cooperative_loop", 0.03))
        await asyncio.sleep(0.005)
        return blocker

    calls: list[tuple[str, Callable[[], Awaitable[Any]], bool]] = [
        ("warm", lambda: w.acall("tasks.remote:add", 1, 2), False),
        ("running", lambda: w.acall("tasks.remote:cooperative_loop", 0.01), False),
        (
            "events",
            lambda: w.arun("tasks.remote:report", (200, ("a",)), on_event=lambda ev: None),
            False,
        ),
        ("shared memory", lambda: w.acall("tasks.remote:hold_array", array, 0.0), False),
        ("large reply", lambda: w.arun("tasks.remote:blob", (4 << 20,), timeout=60), False),
        ("queued", lambda: w.arun("tasks.remote:add", (1, 2), timeout=60), True),
    ]

    async def main() -> None:
        for name, make, queue in calls:
            outcomes = set()
            for turns in _sampled_turns():
                blocker = await blocked_for_a_moment() if queue else None
                generation = w.generation
                outcome = await _cancel_after(turns, make)
                if blocker is not None:
                    await blocker
                outcomes.add(outcome)
                assert outcome != "ran despite the cancel", (name, turns)
                counts = _counts(w)
                assert counts[-2:] == (0, 0), (name, turns)  # nothing in flight, none queued
                # Every call here stops within the grace: the worker and its caches stay.
                assert await w.arun("tasks.remote:add", (1, 2), timeout=30) == 3
                assert w.generation == generation == 1, (name, turns)
                if outcome == "completed":
                    break
            assert outcomes == {"cancelled", "completed"}, (name, outcomes)

    run_small(main)
    assert w.call("tasks.remote:count_calls") == 1


def test_a_cancel_at_any_await_point_of_a_worker_start_leaves_the_pool_sound(
    apool: comfy_env.Pool,
) -> None:
    # Each round retires the idle worker, so the call under test starts a fresh one (on a
    # thread of its own). A cancel while it starts never sends the call; the start goes on
    # and its worker serves the next call.
    w = apool.get_worker()

    async def main() -> None:
        outcomes = set()
        for turns in _sampled_turns():
            apool.retire_idle(w.env)
            generation = w.generation
            outcome = await _cancel_after(turns, lambda: w.arun("tasks.remote:add", (1, 2)))
            outcomes.add(outcome)
            assert outcome != "ran despite the cancel", turns
            assert _counts(w)[-2:] == (0, 0), turns
            assert await w.arun("tasks.remote:add", (1, 2), timeout=30) == 3
            assert w.generation == generation + 1, turns
            if outcome == "completed":
                break
        assert outcomes == {"cancelled", "completed"}, outcomes

    run_small(main)


async def _running(w: comfy_env.Worker) -> None:
    for _ in range(2000):
        if w.stats().workers and w.stats().workers[0].state == "in_call":
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the call never started")


def _ignoring_call(w: comfy_env.Worker, path: str) -> Awaitable[Any]:
    if path == "loop":  # a warm worker: sent and read on the loop
        return w.acall("tasks.remote:ignore_cancel", 30)
    if path == "thread":  # a cold worker: started and run on a thread of the call's own
        return w.arun("tasks.remote:ignore_cancel", (30,), timeout=60)
    return w.arun_ref("tasks.remote:ignore_cancel", (30,))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+")
@pytest.mark.parametrize("path", ["loop", "thread", "ref"])
def test_two_cancels_before_the_task_runs_again_kill_at_once(
    apool: comfy_env.Pool, path: str
) -> None:
    # asyncio throws one CancelledError for both; the second must still kill at once (the
    # README: cancelling the task again), not wait out the 3 s grace.
    w = apool.get_worker()
    if path != "thread":
        w.call("tasks.remote:add", 0)

    async def main() -> None:
        task = asyncio.ensure_future(_ignoring_call(w, path))
        await _running(w)
        task.cancel()
        task.cancel()
        with pytest.raises(asyncio.CancelledError) as info:
            await task
        assert "killed at once" in str(info.value.__cause__)

    run_small(main)
    assert w.call("tasks.remote:add", 1, 2) == 3
    assert w.generation == 2
    s = w.stats()
    assert (s.cancelled, s.in_flight, s.queued) == (1, 0, 0)


@pytest.mark.parametrize("path", ["loop", "thread", "ref"])
def test_the_cancel_message_reaches_the_awaiting_code(apool: comfy_env.Pool, path: str) -> None:
    w = apool.get_worker()
    if path != "thread":
        w.call("tasks.remote:add", 0)

    async def main() -> None:
        if path == "loop":
            call = w.acall("tasks.remote:cooperative_loop", 30)
        elif path == "thread":
            call = w.arun("tasks.remote:cooperative_loop", (30,), timeout=60)
        else:
            call = w.arun_ref("tasks.remote:cooperative_loop", (30,))
        task = asyncio.ensure_future(call)
        await _running(w)
        task.cancel("the client went away")
        with pytest.raises(asyncio.CancelledError) as info:
            await task
        assert info.value.args == ("the client went away",)
        # The README: where the call ended as CallCancelled, that error is the cause, saying
        # it stopped in time (the loop path once dropped the worker's reply without it).
        assert isinstance(info.value.__cause__, comfy_env.CallCancelled)
        assert "stopped in its worker" in str(info.value.__cause__)

    run_small(main)
    assert w.generation == 1  # it stopped in time: the worker stays
    assert w.stats().cancelled == 1


def test_closing_the_pool_from_another_thread_ends_every_pending_acall_typed(
    config: comfy_env.PoolConfig,
) -> None:
    pool = comfy_env.Pool(config)
    w = pool.get_worker()
    w.call("tasks.remote:add", 0)

    async def main() -> list[Any]:
        calls = [w.acall("tasks.remote:cooperative_loop", 30)]  # running, read on the loop
        calls += [w.arun("tasks.remote:add", (1,), timeout=60) for _ in range(2)]  # queued
        calls += [w.acall("tasks.remote:add", 1) for _ in range(2)]  # queued, no deadline
        tasks = [asyncio.ensure_future(c) for c in calls]
        await _running(w)
        closer = threading.Thread(target=pool.close)
        closer.start()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        closer.join()
        with pytest.raises(comfy_env.PoolClosedError):
            await w.acall("tasks.remote:add", 1)
        return outcomes

    outcomes = run_small(main)
    assert [type(o) for o in outcomes] == [comfy_env.PoolClosedError] * 5
    _counts(w)  # every call counted once
    assert _counts(w)[-2:] == (0, 0)


def test_loops_in_several_threads_and_repeated_asyncio_runs_share_one_env_soundly(
    config: comfy_env.PoolConfig,
) -> None:
    cfg = config.model_copy(update={"max_workers_per_env": 2, "cancel_grace": 3.0})
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:add", 0)
        errors: list[BaseException] = []

        def caller(i: int) -> None:
            async def main() -> None:
                for j in range(60):
                    assert await w.acall("tasks.remote:add", i, j) == i + j
                    if j % 20 == 0:  # a cancel now and then, on this thread's loop
                        task = asyncio.ensure_future(w.acall("tasks.remote:cooperative_loop", 9))
                        await asyncio.sleep(0.02)
                        task.cancel()
                        with pytest.raises(asyncio.CancelledError):
                            await task

            try:
                for _ in range(2):  # a new loop each time: nothing of the last one is reused
                    asyncio.run(main())
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        s = w.stats()
        assert (s.ok, s.cancelled, s.crashed, s.in_flight, s.queued) == (1 + 360, 18, 0, 0, 0)
        assert sorted(x.generation for x in s.workers) == [1, 2]  # both workers kept


def test_asyncio_run_ending_with_acalls_in_flight_cancels_them_and_keeps_the_worker(
    apool: comfy_env.Pool,
) -> None:
    w = apool.get_worker()
    assert w.call("tasks.remote:count_calls") == 1

    pending: list[asyncio.Future[Any]] = []

    async def main() -> None:
        for _ in range(3):  # one runs, two wait in the queue
            pending.append(asyncio.ensure_future(w.acall("tasks.remote:cooperative_loop", 30)))
        await _running(w)

    asyncio.run(main())  # cancels the pending tasks and waits for them
    assert all(task.cancelled() for task in pending)
    s = w.stats()
    assert (s.cancelled, s.in_flight, s.queued) == (3, 0, 0)
    assert w.call("tasks.remote:count_calls") == 2  # the same worker, its caches kept
    assert w.generation == 1
