"""The contract every backend keeps, run against each one ("local", "ray").

A promise that depends on something a backend may lack is skipped by the capability it needs
(``Backend.capabilities``: "exit codes", "signal grace", "shared memory", "fork", "fd
channel"), never by the backend's name. What the suite proves, per backend:

* a call returns its result; a remote exception is re-raised as its own class;
* a crash fails that call with ``WorkerCrashed`` (env, pid, generation, the signal), is never
  replayed, and the next call runs on generation 2; a worker that died idle is invisible;
* a missed deadline stops the worker (``CallTimeout``); a cooperative cancel keeps the
  generation and its caches;
* progress and events arrive in order, before the result;
* a ``RemoteRef`` round trip works and is bound to its generation;
* large results are writable, private copies; ``close`` stops every worker;
* the stats add up.

Ray tests use the session's local cluster (see ``conftest.ray_cluster``); they are marked
``ray`` and skipped when ray is not installed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS_DIR, alive, wait_until

import comfy_env
from comfy_env import CallCancelled, CallEvent, CallTimeout, WorkerCrashed

BACKENDS = ["local", pytest.param("ray", marks=pytest.mark.ray)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def cpool(backend: str) -> Iterator[comfy_env.Pool]:
    cfg = comfy_env.PoolConfig(
        backend=backend,  # type: ignore[arg-type]
        sys_path=(str(TESTS_DIR),),
        kill_grace=0.5,
        close_timeout=5.0,
        cancel_grace=3.0,
        start_timeout=90.0,  # Ray's first actor on a busy 2-core machine takes seconds
    )
    with comfy_env.Pool(cfg) as p:
        yield p


def capabilities(pool: comfy_env.Pool) -> frozenset[str]:
    caps: frozenset[str] = pool.backend.capabilities
    return caps


def needs(pool: comfy_env.Pool, capability: str) -> None:
    if capability not in capabilities(pool):
        pytest.skip(f"the {pool.backend.name} backend has no {capability!r}")


def test_a_call_returns_its_result(cpool: comfy_env.Pool) -> None:
    w = cpool.get_worker()
    assert w.call("tasks.remote:add", 2, b=3) == 5
    value = {1: (b"\x00\xff", [1.5, None]), "s": "\u00e9"}
    assert w.call("comfy_env_worker.tasks:echo", value) == value
    assert w.generation == 1


def test_lifecycle_events_name_each_generation_and_its_pid(cpool: comfy_env.Pool) -> None:
    seen: list[object] = []
    unsubscribe = cpool.subscribe(seen.append)
    try:
        w = cpool.get_worker()
        pid = w.call("tasks.remote:getpid")
        with pytest.raises(WorkerCrashed):
            w.call("tasks.remote:count_then_crash", os.devnull)
        assert w.call("tasks.remote:getpid") != pid
        names = ("WorkerSpawned", "WorkerReady", "WorkerRetired")

        def lifecycle() -> list[tuple[str, int]]:
            return [
                (type(e).__name__, e.generation)  # type: ignore[attr-defined]
                for e in seen
                if type(e).__name__ in names
            ]

        want = [("WorkerSpawned", 1), ("WorkerReady", 1), ("WorkerRetired", 1)]
        want += [("WorkerSpawned", 2), ("WorkerReady", 2)]
        # Generation 1's retirement may be published after generation 2 spawned.
        assert wait_until(lambda: sorted(lifecycle()) == sorted(want), 30), lifecycle()
        first = next(e for e in seen if type(e).__name__ == "WorkerSpawned")
        if "exit codes" in capabilities(cpool):
            assert first.pid > 0  # type: ignore[attr-defined]  # the launched process
        else:
            assert first.pid == pid  # type: ignore[attr-defined]  # the actor's, from its hello
    finally:
        unsubscribe()


def test_a_remote_exception_is_reraised_as_its_class(cpool: comfy_env.Pool) -> None:
    from tasks import remote as remote_tasks

    w = cpool.get_worker()
    with pytest.raises(remote_tasks.CustomError) as info:
        w.call("tasks.remote:raise_custom", 7)
    assert info.value.code == 7
    assert "raise_custom" in str(info.value.__cause__)  # the remote traceback
    assert w.call("tasks.remote:add", 1) == 1  # the worker lives on
    assert w.generation == 1


def test_a_crash_fails_that_call_once_and_the_next_runs_on_generation_2(
    cpool: comfy_env.Pool, tmp_path: Path
) -> None:
    w = cpool.get_worker()
    pid = w.call("tasks.remote:getpid")
    marker = tmp_path / "runs"
    with pytest.raises(WorkerCrashed) as info:
        w.call("tasks.remote:count_then_crash", str(marker))
    exc = info.value
    assert exc.generation == 1 and exc.pid == pid and exc.env == w.stats().env
    assert "not retried" in str(exc)
    assert exc.signal == "SIGSEGV"  # Ray: read from the actor's log (faulthandler)
    if "exit codes" in capabilities(cpool):
        assert exc.exitcode == -signal.SIGSEGV
    assert "Segmentation fault" in (exc.stderr_tail or "")  # the worker's last words
    assert marker.read_text() == "ran\n"  # ran once: never replayed
    assert w.call("tasks.remote:add", 4) == 4
    assert w.generation == 2
    assert w.call("tasks.remote:getpid") != pid
    stats = w.stats()
    assert stats.crashed == 1 and stats.spawns == 2


def test_an_exit_without_a_signal_is_a_crash_too(cpool: comfy_env.Pool) -> None:
    w = cpool.get_worker()
    with pytest.raises(WorkerCrashed) as info:
        w.call("comfy_env_worker.tasks:exit_now", 3)
    if "exit codes" in capabilities(cpool):
        assert info.value.exitcode == 3
    else:
        assert info.value.exitcode is None and info.value.signal is None
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 2


def test_a_worker_that_died_idle_is_invisible_to_the_next_call(cpool: comfy_env.Pool) -> None:
    w = cpool.get_worker()
    pid = w.call("tasks.remote:getpid")
    os.kill(pid, signal.SIGKILL)
    # The death is noticed without a call (the local reactor's pidfd; Ray's death notice).
    assert wait_until(lambda: w.pid is None, timeout=30)
    assert w.call("tasks.remote:add", 5) == 5
    assert w.generation == 2
    assert w.stats().crashed == 0  # no call failed


def test_a_missed_deadline_stops_the_worker(cpool: comfy_env.Pool) -> None:
    w = cpool.get_worker()
    pid = w.call("tasks.remote:getpid")
    with pytest.raises(CallTimeout) as info:
        w.run("comfy_env_worker.tasks:sleep", (60,), timeout=1.0)
    assert info.value.generation == 1
    assert wait_until(lambda: not alive(pid), timeout=30)
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 2 and w.stats().timed_out == 1


def test_a_cooperative_cancel_keeps_the_generation_and_its_caches(cpool: comfy_env.Pool) -> None:
    w = cpool.get_worker()
    assert w.call("tasks.remote:count_calls") == 1
    pid = w.pid
    call = w.submit("tasks.remote:cooperative_loop", (60,))
    assert wait_until(lambda: call.running() and w.stats().in_flight == 1, timeout=30)
    time.sleep(0.3)  # let the worker enter the function
    assert call.cancel() is True
    with pytest.raises(CallCancelled):
        call.result(timeout=30)
    assert w.call("tasks.remote:count_calls") == 2  # same process, its module cache kept
    assert w.pid == pid and w.generation == 1
    assert w.stats().cancelled == 1


def test_progress_and_events_arrive_in_order_before_the_result(cpool: comfy_env.Pool) -> None:
    w = cpool.get_worker()
    seen: list[CallEvent] = []
    assert w.run("tasks.remote:events_in_order", (5,), on_event=seen.append) == 5
    kinds = [(e.kind, e.data if e.kind == "step" else e.data["done"]) for e in seen]
    assert kinds == [x for i in range(5) for x in (("step", i), ("progress", i + 1))]
    assert {e.generation for e in seen} == {1}


def test_events_arrive_while_a_long_call_runs(cpool: comfy_env.Pool) -> None:
    """Progress is delivered during the call, not only with its result."""
    w = cpool.get_worker()
    w.call("tasks.remote:add", 0)
    seen: list[CallEvent] = []
    call = w.submit("tasks.remote:report_then_wait", (3, 60.0), on_event=seen.append)
    assert wait_until(lambda: len(seen) >= 1, timeout=30), "no event while the call ran"
    assert not call.done()
    call.cancel()
    with pytest.raises(CallCancelled):
        call.result(timeout=30)


def test_a_remote_ref_round_trip(cpool: comfy_env.Pool) -> None:
    w = cpool.get_worker()
    ref = w.call_ref("tasks.remote:make_counter", 10)
    assert ref.call_method("add", 5) == 15
    assert w.call("tasks.remote:counter_value", ref) == 15
    assert w.call("tasks.remote:kept_objects") == 1
    ref.release()
    assert w.call("tasks.remote:kept_objects") == 0


def test_large_results_are_writable_private_copies(cpool: comfy_env.Pool) -> None:
    np = pytest.importorskip("numpy")
    w = cpool.get_worker()
    arr = np.arange(2 << 20, dtype=np.float32)  # 8 MiB: out of band
    out = w.call("comfy_env_worker.tasks:echo", arr)
    assert out.flags.writeable and np.array_equal(out, arr)
    out[:] = -1  # ours to change: nothing the backend reuses
    again = w.call("comfy_env_worker.tasks:echo", arr)
    assert np.array_equal(again, arr) and not np.shares_memory(out, again)
    expected = "on" if "shared memory" in capabilities(cpool) else "off"
    assert w.stats().shared_memory == expected


def test_close_stops_every_worker(backend: str) -> None:
    cfg = comfy_env.PoolConfig(
        backend=backend,  # type: ignore[arg-type]
        sys_path=(str(TESTS_DIR),),
        close_timeout=5.0,
        start_timeout=90.0,
    )
    pool = comfy_env.Pool(cfg)
    pids = [pool.get_worker().call("tasks.remote:getpid")]
    busy = pool.get_worker().submit("comfy_env_worker.tasks:sleep", (60,))
    assert wait_until(lambda: busy.running(), timeout=30)
    pool.close()
    with pytest.raises(comfy_env.PoolClosedError):
        busy.result(timeout=30)
    assert wait_until(lambda: not any(alive(pid) for pid in pids), timeout=30)


def test_the_stats_add_up(cpool: comfy_env.Pool, tmp_path: Path) -> None:
    w = cpool.get_worker()
    w.call("tasks.remote:add", 1)
    with pytest.raises(Exception):  # noqa: B017 - any remote error
        w.call("tasks.remote:raise_custom", 1)
    with pytest.raises(WorkerCrashed):
        w.call("tasks.remote:count_then_crash", str(tmp_path / "runs"))
    w.call("tasks.remote:add", 2)
    s = w.stats()
    assert s.in_flight == 0 and s.queued == 0
    assert s.submitted == s.ok + s.raised + s.crashed + s.timed_out + s.cancelled + s.failed
    assert (s.ok, s.raised, s.crashed) == (2, 1, 1)
    assert s.spawns == s.generation == 2
    assert s.state == "idle" and s.pid is not None


def _policy_pool(backend: str, **overrides: object) -> comfy_env.Pool:
    settings: dict[str, object] = {
        "backend": backend,
        "sys_path": (str(TESTS_DIR),),
        "kill_grace": 2.0,
        "close_timeout": 5.0,
        "start_timeout": 90.0,
    }
    settings.update(overrides)
    return comfy_env.Pool(comfy_env.PoolConfig(**settings))


def test_a_call_that_ignores_its_cancel_is_killed_after_the_grace(backend: str) -> None:
    with _policy_pool(backend, cancel_grace=1.0) as pool:
        w = pool.get_worker()
        pid = w.call("tasks.remote:getpid")
        call = w.submit("tasks.remote:ignore_cancel", (60,))
        assert wait_until(lambda: call.running() and w.stats().in_flight == 1, timeout=30)
        time.sleep(0.3)
        call.cancel()
        with pytest.raises(CallCancelled) as info:
            call.result(timeout=30)
        assert "was killed" in str(info.value)
        assert wait_until(lambda: not alive(pid), timeout=30)
        assert w.call("tasks.remote:add", 1) == 1 and w.generation == 2


def test_an_idle_worker_is_reaped_politely_and_respawned(backend: str, tmp_path: Path) -> None:
    marker = tmp_path / "released"
    with _policy_pool(backend, idle_timeout=1.0) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:register_release_hook", str(marker))
        pid = w.pid
        assert pid is not None
        assert wait_until(lambda: w.stats().reaped == 1, timeout=30)
        assert wait_until(lambda: not alive(pid), timeout=30)
        assert marker.read_text() == "released\n"  # asked to leave: its release hooks ran
        assert w.call("tasks.remote:add", 1) == 1
        assert w.generation == 2 and w.stats().crashed == 0


def test_a_long_idle_worker_is_pinged_before_a_call(backend: str) -> None:
    with _policy_pool(backend, ping_after_idle=0.2) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:add", 1)
        time.sleep(0.5)
        assert w.call("tasks.remote:add", 2) == 2
        stats = w.stats()
        assert (stats.pings, stats.ping_failures, w.generation) == (1, 0, 1)


def test_asyncio_calls_work_and_events_arrive(cpool: comfy_env.Pool) -> None:
    import asyncio

    w = cpool.get_worker()
    seen: list[CallEvent] = []

    async def main() -> tuple[int, int]:
        first = await w.acall("tasks.remote:add", 2, b=3)
        second = await w.arun("tasks.remote:events_in_order", (3,), on_event=seen.append)
        return first, second

    assert asyncio.run(main()) == (5, 3)
    assert [e.kind for e in seen] == ["step", "progress"] * 3


def test_the_ray_backend_without_ray_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pure logic, no cluster: ray missing in the host is said at pool creation, typed."""
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(comfy_env.ConfigError) as info:
        comfy_env.Pool(comfy_env.PoolConfig(backend="ray"))
    assert "pip install 'ray>=2.60'" in str(info.value) and info.value.field == "backend"
    # PyPI's comfy-env is another project: the hint must not install it.
    assert "comfy-env[ray]" not in str(info.value)
