"""A stateful soak of one real Pool: hypothesis drives random sequences of calls and faults.

One ``RuleBasedStateMachine`` owns a real ``Pool`` (two workers per env, a fake clock for the
idle reaper) over two envs: the current interpreter and a bare venv made once per module. The
rules are a successful call, a call that raises (re-raised as itself or as ``RemoteError``), a
native crash, a call timeout, SIGKILL of an idle worker from outside, advancing the fake clock
past ``idle_timeout`` and reaping, ``pool.reset(env)`` and concurrent calls from several
threads. After every step the invariants below must hold:

* the stats identity ``submitted == ok + raised + crashed + timed_out + cancelled + failed +
  in_flight + queued``, with nothing in flight or queued between steps;
* each outcome counter equals the model's count;
* generations never decrease (per env and per slot), and every spawn bumps the env's generation;
* at most ``max_workers_per_env`` live worker processes per env, each alive, and no other worker
  process of this host outlives its retirement;
* ``stale_events_dropped`` never decreases.

The pool is closed in ``teardown``; the autouse leak guard of ``conftest.py`` then checks that
the whole run left no process, descriptor, thread, runtime directory or shared-memory block.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from conftest import TESTS_DIR
from conftest import alive as _alive
from conftest import wait_until as _wait
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import comfy_env
from comfy_env import CallTimeout, RemoteError, WorkerCrashed

MAX_WORKERS = 2
IDLE_TIMEOUT = 10.0
ENVS = ("current", "venv")
_OUTCOMES = ("ok", "raised", "crashed", "timed_out", "cancelled", "failed")
_LIVE_STATES = ("idle", "in_call")
_WORKER_MARK = "comfy_env_worker.main"


class FakeClock:
    """A settable monotonic clock for the pool's idleness bookkeeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@functools.cache
def module_venv() -> Path:
    """A bare venv (``--without-pip``), made once per module and removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="comfy-env-soak-"))
    atexit.register(shutil.rmtree, root, True)
    path = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path


def _our_worker_pids() -> set[int]:
    """Live (non-zombie) worker processes among this process's descendants."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any(_WORKER_MARK in part for part in child.cmdline()):
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


class PoolMachine(RuleBasedStateMachine):
    """The model: per env, how many calls ended each way, and what was seen last."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        config = comfy_env.PoolConfig(
            sys_path=(str(TESTS_DIR),),
            max_workers_per_env=MAX_WORKERS,
            max_restarts=1000,
            kill_grace=0.2,
            close_timeout=3.0,
            idle_timeout=IDLE_TIMEOUT,
        )
        self.pool = comfy_env.Pool(config, clock=self.clock)
        self.env_args: dict[str, Path | None] = {"current": None, "venv": module_venv()}
        self.workers = {name: self.pool.get_worker(arg) for name, arg in self.env_args.items()}
        self.keys = {name: w.stats().env for name, w in self.workers.items()}
        self.model: dict[str, dict[str, int]] = {name: dict.fromkeys(_OUTCOMES, 0) for name in ENVS}
        self.last_generation = dict.fromkeys(ENVS, 0)
        self.last_spawns = dict.fromkeys(ENVS, 0)
        self.last_stale = dict.fromkeys(ENVS, 0)
        self.slot_generation: dict[tuple[str, int], int] = {}

    def teardown(self) -> None:
        self.pool.close()

    # ---- helpers --------------------------------------------------------------------------

    def _stats(self, env: str) -> comfy_env.EnvStats:
        return self.pool.stats()[self.keys[env]]

    def _live_workers(self, env: str) -> dict[int, comfy_env.WorkerStats]:
        return {
            ws.pid: ws
            for ws in self._stats(env).workers
            if ws.state in _LIVE_STATES and ws.pid is not None
        }

    def _successful_call(self, env: str) -> None:
        pid = self.workers[env].call("comfy_env_worker.tasks:getpid")
        self.model[env]["ok"] += 1
        served = self._live_workers(env).get(pid)
        assert served is not None, f"call ran on pid {pid}, not a live worker of {env}"
        key = (env, served.slot)
        assert served.generation >= self.slot_generation.get(key, 0)
        self.slot_generation[key] = served.generation

    # ---- rules -----------------------------------------------------------------------------

    @rule(env=st.sampled_from(ENVS), value=st.integers(-(2**40), 2**40))
    def call_ok(self, env: str, value: int) -> None:
        assert self.workers[env].call("comfy_env_worker.tasks:echo", value) == value
        self.model[env]["ok"] += 1

    @rule(env=st.sampled_from(ENVS))
    def call_getpid(self, env: str) -> None:
        self._successful_call(env)

    @rule(env=st.sampled_from(ENVS), kind=st.sampled_from(["builtin", "custom", "remote"]))
    def call_raises(self, env: str, kind: str) -> None:
        w = self.workers[env]
        try:
            if kind == "builtin":
                w.call(int, "not a number")
            elif kind == "custom":
                w.call("tasks.remote:raise_custom", 7)
            else:
                w.call("tasks.remote:raise_local_class")
        except ValueError:
            assert kind == "builtin"
        except RemoteError as exc:
            assert kind == "remote" and "LocalOnly" in exc.type_name
        except Exception as exc:  # noqa: BLE001 - checked: remote_tasks.CustomError re-raised
            assert kind == "custom" and type(exc).__name__ == "CustomError", repr(exc)
        else:
            raise AssertionError("the call did not raise")
        self.model[env]["raised"] += 1

    @rule(env=st.sampled_from(ENVS))
    def crash(self, env: str) -> None:
        try:
            self.workers[env].call("comfy_env_worker.tasks:crash")
        except WorkerCrashed as exc:
            assert exc.signal == "SIGSEGV", str(exc)
        else:
            raise AssertionError("crash() returned")
        self.model[env]["crashed"] += 1

    @rule(env=st.sampled_from(ENVS))
    def timeout(self, env: str) -> None:
        started = time.monotonic()
        try:
            self.workers[env].run("comfy_env_worker.tasks:sleep", (5,), timeout=0.2)
        except CallTimeout:
            pass
        else:
            raise AssertionError("the call did not time out")
        # A spawn is not cut short by the deadline, so allow start-up time on top.
        assert time.monotonic() - started < 4.0
        self.model[env]["timed_out"] += 1

    @rule(env=st.sampled_from(ENVS), victim=st.integers(0, MAX_WORKERS - 1))
    def sigkill_idle_worker(self, env: str, victim: int) -> None:
        # (The victim index is drawn up front: what hypothesis draws must not depend on the
        # live processes, or a replay would draw differently.)
        idle = sorted(pid for pid, ws in self._live_workers(env).items() if ws.state == "idle")
        if not idle:
            self._successful_call(env)  # make one, so the kill has a target next time
            return
        pid = idle[victim % len(idle)]
        os.kill(pid, signal.SIGKILL)
        assert _wait(lambda: not _alive(pid))
        self._successful_call(env)  # the pool replaces it transparently

    @rule()
    def advance_clock_and_reap(self) -> None:
        idle = {
            env: sum(1 for ws in self._live_workers(env).values() if ws.state == "idle")
            for env in ENVS
        }
        reaped_before = {env: self._stats(env).reaped for env in ENVS}
        self.clock.now += IDLE_TIMEOUT + 1
        assert self.pool.reap_idle() == sum(idle.values())
        for env in ENVS:
            assert self._stats(env).reaped == reaped_before[env] + idle[env]
            assert not self._live_workers(env)

    @rule(env=st.sampled_from(ENVS))
    def reset(self, env: str) -> None:
        self.pool.reset(self.env_args[env])
        assert not self._stats(env).abandoned

    @rule(
        plan=st.lists(
            st.tuples(st.sampled_from(ENVS), st.sampled_from(["ok", "raise"])),
            min_size=2,
            max_size=3,
        )
    )
    def concurrent_calls(self, plan: list[tuple[str, str]]) -> None:
        errors: list[BaseException] = []
        barrier = threading.Barrier(len(plan))

        def one(env: str, kind: str, value: int) -> None:
            try:
                barrier.wait(5)
                w = self.workers[env]
                if kind == "ok":
                    assert w.call("comfy_env_worker.tasks:echo", value) == value
                else:
                    try:
                        w.call(int, "nope")
                    except ValueError:
                        pass
                    else:
                        raise AssertionError("the call did not raise")
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                errors.append(exc)

        threads = [
            threading.Thread(target=one, args=(env, kind, i)) for i, (env, kind) in enumerate(plan)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a concurrent call hung"
        assert not errors, errors
        for env, kind in plan:
            self.model[env]["ok" if kind == "ok" else "raised"] += 1

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def stats_match_the_model(self) -> None:
        for env in ENVS:
            stats = self._stats(env)
            total = sum(getattr(stats, f) for f in _OUTCOMES) + stats.in_flight + stats.queued
            assert stats.submitted == total, stats
            assert stats.in_flight == 0 and stats.queued == 0, stats
            for outcome in _OUTCOMES:
                assert getattr(stats, outcome) == self.model[env][outcome], (outcome, stats)

    @invariant()
    def generations_only_grow(self) -> None:
        for env in ENVS:
            stats = self._stats(env)
            assert stats.generation >= self.last_generation[env], stats
            assert stats.spawns >= self.last_spawns[env], stats
            if stats.spawns > self.last_spawns[env]:
                spawned = stats.spawns - self.last_spawns[env]
                assert stats.generation >= self.last_generation[env] + spawned, stats
            for ws in stats.workers:
                key = (env, ws.slot)
                assert ws.generation >= self.slot_generation.get(key, 0), stats
                self.slot_generation[key] = ws.generation
            generations = [ws.generation for ws in stats.workers if ws.state != "empty"]
            assert len(generations) == len(set(generations)), stats
            self.last_generation[env] = stats.generation
            self.last_spawns[env] = stats.spawns

    @invariant()
    def stale_events_dropped_never_decreases(self) -> None:
        for env in ENVS:
            dropped = self._stats(env).stale_events_dropped
            assert dropped >= self.last_stale[env]
            self.last_stale[env] = dropped

    @invariant()
    def worker_processes_are_bounded_and_accounted_for(self) -> None:
        # The death of an idle worker is noticed asynchronously (its channel's hang-up on the
        # reactor), so a snapshot may still list a just-killed worker as idle; the pool must
        # catch up quickly, though.
        def listed_workers_alive() -> bool:
            return all(_alive(pid) for env in ENVS for pid in self._live_workers(env))

        assert _wait(listed_workers_alive, 2.0), {env: self._stats(env) for env in ENVS}
        live: set[int] = set()
        for env in ENVS:
            pids = self._live_workers(env)
            assert len(pids) <= MAX_WORKERS, self._stats(env)
            live |= set(pids)
        # Retired workers are stopped asynchronously (kill_grace); give them that long.
        assert _wait(lambda: _our_worker_pids() <= live, 3.0), (_our_worker_pids(), live)


def test_pool_state_machine() -> None:
    run_state_machine_as_test(
        PoolMachine,
        settings=settings(
            max_examples=8,
            stateful_step_count=15,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
