"""Settings per env: ``Pool.configure(env, ...)`` and a ``Recipe``'s ``settings`` give one env
its own variables, deadlines, grace, idle timeout, memory limit and breaker; the env's values win
over the pool's, the other envs keep the pool's, ``stats()`` and ``comfy-env status`` show what
each env runs with, and bad values are refused up front. Real workers, two envs side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TESTS_DIR, wait_until

import comfy_env
from comfy_env import CallTimeout, EnvAbandonedError, WorkerCrashed, WorkerOutOfMemory
from comfy_env._pool import snapshot_pool

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def _pool(**settings: object) -> comfy_env.Pool:
    return comfy_env.Pool(comfy_env.PoolConfig(sys_path=(str(TESTS_DIR),), **settings))


def _variable(name: str) -> str | None:
    import os

    return os.environ.get(name)


def test_an_env_s_own_variables_and_deadline_win_and_the_other_env_keeps_the_pool_s(
    foreign_venv: Path,
) -> None:
    with _pool(env_vars={"FROM_POOL": "pool", "SHARED": "pool"}) as pool:
        mine, other = pool.get_worker(), pool.get_worker(str(foreign_venv))
        pool.configure(None, env_vars={"SHARED": "mine", "OWN": "1"}, call_timeout=1.0)
        getenv = "os:getenv"
        assert mine.call(getenv, "SHARED") == "mine"
        assert mine.call(getenv, "OWN") == "1"
        assert mine.call(getenv, "FROM_POOL") == "pool"  # added to the pool's
        assert other.call(getenv, "SHARED") == "pool"
        assert other.call(getenv, "OWN") is None
        with pytest.raises(CallTimeout) as late:
            mine.call("time:sleep", 5)
        assert late.value.timeout == 1.0
        assert other.call("time:sleep", 1.5) is None  # the pool's: no deadline
        stats = pool.stats()
        own = stats[mine.env]
        assert own.settings is not None and own.settings.call_timeout == 1.0
        assert own.own_settings == ("env_vars", "call_timeout")
        assert own.settings.env_vars == {"FROM_POOL": "pool", "SHARED": "mine", "OWN": "1"}
        theirs = stats[other.env]
        assert theirs.settings is not None and theirs.settings.call_timeout is None
        assert theirs.own_settings == ()


def test_a_later_configure_adds_to_the_own_settings_and_a_running_worker_keeps_its_variables() -> (
    None
):
    with _pool() as pool:
        worker = pool.get_worker()
        pool.configure(None, env_vars={"A": "1"})
        assert worker.call("os:getenv", "A") == "1"
        pool.configure(None, call_timeout=30.0, env_vars={"A": "2"})
        assert worker.call("os:getenv", "A") == "1"  # the running worker keeps its own
        assert worker.stats().settings.call_timeout == 30.0  # type: ignore[union-attr]
        assert pool.retire_idle() == 1
        assert worker.call("os:getenv", "A") == "2"  # the next worker takes the new ones


def test_an_env_s_idle_timeout_reaps_only_its_workers(foreign_venv: Path) -> None:
    with _pool(idle_timeout=None) as pool:
        mine, other = pool.get_worker(), pool.get_worker(str(foreign_venv))
        pool.configure(None, idle_timeout=0.3)
        mine.call("math:sqrt", 4.0)
        other.call("math:sqrt", 4.0)
        assert wait_until(lambda: mine.stats().reaped == 1, 10)
        assert other.stats().reaped == 0 and other.pid is not None


def test_an_env_s_memory_limit_applies_to_its_workers_only(foreign_venv: Path) -> None:
    with _pool() as pool:
        mine, other = pool.get_worker(), pool.get_worker(str(foreign_venv))
        pool.configure(None, memory_limit=128 * MiB)
        with pytest.raises(WorkerOutOfMemory) as out:
            mine.call("tasks.remote:allocate_mib", 512)
        assert out.value.limit == 128 * MiB
        assert other.call("tasks.remote:allocate_mib", 256) == 32


def test_an_env_s_breaker_settings_trip_it_alone(foreign_venv: Path) -> None:
    with _pool(max_restarts=100) as pool:
        mine, other = pool.get_worker(), pool.get_worker(str(foreign_venv))
        pool.configure(None, max_restarts=1, abandon_for=600.0)
        for _ in range(2):
            with pytest.raises(WorkerCrashed):
                mine.call("comfy_env_worker.tasks:crash")
        with pytest.raises(EnvAbandonedError, match="abandon_for=600s"):
            mine.call("math:sqrt", 4.0)
        for _ in range(2):
            with pytest.raises(WorkerCrashed):
                other.call("comfy_env_worker.tasks:crash")
        assert other.call("math:sqrt", 4.0) == 2.0


def test_bad_settings_are_refused_and_change_nothing() -> None:
    with _pool() as pool:
        pool.configure(None, call_timeout=5.0)
        for bad in (
            {"call_timeout": -1},
            {"cancel_grace": float("inf")},
            {"memory_limit": 1000},
            {"env_vars": {"A=B": "x"}},
            {"idle_timeout": "soon"},
        ):
            with pytest.raises(comfy_env.ConfigError, match=next(iter(bad))):
                pool.configure(None, **bad)
        with pytest.raises(comfy_env.ArgumentError, match="shared_memory"):
            pool.configure(None, shared_memory=False)
        stats = pool.get_worker().stats()
        assert stats.own_settings == ("call_timeout",)
        assert stats.settings is not None and stats.settings.call_timeout == 5.0
        assert stats.spawns == 0


def test_status_shows_an_env_s_own_settings_and_never_its_variables_values() -> None:
    with _pool() as pool:
        pool.configure(None, env_vars={"TOKEN": "s3cret"}, memory_limit=256 * MiB)
        pool.get_worker().call("math:sqrt", 1.0)
        text = json.dumps(snapshot_pool(pool))
        assert "s3cret" not in text
        (env,) = snapshot_pool(pool)["envs"]
        assert env["settings"] == {"env_vars": ["TOKEN"], "memory_limit": 256 * MiB}


_STATUS_HOST = """
import sys, time
import comfy_env
with comfy_env.Pool() as pool:
    pool.configure(None, env_vars={"TOKEN": "s3cret"}, call_timeout=7.5)
    pool.get_worker().call("math:sqrt", 1.0)
    print("ready", flush=True)
    sys.stdin.readline()
"""


def test_comfy_env_status_prints_an_env_s_own_settings() -> None:
    host = subprocess.Popen(
        [sys.executable, "-c", _STATUS_HOST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "ready"
        shown = ""
        for _ in range(50):
            out = subprocess.run(
                [sys.executable, "-m", "comfy_env", "status"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            shown = out.stdout
            if "own settings" in shown:
                break
            wait_until(lambda: False, 0.1)
        assert "own settings: call_timeout=7.5s, env_vars=TOKEN" in shown, shown
        assert "s3cret" not in shown
    finally:
        assert host.stdin is not None
        host.stdin.write("\n")
        host.stdin.flush()
        host.communicate(timeout=60)


def test_a_recipe_s_settings_are_checked_when_it_is_made() -> None:
    with pytest.raises(comfy_env.ConfigError, match="call_timeout"):
        comfy_env.Recipe(requirements=["six==1.16.0"], settings={"call_timeout": 0})
    with pytest.raises(comfy_env.ArgumentError, match="backend"):
        comfy_env.Recipe(requirements=["six==1.16.0"], settings={"backend": "ray"})
    recipe = comfy_env.Recipe(requirements=["six==1.16.0"], settings={"call_timeout": 9.0})
    same = comfy_env.Recipe(requirements=["six==1.16.0"])
    assert recipe == same  # settings change no file: the same env


def test_a_recipe_s_settings_become_its_env_s_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        pytest.skip("the package index is unreachable")
    monkeypatch.setenv("COMFY_ENV_HOME", str(tmp_path / "home"))
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    recipe = comfy_env.Recipe(
        requirements=["six==1.16.0"],
        python=python,
        settings={"env_vars": {"FROM_RECIPE": "yes"}, "call_timeout": 1.0},
    )
    with _pool() as pool:
        worker = pool.get_worker(recipe)
        assert worker.call("os:getenv", "FROM_RECIPE") == "yes"
        with pytest.raises(CallTimeout):
            worker.call("time:sleep", 5)
        assert worker.stats().own_settings == ("env_vars", "call_timeout")
