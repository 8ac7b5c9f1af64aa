"""Faults from outside a call's own exchange, with real processes: signals sent to a worker, a
log flood beside a large reply, the reaper racing a slow argument, shutdown with workers dead
or never spawned, and the host's own death with two envs and pinned shared memory. Each one
leaves every call answered (or failed with its typed error) and nothing behind.

* SIGTERM to an idle worker retires it quietly; the next call runs on generation 2.
* SIGSTOP on a worker in a call: the deadline still fires, the stopped worker is killed.
* A log flood from a background thread while a 16 MiB array is returned: the reply is intact.
* An argument that pickles slowly while another thread reaps idle workers with a fake clock:
  the call never fails.
* Shutdown: ``close()`` with every worker already dead, ``close()`` before any spawn, and
  interpreter exit with live workers (exit code 0, stdout untouched, stderr empty).
* Host death (SIGKILL, SIGTERM, ``os._exit(0)``, and the exit of the thread that spawned the
  workers followed by SIGKILL) with two envs and reply blocks pinned (acks disabled): every
  worker is gone within 2 s and ``comfy_env.sweep()`` removes the host's blocks, runtime
  directories and status file.

The flooding worker function is ``tasks.output:flood_while_returning`` (tests/tasks/output.py).
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import alive as _alive
from conftest import run_host as _run_host
from conftest import wait_until as _wait

import comfy_env
from comfy_env import CallTimeout, PoolClosedError
from comfy_env._process import runtime_root

ECHO = "comfy_env_worker.tasks:echo"
FLOOD_LINES = 20000
BIG_BYTES = 16 * 1024 * 1024


class FakeClock:
    """A settable monotonic clock for the pool's idleness bookkeeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _invariant_holds(stats: comfy_env.EnvStats) -> bool:
    outcomes = ("ok", "raised", "crashed", "timed_out", "cancelled", "failed")
    total: int = sum(getattr(stats, f) for f in outcomes) + stats.in_flight + stats.queued
    return bool(stats.submitted == total)


# ---- host-side helpers ---------------------------------------------------------------------


class SlowPickle:
    """An argument whose pickling (in the host) takes ``seconds``; it unpickles as an int."""

    def __init__(self, value: int, seconds: float) -> None:
        self.value = value
        self.seconds = seconds

    def __reduce__(self) -> tuple[Any, ...]:
        time.sleep(self.seconds)
        return (int, (self.value,))


# ---- outside signals ------------------------------------------------------------------------


def test_sigterm_to_an_idle_worker_retires_it_quietly(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    assert w.call(ECHO, 0) == 0
    pid = w.pid
    assert pid is not None
    os.kill(pid, signal.SIGTERM)
    assert _wait(lambda: w.stats().workers[0].state == "retired")
    assert w.stats().workers[0].retire_reason == "crashed"
    assert _wait(lambda: not _alive(pid))
    assert w.call(ECHO, 1) == 1  # nobody saw an exception
    stats = w.stats()
    assert w.generation == 2 and stats.spawns == 2 and w.pid != pid
    assert stats.ok == 2 and stats.crashed == 0 and stats.failed == 0
    assert _invariant_holds(stats)


def test_sigstop_mid_call_still_times_out_and_the_stopped_worker_is_killed(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    assert w.call(ECHO, 0) == 0
    pid = w.pid
    assert pid is not None

    def stop_it() -> None:
        if _wait(lambda: w.stats().in_flight == 1):
            os.kill(pid, signal.SIGSTOP)

    stopper = threading.Thread(target=stop_it)
    stopper.start()
    started = time.monotonic()
    with pytest.raises(CallTimeout):
        w.run("comfy_env_worker.tasks:sleep", (30,), timeout=0.5)
    elapsed = time.monotonic() - started
    stopper.join()
    assert elapsed < 3.0, elapsed
    assert _wait(lambda: not _alive(pid), 3.0), f"stopped worker {pid} survived"
    assert w.call(ECHO, 2) == 2
    assert w.generation == 2
    stats = w.stats()
    assert stats.timed_out == 1 and stats.ok == 2 and _invariant_holds(stats)


# ---- a log flood during a large reply -----------------------------------------------------


def test_a_log_flood_during_a_large_reply_leaves_the_reply_intact(pool: comfy_env.Pool) -> None:
    np = pytest.importorskip("numpy")
    w = pool.get_worker()
    started = time.monotonic()
    result = w.run("tasks.output:flood_while_returning", (FLOOD_LINES, BIG_BYTES), timeout=30)
    assert time.monotonic() - started < 10
    assert result.dtype == np.int64 and result.nbytes == BIG_BYTES
    assert np.array_equal(result, np.arange(BIG_BYTES // 8, dtype=np.int64))
    result = w.run("tasks.output:flood_while_returning", (FLOOD_LINES, BIG_BYTES), timeout=30)
    assert np.array_equal(result, np.arange(BIG_BYTES // 8, dtype=np.int64))
    assert w.call(ECHO, 3) == 3
    stats = w.stats()
    assert stats.ok == 3 and stats.generation == 1 and _invariant_holds(stats)


# ---- a slow-pickling argument racing the idle reaper ---------------------------------------


def test_a_slow_pickling_argument_racing_the_reaper_never_fails(
    config: comfy_env.PoolConfig,
) -> None:
    clock = FakeClock()
    pool = comfy_env.Pool(config.model_copy(update={"idle_timeout": 10.0}), clock=clock)
    try:
        w = pool.get_worker()
        assert w.call(ECHO, 0) == 0
        for round_ in range(3):
            stop = threading.Event()
            reaper_errors: list[BaseException] = []

            def reap(stop: threading.Event, reaper_errors: list[BaseException]) -> None:
                try:
                    while not stop.is_set():
                        clock.now += 11
                        pool.reap_idle()
                        time.sleep(0.01)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    reaper_errors.append(exc)

            reaper = threading.Thread(target=reap, args=(stop, reaper_errors))
            reaper.start()
            try:
                assert w.call(ECHO, SlowPickle(round_, 0.3)) == round_
            finally:
                stop.set()
                reaper.join()
            assert not reaper_errors, reaper_errors
        stats = w.stats()
        assert stats.ok == 4 and stats.failed == 0 and _invariant_holds(stats)
    finally:
        pool.close()


# ---- shutdown -------------------------------------------------------------------------------


def test_close_with_every_worker_already_dead_returns_promptly(
    config: comfy_env.PoolConfig, foreign_venv: Path
) -> None:
    pool = comfy_env.Pool(config.model_copy(update={"max_workers_per_env": 2}))
    here, there = pool.get_worker(), pool.get_worker(foreign_venv)
    barrier = threading.Barrier(2)

    def parallel_call() -> None:
        barrier.wait(10)
        here.call("comfy_env_worker.tasks:sleep", 0.3)

    threads = [threading.Thread(target=parallel_call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert there.call(ECHO, 1) == 1
    pids = [ws.pid for w in (here, there) for ws in w.stats().workers if ws.state == "idle"]
    assert len(pids) == 3 and all(pid is not None for pid in pids), pids
    for pid in pids:
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    assert _wait(lambda: not any(_alive(p) for p in pids if p is not None))
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 1.5
    assert pool.closed
    with pytest.raises(PoolClosedError):
        here.call(ECHO, 2)


def test_close_before_any_spawn(config: comfy_env.PoolConfig) -> None:
    pool = comfy_env.Pool(config)
    w = pool.get_worker()
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 0.5
    assert w.stats().spawns == 0
    with pytest.raises(PoolClosedError):
        w.call(ECHO, 1)
    pool.close()  # idempotent


def test_interpreter_exit_with_live_workers_is_clean() -> None:
    host = _run_host(
        """
        import threading
        import comfy_env

        pool = comfy_env.Pool(comfy_env.PoolConfig(max_workers_per_env=2))
        w = pool.get_worker()
        barrier = threading.Barrier(2)

        def call():
            barrier.wait()
            w.call("comfy_env_worker.tasks:sleep", 0.2)

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        default = comfy_env.get_worker()
        default.call("comfy_env_worker.tasks:echo", 1)
        pids = [ws.pid for ws in w.stats().workers] + [default.pid]
        print("workers", *pids, flush=True)
        # no close(), no shutdown(): interpreter exit must stop all three
        """
    )
    out, err = host.communicate(timeout=60)
    exited = time.monotonic()
    assert host.returncode == 0, err
    assert re.fullmatch(r"workers \d+ \d+ \d+\n", out), repr(out)
    assert err == ""
    pids = [int(p) for p in out.split()[1:]]
    assert len(set(pids)) == 3
    remaining = 2.0 - (time.monotonic() - exited)
    assert _wait(lambda: not any(_alive(p) for p in pids), max(remaining, 0.0))
    assert not [d for d in os.listdir(runtime_root()) if d.startswith(f"host-{host.pid}-")]


# ---- host death with two envs and pinned shared memory --------------------------------------

_DYING_HOST = """
    import glob, json, os, sys, threading, time
    import numpy as np
    import comfy_env
    from comfy_env._process import runtime_root
    from conftest import stop_consumed_acks

    how, venv = sys.argv[1], sys.argv[2]
    pool = comfy_env.Pool(comfy_env.PoolConfig(shm_pinned_ttl=600))
    workers = [pool.get_worker(), pool.get_worker(venv)]
    # The bare venv has no numpy: a large bytes object travels out of band just the same.
    # An echoed array would come back in the host's own block (nothing pinned): a copy
    # needs a reply block.
    payloads = [np.arange(1 << 20, dtype=np.float64), os.urandom(8 << 20)]
    targets = ["numpy:copy", "comfy_env_worker.tasks:echo"]

    def work():
        for w, target, payload in zip(workers, targets, payloads):
            w.call(target, payload)
            stop_consumed_acks(w._entry.slots[0].process.channel)
            w.call(target, payload)  # its reply blocks stay pinned

    if how == "thread-exit":
        spawner = threading.Thread(target=work)
        spawner.start()
        spawner.join()
    else:
        work()
    pattern = os.path.join(runtime_root(), "status", f"{os.getpid()}-*.json")
    deadline = time.monotonic() + 3
    while not glob.glob(pattern) and time.monotonic() < deadline:
        time.sleep(0.02)
    blocks = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{os.getpid()}-"))
    report = {
        "pids": [w.pid for w in workers],
        "blocks": blocks,
        "pinned": [w.call("comfy_env_worker.tasks:shm_stats") for w in workers],
        "status": glob.glob(pattern),
    }
    print(json.dumps(report), flush=True)
    if how == "os._exit":
        os._exit(0)
    time.sleep(60)
"""

HOW_TO_DIE = ["SIGKILL", "SIGTERM", "os._exit", "thread-exit"]


def _kill_host(how: str, foreign_venv: Path) -> tuple[int, dict[str, Any]]:
    """Run the dying host to the point of death; returns its pid and its report, once every
    worker of it is gone (asserted within 2 s)."""
    host = _run_host(_DYING_HOST, how, str(foreign_venv))
    try:
        assert host.stdout is not None
        line = host.stdout.readline()
        assert line, host.communicate(timeout=10)[1]
        report = json.loads(line)
        pids: list[int] = report["pids"]
        assert len(set(pids)) == 2 and report["blocks"], report
        assert all(stats.get("pinned", 0) >= 1 for stats in report["pinned"]), report
        if how == "thread-exit":
            # The thread that spawned the workers has exited; the workers must live on.
            time.sleep(0.5)
            assert all(_alive(p) for p in pids), "workers died with their spawning thread"
            host.send_signal(signal.SIGKILL)
        elif how != "os._exit":
            host.send_signal(getattr(signal, how))
        host.wait(30)
        died = time.monotonic()
        assert _wait(lambda: not any(_alive(p) for p in pids), 2.0), (
            f"workers {pids} outlived their host ({how}) by {time.monotonic() - died:.1f} s"
        )
    finally:
        if host.poll() is None:
            host.kill()
        host.communicate(timeout=30)
    return host.pid, report


@pytest.mark.parametrize("how", HOW_TO_DIE)
def test_host_death_with_two_envs_and_pinned_shm(how: str, foreign_venv: Path) -> None:
    host_pid, _report = _kill_host(how, foreign_venv)
    comfy_env.sweep()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{host_pid}-")]
    assert not [d for d in os.listdir(runtime_root()) if d.startswith(f"host-{host_pid}-")]


@pytest.mark.parametrize("how", ["SIGKILL", "os._exit"])
def test_sweep_removes_the_status_file_of_a_dead_host(how: str, foreign_venv: Path) -> None:
    host_pid, report = _kill_host(how, foreign_venv)
    assert report["status"], "the host never wrote its status file"
    comfy_env.sweep()
    pattern = os.path.join(runtime_root(), "status", f"{host_pid}-*.json")
    assert not glob.glob(pattern)
