"""``comfy_env.Executor`` against what ``concurrent.futures`` documents, case by case, with real
workers (the current interpreter, and an env of another Python version, where
``ProcessPoolExecutor`` with ``set_executable`` never runs a call)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS_DIR, other_python, wait_until
from tasks import executor as tasks

import comfy_env
from comfy_env import ArgumentError, SerializationError, WorkerCrashed


@pytest.fixture
def executor(config: comfy_env.PoolConfig) -> Iterator[comfy_env.Executor]:
    ex = comfy_env.Executor(None, max_workers=2, config=config)
    try:
        yield ex
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def test_is_a_concurrent_futures_executor_whose_submit_returns_a_future(
    executor: comfy_env.Executor,
) -> None:
    assert isinstance(executor, concurrent.futures.Executor)
    future = executor.submit(tasks.square, 7)
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(timeout=30) == 49
    assert executor.submit(tasks.add, 2, b=3).result(timeout=30) == 5
    # A "module:function" string, as Worker.call takes it, and a by-value lambda.
    assert executor.submit("tasks.executor:square", 4).result(timeout=30) == 16
    offset = 10
    assert executor.submit(lambda x: x + offset, 1).result(timeout=30) == 11
    assert executor.submit(tasks.pid).result(timeout=30) != os.getpid()


def test_max_workers_means_worker_processes(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Executor(max_workers=2, config=config) as ex:
        futures = [ex.submit(tasks.sleep_then, 0.5, i) for i in range(4)]
        pids = {ex.submit(tasks.pid).result(timeout=30) for _ in range(4)}
        assert [f.result(timeout=30) for f in futures] == [0, 1, 2, 3]
        stats = ex.pool.stats()[ex.env]
        assert len(stats.workers) <= 2
        assert len(pids) <= 2


def test_bad_arguments_are_refused_up_front(config: comfy_env.PoolConfig) -> None:
    for bad in (0, -1, 257, 1.5, True, "2"):
        with pytest.raises((ArgumentError, ValueError)):
            comfy_env.Executor(max_workers=bad, config=config)  # type: ignore[arg-type]
    with pytest.raises(comfy_env.EnvError):
        comfy_env.Executor("/no/such/env", config=config)
    with comfy_env.Executor(max_workers=1, config=config) as ex:
        with pytest.raises(ValueError, match="chunksize"):
            ex.map(tasks.square, [1], chunksize=0)
        with pytest.raises(ArgumentError):
            ex.submit(42)  # type: ignore[arg-type]


def test_submit_after_shutdown_raises_runtime_error(config: comfy_env.PoolConfig) -> None:
    ex = comfy_env.Executor(max_workers=1, config=config)
    assert ex.submit(tasks.square, 2).result(timeout=30) == 4
    ex.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(tasks.square, 2)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.map(tasks.square, [1, 2])
    ex.shutdown()  # idempotent
    assert ex.pool.closed


def test_shutdown_of_an_unused_executor_starts_nothing(config: comfy_env.PoolConfig) -> None:
    ex = comfy_env.Executor(max_workers=3, config=config)
    ex.shutdown()
    assert ex.pool.closed


def test_map_returns_results_in_order(executor: comfy_env.Executor) -> None:
    # Later items finish first (shorter sleeps); results still come in submission order.
    delays = [0.3, 0.2, 0.1, 0.0]
    assert list(executor.map(tasks.sleep_then, delays, "abcd")) == ["a", "b", "c", "d"]
    assert list(executor.map(tasks.square, range(50))) == [x * x for x in range(50)]


@pytest.mark.parametrize("chunksize", [1, 3, 7, 100])
def test_map_with_chunksize_gives_the_same_results(
    executor: comfy_env.Executor, chunksize: int
) -> None:
    assert list(executor.map(tasks.square, range(20), chunksize=chunksize)) == [
        x * x for x in range(20)
    ]
    assert list(executor.map(lambda x: -x, range(5), chunksize=chunksize)) == [0, -1, -2, -3, -4]
    assert list(executor.map(tasks.square, [], chunksize=chunksize)) == []
    assert list(executor.map(tasks.pid, chunksize=chunksize)) == []  # no iterables: no calls


def test_map_with_chunksize_sends_one_call_per_chunk(executor: comfy_env.Executor) -> None:
    before = executor.pool.stats()[executor.env].submitted
    assert len(list(executor.map(tasks.square, range(100), chunksize=25))) == 100
    assert executor.pool.stats()[executor.env].submitted - before == 4


def test_map_chunks_carry_non_scalar_items_and_results(executor: comfy_env.Executor) -> None:
    # Scalars travel as one pickle per chunk; anything else (here tuples, bytes, a dict) as the
    # call path sends any argument and result.
    items = [(1, "a"), b"bytes", {"k": [1, 2]}, None, 2.5, "text"]
    assert list(executor.map(tasks.identity, items, chunksize=4)) == items
    assert list(executor.map(tasks.identity, range(5), chunksize=2)) == list(range(5))
    # A big chunk of scalars (its pickle over comfy_env_worker.tasks.PACKED_MAX) goes as bytes,
    # which may travel out of band.
    words = [f"word-{i:08d}" for i in range(30_000)]
    assert list(executor.map(tasks.identity, words, chunksize=15_000)) == words


@pytest.mark.parametrize("chunksize", [1, 2])
def test_map_over_several_iterables_stops_at_the_shortest(
    executor: comfy_env.Executor, chunksize: int
) -> None:
    result = executor.map(tasks.add, [1, 2, 3, 4], (10, 20, 30), chunksize=chunksize)
    assert list(result) == [11, 22, 33]


def test_map_submits_everything_before_the_first_result_is_read(
    executor: comfy_env.Executor, tmp_path: Path
) -> None:
    paths = [str(tmp_path / f"f{i}") for i in range(3)]
    results = executor.map(tasks.touch, paths)  # not iterated yet
    assert wait_until(lambda: all(os.path.exists(p) for p in paths), timeout=30)
    assert list(results) == paths


def test_map_timeout_raises_from_the_iterator_and_cancels_the_rest(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    with comfy_env.Executor(max_workers=1, config=config) as ex:
        ex.submit(tasks.square, 1).result(timeout=30)  # started: the timeout measures the calls
        markers = [tmp_path / f"m{i}" for i in range(4)]
        started = time.monotonic()
        results = ex.map(tasks.touch, [str(m) for m in markers], [1.0] * 4, timeout=0.5)
        with pytest.raises(TimeoutError):
            next(results)
        # concurrent.futures.TimeoutError is TimeoutError from 3.11; on 3.10 it is its own class.
        assert time.monotonic() - started < 5.0
        # The first call was running (it goes on); the queued ones were cancelled and never run.
    assert not any(m.exists() for m in markers[1:])


def test_map_results_left_unread_are_cancelled_when_the_iterator_is_closed(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    with comfy_env.Executor(max_workers=1, config=config) as ex:
        markers = [tmp_path / f"m{i}" for i in range(5)]
        results = ex.map(tasks.touch, [str(m) for m in markers], [0.3] * 5)
        assert next(results) == str(markers[0])
        results.close()  # given up: what has not started is cancelled
    ran = sum(m.exists() for m in markers)
    assert ran < 5


def test_an_exception_raised_by_the_function_is_reraised_from_result(
    executor: comfy_env.Executor,
) -> None:
    future = executor.submit(tasks.fail, "boom")
    with pytest.raises(KeyError, match="boom"):
        future.result(timeout=30)
    assert isinstance(future.exception(), KeyError)
    # In map, the exception is raised when its value is reached; earlier values come first.
    results = executor.map(tasks.crash_if, [1, 2], [0, 0])
    assert list(results) == [1, 2]
    it = executor.map(tasks.fail, ["x"])
    with pytest.raises(KeyError):
        next(it)
    # And the executor carries on.
    assert executor.submit(tasks.square, 5).result(timeout=30) == 25


def test_a_crash_fails_only_its_future_and_later_futures_succeed(
    executor: comfy_env.Executor,
) -> None:
    before = [executor.submit(tasks.square, i) for i in range(3)]
    crashed = executor.submit(tasks.crash_if, 1, 1)
    aborted = executor.submit(tasks.abort)
    after = [executor.submit(tasks.square, i) for i in range(3)]
    with pytest.raises(WorkerCrashed, match="SIGSEGV"):
        crashed.result(timeout=60)
    with pytest.raises(WorkerCrashed, match="SIGABRT"):
        aborted.result(timeout=60)
    assert [f.result(timeout=60) for f in before + after] == [0, 1, 4, 0, 1, 4]
    assert executor.submit(tasks.square, 9).result(timeout=60) == 81
    # A crash inside a chunk of map fails that chunk; the other chunks' results arrive.
    results = executor.map(tasks.crash_if, range(6), [4] * 6, chunksize=2)
    assert [next(results) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(WorkerCrashed):
        next(results)


def test_shutdown_with_cancel_futures_cancels_pending_calls_which_never_run(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    ex = comfy_env.Executor(max_workers=1, config=config)
    running = ex.submit(tasks.touch, str(tmp_path / "running"), 1.0)
    assert wait_until(running.running, timeout=30)
    pending = [ex.submit(tasks.touch, str(tmp_path / f"pending{i}")) for i in range(5)]
    ex.shutdown(wait=True, cancel_futures=True)
    assert running.result(timeout=0) == str(tmp_path / "running")  # a running call completes
    assert all(f.cancelled() for f in pending)
    with pytest.raises(concurrent.futures.CancelledError):
        pending[0].result()
    assert not any((tmp_path / f"pending{i}").exists() for i in range(5))
    assert ex.pool.closed


def test_a_future_cancelled_while_queued_never_runs(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    with comfy_env.Executor(max_workers=1, config=config) as ex:
        first = ex.submit(tasks.touch, str(tmp_path / "first"), 0.5)
        queued = ex.submit(tasks.touch, str(tmp_path / "queued"))
        assert queued.cancel()
        assert queued.cancelled()
        assert first.result(timeout=30)
        assert wait_until(first.running, timeout=0.1) or first.done()
        assert not first.cancel()  # done (or running): cannot be cancelled, as documented
    assert not (tmp_path / "queued").exists()


def test_shutdown_without_wait_returns_at_once_and_the_calls_still_run(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    ex = comfy_env.Executor(max_workers=1, config=config)
    futures = [ex.submit(tasks.touch, str(tmp_path / f"f{i}"), 0.3) for i in range(3)]
    started = time.monotonic()
    ex.shutdown(wait=False)
    assert time.monotonic() - started < 0.3
    with pytest.raises(RuntimeError):
        ex.submit(tasks.square, 1)
    assert [f.result(timeout=30) for f in futures] == [str(tmp_path / f"f{i}") for i in range(3)]
    # The last dispatcher closes the pool once the queue is empty: nothing is left running.
    assert wait_until(lambda: ex.pool.closed, timeout=30)
    assert wait_until(lambda: not ex._threads, timeout=30)


def test_an_exception_in_a_done_callback_is_logged_not_raised(
    executor: comfy_env.Executor, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[int] = []

    def bad(_: concurrent.futures.Future[int]) -> None:
        raise RuntimeError("callback failed")

    future = executor.submit(tasks.square, 3)
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        future.add_done_callback(bad)
        future.add_done_callback(lambda f: seen.append(f.result()))
        assert future.result(timeout=30) == 9
        assert wait_until(lambda: seen == [9], timeout=30)
        # A callback added to a done future runs at once, on this thread, and is logged too.
        future.add_done_callback(bad)
    assert sum("exception calling callback" in r.getMessage() for r in caplog.records) == 2
    assert executor.submit(tasks.square, 4).result(timeout=30) == 16


def test_usable_with_loop_run_in_executor(executor: comfy_env.Executor) -> None:
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        calls = (loop.run_in_executor(executor, tasks.square, x) for x in range(6))
        return list(await asyncio.gather(*calls))

    assert asyncio.run(main()) == [0, 1, 4, 9, 16, 25]


def test_context_manager_waits_for_the_calls_and_stops_the_workers(
    config: comfy_env.PoolConfig,
) -> None:
    with comfy_env.Executor(max_workers=2, config=config) as ex:
        futures = [ex.submit(tasks.sleep_then, 0.2, i) for i in range(4)]
        pid = ex.submit(tasks.pid).result(timeout=30)
    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == [0, 1, 2, 3]
    assert ex.pool.closed
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.fixture(scope="module")
def other_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    minor = 12 if sys.version_info[:2] != (3, 12) else 11
    python = other_python(minor) or other_python(8)
    if python is None:
        pytest.skip("no Python of another minor version on this machine")
    env = tmp_path_factory.mktemp("executor") / "other"
    subprocess.run([python, "-m", "venv", "--without-pip", str(env)], check=True)
    return env


@pytest.mark.timeout(120)
def test_an_env_of_another_python_runs_submit_map_and_crashes(
    config: comfy_env.PoolConfig, other_env: Path
) -> None:
    with comfy_env.Executor(other_env, max_workers=2, config=config) as ex:
        version = ex.submit(tasks.version).result(timeout=60)
        assert version != f"{sys.version_info[0]}.{sys.version_info[1]}"
        assert list(ex.map(tasks.square, range(10))) == [x * x for x in range(10)]
        assert list(ex.map(tasks.add, range(10), range(10), chunksize=3)) == list(range(0, 20, 2))
        with pytest.raises(KeyError, match="boom"):
            ex.submit(tasks.fail, "boom").result(timeout=60)
        crashed = ex.submit(tasks.crash_if, 1, 1)
        later = ex.submit(tasks.square, 6)
        with pytest.raises(WorkerCrashed):
            crashed.result(timeout=60)
        assert later.result(timeout=60) == 36
        # By value needs the same Python: said clearly, and only that future fails.
        with pytest.raises(SerializationError, match="same Python version"):
            ex.submit(lambda: 1).result(timeout=60)
        with pytest.raises(SerializationError):
            list(ex.map(lambda x: x, range(4), chunksize=2))

        async def main() -> int:
            loop = asyncio.get_running_loop()
            return int(await loop.run_in_executor(ex, tasks.square, 11))

        assert asyncio.run(main()) == 121


@pytest.mark.timeout(120)
def test_process_pool_executor_cannot_run_a_call_in_that_env(other_env: Path) -> None:
    """The baseline the issue reports: ProcessPoolExecutor with spawn and the env's interpreter
    (``set_executable``) never runs a call there; comfy_env.Executor does (above)."""
    code = f"""
import multiprocessing, concurrent.futures, sys
sys.path.insert(0, {str(TESTS_DIR)!r})
from tasks import executor as executor_tasks
ctx = multiprocessing.get_context("spawn")
ctx.set_executable({str(other_env / "bin" / "python")!r})
with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as ex:
    try:
        print("RESULT", ex.submit(executor_tasks.square, 3).result(timeout=60))
    except Exception as exc:
        print("FAILED", type(exc).__name__)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100
    ).stdout
    assert "RESULT 9" not in out


@pytest.mark.timeout(60)
def test_an_executor_not_shut_down_runs_out_its_queue_at_interpreter_exit(tmp_path: Path) -> None:
    # As concurrent.futures' executors do: the host exits only after the queued calls ran.
    code = f"""
import sys
sys.path.insert(0, {str(TESTS_DIR)!r})
import comfy_env
from tasks import executor as executor_tasks
ex = comfy_env.Executor(None, 1, config=comfy_env.PoolConfig(sys_path=({str(TESTS_DIR)!r},)))
for i in range(4):
    ex.submit(executor_tasks.touch, {str(tmp_path)!r} + f"/m{{i}}", 0.1)
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0", "m1", "m2", "m3"]
