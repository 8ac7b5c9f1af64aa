"""asyncio-native ``arun``/``acall``: no borrowed threads, deadlines at every stage, cancellation.

Every test runs its loop with a deliberately small default executor (2 threads) so that any
call that borrowed an executor thread while it waits would starve the others and show. What
they prove:

* thousands of queued calls cost no thread, and a queue on one env never delays another env;
* the deadline starts when ``arun`` is called and holds while queued, while a worker starts
  and while the call runs;
* task cancellation removes a queued call, and stops a running one cooperatively (the worker
  lives on) or by the kill after the grace; ``on_event`` runs on the loop, in order, before
  the result.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TESTS_DIR, alive, run_small, wait_until

import comfy_env
from comfy_env import CallEvent, CallTimeout, RemoteError, WorkerCrashed


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_a_queue_on_one_env_never_delays_another_env_and_costs_no_thread(
    apool: comfy_env.Pool, foreign_venv: Path
) -> None:
    busy = apool.get_worker()
    other = apool.get_worker(foreign_venv)
    busy.call("tasks.remote:add", 1)
    other.call("comfy_env_worker.tasks:echo", 0)  # both warm
    threads_before = threading.active_count()

    async def main() -> tuple[int, int, int]:
        finished = 0

        async def slow(i: int) -> None:
            nonlocal finished
            await busy.acall("tasks.remote:cooperative_loop", 0.05)
            finished += 1

        tasks = [asyncio.ensure_future(slow(i)) for i in range(40)]
        await asyncio.sleep(0.1)
        assert busy.stats().queued >= 30
        threads_while_queued = threading.active_count()
        # Another env answers while 30+ calls are queued on the busy one.
        assert await other.acall("comfy_env_worker.tasks:echo", "fast") == "fast"
        finished_then = finished
        await asyncio.gather(*tasks)
        return finished_then, threads_while_queued, finished

    finished_then, threads_while_queued, finished = run_small(main)
    assert finished_then < 20 and finished == 40
    assert threads_while_queued <= threads_before + 1  # at most the loop's own helpers
    stats = busy.stats()
    assert (stats.ok, stats.queued, stats.in_flight) == (41, 0, 0)


def test_thousands_of_queued_acalls_cost_no_threads(apool: comfy_env.Pool, tmp_path: Path) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:add", 1)
    threads_before = threading.active_count()
    release = tmp_path / "release"

    async def main() -> list[Any]:
        # The call ahead runs until the file appears: however slow the machine is at queueing
        # 2000 calls, none of them starts before the counts are read.
        blocker = asyncio.ensure_future(w.acall("tasks.remote:wait_for_file", str(release), 60))
        await asyncio.sleep(0.05)
        tasks = [asyncio.ensure_future(w.acall("tasks.remote:add", i, 1)) for i in range(2000)]
        await asyncio.sleep(0.05)
        assert w.stats().queued == 2000
        assert threading.active_count() <= threads_before + 1
        release.touch()
        return [await blocker, *await asyncio.gather(*tasks)]

    results = run_small(main)
    assert results == ["finished", *range(1, 2001)]


def test_the_deadline_holds_while_queued(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:add", 1)

    async def main() -> None:
        blocker = asyncio.ensure_future(w.acall("tasks.remote:cooperative_loop", 2.0))
        await asyncio.sleep(0.05)
        with pytest.raises(CallTimeout, match="queued") as info:
            await w.arun("tasks.remote:add", (1,), timeout=0.3)
        assert (info.value.timeout, info.value.target) == (0.3, "tasks.remote:add")
        assert str(info.value).endswith("(call to tasks.remote:add, timeout 0.3s)")
        assert not blocker.done()  # it gave up while the call ahead still ran
        assert await blocker == "finished"

    run_small(main)
    stats = w.stats()
    assert (stats.timed_out, stats.queued, stats.in_flight, stats.ok) == (1, 0, 0, 2)


def test_the_deadline_holds_while_a_worker_starts(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    # An env whose interpreter takes 1.5 s to start (a launcher that sleeps first).
    _script(tmp_path / "env" / "bin" / "python", f'sleep 1.5\nexec "{sys.executable}" "$@"\n')
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker(tmp_path / "env")

        async def main() -> None:
            with pytest.raises(CallTimeout, match="the worker still starting goes on") as info:
                await w.arun("comfy_env_worker.tasks:echo", (1,), timeout=0.3)
            err = info.value
            assert (err.timeout, err.target) == (0.3, "comfy_env_worker.tasks:echo")
            assert err.call_id is None  # (the start was not over: the call never got one)
            assert str(err).endswith("(call to comfy_env_worker.tasks:echo, timeout 0.3s)")
            assert w.stats().workers[0].state == "starting"  # the caller did not wait for it

        run_small(main)
        # The slow start was not a failed one: the next call uses the same worker.
        assert wait_until(lambda: w.stats().in_flight == 0)
        assert w.call("comfy_env_worker.tasks:echo", 2) == 2
        assert (w.generation, w.stats().timed_out) == (1, 1)


def test_a_cold_acall_that_overruns_once_started_names_its_call(
    config: comfy_env.PoolConfig,
) -> None:
    """The first call of a pool runs on a thread (its worker starts there); when the worker
    started in time but the call then overran, the deadline's error said only "a worker still
    starting goes on ...; a running call's worker is stopped", with no call id."""
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()

        async def main() -> None:
            with pytest.raises(CallTimeout, match="missed its deadline") as info:
                await w.arun("tasks.remote:ignore_cancel", (30,), timeout=2.0)
            err = info.value
            assert err.call_id is not None and err.generation == 1
            assert (err.timeout, err.target) == (2.0, "tasks.remote:ignore_cancel")

        run_small(main)
        assert w.call("tasks.remote:add", 1) == 1 and w.generation == 2  # it was stopped


def test_the_deadline_holds_while_running(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")

    async def main() -> None:
        with pytest.raises(CallTimeout, match="missed its deadline") as info:
            await w.arun("tasks.remote:ignore_cancel", (30,), timeout=0.3)
        err = info.value
        assert (err.timeout, err.target) == (0.3, "tasks.remote:ignore_cancel")
        assert err.call_id is not None and str(err).endswith("was stopped (timeout 0.3s)")

    run_small(main)
    assert w.call("tasks.remote:getpid") != pid
    assert (w.generation, w.stats().timed_out) == (2, 1)


def test_cancelling_a_running_task_stops_the_call_and_keeps_the_worker(
    apool: comfy_env.Pool,
) -> None:
    w = apool.get_worker()
    assert w.call("tasks.remote:count_calls") == 1
    pid = w.pid

    async def main() -> None:
        task = asyncio.ensure_future(w.acall("tasks.remote:cooperative_loop", 30))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    run_small(main)
    assert w.call("tasks.remote:count_calls") == 2  # caches intact
    assert (w.pid, w.generation) == (pid, 1)
    stats = w.stats()
    assert (stats.cancelled, stats.in_flight, stats.ok) == (1, 0, 2)


def test_cancelling_a_queued_task_removes_it(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:count_calls")

    async def main() -> None:
        blocker = asyncio.ensure_future(w.acall("tasks.remote:cooperative_loop", 0.5))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(w.acall("tasks.remote:count_calls"))
        await asyncio.sleep(0.05)
        assert w.stats().queued == 1
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert w.stats().queued == 0
        assert await blocker == "finished"

    run_small(main)
    assert w.call("tasks.remote:count_calls") == 2  # the cancelled call never ran
    stats = w.stats()
    assert (stats.cancelled, stats.ok, stats.queued, stats.in_flight) == (1, 3, 0, 0)


def test_a_task_that_ignores_the_cancel_is_killed_after_the_grace(
    config: comfy_env.PoolConfig,
) -> None:
    cfg = config.model_copy(update={"cancel_grace": 0.5})
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        pid = w.call("tasks.remote:getpid")

        async def main() -> None:
            task = asyncio.ensure_future(w.acall("tasks.remote:ignore_cancel", 30))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        run_small(main)
        assert w.call("tasks.remote:getpid") != pid
        assert (w.generation, w.stats().cancelled) == (2, 1)


def test_on_event_runs_on_the_loop_in_order_before_the_result(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()

    async def main(warm: bool) -> None:
        loop_thread = threading.get_ident()
        seen: list[tuple[str, Any, int]] = []

        def on_event(event: CallEvent) -> None:
            seen.append((event.kind, event.data, threading.get_ident()))

        result = await w.arun("tasks.remote:events_in_order", (3,), on_event=on_event)
        assert result == 3
        kinds = [(k, d if k == "step" else d["done"]) for k, d, _ in seen]
        assert kinds == [x for i in range(3) for x in (("step", i), ("progress", i + 1))]
        assert {t for _, _, t in seen} == {loop_thread}

    run_small(lambda: main(warm=False))  # first call: the worker starts (thread path)
    run_small(lambda: main(warm=True))  # warm: read on the loop
    assert w.generation == 1


def test_acall_errors_and_crashes(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:add", 1)

    async def main() -> None:
        with pytest.raises(RemoteError, match="SystemExit"):
            await w.acall("tasks.remote:system_exit", 3)
        with pytest.raises(WorkerCrashed, match="SIGSEGV"):
            await w.acall("comfy_env_worker.tasks:crash")
        assert await w.acall("tasks.remote:add", 2, 3) == 5  # a fresh worker
        big = bytes(3 * 1024 * 1024)
        assert await w.acall("comfy_env_worker.tasks:echo", big) == big  # out of band

    run_small(main)
    assert w.generation == 2


def test_cancelling_a_task_while_its_worker_starts_never_sends_the_call(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    _script(tmp_path / "env" / "bin" / "python", f'sleep 1\nexec "{sys.executable}" "$@"\n')
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker(tmp_path / "env")

        async def main() -> None:
            task = asyncio.ensure_future(w.acall("comfy_env_worker.tasks:echo", 1))
            await asyncio.sleep(0.2)
            assert w.stats().workers[0].state == "starting"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        run_small(main)
        stats = w.stats()
        assert (stats.cancelled, stats.ok, stats.in_flight) == (1, 0, 0)
        # The start finished and was not wasted: the next call uses that worker.
        assert w.call("comfy_env_worker.tasks:echo", 2) == 2
        assert w.generation == 1


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return 0


def test_an_acall_after_an_idle_death_runs_on_a_fresh_worker_and_counts_once(
    apool: comfy_env.Pool,
) -> None:
    # The warm acall starts in the lease's lock section only when the idle channel is quiet;
    # a worker that died while idle (maybe not reaped yet: its channel shows EOF) is left to the
    # general path, which replaces it. The call runs once, nothing counts as crashed.
    w = apool.get_worker()

    async def main() -> tuple[int, int]:
        first = await w.acall("tasks.remote:add", 1, 1)
        pid = w.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        # Dead while idle: every thread gone (a zombie leader's other threads still hold the
        # channel for a moment), maybe not reaped yet.
        assert wait_until(lambda: not alive(pid) and _threads(pid) <= 1, 5.0)
        second = await w.acall("tasks.remote:add", 2, 2)
        return first, second

    assert run_small(main) == (2, 4)
    assert w.generation == 2
    stats = w.stats()
    assert (stats.submitted, stats.ok, stats.crashed, stats.in_flight) == (2, 2, 0, 0)


def test_an_acall_never_goes_to_a_worker_that_wrote_on_its_idle_channel(
    apool: comfy_env.Pool,
) -> None:
    # The lease's one-lock start polls the idle channel: a worker that wrote bytes nobody
    # asked for is retired before it gets the call (its bytes would be taken for the reply),
    # and the call runs on a fresh worker.
    import select

    w = apool.get_worker()

    async def main() -> int:
        await w.acall("tasks.remote:write_garbage_later", 0.05)
        process = w._entry.slots[0].process
        assert process is not None and process.reply_sock is not None
        sock = process.reply_sock
        assert wait_until(lambda: bool(select.select([sock], [], [], 0)[0]), 5.0)
        result: int = await w.acall("tasks.remote:add", 2, 3)
        return result

    assert run_small(main) == 5
    assert w.generation == 2
    stats = w.stats()
    assert (stats.submitted, stats.ok, stats.crashed, stats.failed) == (2, 2, 0, 0)


# ---- out-of-band buffers on the loop ----------------------------------------------------------


class _NoThreads:
    """Makes any thread started while active fail the test (patches ``threading.Thread``),
    but for the helper that faults in a spare block for a caller keeping its results (it
    never runs a call: ``_channel.Loans._spare_soon``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch

    def __enter__(self) -> None:
        real = threading.Thread

        def refuse(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("name") == "comfy-env-spare":
                return real(*args, **kwargs)
            raise AssertionError("a thread was started for a warm acall")

        self.monkeypatch.setattr(threading, "Thread", refuse)

    def __exit__(self, *exc: object) -> None:
        self.monkeypatch.undo()


def _thread_path_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from comfy_env import _acall

    used = [0]
    real = _acall._on_thread

    async def counting(*args: Any, **kwargs: Any) -> Any:
        used[0] += 1
        return await real(*args, **kwargs)

    monkeypatch.setattr(_acall, "_on_thread", counting)
    return used


def test_a_warm_acall_with_out_of_band_buffers_runs_on_the_loop_without_a_thread(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    np = pytest.importorskip("numpy")
    w = apool.get_worker()
    w.call("tasks.remote:getpid")  # warm: the start runs on a thread of its own
    arr = np.arange(512 * 512 * 3, dtype=np.float32).reshape(512, 512, 3)  # 3 MiB
    used = _thread_path_counter(monkeypatch)

    async def main() -> list[Any]:
        results = []
        with _NoThreads(monkeypatch):
            for _ in range(3):  # later calls carry the loans of the earlier replies back
                results.append(await w.acall("comfy_env_worker.tasks:echo", arr))
        return results

    results = run_small(main)
    for echoed in results:
        assert echoed.dtype == arr.dtype and echoed.shape == arr.shape
        assert np.array_equal(echoed, arr)
    assert used == [0]
    stats = w.stats()
    assert (stats.ok, stats.in_flight, w.generation) == (4, 0, 1)
    del results, echoed
    assert w.call("tasks.remote:add", 2, 3) == 5  # the loans went back; the channel is in sync


def test_cancel_and_deadline_hold_for_a_warm_acall_with_buffers(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    np = pytest.importorskip("numpy")
    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")
    used = _thread_path_counter(monkeypatch)
    arr = np.ones(1 << 20, dtype=np.float32)  # 4 MiB: shared memory, on the loop

    async def main() -> None:
        task = asyncio.ensure_future(w.acall("tasks.remote:hold_array", arr, 30))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The worker stopped cooperatively and lives on; the next buffer call is exact.
        assert await w.acall("tasks.remote:hold_array", arr, 0) == float(1 << 20)
        with pytest.raises(CallTimeout, match="missed its deadline"):
            await w.arun("tasks.remote:hold_array", (arr, 30), timeout=0.3)

    run_small(main)
    stats = w.stats()
    assert (stats.cancelled, stats.timed_out, stats.in_flight) == (1, 1, 0)
    assert used == [0]  # all three ran on the loop
    assert w.call("tasks.remote:hold_array", arr, 0) == float(1 << 20)
    assert w.pid != pid and w.generation == 2  # the deadline stopped generation 1


def test_an_acall_with_buffers_above_the_loop_bound_uses_the_thread_path(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    np = pytest.importorskip("numpy")
    from comfy_env import _acall

    w = apool.get_worker()
    w.call("tasks.remote:getpid")
    used = _thread_path_counter(monkeypatch)
    big = np.full(_acall._OOB_LOOP_MAX // 4 + 1024, 2.0, dtype=np.float32)  # just above
    small = np.full(1 << 20, 3.0, dtype=np.float32)

    async def main() -> tuple[Any, Any]:
        return await w.acall("comfy_env_worker.tasks:echo", big), await w.acall(
            "comfy_env_worker.tasks:echo", small
        )

    got_big, got_small = run_small(main)
    assert np.array_equal(got_big, big) and np.array_equal(got_small, small)
    assert used == [1]  # only the large one took a thread
    del got_big, got_small


def test_the_first_acall_of_a_big_buffer_size_makes_its_block_off_the_loop(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh block costs far more than the copy (create, reserve, fault in: 107 ms at 16 MiB
    # was measured on the loop). Above _FRESH_LOOP_MAX the first call of a size runs on a
    # thread; once a block of that size is idle in the pool, calls run on the loop.
    np = pytest.importorskip("numpy")
    from comfy_env import _acall

    w = apool.get_worker()
    w.call("tasks.remote:getpid")
    used = _thread_path_counter(monkeypatch)
    n = (_acall._FRESH_LOOP_MAX + _acall._OOB_LOOP_MAX) // 2 // 4
    arr = np.ones(n, dtype=np.float32)  # between the two bounds

    async def main() -> list[float]:
        return [await w.acall("tasks.remote:hold_array", arr, 0) for _ in range(3)]

    assert run_small(main) == [float(n)] * 3
    assert used == [1]  # only the first: the block it made went back to the pool
    stats = w.stats()
    assert (stats.ok, stats.in_flight, w.generation) == (4, 0, 1)


def test_an_acall_with_buffers_streams_inline_on_a_thread_when_shared_memory_is_off() -> None:
    np = pytest.importorskip("numpy")
    cfg = comfy_env.PoolConfig(sys_path=(str(TESTS_DIR),), shared_memory=False)
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:getpid")
        arr = np.arange(1 << 20, dtype=np.float32)

        async def main() -> Any:
            return await w.acall("comfy_env_worker.tasks:echo", arr)

        with pytest.MonkeyPatch.context() as mp:
            used = _thread_path_counter(mp)
            got = run_small(main)
            assert used == [1]
        assert np.array_equal(got, arr)
        assert w.stats().ok == 2


def test_a_warm_acall_reads_a_reply_that_spans_many_reads_on_the_loop(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The spin's first read holds only the start of the frame: the general parser takes
    # over from there (on the spot, then through the loop), never a thread.
    w = apool.get_worker()
    w.call("tasks.remote:getpid")
    used = _thread_path_counter(monkeypatch)
    size = 700_000

    async def main() -> list[Any]:
        return [await w.acall("tasks.remote:blob", size + i) for i in range(3)]

    got = run_small(main)
    assert used == [0]
    assert [len(b) for b in got] == [size, size + 1, size + 2]
    assert got[2][:256] == bytes(range(256)) and got[2].endswith(b"xx")
    assert w.stats().ok == 4 and w.generation == 1


def _pin(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_warm_acalls_confined_to_one_cpu_with_their_worker_keep_order_and_events(
    apool: comfy_env.Pool,
) -> None:
    # One CPU for the caller and the worker: a reply not there yet is waited for by yielding
    # the CPU to the worker (``_shares_one_cpu``); events, logs and results are unchanged.
    from comfy_env import _acall

    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")
    original = os.sched_getaffinity(0)
    cpu = min(original)
    me = threading.get_native_id()
    try:
        os.sched_setaffinity(me, {cpu})
        _pin(pid, {cpu})

        async def main() -> list[Any]:
            seen: list[tuple[str, Any]] = []
            out: list[Any] = [await w.acall("tasks.remote:add", i, 1) for i in range(200)]
            out.append(
                await w.arun(
                    "tasks.remote:events_in_order",
                    (4,),
                    on_event=lambda e: seen.append((e.kind, e.data)),
                )
            )
            out.append(await w.acall("tasks.remote:log_things", 2))
            out.append([k for k, _ in seen])
            return out

        got = run_small(main)
        process = w._entry.slots[0].process
        assert process is not None
        later = time.monotonic() + 1000.0  # past any cached check
        assert _acall._shares_one_cpu(process, later) is True
        if len(original) > 1:
            # The worker moved to another CPU: seen at the next check after the TTL.
            _pin(pid, {max(original)})
            assert _acall._shares_one_cpu(process, later) is True  # cached
            assert _acall._shares_one_cpu(process, later + 2 * _acall._AFFINITY_TTL) is False
    finally:
        os.sched_setaffinity(me, original)
        _pin(pid, original)
    assert got[:200] == [i + 1 for i in range(200)]
    assert got[200] == 4 and got[201] == 2
    assert got[202] == ["step", "progress"] * 4
    assert w.stats().ok == 203 and w.generation == 1


def test_a_frame_buffer_grows_by_doubling_past_its_eager_size() -> None:
    from comfy_env_worker.protocol import FrameBuffer

    chunk, n = 64 << 10, 256
    frame = FrameBuffer(n * chunk, b"", eager=chunk)
    payload = frame.data
    done = False
    for i in range(n):
        with frame.space() as view:
            view[:chunk] = bytes((i % 256,)) * chunk
        done = frame.wrote(chunk)
    assert done and frame.complete
    assert frame.data is payload  # grown in place: the payload is the one buffer
    assert len(payload) == n * chunk
    assert frame.allocations <= 1 + 8  # log2(n) doublings, not one per chunk
    assert all(payload[i * chunk] == i % 256 == payload[(i + 1) * chunk - 1] for i in range(n))
    # A frame up to the eager size is one allocation of its exact size, head included.
    small = FrameBuffer(1000, b"x" * 100)
    assert (len(small.data), small.allocations, small.data[:100]) == (1000, 1, b"x" * 100)


def test_a_large_reply_on_the_loop_is_received_into_one_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each readiness callback reads once; a frame's payload goes straight into one buffer
    # of its size. Joining every 64 KiB read to what came before (the old reader) held the
    # reply twice at the end and copied it again at every read: quadratic time. (A reply of
    # _BIG_REPLY bytes or more is left to a thread of its own, test_acall_big_reply.py: the
    # bound is raised here so that the loop's reader receives these.)
    import socket
    import tracemalloc

    from comfy_env import _acall
    from comfy_env._acall import _ReplyReader
    from comfy_env_worker.protocol import HEADER, MAGIC, FrameReader, FrameType

    monkeypatch.setattr(_acall, "_BIG_REPLY", 1 << 62)

    size = 8 << 20
    payload = bytes(range(256)) * (size // 256)
    stream = (
        HEADER.pack(MAGIC, FrameType.EVENT, 0, 5, 7)
        + b"event"
        + HEADER.pack(MAGIC, FrameType.REPLY_OK, 0, size, 7)
        + payload
    )
    a, b = socket.socketpair()
    try:
        frames = FrameReader(a, 4 << 30)
        events: list[tuple[int, bytes]] = []
        reader = _ReplyReader(frames, lambda _p: None, 7, lambda c, p: events.append((c, p)))
        tracemalloc.start()
        try:
            for i in range(0, len(stream), 65536):
                b.sendall(stream[i : i + 65536])
                while reader.outcome is None and frames.readable_now():
                    reader.on_readable()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < size * 3 // 2  # the reply once, never twice
        assert reader.outcome is not None
        kind, (ftype, flags, call_id, got, rest) = reader.outcome
        assert (kind, ftype, flags, call_id, rest) == ("frame", FrameType.REPLY_OK, 0, 7, b"")
        assert type(got) is bytearray and got == payload
        assert events == [(7, b"event")]

        # A peer announcing a huge frame gets memory only as bytes arrive, on the loop too.
        reader = _ReplyReader(frames, lambda _p: None, 8, None)
        b.sendall(HEADER.pack(MAGIC, FrameType.REPLY_OK, 0, 3 << 30, 8) + b"\0" * 1000)
        b.close()
        tracemalloc.start()
        try:
            while reader.outcome is None:
                reader.on_readable()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert reader.outcome == ("eof", None)
        assert peak < 128 << 20  # not 3 GiB up front
    finally:
        a.close()
        b.close()


def test_a_reply_reader_on_the_loop_stops_at_the_header_of_its_large_reply() -> None:
    # From _BIG_REPLY bytes on, the loop reads nothing of a reply to its call past the
    # header (and what came with it): the rest is the receiving thread's. Events before it
    # are handled; a large frame of another kind, or for another call, is not handed over.
    import socket

    from comfy_env._acall import _BIG_REPLY, _ReplyReader
    from comfy_env_worker.protocol import HEADER, MAGIC, FrameReader, FrameType

    size = _BIG_REPLY
    head = HEADER.pack(MAGIC, FrameType.REPLY_OK, 0, size, 7)
    a, b = socket.socketpair()
    try:
        frames = FrameReader(a, 4 << 30)
        events: list[tuple[int, bytes]] = []
        reader = _ReplyReader(frames, lambda _p: None, 7, lambda c, p: events.append((c, p)))
        b.sendall(HEADER.pack(MAGIC, FrameType.EVENT, 0, 5, 7) + b"event" + head + b"abc")
        reader.on_readable()
        assert events == [(7, b"event")]
        assert reader.outcome == ("big", (FrameType.REPLY_OK, 0, size, b"abc"))
        b.sendall(b"rest")
        reader.on_readable()  # ended: reads nothing more
        assert frames.recv_nowait() == b"rest"
        for ftype, call_id in ((FrameType.EVENT, 7), (FrameType.REPLY_OK, 8)):
            other = _ReplyReader(frames, lambda _p: None, 7, None)
            b.sendall(HEADER.pack(MAGIC, ftype, 0, size, call_id) + b"abc")
            other.on_readable()
            assert other.outcome is None and other.frame is not None  # received on the loop
    finally:
        a.close()
        b.close()


def test_large_in_band_replies_round_trip_through_a_warm_acall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    np = pytest.importorskip("numpy")
    cfg = comfy_env.PoolConfig(sys_path=(str(TESTS_DIR),), shared_memory=False)
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        # Warm: both calls below run on the loop (their large replies are received and
        # unpickled on a thread of their own, never through the sync path on a thread).
        w.call("tasks.remote:getpid")
        used = _thread_path_counter(monkeypatch)

        async def main() -> tuple[str, Any]:
            text = await w.acall("tasks.remote:text", 32 << 20)
            arr = await w.acall("tasks.remote:filled", 2.5, 4 << 20)  # 16 MiB, inline
            return text, arr

        text, arr = run_small(main)
        assert used == [0]
        n = 32 << 20
        assert text == "abcdefghijklmnopqrstuvwxyz" * (n // 26) + "z" * (n % 26)
        assert arr.dtype == np.float32 and arr.shape == (4 << 20,) and bool((arr == 2.5).all())
        stats = w.stats()
        assert (stats.ok, stats.in_flight, w.generation) == (3, 0, 1)


def test_an_async_on_event_is_refused_at_the_call_never_silently_dropped(
    apool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    # Calling an ``async def`` only makes a coroutine: nothing would await it and every event
    # would be lost (a RuntimeWarning at best). It is an ArgumentError before anything runs.
    w = apool.get_worker()
    w.call("tasks.remote:add", 1)

    async def on_event(event: CallEvent) -> None:
        pass

    class AsyncCallable:
        async def __call__(self, event: CallEvent) -> None:
            pass

    async def main() -> None:
        for callback in (on_event, AsyncCallable()):
            with pytest.raises(comfy_env.ArgumentError, match="coroutine function"):
                await w.arun("tasks.remote:events_in_order", (3,), on_event=callback)
            with pytest.raises(comfy_env.ArgumentError, match="coroutine function"):
                await w.arun_ref("tasks.remote:events_in_order", (3,), on_event=callback)

    run_small(main)
    with pytest.raises(comfy_env.ArgumentError, match="coroutine function"):
        w.run("tasks.remote:events_in_order", (3,), on_event=on_event)
    with pytest.raises(comfy_env.ArgumentError, match="coroutine function"):
        w.submit("tasks.remote:events_in_order", (3,), on_event=on_event)
    assert w.stats().submitted == 1  # nothing ran, nothing was counted

    # A plain callback that returns a coroutine: closed (no "never awaited" warning) and
    # reported, and the call goes on.
    seen: list[str] = []

    async def handle(event: CallEvent) -> None:
        seen.append(event.kind)

    with caplog.at_level("ERROR", logger="comfy_env"):

        async def lossy() -> Any:
            return await w.arun(
                "tasks.remote:events_in_order", (2,), on_event=lambda ev: handle(ev)
            )

        assert run_small(lossy) == 2
    assert seen == []
    assert sum("on_event returned a coroutine" in r.getMessage() for r in caplog.records) == 4
