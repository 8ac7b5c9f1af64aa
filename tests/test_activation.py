"""Env activation: workers of a venv, conda or pixi env get the variables activating it sets.

Real workers read their own environment (``tasks.remote:environ``). The conda and pixi envs are
fake (a ``conda-meta`` directory, ``bin/python`` linked to this interpreter) with real
``etc/conda/activate.d`` scripts, sourced by a real shell.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import sys
from pathlib import Path

import pytest

import comfy_env
from comfy_env import WorkerCrashed

pytestmark = pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")


def _conda_env(
    where: Path,
    scripts: dict[str, str] | None = None,
    state: dict[str, object] | None = None,
    bin_tools: tuple[str, ...] = (),
) -> Path:
    """A conda-like env at ``where``: ``conda-meta/``, ``bin/python`` -> this interpreter,
    ``etc/conda/activate.d/<name>`` scripts, ``conda-meta/state`` and executables in bin."""
    (where / "conda-meta").mkdir(parents=True)
    (where / "bin").mkdir()
    (where / "bin" / "python").symlink_to(sys.executable)
    for name, body in (scripts or {}).items():
        script = where / "etc" / "conda" / "activate.d" / name
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(body)
    if state is not None:
        (where / "conda-meta" / "state").write_text(json.dumps(state))
    for tool in bin_tools:
        path = where / "bin" / tool
        path.write_text("#!/bin/sh\necho tool\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return where


def _env_of(worker: comfy_env.Worker, *names: str) -> dict[str, str | None]:
    return {name: worker.call("tasks.remote:environ", name) for name in names}


def _path(worker: comfy_env.Worker) -> list[str]:
    return str(worker.call("tasks.remote:environ", "PATH") or "").split(os.pathsep)


def _activation_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "comfy_env"
        and r.levelno == logging.WARNING
        and "activation script" in r.getMessage()
    ]


OCCT = """\
# like conda-forge's occt: data paths for OpenCASCADE, relative to the env
export CASROOT="$CONDA_PREFIX/share/opencascade"
export CSF_OCCTResourcePath="$CASROOT/resources"
echo "occt activated"
"""
TOOLS = """\
export PATH="$CONDA_PREFIX/tools:$PATH"
export SEEN_STATE_VAR="${STATE_VAR:-unset}"
"""


def test_a_conda_env_worker_gets_what_activating_the_env_sets(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    env = _conda_env(
        tmp_path / "occt",
        scripts={"occt_activate.sh": OCCT, "tools.sh": TOOLS},
        state={"env_vars": {"STATE_VAR": "from-state"}},
        bin_tools=("ninja",),
    )
    w = pool.get_worker(env)
    got = _env_of(
        w, "CONDA_PREFIX", "CASROOT", "CSF_OCCTResourcePath", "STATE_VAR", "SEEN_STATE_VAR"
    )
    assert got == {
        "CONDA_PREFIX": str(env),
        "CASROOT": f"{env}/share/opencascade",
        "CSF_OCCTResourcePath": f"{env}/share/opencascade/resources",
        "STATE_VAR": "from-state",
        "SEEN_STATE_VAR": "from-state",  # conda exports the state's variables first
    }
    # The env's bin first, then what the scripts prepended in front of it, then the host's.
    path = _path(w)
    assert path[:2] == [str(env / "tools"), str(env / "bin")]
    assert path[2:] == os.environ["PATH"].split(os.pathsep)
    # The env's binaries are found through PATH (shutil.which, subprocess).
    assert w.call("shutil:which", "ninja") == str(env / "bin" / "ninja")
    # Shell bookkeeping is not the env's.
    assert w.call("tasks.remote:environ", "SHLVL") == os.environ.get("SHLVL")


def test_a_pixi_env_is_activated_as_a_conda_env(pool: comfy_env.Pool, tmp_path: Path) -> None:
    project = tmp_path / "project"
    prefix = _conda_env(project / ".pixi" / "envs" / "default", scripts={"occt.sh": OCCT})
    w = pool.get_worker(project)  # the project directory, as pixi users name it
    assert _env_of(w, "CONDA_PREFIX", "CASROOT") == {
        "CONDA_PREFIX": str(prefix),
        "CASROOT": f"{prefix}/share/opencascade",
    }
    assert _path(w)[0] == str(prefix / "bin")


def test_a_venv_worker_gets_virtual_env_and_its_bin_first_on_path(
    pool: comfy_env.Pool, foreign_venv: Path
) -> None:
    w = pool.get_worker(foreign_venv)
    assert w.call("tasks.remote:environ", "VIRTUAL_ENV") == str(foreign_venv)
    path = _path(w)
    assert path[0] == str(foreign_venv / "bin")
    assert path[1:] == os.environ["PATH"].split(os.pathsep)


def test_env_vars_win_over_activation(config: comfy_env.PoolConfig, tmp_path: Path) -> None:
    env = _conda_env(
        tmp_path / "env", scripts={"occt.sh": OCCT}, state={"env_vars": {"STATE_VAR": "s"}}
    )
    overrides = {"CASROOT": "/mine", "STATE_VAR": "mine", "PATH": "/only/this"}
    with comfy_env.Pool(config.model_copy(update={"env_vars": overrides})) as pool:
        w = pool.get_worker(env)
        assert _env_of(w, "CASROOT", "STATE_VAR", "PATH", "CONDA_PREFIX") == {
            "CASROOT": "/mine",
            "STATE_VAR": "mine",
            "PATH": "/only/this",
            "CONDA_PREFIX": str(env),  # what env_vars does not name stays activated
        }


def test_activate_false_gives_workers_the_hosts_environment_only(
    config: comfy_env.PoolConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    count = tmp_path / "count"
    env = _conda_env(tmp_path / "env", scripts={"count.sh": f'echo x >> "{count}"\n' + OCCT})
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    monkeypatch.setenv("COMFY_ENV_ACTIVATE", "false")
    assert comfy_env.PoolConfig().activate is False
    with comfy_env.Pool(config.model_copy(update={"activate": False})) as pool:
        w = pool.get_worker(env)
        assert _env_of(w, "CONDA_PREFIX", "CASROOT") == {"CONDA_PREFIX": None, "CASROOT": None}
        assert _path(w) == os.environ["PATH"].split(os.pathsep)
    assert not count.exists()  # the scripts never ran


def test_activation_scripts_run_once_per_host_across_respawns_and_pools(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    count = tmp_path / "count"
    env = _conda_env(tmp_path / "env", scripts={"count.sh": f'echo x >> "{count}"\n' + OCCT})
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker(env)
        assert w.call("tasks.remote:environ", "CASROOT") == f"{env}/share/opencascade"
        with pytest.raises(WorkerCrashed):
            w.call("tasks.remote:kill_self", signal.SIGKILL)
        # generation 2, and many warm calls: the scripts are not run again
        for _ in range(20):
            assert w.call("tasks.remote:environ", "CASROOT") == f"{env}/share/opencascade"
        assert w.generation == 2
    with comfy_env.Pool(config) as pool:  # a later pool of the same host
        assert pool.get_worker(env).call("tasks.remote:environ", "CASROOT") is not None
    assert count.read_text() == "x\n"
    # An edited script is run again at the next spawn.
    script = env / "etc" / "conda" / "activate.d" / "count.sh"
    script.write_text(script.read_text() + "export EDITED=1\n")
    with comfy_env.Pool(config) as pool:
        assert pool.get_worker(env).call("tasks.remote:environ", "EDITED") == "1"
    assert count.read_text() == "x\nx\n"


def test_state_variables_execve_cannot_take_are_left_out_and_the_worker_starts(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    # conda-meta/state is the env's file, not ours: a NUL or "=" in it must not fail the spawn.
    env = _conda_env(
        tmp_path / "env",
        state={"env_vars": {"GOOD": "1", "NUL_VALUE": "a\u0000b", "A=B": "x", "": "y"}},
    )
    w = pool.get_worker(env)
    assert _env_of(w, "GOOD", "NUL_VALUE", "A") == {"GOOD": "1", "NUL_VALUE": None, "A": None}


def test_a_failing_script_is_one_warning_and_the_worker_starts_with_what_ran(
    pool: comfy_env.Pool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = _conda_env(
        tmp_path / "env",
        scripts={
            "a_ok.sh": "export A_SET=1\n",
            "b_status.sh": "export B_SET=1\necho 'b went wrong' >&2\nfalse\n",
            "c_exits.sh": "export C_SET=1\necho 'c cannot go on' >&2\nexit 3\n",
            "d_never.sh": "export D_SET=1\n",
        },
    )
    with caplog.at_level(logging.WARNING, logger="comfy_env"):
        w = pool.get_worker(env)
        got = _env_of(w, "A_SET", "B_SET", "C_SET", "D_SET", "CONDA_PREFIX")
        with pytest.raises(WorkerCrashed):
            w.call("tasks.remote:kill_self", signal.SIGKILL)
        assert w.call("tasks.remote:environ", "A_SET") == "1"  # respawned: cached, no warning
    # A non-zero status keeps the script's exports (conda ignores it too); a script that ends
    # the shell loses its own and the later scripts'.
    assert got == {
        "A_SET": "1",
        "B_SET": "1",
        "C_SET": None,
        "D_SET": None,
        "CONDA_PREFIX": str(env),
    }
    warnings = _activation_warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "b_status.sh" in warnings[0] and "status 1" in warnings[0]
    assert "b went wrong" in warnings[0]
    assert "c_exits.sh" in warnings[1] and "ended the shell" in warnings[1]
    assert "c cannot go on" in warnings[1]


def test_a_hanging_script_is_killed_at_start_timeout_and_the_worker_still_starts(
    config: comfy_env.PoolConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    env = _conda_env(
        tmp_path / "env",
        scripts={
            "a_ok.sh": "export A_SET=1\n",
            "b_hangs.sh": "echo 'waiting for a licence server' >&2\nsleep 600\nexport B_SET=1\n",
        },
    )
    with caplog.at_level(logging.WARNING, logger="comfy_env"):
        with comfy_env.Pool(config.model_copy(update={"start_timeout": 2.0})) as pool:
            w = pool.get_worker(env)
            assert _env_of(w, "A_SET", "B_SET") == {"A_SET": "1", "B_SET": None}
    warnings = _activation_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "b_hangs.sh" in warnings[0] and "did not finish within 2s" in warnings[0]
    assert "waiting for a licence server" in warnings[0]


def test_the_current_interpreter_and_a_bare_interpreter_are_not_activated(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    # A folder that looks activatable (bin/python, activate.d) but is no env (no conda-meta,
    # no pyvenv.cfg): its scripts must not run.
    count = tmp_path / "count"
    script = tmp_path / "loose" / "etc" / "conda" / "activate.d" / "count.sh"
    script.parent.mkdir(parents=True)
    script.write_text(f'echo x >> "{count}"\nexport LOOSE=1\n')
    (tmp_path / "loose" / "bin").mkdir()
    (tmp_path / "loose" / "bin" / "python").symlink_to(sys.executable)
    loose = pool.get_worker(tmp_path / "loose" / "bin" / "python")
    assert loose.call("tasks.remote:environ", "LOOSE") is None
    assert not count.exists()
    current = pool.get_worker()
    for w in (loose, current):
        assert _path(w) == os.environ["PATH"].split(os.pathsep)
        assert w.call("tasks.remote:environ", "CONDA_PREFIX") == os.environ.get("CONDA_PREFIX")
        assert w.call("tasks.remote:environ", "VIRTUAL_ENV") == os.environ.get("VIRTUAL_ENV")


def test_scripts_whose_environment_cannot_be_read_are_a_warning_not_silence(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The shell runs the scripts but ``env -0`` is not found (a PATH without it, as a
    minimal system might have): their exports are lost, and the warning says so."""
    from comfy_env._activation import _run_scripts

    script = tmp_path / "a.sh"
    script.write_text("export A_SET=1\n")
    start = {"PATH": str(tmp_path / "nothing-here"), "CONDA_PREFIX": str(tmp_path)}
    with caplog.at_level(logging.WARNING, logger="comfy_env"):
        final, failures = _run_scripts(str(tmp_path), [str(script)], start, 10.0)
    assert final == start
    assert len(failures) == 1 and "could not be read" in failures[0]
    assert failures[0] in caplog.text
