"""Lifecycle policies with real workers: reaper, health ping, crash-loop breaker, events, refs.

The decisions themselves are table-tested without processes in test_lifecycle.py; here a fake
clock drives them against real workers.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import reactor_held
from conftest import wait_until as _wait
from tasks import remote as remote_tasks

import comfy_env
from comfy_env import (
    EnvAbandonedError,
    RefReleasedError,
    StaleGenerationError,
    WorkerCrashed,
    WorkerStartError,
)
from comfy_env import _lifecycle as lc
from comfy_env._failures import crash_frame


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    """The fake clock of the test's pools (idleness, the reaper, the breaker); step ``now``."""
    return FakeClock()


@pytest.fixture
def pool_with(config: comfy_env.PoolConfig) -> Iterator[Callable[..., comfy_env.Pool]]:
    """``pool_with(**overrides, clock=...)``: a pool on the ``config`` fixture's settings with
    ``overrides`` (``idle_timeout=10.0``, ...) and, when given, a clock of its own (the
    ``clock`` fixture). Used as ``with pool_with(...) as pool:``; one the test left open is
    closed at teardown, before the leak guard looks."""
    made: list[comfy_env.Pool] = []

    def make(clock: Callable[[], float] | None = None, **overrides: Any) -> comfy_env.Pool:
        settings = config.model_copy(update=overrides)
        pool = comfy_env.Pool(settings) if clock is None else comfy_env.Pool(settings, clock=clock)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---- the idle reaper --------------------------------------------------------------------------


def test_an_idle_worker_is_reaped_after_its_release_hooks_and_respawned_on_demand(
    pool_with: Callable[..., comfy_env.Pool], tmp_path: Path
) -> None:
    marker = tmp_path / "released"
    with pool_with(idle_timeout=0.3) as pool:
        w = pool.get_worker()
        w.call(remote_tasks.register_release_hook, str(marker))
        pid = w.pid
        assert pid is not None
        assert _wait(lambda: w.stats().reaped == 1)
        assert w.stats().workers[0].retire_reason == "idle"
        assert _wait(lambda: _gone(pid))
        assert marker.read_text() == "released\n"  # it asked the worker to leave, politely
        assert w.call("tasks.remote:add", 1) == 1  # spawned exactly as a first call
        assert w.generation == 2 and w.stats().spawns == 2


def test_a_reaper_decision_is_dropped_when_a_call_ran_in_between(
    pool_with: Callable[..., comfy_env.Pool],
    clock: FakeClock,
) -> None:
    with pool_with(idle_timeout=30.0, clock=clock) as pool:
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)
        entry, slot = w._entry, w._entry.slots[0]
        clock.now += 31
        decision = lc.idle_expired(slot.state, clock.now, 30.0)
        assert decision is not None  # the reaper looked and found it expired ...
        w.call("comfy_env_worker.tasks:echo", 1)  # ... then a call ran ...
        assert not entry.apply(slot, decision)  # ... so its stale observation changes nothing
        assert w.stats().state == "idle" and w.generation == 1
        assert pool.reap_idle(clock.now) == 0  # and a fresh look finds nothing to reap yet
        clock.now += 31
        assert pool.reap_idle(clock.now) == 1


@pytest.mark.parametrize("now", [float("nan"), float("inf"), True, "1e9", None])
def test_reap_idle_refuses_a_now_that_is_no_time_and_reaps_nothing(
    pool_with: Callable[..., comfy_env.Pool], now: object
) -> None:
    """``reap_idle(now)`` takes a time on the pool's clock; NaN compared as "idle long
    enough" and retired every idle worker. Anything but a finite number is an
    ``ArgumentError`` and the idle worker stays (``now=None`` means the pool's clock)."""
    with pool_with(idle_timeout=30.0) as pool:
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)
        pid = w.pid
        if now is None:
            assert pool.reap_idle(now) == 0  # idle for less than 30 s on the pool's clock
        else:
            with pytest.raises(comfy_env.ArgumentError, match="now"):
                pool.reap_idle(now)  # type: ignore[arg-type]
        assert w.stats().reaped == 0 and w.stats().state == "idle" and w.pid == pid
        assert w.call("comfy_env_worker.tasks:echo", 1) == 1 and w.generation == 1


def test_a_worker_holding_remote_refs_is_not_reaped_by_default(
    pool_with: Callable[..., comfy_env.Pool],
    clock: FakeClock,
) -> None:
    with pool_with(idle_timeout=10.0, clock=clock) as pool:
        w = pool.get_worker()
        ref = w.call_ref(remote_tasks.make_counter)
        clock.now += 100
        assert pool.reap_idle() == 0
        ref.release()  # a call: the worker is idle anew from now
        clock.now += 100
        assert pool.reap_idle() == 1
    with pool_with(idle_timeout=10.0, reap_with_refs=True, clock=clock) as pool:
        w = pool.get_worker()
        ref = w.call_ref(remote_tasks.make_counter)
        clock.now += 100
        assert pool.reap_idle() == 1
        with pytest.raises(StaleGenerationError, match="generation 1"):
            ref.call_method("add", 1)


def test_retire_idle_retires_an_env_s_idle_worker_now_but_never_one_holding_refs(
    config: comfy_env.PoolConfig, foreign_venv: Path
) -> None:
    with comfy_env.Pool(config) as pool:  # idle_timeout 30 min: the reaper would not act
        w, other = pool.get_worker(), pool.get_worker(str(foreign_venv))
        assert pool.retire_idle() == 0  # nothing spawned yet
        ref = w.call_ref(remote_tasks.make_counter)
        other.call("comfy_env_worker.tasks:echo", 0)
        assert pool.retire_idle() == 0  # its object is still held in the host
        ref.release()
        pid = w.pid
        assert pid is not None
        assert pool.retire_idle() == 1
        assert w.stats().workers[0].retire_reason == "idle" and w.stats().reaped == 1
        assert _wait(lambda: _gone(pid))
        assert other.stats().state == "idle"  # another env's worker is left alone
        assert w.call("tasks.remote:add", 1) == 1 and w.generation == 2


def test_a_garbage_collected_ref_does_not_keep_an_idle_worker_from_being_reaped(
    pool_with: Callable[..., comfy_env.Pool],
    clock: FakeClock,
) -> None:
    with pool_with(idle_timeout=10.0, clock=clock) as pool:
        w = pool.get_worker()
        kept = w.call_ref(remote_tasks.make_counter)
        dropped = w.call_ref(remote_tasks.make_counter)
        del dropped
        gc.collect()  # queued for release before the next call; no call comes
        clock.now += 100
        assert pool.reap_idle() == 0  # the ref still held keeps the worker
        kept.discard()
        assert pool.reap_idle() == 1


def test_a_reap_hook_that_discards_its_refs_lets_the_reaper_retire_the_worker(
    pool_with: Callable[..., comfy_env.Pool],
    clock: FakeClock,
) -> None:
    with pool_with(idle_timeout=10.0, clock=clock) as pool:
        w = pool.get_worker()
        mine = w.call_ref(remote_tasks.make_counter)
        other = w.call_ref(remote_tasks.make_counter)  # an owner without a hook
        asked: list[tuple[str, int]] = []
        let_go = [False]
        held = [mine]

        def hook(env: str, generation: int) -> None:
            asked.append((env, generation))
            if let_go[0]:
                for ref in held:
                    ref.discard()

        def broken(env: str, generation: int) -> None:
            raise RuntimeError("a buggy owner")

        remove = pool.add_reap_hook(hook)
        pool.add_reap_hook(broken)  # logged; the other hooks still run
        clock.now += 5
        assert pool.reap_idle() == 0 and asked == []  # not idle long enough: nobody is asked
        clock.now += 100
        assert pool.reap_idle() == 0  # the owner keeps its ref
        assert asked == [(w.env, 1)] and mine.alive
        let_go[0] = True
        assert pool.reap_idle() == 0  # it let go, but another owner's ref keeps the worker
        assert not mine.alive and other.alive
        assert w.call(remote_tasks.kept_objects) == 1  # the discarded object was dropped first
        other.release()  # a call: the worker is idle anew from now
        assert pool.reap_idle() == 0
        mine2 = w.call_ref(remote_tasks.make_counter)
        held.append(mine2)
        clock.now += 100
        assert pool.reap_idle() == 1 and not mine2.alive  # discarded by its hook, then reaped
        assert w.stats().workers[0].retire_reason == "idle"
        with pytest.raises(RefReleasedError):
            mine2.call_method("add", 1)
        remove()
        assert w.call_ref(remote_tasks.make_counter).generation == 2  # spawned as a first call


def test_a_reap_hook_cannot_retire_a_worker_that_ran_a_call_meanwhile(
    pool_with: Callable[..., comfy_env.Pool],
    clock: FakeClock,
) -> None:
    with pool_with(idle_timeout=10.0, clock=clock) as pool:
        w = pool.get_worker()
        ref = w.call_ref(remote_tasks.make_counter)

        def hook(env: str, generation: int) -> None:
            w.call("comfy_env_worker.tasks:echo", 0)  # a call lands while the owner is asked
            ref.discard()

        pool.add_reap_hook(hook)
        clock.now += 100
        assert pool.reap_idle() == 0  # the decision named the old idle_since: dropped
        assert w.generation == 1 and not ref.alive


# ---- the health ping ---------------------------------------------------------------------------


def test_a_long_idle_worker_is_pinged_before_a_call(
    pool_with: Callable[..., comfy_env.Pool], clock: FakeClock
) -> None:
    with pool_with(ping_after_idle=60.0, clock=clock) as pool:
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)
        w.call("comfy_env_worker.tasks:echo", 0)
        assert w.stats().pings == 0
        clock.now += 61
        assert w.call("tasks.remote:add", 2) == 2
        stats = w.stats()
        assert (stats.pings, stats.ping_failures, w.generation) == (1, 0, 1)


def test_a_worker_failing_its_ping_is_replaced_and_the_call_runs_on_the_new_one(
    pool_with: Callable[..., comfy_env.Pool],
    clock: FakeClock,
) -> None:
    update = {"ping_after_idle": 60.0, "ping_timeout": 0.3}
    with pool_with(clock=clock, **update) as pool:
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)
        pid = w.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # alive but unresponsive
        clock.now += 61
        assert w.call("tasks.remote:add", 3) == 3
        stats = w.stats()
        assert (stats.pings, stats.ping_failures, w.generation) == (1, 1, 2)
        assert _wait(lambda: _gone(pid))


# ---- the crash-loop breaker --------------------------------------------------------------------


def test_a_crash_loop_abandons_the_env_until_reset(
    pool_with: Callable[..., comfy_env.Pool], foreign_venv: Path
) -> None:
    update = {"max_restarts": 2, "restart_window": 60.0}
    with pool_with(**update) as pool:
        w = pool.get_worker()
        other = pool.get_worker(foreign_venv)
        for _ in range(3):
            with pytest.raises(WorkerCrashed):
                w.call("comfy_env_worker.tasks:crash")
        assert _wait(lambda: w.stats().abandoned)
        with pytest.raises(EnvAbandonedError) as info:
            w.call("tasks.remote:add", 1)
        message = str(info.value)
        assert "3 worker deaths" in message and "SIGSEGV" in message
        assert "(max_restarts/restart_window: PoolConfig)" in message
        assert "generation 3" in message and "pool.reset" in message
        assert w.stats().spawns == 3  # failing fast: no spawn
        assert other.call("tasks.remote:add", 5) == 5  # another env is not blocked
        pool.reset(w.env)
        assert w.call("tasks.remote:add", 1) == 1
        assert w.generation == 4 and not w.stats().abandoned


def test_an_untimed_abandonment_outlasts_any_time_and_says_how_to_recover(
    pool_with: Callable[..., comfy_env.Pool],
) -> None:
    offset = [0.0]
    update = {"max_restarts": 1, "restart_window": 60.0}
    with pool_with(clock=lambda: time.monotonic() + offset[0], **update) as pool:
        w = pool.get_worker()
        for _ in range(2):
            with pytest.raises(WorkerCrashed):
                w.call("comfy_env_worker.tasks:crash")
        offset[0] += 10_000.0  # far past the window: the default block is until reset
        with pytest.raises(EnvAbandonedError) as info:
            w.call("tasks.remote:add", 1)
        assert "pool.reset(env)" in str(info.value)
        assert "COMFY_ENV_ABANDON_FOR" in str(info.value)  # what an operator can set
        assert w.stats().abandoned and w.stats().spawns == 2


def test_abandon_for_lifts_the_block_by_itself_and_the_next_call_starts_a_fresh_worker(
    pool_with: Callable[..., comfy_env.Pool],
) -> None:
    offset = [0.0]
    update = {"max_restarts": 1, "abandon_for": 30.0}
    with pool_with(clock=lambda: time.monotonic() + offset[0], **update) as pool:
        events: list[object] = []
        pool.subscribe(events.append)
        w = pool.get_worker()
        for _ in range(2):
            with pytest.raises(WorkerCrashed):
                w.call("comfy_env_worker.tasks:crash")
        with pytest.raises(EnvAbandonedError) as info:
            w.call("tasks.remote:add", 1)
        assert "abandon_for=30s" in str(info.value) and "fresh worker" in str(info.value)
        offset[0] += 29.0
        with pytest.raises(EnvAbandonedError):  # still in force
            w.call("tasks.remote:add", 1)
        offset[0] += 2.0
        assert not w.stats().abandoned
        assert w.call("tasks.remote:add", 1) == 1
        assert w.generation == 3 and w.stats().restarts_in_window == 0
        # The deaths that tripped it are forgotten: one more crash does not trip it again.
        with pytest.raises(WorkerCrashed):
            w.call("comfy_env_worker.tasks:crash")
        assert w.call("tasks.remote:add", 2) == 2


def test_restarts_in_window_counts_only_the_deaths_still_in_the_window(
    pool_with: Callable[..., comfy_env.Pool],
) -> None:
    """``restarts_in_window`` is what the breaker would count now: a death older than
    ``restart_window`` (the pool's, or the env's own from ``set_breaker``) no longer counts,
    though no later death has come to prune it."""
    offset = [0.0]
    update = {"max_restarts": 5, "restart_window": 60.0}
    with pool_with(clock=lambda: time.monotonic() + offset[0], **update) as pool:
        w = pool.get_worker()
        for _ in range(2):
            with pytest.raises(WorkerCrashed):
                w.call("comfy_env_worker.tasks:crash")
        assert _wait(lambda: w.stats().restarts_in_window == 2)
        offset[0] += 59.0
        assert w.stats().restarts_in_window == 2
        offset[0] += 2.0  # both deaths are now older than the window
        assert w.stats().restarts_in_window == 0
        assert pool.stats()[w.env].restarts_in_window == 0
        with pytest.raises(WorkerCrashed):
            w.call("comfy_env_worker.tasks:crash")
        assert _wait(lambda: w.stats().restarts_in_window == 1)
        pool.set_breaker(None, restart_window=5.0)  # the env's own window counts from now on
        offset[0] += 6.0
        assert w.stats().restarts_in_window == 0
        assert w.call("tasks.remote:add", 1) == 1


def test_set_breaker_gives_one_env_its_own_settings(
    pool_with: Callable[..., comfy_env.Pool], foreign_venv: Path
) -> None:
    with pool_with(max_restarts=100) as pool:
        w = pool.get_worker()
        other = pool.get_worker(foreign_venv)
        pool.set_breaker(None, max_restarts=1, abandon_for=600.0)
        for _ in range(2):
            with pytest.raises(WorkerCrashed):
                w.call("comfy_env_worker.tasks:crash")
        with pytest.raises(EnvAbandonedError, match="abandon_for=600s") as info:
            w.call("tasks.remote:add", 1)
        # Its own limits are named, not the pool's (which were not the ones that tripped).
        assert (
            "after 2 worker deaths within the restart window (max_restarts/restart_window: the "
            "env's own limits, given to Pool.set_breaker or a ComfyUI pack's isolate())"
        ) in str(info.value)
        assert "PoolConfig" not in str(info.value)
        for _ in range(2):  # the other env keeps the pool's max_restarts=100
            with pytest.raises(WorkerCrashed):
                other.call("comfy_env_worker.tasks:crash")
        assert other.call("comfy_env_worker.tasks:echo", 5) == 5
        for bad in ({"max_restarts": -1}, {"restart_window": 0}, {"abandon_for": float("inf")}):
            with pytest.raises(comfy_env.ArgumentError, match=next(iter(bad))) as info:
                pool.set_breaker(None, **bad)  # type: ignore[arg-type]
            assert "deadline" not in str(info.value)  # None keeps the pool's value here


def test_recent_deaths_quote_the_crashing_frame_not_the_last_output_line(
    pool_with: Callable[..., comfy_env.Pool],
) -> None:
    with pool_with(max_restarts=1) as pool:
        w = pool.get_worker()
        for _ in range(2):
            with pytest.raises(WorkerCrashed) as crashed:
                w.call("tasks.remote:crash_in_this_frame")
        last_lines = crashed.value.stderr_tail.splitlines()[-3:]  # what was quoted before
        assert not any("crash_in_this_frame" in line for line in last_lines)
        with pytest.raises(EnvAbandonedError) as info:
            w.call("tasks.remote:add", 1)
        deaths = str(info.value).split("Recent deaths:\n", 1)[1].splitlines()
        assert len(deaths) == 2
        for line in deaths:
            assert "crashed in File " in line and "tasks/remote.py" in line, line
            assert line.endswith(" in crash_in_this_frame") and "Extension modules" not in line


def test_recent_deaths_quote_the_code_that_called_a_stdlib_wrapper_that_crashed(
    pool_with: Callable[..., comfy_env.Pool],
) -> None:
    """``ctypes.string_at(0)`` crashes inside ``ctypes/__init__.py``: the innermost frame was
    quoted, which names Python's library, not the env's code that called it."""
    with pool_with(max_restarts=0) as pool:
        w = pool.get_worker()
        with pytest.raises(WorkerCrashed) as crashed:
            w.call("comfy_env_worker.tasks:crash")
        assert "ctypes/__init__.py" in crashed.value.stderr_tail  # the innermost frame
        with pytest.raises(EnvAbandonedError) as info:
            w.call("tasks.remote:add", 1)
        (death,) = str(info.value).split("Recent deaths:\n", 1)[1].splitlines()
        assert re.search(
            r'crashed in File ".*comfy_env_worker/tasks\.py", line \d+ in crash$', death
        )


@pytest.mark.parametrize(
    ("stack", "named"),
    [
        (["/usr/lib/python3.11/ctypes/__init__.py", "/p/nodes.py"], "/p/nodes.py"),
        (["<frozen importlib._bootstrap>", "/p/nodes.py"], "/p/nodes.py"),
        (
            ["/v/lib/python3.12/site-packages/numpy/x.py", "/p/n.py"],
            "/v/lib/python3.12/site-packages/numpy/x.py",
        ),
        (["C:\\Python311\\Lib\\ctypes\\__init__.py", "C:\\p\\n.py"], "C:\\p\\n.py"),
        (["/usr/lib/python3.11/ctypes/__init__.py"], "/usr/lib/python3.11/ctypes/__init__.py"),
    ],
)
def test_the_crash_frame_is_the_innermost_outside_python_s_own_library(
    stack: list[str], named: str
) -> None:
    dump = (
        "Fatal Python error: Segmentation fault\n\nCurrent thread 0x7f (most recent call first):\n"
    )
    dump += "".join(f'  File "{path}", line 7 in f\n' for path in stack)
    dump += "\nExtension modules: numpy (total: 1)\n"
    assert crash_frame(dump) == f'File "{named}", line 7 in f'


def test_a_deterministic_start_failure_is_reported_once_per_call_without_a_respawn_loop(
    pool_with: Callable[..., comfy_env.Pool], tmp_path: Path
) -> None:
    interp = tmp_path / "env" / "bin" / "python"
    interp.parent.mkdir(parents=True)
    interp.write_text("#!/bin/sh\necho 'ImportError: broken env' >&2\nexit 1\n")
    interp.chmod(0o755)
    with pool_with(max_restarts=1) as pool:
        w = pool.get_worker(tmp_path / "env")
        with pytest.raises(WorkerStartError, match="broken env"):
            w.call("comfy_env_worker.tasks:echo", 1)
        assert w.stats().spawns == 1
        with pytest.raises(WorkerStartError):
            w.call("comfy_env_worker.tasks:echo", 1)
        assert _wait(lambda: w.stats().abandoned)  # two start failures > max_restarts=1
        with pytest.raises(EnvAbandonedError, match="start_failed"):
            w.call("comfy_env_worker.tasks:echo", 1)
        assert w.stats().spawns == 2


def _retired_then_abandoned(events: list[object], env: str, generation: int, reason: str) -> None:
    """The breaker's ``EnvAbandoned`` comes once, right after the ``WorkerRetired`` of the death
    that tripped it (and after every earlier one): causal order."""
    kinds = [
        (type(e).__name__, getattr(e, "generation", None), getattr(e, "reason", None))
        for e in events
        if getattr(e, "env", None) == env
    ]
    abandoned = [i for i, k in enumerate(kinds) if k[0] == "EnvAbandoned"]
    assert len(abandoned) == 1, kinds
    assert kinds[abandoned[0] - 1] == ("WorkerRetired", generation, reason), kinds
    retired = [k[1] for k in kinds[: abandoned[0]] if k[0] == "WorkerRetired"]
    assert retired == list(range(1, generation + 1)), kinds


def test_env_abandoned_follows_the_retirement_that_tripped_the_breaker(
    pool_with: Callable[..., comfy_env.Pool],
) -> None:
    update = {"max_restarts": 2, "restart_window": 60.0}
    with pool_with(**update) as pool:
        events: list[object] = []
        pool.subscribe(events.append)
        w = pool.get_worker()
        for _ in range(3):
            with pytest.raises(WorkerCrashed):
                w.call("comfy_env_worker.tasks:crash")
        assert _wait(lambda: any(isinstance(e, comfy_env.EnvAbandoned) for e in events))
        assert _wait(lambda: len([e for e in events if type(e).__name__ == "WorkerRetired"]) >= 3)
        _retired_then_abandoned(events, w.env, 3, "crashed")


def test_env_abandoned_follows_the_failed_launch_that_tripped_the_breaker(
    pool_with: Callable[..., comfy_env.Pool], tmp_path: Path
) -> None:
    # An interpreter the kernel refuses to execute: the launch itself fails, nothing forks,
    # and the pool reports the death on the spot (no exit will come).
    interp = tmp_path / "env" / "bin" / "python"
    interp.parent.mkdir(parents=True)
    interp.write_bytes(b"\x00\x01 not an executable format\n")
    interp.chmod(0o755)
    with pool_with(max_restarts=1) as pool:
        events: list[object] = []
        pool.subscribe(events.append)
        w = pool.get_worker(tmp_path / "env")
        for _ in range(2):
            with pytest.raises(WorkerStartError, match="cannot launch"):
                w.call("comfy_env_worker.tasks:echo", 1)
        assert w.stats().abandoned
        assert _wait(lambda: any(isinstance(e, comfy_env.EnvAbandoned) for e in events))
        _retired_then_abandoned(events, w.env, 2, "start_failed")
        with pytest.raises(EnvAbandonedError) as info:
            w.call("comfy_env_worker.tasks:echo", 1)
        # Each death says it never launched, not "exit code None".
        assert str(info.value).count("start_failed (never launched)") == 2, str(info.value)
        assert "exit code None" not in str(info.value)


# ---- lifecycle events ---------------------------------------------------------------------------


def test_events_tell_the_lifecycle_in_order(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config) as pool:
        events: list[object] = []
        pool.subscribe(events.append)
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)
        with pytest.raises(WorkerCrashed):
            w.call("comfy_env_worker.tasks:crash")
        w.call("comfy_env_worker.tasks:echo", 0)
        assert _wait(lambda: len(events) >= 5)
        kinds = [type(e).__name__ for e in events[:5]]
        assert kinds == [
            "WorkerSpawned",
            "WorkerReady",
            "WorkerRetired",
            "WorkerSpawned",
            "WorkerReady",
        ], kinds
        retired = events[2]
        assert isinstance(retired, comfy_env.WorkerRetired)
        assert (retired.generation, retired.reason, retired.signal) == (1, "crashed", "SIGSEGV")
        ready = events[4]
        assert isinstance(ready, comfy_env.WorkerReady)
        assert ready.generation == 2 and ready.startup_seconds > 0
        with pytest.raises(AttributeError):
            ready.generation = 3  # type: ignore[misc]
    closed = [e for e in events if isinstance(e, comfy_env.WorkerRetired)]
    assert closed[-1].reason == "closed"


async def _async_callback(*_args: object) -> None:
    pass


@pytest.mark.parametrize("bad", [5, None, "print", _async_callback])
def test_a_subscriber_or_reap_hook_that_cannot_be_called_is_refused_when_given(
    config: comfy_env.PoolConfig, bad: object
) -> None:
    """A callback that is not a plain callable is an ``ArgumentError`` when it is given, not a
    logged ``TypeError`` on every later event (or a coroutine nobody awaits, for an
    ``async def``); the pool goes on as before."""
    with comfy_env.Pool(config) as pool:
        with pytest.raises(comfy_env.ArgumentError, match="callback"):
            pool.subscribe(bad)  # type: ignore[arg-type]
        with pytest.raises(comfy_env.ArgumentError, match="hook"):
            pool.add_reap_hook(bad)  # type: ignore[arg-type]
        assert not pool.events.subscribed and not pool._reap_hooks._hooks
        events: list[object] = []
        pool.subscribe(events.append)
        w = pool.get_worker()
        assert w.call("comfy_env_worker.tasks:echo", 2) == 2
        assert _wait(lambda: len(events) >= 2)


def test_callbacks_may_call_back_into_the_pool_and_their_errors_never_break_it(
    config: comfy_env.PoolConfig, caplog: pytest.LogCaptureFixture
) -> None:
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        answers: list[int] = []
        done = threading.Event()

        def reentrant(event: object) -> None:
            if isinstance(event, comfy_env.WorkerReady) and not done.is_set():
                answers.append(pool.get_worker(event.env).call("tasks.remote:add", 40, 2))
                done.set()

        def broken(event: object) -> None:
            raise RuntimeError("subscriber bug")

        caplog.set_level(logging.ERROR, logger="comfy_env")
        pool.subscribe(broken)
        pool.subscribe(reentrant)
        assert w.call("tasks.remote:add", 1) == 1
        assert done.wait(10)
        assert answers == [42]
        assert any("subscriber bug" in r.getMessage() or r.exc_info for r in caplog.records)
        assert w.call("tasks.remote:add", 2) == 2


# ---- remote objects ------------------------------------------------------------------------------


def test_a_remote_ref_resolves_to_the_live_object(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    ref = w.call_ref(remote_tasks.make_counter, 10)
    assert (ref.env, ref.generation) == (w.env, 1)
    assert ref.call_method("add", 5) == 15
    assert w.call(remote_tasks.counter_value, ref) == 15  # passed as an argument
    assert w.stats().live_refs == 1
    ref.release()
    assert w.stats().live_refs == 0
    assert w.call(remote_tasks.kept_objects) == 0
    ref.release()  # idempotent


@pytest.mark.parametrize("how", ["crash", "timeout"])
def test_a_remote_ref_of_a_dead_generation_is_stale(pool: comfy_env.Pool, how: str) -> None:
    w = pool.get_worker()
    ref = w.call_ref(remote_tasks.make_counter, 1)
    if how == "crash":
        with pytest.raises(WorkerCrashed):
            w.call("comfy_env_worker.tasks:crash")
    else:
        with pytest.raises(comfy_env.CallTimeout):
            w.run("comfy_env_worker.tasks:sleep", (30,), timeout=0.3)
    w.call("tasks.remote:add", 1)  # generation 2 now serves the env
    with pytest.raises(StaleGenerationError) as info:
        w.call(remote_tasks.counter_value, ref)
    message = str(info.value)
    assert "generation 1" in message and "generation 2" in message
    with pytest.raises(StaleGenerationError):
        ref.call_method("add", 1)
    ref.release()  # releasing a stale ref is a no-op


def test_dropped_refs_are_released_in_the_worker(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    refs = [w.call_ref(remote_tasks.make_counter, i) for i in range(3)]
    assert w.call(remote_tasks.kept_objects) == 3
    del refs
    gc.collect()
    assert w.call(remote_tasks.kept_objects) == 0
    assert w.stats().live_refs == 0


def test_a_ref_of_another_env_is_refused(pool: comfy_env.Pool, foreign_venv: Path) -> None:
    ref = pool.get_worker().call_ref(remote_tasks.make_counter)
    with pytest.raises(StaleGenerationError, match="cannot be used"):
        pool.get_worker(foreign_venv).call(remote_tasks.counter_value, ref)
    ref.release()


def test_a_released_ref_raises_a_comfy_env_error_in_the_host_at_once(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    ref = w.call_ref(remote_tasks.make_counter, 1)
    ref.release()
    submitted = w.stats().submitted
    with pytest.raises(comfy_env.RefReleasedError, match="was released") as info:
        w.call(remote_tasks.counter_value, ref)
    assert isinstance(info.value, comfy_env.ComfyEnvError)
    with pytest.raises(comfy_env.RefReleasedError):
        ref.call_method("add", 1)
    assert w.stats().submitted == submitted  # refused before anything was sent
    # Nested deeper than the host looks, the worker's report maps to the same error.
    with pytest.raises(comfy_env.RefReleasedError):
        w.call("comfy_env_worker.tasks:echo", [[{"r": ref}]])


def test_every_call_is_counted_once_whichever_path_runs_it(
    pool_with: Callable[..., comfy_env.Pool], clock: FakeClock
) -> None:
    # ``Worker.call`` first tries the plain path (a target string, scalar arguments, an idle
    # worker ready); anything else goes to the general path, which must find nothing counted,
    # leased or sent. Each kind of hand-over below, then the plain call itself.
    with pool_with(ping_after_idle=60.0, clock=clock) as pool:
        w = pool.get_worker()
        assert w.call("tasks.remote:add", 1, 1) == 2  # no worker yet: spawned by the general path
        assert w.call("tasks.remote:add", 2, b=3) == 5  # plain, keyword arguments too
        assert w.call("tasks.remote:add", [1], [2]) == [1, 2]  # not all scalars
        clock.now += 61
        assert w.call("tasks.remote:add", 3) == 3  # a ping is due first
        assert w.stats().pings == 1
        ref = w.call_ref("tasks.remote:add", 4)
        with reactor_held(pool):  # (else the reactor releases it at once: a ref dropped idle)
            del ref  # dropped, not released: the next call releases it first
            gc.collect()
            assert w._entry.dropped_refs
            assert w.call("tasks.remote:add", 5) == 5
            assert not w._entry.dropped_refs
        with pytest.raises(ValueError, match="not of the form"):
            w.call("no colon here", 1)  # refused before anything is counted
        stats = w.stats()
        assert (stats.submitted, stats.ok, stats.in_flight, stats.queued) == (6, 6, 0, 0)
        assert (stats.failed, stats.raised, stats.crashed) == (0, 0, 0)
        assert w.generation == 1


def test_a_plain_call_that_ends_otherwise_goes_on_in_the_general_path(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The plain path starts a call in one step (``Exchange.start_plain``) and runs it as the
    # same object runs any call: anything but a plain reply goes on in that object from where
    # it is, answered by the general path's rules: an error reply, a log frame, a read that
    # failed (a crash, a deadline: ``read_failed``), a send that failed before a byte went
    # out (the worker went between the idle check and the send: a fresh worker, ``start``).
    # Each must end as the general path ends it, counted once.
    from comfy_env import _exchange
    from comfy_env._process import WorkerProcess

    seen: list[str] = []
    exchange = _exchange.Exchange
    real_start_plain, real_start = exchange.start_plain, exchange.start
    real_send_failed, real_read_failed = exchange.send_failed, exchange.read_failed

    def start_plain(self: _exchange.Exchange, *args: Any) -> bool:
        started = real_start_plain(self, *args)
        seen.append("plain" if started else "declined")
        return started

    def start(self: _exchange.Exchange) -> object:
        seen.append("start")
        return real_start(self)

    def send_failed(self: _exchange.Exchange, exc: BaseException, process: Any) -> None:
        real_send_failed(self, exc, process)  # raises the call's error if it went out
        seen.append("not sent")

    def read_failed(self: _exchange.Exchange, exc: BaseException) -> object:
        seen.append("read failed")
        return real_read_failed(self, exc)

    # The steps are watched on the pure modules; a compiled Exchange's methods cannot be
    # replaced, so there the outcomes alone are checked.
    pure = (_exchange.__file__ or "").endswith(".py")
    if pure:
        for name, spy in [
            ("start_plain", start_plain),
            ("start", start),
            ("send_failed", send_failed),
            ("read_failed", read_failed),
        ]:
            monkeypatch.setattr(exchange, name, spy)

    def steps(*expected: str) -> list[str]:
        return list(expected) if pure else []

    with caplog.at_level(logging.WARNING, logger="comfy_env.worker"):
        with comfy_env.Pool(config.model_copy(update={"call_timeout": 3.0})) as pool:
            w = pool.get_worker()
            assert w.call("tasks.remote:add", 1, 1) == 2  # spawned: the general path
            assert w.call("tasks.remote:add", 2, 2) == 4  # a plain reply
            assert seen == steps("declined", "start", "plain")
            seen.clear()

            with pytest.raises(remote_tasks.CustomError):
                w.call("tasks.remote:raise_custom", 7)  # an error reply
            assert seen == steps("plain") and w.generation == 1

            seen.clear()
            assert w.call("tasks.remote:log_things", 1) == 1  # log frames before the reply
            assert seen == steps("plain")
            assert "careful: warning" in caplog.messages

            seen.clear()
            with pytest.raises(WorkerCrashed):
                w.call("tasks.remote:kill_self", int(signal.SIGKILL))  # its read hit EOF
            assert seen == steps("plain", "read failed")

            assert w.call("tasks.remote:add", 0, 0) == 0  # generation 2
            seen.clear()
            with pytest.raises(comfy_env.CallTimeout):
                w.call("comfy_env_worker.tasks:sleep", 30.0)  # its read hit the deadline
            assert seen == steps("plain", "read failed")

            # The worker goes between the idle check and the send: our write half is shut
            # right after the check said quiet, so the send fails before a byte went out
            # and the call runs on a fresh worker (it never ran: not a replay).
            assert w.call("tasks.remote:add", 3, 3) == 6  # generation 3
            # (The process's ``idle_channel_state`` is its channel's bound method.)
            process = w._entry.slots[0].process
            assert isinstance(process, WorkerProcess)
            checked = process.idle_channel_state

            def quiet_then_gone() -> str:
                answer = checked()
                assert process.sock is not None
                process.sock.shutdown(socket.SHUT_WR)
                monkeypatch.setattr(process, "idle_channel_state", checked)
                return answer

            monkeypatch.setattr(process, "idle_channel_state", quiet_then_gone)
            seen.clear()
            assert w.call("tasks.remote:add", 4, 4) == 8
            assert seen == steps("plain", "not sent", "start")
            assert w.generation == 4

            stats = w.stats()
            counted = (
                stats.ok + stats.raised + stats.crashed + stats.timed_out + stats.cancelled
            ) + stats.failed
            assert (stats.submitted, counted, stats.in_flight) == (9, 9, 0)
            assert (stats.ok, stats.raised, stats.crashed, stats.timed_out) == (6, 1, 1, 1)
