"""Config, arguments and envs that the OS or the clock cannot take are typed errors up front:
timeouts that are infinite, NaN or too large (in ``PoolConfig``, from the environment, in a
config copied past validation, and per call), booleans given as numbers, env vars ``execve``
cannot take, paths with NUL, an interpreter that cannot be executed and an env dir without
permission (``EnvError``).
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    root_only,
)

import comfy_env

TIME_FIELDS = (
    "call_timeout",
    "start_timeout",
    "cancel_grace",
    "kill_grace",
    "close_timeout",
    "idle_timeout",
    "ping_after_idle",
    "ping_timeout",
    "restart_window",
    "abandon_for",
    "shm_pinned_ttl",
)


@pytest.mark.parametrize("field", TIME_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e300, 10**30])
def test_config_timeouts_the_clock_cannot_take_are_validation_errors(
    field: str, value: float
) -> None:
    with pytest.raises(comfy_env.ConfigError, match=field):
        comfy_env.PoolConfig(**{field: value})


def test_config_timeouts_from_the_environment_are_checked_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMFY_ENV_CLOSE_TIMEOUT", "inf")
    with pytest.raises(comfy_env.ConfigError, match=r"CLOSE_TIMEOUT|close_timeout"):
        comfy_env.PoolConfig()


def test_a_config_copied_past_validation_is_checked_when_the_pool_takes_it(
    config: comfy_env.PoolConfig,
) -> None:
    bad = config.model_copy(update={"close_timeout": math.inf})
    with pytest.raises(comfy_env.ConfigError, match="close_timeout"):
        comfy_env.Pool(bad)


def _numeric_fields() -> list[str]:
    """Every ``PoolConfig`` field that holds a number (``int``, ``float``, or one of them or
    None), read from the model: a new numeric field is covered without editing this test."""
    numbers = {int, float, int | None, float | None}
    return [n for n, f in comfy_env.PoolConfig.model_fields.items() if f.annotation in numbers]


@pytest.mark.parametrize("field", _numeric_fields())
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_no_number_for_any_numeric_config_field(field: str, value: bool) -> None:
    # pydantic would take True as 1: call_timeout=True was a one-second deadline.
    with pytest.raises(comfy_env.ConfigError, match=f"{field}.*boolean"):
        comfy_env.PoolConfig(**{field: value})


def test_the_numeric_config_fields_are_the_ones_expected() -> None:
    assert len(_numeric_fields()) == 19  # the list above is not empty by accident


def _with_timeout(worker: comfy_env.Worker, how: str, timeout: object) -> object:
    """``tasks.remote:add(1, 2)`` through the handle ``how`` with ``timeout``, to its result."""
    kw: Any = {"timeout": timeout}
    if how == "run":
        return worker.run("tasks.remote:add", (1, 2), **kw)
    if how == "submit":
        return worker.submit("tasks.remote:add", (1, 2), **kw).result()
    if how == "arun":
        return asyncio.run(worker.arun("tasks.remote:add", (1, 2), **kw))
    ref = asyncio.run(worker.arun_ref("tasks.remote:add", (1, 2), **kw))
    try:
        return ref.call_method("__int__")
    finally:
        ref.release()


@pytest.mark.parametrize("how", ["run", "submit", "arun", "arun_ref"])
@pytest.mark.parametrize("value", [math.inf, math.nan, 1e300, -1.0, 0, True, "5"])
def test_per_call_timeouts_the_clock_cannot_take_are_argument_errors(
    pool: comfy_env.Pool, value: object, how: str
) -> None:
    # Every handle that takes a timeout checks it itself, before the call is prepared (the
    # call's object, compiled in ``dev.py compile``'s build, takes only float or None).
    worker = pool.get_worker()
    with pytest.raises(comfy_env.ArgumentError, match="timeout"):
        _with_timeout(worker, how, value)
    stats = worker.stats()
    assert stats.spawns == 0 and stats.crashed == 0  # refused before anything ran
    assert _with_timeout(worker, how, 30) == 3


@pytest.mark.parametrize(
    ("env_vars", "needle"),
    [
        ({"A=B": "x"}, "A=B"),
        ({"A\0B": "x"}, "NUL"),
        ({"": "x"}, "non-empty"),
        ({"A": "x\0y"}, "NUL"),
    ],
)
def test_env_vars_execve_cannot_take_are_validation_errors(
    env_vars: dict[str, str], needle: str
) -> None:
    with pytest.raises(comfy_env.ConfigError, match="env_vars") as info:
        comfy_env.PoolConfig(env_vars=env_vars)
    assert needle in str(info.value)


def test_paths_with_nul_are_validation_errors() -> None:
    with pytest.raises(comfy_env.ConfigError, match="sys_path"):
        comfy_env.PoolConfig(sys_path=("a\0b",))
    with pytest.raises(comfy_env.ConfigError, match="cwd"):
        comfy_env.PoolConfig(cwd="a\0b")


def test_an_interpreter_that_cannot_be_executed_is_an_env_error(tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o644)
    with pytest.raises(comfy_env.EnvError):
        comfy_env.resolve_env(env)


@root_only
def test_an_env_dir_without_permission_is_an_env_error(tmp_path: Path) -> None:
    env = tmp_path / "private-env"
    (env / "bin").mkdir(parents=True)
    os.symlink(sys.executable, env / "bin" / "python")
    env.chmod(0o700)  # root's; the probe below runs as nobody
    tmp_path.chmod(0o755)
    code = (
        "import sys, comfy_env\n"
        "try:\n"
        "    comfy_env.resolve_env(sys.argv[1])\n"
        "except comfy_env.EnvError as exc:\n"
        "    print('EnvError', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(env)],
        capture_output=True,
        text=True,
        timeout=60,
        user=65534,
        env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
    )
    if "ImportError" in out.stderr or "ModuleNotFoundError" in out.stderr:
        pytest.skip(f"nobody cannot import comfy_env here: {out.stderr[-300:]}")
    assert out.stdout.startswith("EnvError"), out.stdout + out.stderr
    assert "permission denied" in out.stdout
