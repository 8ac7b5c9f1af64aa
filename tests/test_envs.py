"""Env resolution, foreign interpreters, start-up failures and configuration."""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import other_python, wait_until
from pydantic import ValidationError

import comfy_env
import comfy_env._envs
import comfy_env._settings
from comfy_env import EnvError, SerializationError, WorkerStartError
from comfy_env._envs import resolve_env


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# ---- resolution ---------------------------------------------------------------------------


def test_none_is_the_current_interpreter() -> None:
    spec = resolve_env(None)
    assert spec.interpreter == sys.executable
    assert spec.key == os.path.abspath(sys.prefix)
    assert spec.is_current


def test_missing_env_dir_is_an_env_error(tmp_path: Path) -> None:
    with pytest.raises(EnvError, match="does not exist") as info:
        comfy_env.Pool().get_worker(tmp_path / "nope")
    assert info.value.tried == (str(tmp_path / "nope"),)


def test_env_dir_without_interpreter_lists_the_paths_tried(tmp_path: Path) -> None:
    with pytest.raises(EnvError) as info:
        resolve_env(tmp_path)
    err = info.value
    assert str(tmp_path / "bin" / "python") in err.tried
    assert str(tmp_path / ".pixi" / "envs" / "default" / "bin" / "python") in err.tried
    for path in err.tried:
        assert path in str(err)


def test_non_executable_file_is_an_env_error(tmp_path: Path) -> None:
    f = tmp_path / "python"
    f.write_text("")
    with pytest.raises(EnvError, match="neither an env directory nor an executable"):
        resolve_env(f)


def test_wrong_type_is_an_env_error() -> None:
    with pytest.raises(EnvError, match="not int"):
        resolve_env(3)  # type: ignore[arg-type]


class _BytesPath(os.PathLike):  # type: ignore[type-arg]
    def __fspath__(self) -> bytes:
        return b"/tmp"


@pytest.mark.parametrize(
    ("env", "needle"),
    [("venv\0x", "NUL character"), (_BytesPath(), "bytes"), (b"/tmp", "not bytes")],
)
def test_an_env_no_path_can_name_is_an_env_error_saying_why(
    pool: comfy_env.Pool, env: object, needle: str
) -> None:
    """A NUL in the env, or an ``os.PathLike`` that gives bytes, is an ``EnvError`` saying so
    (not "does not exist" with the NUL printed raw, nor a bare ``TypeError`` from path
    arithmetic); the pool goes on serving other envs."""
    with pytest.raises(EnvError, match=needle) as info:
        pool.get_worker(env)  # type: ignore[arg-type]
    assert "\0" not in str(info.value)
    assert pool.get_worker().call("comfy_env_worker.tasks:echo", 1) == 1
    assert len(pool.stats()) == 1


def test_venv_interpreter_path_is_kept_unresolved(foreign_venv: Path) -> None:
    spec = resolve_env(foreign_venv)
    assert spec.interpreter == str(foreign_venv / "bin" / "python")
    assert spec.key == str(foreign_venv)
    assert resolve_env(foreign_venv / "bin" / "python").key == str(foreign_venv)


def _env_at(path: Path) -> Path:
    """An env directory at ``path`` (with a venv's ``pyvenv.cfg``) whose ``bin/python`` runs
    this interpreter."""
    interp = path / "bin" / "python"
    interp.parent.mkdir(parents=True)
    interp.symlink_to(sys.executable)
    (path / "pyvenv.cfg").write_text(f"home = {os.path.dirname(sys.executable)}\n")
    return path


def test_dotdot_after_a_symlink_is_the_directory_the_os_opens(tmp_path: Path) -> None:
    (tmp_path / "deep" / "a").mkdir(parents=True)
    meant = _env_at(tmp_path / "deep" / "venvX")
    _env_at(tmp_path / "venvX")  # what collapsing "lnk/.." as a string would pick
    (tmp_path / "lnk").symlink_to(tmp_path / "deep" / "a")
    spec = resolve_env(tmp_path / "lnk" / ".." / "venvX")
    assert (spec.key, spec.interpreter) == (str(meant), str(meant / "bin" / "python"))
    # Without "..", the path stays as spelled (symlinks are not resolved).
    assert resolve_env(tmp_path / "lnk" / ".." / "venvX" / "bin" / "python").key == str(meant)
    link = tmp_path / "link-to-venv"
    link.symlink_to(meant)
    assert resolve_env(link).key == str(link)


def test_two_interpreters_in_one_folder_are_two_envs(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    # Like /usr/bin/python3.10 beside /usr/bin/python3.12: not one env keyed /usr.
    folder = tmp_path / "multi" / "bin"
    folder.mkdir(parents=True)
    plain = folder / "python3.8"
    plain.symlink_to(os.path.realpath(sys.executable))
    wrapped = _script(folder / "python3.12", f'WRAPPED_PYTHON=yes exec "{plain}" "$@"\n')
    assert resolve_env(plain).key == str(plain)
    assert resolve_env(wrapped).key == str(wrapped)
    with comfy_env.Pool(config) as pool:
        assert pool.get_worker(plain).call("os:getenv", "WRAPPED_PYTHON") is None
        assert pool.get_worker(wrapped).call("os:getenv", "WRAPPED_PYTHON") == "yes"
        assert sorted(pool.stats()) == sorted([str(plain), str(wrapped)])


def test_a_venvs_own_interpreter_and_its_directory_are_one_env(tmp_path: Path) -> None:
    env = _env_at(tmp_path / "venv")
    (env / "bin" / "python3.11").symlink_to("python")
    foreign = _script(env / "bin" / "python3.8", f'exec "{sys.executable}" "$@"\n')
    assert resolve_env(env / "bin" / "python3.11").key == str(env)
    assert resolve_env(env / "bin" / "python").key == str(env)
    assert resolve_env(env).key == str(env)
    # Another interpreter in the venv's bin/ is not the venv's own: a key of its own.
    assert resolve_env(foreign).key == str(foreign)


def test_an_env_whose_interpreter_changed_is_refused_not_silently_reused(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    env = _env_at(tmp_path / "venv")
    (env / "bin" / "python").rename(env / "bin" / "python3")  # the env's interpreter, for now
    with comfy_env.Pool(config) as pool:
        assert pool.get_worker(env).call("os:getenv", "WRAPPED_PYTHON") is None
        # bin/python appears (another file): the env's interpreter is no longer the entry's.
        _script(env / "bin" / "python", f'WRAPPED_PYTHON=yes exec "{sys.executable}" "$@"\n')
        with pytest.raises(EnvError, match="already in this pool with the interpreter"):
            pool.get_worker(env)


@pytest.mark.parametrize(
    ("where", "name"),
    [
        ("mesh_pack/.venv", "mesh_pack"),  # every ComfyUI pack's env=".venv"
        ("mesh_pack/venv", "mesh_pack"),
        ("mesh_pack/env", "mesh_pack"),
        ("mesh_pack/.env", "mesh_pack"),
        ("my.pack/.venv", "my_pack"),
        ("pythons/3.12.1", "3_12_1"),  # a dot would split the logger tree
        ("envs/mesh-env", "mesh-env"),
        ("mesh_pack/.Venv", "_Venv"),  # generic names are compared as spelled
    ],
)
def test_an_env_is_named_for_its_loggers_after_what_it_belongs_to(
    tmp_path: Path, where: str, name: str
) -> None:
    env = _env_at(tmp_path / where)
    spec = resolve_env(env)
    assert spec.name == name
    assert spec.key == str(env)  # the env key stays the path
    assert resolve_env(env / "bin" / "python").name == name


def test_two_packs_venvs_log_on_loggers_of_their_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    with comfy_env.Pool() as pool:
        for pack in ("mesh_pack", "cad_pack"):
            env = _env_at(tmp_path / pack / ".venv")
            pool.get_worker(env).call("builtins:print", f"hello from {pack}")
            env_records = [r for r in caplog.records if r.getMessage() == f"hello from {pack}"]
            assert [r.name for r in env_records] == [f"comfy_env.worker.{pack}"]
            assert env_records[0].env == str(env)  # type: ignore[attr-defined]


def test_pixi_layout_is_found(tmp_path: Path) -> None:
    interp = tmp_path / ".pixi" / "envs" / "default" / "bin" / "python"
    interp.parent.mkdir(parents=True)
    interp.symlink_to(sys.executable)
    spec = resolve_env(tmp_path)
    assert (spec.key, spec.interpreter) == (str(tmp_path), str(interp))


# ---- a real foreign env ------------------------------------------------------------------


def test_foreign_venv_runs_calls_without_host_packages(
    pool: comfy_env.Pool, foreign_venv: Path
) -> None:
    w = pool.get_worker(foreign_venv)
    assert w.call("tasks.remote:prefix") == str(foreign_venv)
    assert w.call("tasks.remote:executable") == str(foreign_venv / "bin" / "python")
    # Installed in the host's env only: must not be importable in the worker.
    assert pool.get_worker().call("tasks.remote:can_import", "pydantic")
    assert not w.call("tasks.remote:can_import", "pydantic")
    assert not w.call("tasks.remote:can_import", "psutil")
    assert not w.call("tasks.remote:can_import", "comfy_env")
    # By value works because the venv runs the host's Python version.
    assert w.call(lambda: 6 * 7) == 42


def test_host_pythonpath_does_not_leak_into_workers(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "leaky"))
    monkeypatch.setenv("COMFY_TEST_MARKER", "visible")
    with comfy_env.Pool(config.model_copy(update={"env_vars": {"EXTRA": "1"}})) as pool:
        w = pool.get_worker()
        assert w.call("tasks.remote:environ", "PYTHONPATH") is None
        assert w.call("tasks.remote:environ", "COMFY_TEST_MARKER") == "visible"
        assert w.call("tasks.remote:environ", "EXTRA") == "1"
        path = w.call("tasks.remote:sys_path")
        assert not any("leaky" in p for p in path)
        assert path[0].startswith(comfy_env._process.runtime_root())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11+")
def test_a_worker_with_pythonsafepath_keeps_its_stdlib_on_sys_path(
    config: comfy_env.PoolConfig,
) -> None:
    # env_vars wins over the host's stripping of PYTHONSAFEPATH: no '' entry for BOOT to take.
    with comfy_env.Pool(config) as pool:
        normal = pool.get_worker().call("tasks.remote:sys_path")
    safe_config = config.model_copy(update={"env_vars": {"PYTHONSAFEPATH": "1"}})
    with comfy_env.Pool(safe_config) as pool:
        w = pool.get_worker()
        assert w.call("tasks.remote:environ", "PYTHONSAFEPATH") == "1"
        path = w.call("tasks.remote:sys_path")
        # The runtime dir first (each pool has its own), then exactly a normal worker's entries.
        assert path[0].startswith(comfy_env._process.runtime_root())
        assert path[1:] == normal[1:]
        assert w.call("json:dumps", [1]) == "[1]"


def test_worker_cwd_comes_from_the_config(config: comfy_env.PoolConfig, tmp_path: Path) -> None:
    with comfy_env.Pool(config.model_copy(update={"cwd": str(tmp_path)})) as pool:
        assert pool.get_worker().call(os.getcwd) == str(tmp_path)


def test_a_relative_cwd_is_the_hosts_directory_of_that_name(
    config: comfy_env.PoolConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "some dir").mkdir()
    monkeypatch.chdir(tmp_path)
    with comfy_env.Pool(config.model_copy(update={"cwd": "some dir"})) as pool:
        assert pool.config.cwd == str(tmp_path / "some dir")
        assert pool.get_worker().call(os.getcwd) == str(tmp_path / "some dir")


def test_relative_sys_path_entries_are_relative_to_the_hosts_directory(
    config: comfy_env.PoolConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "relative_mod.py").write_text("VALUE = 42\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    update = {"sys_path": ("lib",), "cwd": str(tmp_path / "elsewhere")}
    with comfy_env.Pool(config.model_copy(update=update)) as pool:
        assert pool.config.sys_path == (str(tmp_path / "lib"),)
        assert pool.get_worker().call("relative_mod:VALUE.__int__") == 42


def test_a_missing_cwd_is_a_start_error_naming_cwd(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    missing = tmp_path / "no such cwd"
    with comfy_env.Pool(config.model_copy(update={"cwd": str(missing)})) as pool:
        with pytest.raises(WorkerStartError, match=r"its cwd .*no such cwd.* \(PoolConfig.cwd\)"):
            pool.get_worker().call(os.getcwd)


def test_oldest_supported_env_python_runs_the_worker(pool: comfy_env.Pool, tmp_path: Path) -> None:
    py38 = other_python(8)
    if py38 is None:
        pytest.skip("no Python 3.8 on this machine")
    env = tmp_path / "py38"
    subprocess.run([py38, "-m", "venv", "--without-pip", str(env)], check=True)
    w = pool.get_worker(env)
    assert w.call("comfy_env_worker.tasks:info")["python"].startswith("3.8")
    assert w.call("tasks.remote:add", 1, 2) == 3


def test_by_value_function_to_another_python_is_refused_clearly(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    minor = 12 if sys.version_info[:2] != (3, 12) else 11
    other = other_python(minor)
    if other is None:
        pytest.skip(f"no Python 3.{minor} on this machine")
    env = tmp_path / "other"
    subprocess.run([other, "-m", "venv", "--without-pip", str(env)], check=True)
    w = pool.get_worker(env)
    assert w.call("tasks.remote:add", 2, 3) == 5  # by reference works across versions
    with pytest.raises(SerializationError, match="same Python version"):
        w.call(lambda: 1)
    assert w.generation == 1
    assert w.stats().failed == 1


def test_an_env_rebuilt_with_another_python_is_warned_about_when_its_next_worker_starts(
    config: comfy_env.PoolConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Same path, another Python (``rm -rf venv && python3.12 -m venv venv``): not refused,
    but the pool says so when the first worker of the new Python is ready."""
    minor = 12 if sys.version_info[:2] != (3, 12) else 11
    other = other_python(minor)
    if other is None:
        pytest.skip(f"no Python 3.{minor} on this machine")
    env = _env_at(tmp_path / "venv")
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker(env)
        assert w.call("platform:python_version_tuple")[:2] == platform.python_version_tuple()[:2]
        (env / "bin" / "python").unlink()
        (env / "bin" / "python").symlink_to(other)  # the rebuild
        caplog.set_level(logging.WARNING, logger="comfy_env")
        assert (
            w.call("platform:python_version_tuple")[:2] == platform.python_version_tuple()[:2]
        )  # (still live)
        assert not [r for r in caplog.records if "rebuilt" in r.getMessage()]
        pid = w.pid
        assert pid is not None
        os.kill(pid, 9)  # its worker ends; the next one starts from the rebuilt env
        assert wait_until(lambda: w.pid is None)
        assert w.call("platform:python_version_tuple")[:2] == ("3", str(minor))
        (warning,) = [r for r in caplog.records if "rebuilt" in r.getMessage()]
        here = ".".join(map(str, sys.version_info[:3]))
        assert f"{env} now runs Python 3.{minor}." in warning.getMessage()
        assert f"its earlier workers ran Python {here}" in warning.getMessage()


# ---- start-up failures -------------------------------------------------------------------


def test_interpreter_that_dies_at_start_is_reported_at_once_with_its_output(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    _script(tmp_path / "env" / "bin" / "python", "echo 'boom: cannot start' >&2\nexit 3\n")
    with comfy_env.Pool(config.model_copy(update={"start_timeout": 60})) as pool:
        w = pool.get_worker(tmp_path / "env")
        started = time.monotonic()
        with pytest.raises(WorkerStartError) as info:
            w.call("comfy_env_worker.tasks:echo", 1)
        elapsed = time.monotonic() - started
    err = info.value
    assert "exited with code 3 during start-up" in str(err)
    assert "boom: cannot start" in err.stderr_tail
    assert "a Python interpreter?" not in str(err)  # it said something: no guessing
    assert err.generation == 1
    assert elapsed < 30, "start-up death must not wait for start_timeout"


def test_a_silent_non_python_interpreter_is_asked_about(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    true = shutil.which("true")
    if true is None:
        pytest.skip("no true(1) on this machine")
    interp = tmp_path / "env" / "bin" / "python"
    interp.parent.mkdir(parents=True)
    interp.symlink_to(true)
    with comfy_env.Pool(config) as pool:
        with pytest.raises(WorkerStartError) as info:
            pool.get_worker(tmp_path / "env").call("comfy_env_worker.tasks:echo", 1)
    assert "exited with code 0 during start-up" in str(info.value)
    assert f"(is {interp} a Python interpreter?)" in str(info.value)


def test_an_env_at_the_root_directory_is_named_after_its_interpreter() -> None:
    spec = comfy_env._envs.EnvSpec(key="/", interpreter="/bin/python3.12", is_current=False)
    assert spec.name == "python3_12"


def test_a_venv_whose_base_python_was_removed_says_so(tmp_path: Path) -> None:
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    (env / "pyvenv.cfg").write_text("home = /gone/bin\n")
    # As venv makes it: python -> python3 -> the base interpreter (now gone).
    (env / "bin" / "python3").symlink_to(tmp_path / "gone" / "python3.8")
    (env / "bin" / "python").symlink_to("python3")
    gone = os.path.realpath(tmp_path / "gone" / "python3.8")
    with pytest.raises(EnvError) as info:
        resolve_env(env)
    note = f"(bin/python is a dangling symlink to {gone}: was its base Python removed?)"
    assert note in str(info.value)


def test_interpreter_that_hangs_at_start_hits_the_start_timeout(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    _script(tmp_path / "env" / "bin" / "python", "exec sleep 30\n")
    with comfy_env.Pool(config.model_copy(update={"start_timeout": 0.5})) as pool:
        with pytest.raises(WorkerStartError, match="start_timeout"):
            pool.get_worker(tmp_path / "env").call("comfy_env_worker.tasks:echo", 1)


def test_unlaunchable_interpreter_is_a_start_error(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    interp = tmp_path / "env" / "bin" / "python"
    interp.parent.mkdir(parents=True)
    interp.write_bytes(b"\x7fELF garbage")
    interp.chmod(0o755)
    with comfy_env.Pool(config) as pool:
        with pytest.raises(WorkerStartError, match="cannot launch"):
            pool.get_worker(tmp_path / "env").call("comfy_env_worker.tasks:echo", 1)


def test_a_worker_without_shared_memory_gets_the_canary_inline(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host encodes the canary into a shared-memory block before the worker's HELLO
    # arrives; a worker that says it cannot use shared memory gets it inline instead, and the
    # block made in advance is unlinked (the leak guard checks /dev/shm).
    import pickle

    from comfy_env import _channel
    from comfy_env_worker.protocol import FrameReader, FrameType

    class NoShmHello(FrameReader):
        def read(self, deadline: float | None = None) -> tuple[int, int, int, bytes]:
            ftype, flags, call_id, payload = super().read(deadline)
            if ftype == FrameType.HELLO:
                hello = pickle.loads(payload)
                payload = pickle.dumps({**hello, "shm": False}, protocol=5)
            return ftype, flags, call_id, payload

    monkeypatch.setattr(_channel, "FrameReader", NoShmHello)
    with comfy_env.Pool(config) as pool:
        worker = pool.get_worker()
        payload = bytes(range(256)) * 4096  # 1 MiB: over the shared-memory threshold
        assert worker.call("comfy_env_worker.tasks:echo", payload) == payload
        stats = worker.stats()
        assert stats.shared_memory == "unavailable"
        assert stats.spawns == 1 and stats.crashed == 0


def test_worker_failing_its_canary_is_refused(config: comfy_env.PoolConfig, tmp_path: Path) -> None:
    # A launcher wrapper that runs the real worker with a tampered echo (after the host's GO
    # byte, as the pool's BOOT does).
    boot = (
        "import sys,os;os.read(int(sys.argv[2]),1);"
        "sys.path[0]=sys.argv[1];import comfy_env_worker.tasks as t;"
        "t.echo=lambda v: 'tampered';from comfy_env_worker.main import main;main(sys.argv[2:])"
    )
    _script(
        tmp_path / "env" / "bin" / "python",
        f'shift 2\nexec "{sys.executable}" -c "{boot}" "$@"\n',
    )
    with comfy_env.Pool(config) as pool:
        with pytest.raises(WorkerStartError, match="canary"):
            pool.get_worker(tmp_path / "env").call("comfy_env_worker.tasks:echo", 1)


def test_launcher_wrapper_is_supported_and_reports_the_real_pid(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    # Like `pixi run python`: a shell that stays alive as the parent of the interpreter.
    _script(tmp_path / "env" / "bin" / "python", f'"{sys.executable}" "$@"\n')
    w = pool.get_worker(tmp_path / "env")
    pid = w.call("comfy_env_worker.tasks:getpid")
    assert w.pid == pid
    popen = w._entry.slots[0].process.popen  # type: ignore[union-attr]
    assert popen is not None and popen.pid != pid  # the host holds the wrapper


# ---- configuration -----------------------------------------------------------------------


def test_config_reads_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMFY_ENV_CALL_TIMEOUT", "2.5")
    monkeypatch.setenv("COMFY_ENV_MAX_WORKERS_PER_ENV", "3")
    monkeypatch.setenv("COMFY_ENV_SYS_PATH", os.pathsep.join(["/a", "/b"]))
    monkeypatch.setenv("COMFY_ENV_ENV_VARS", '{"K": "V"}')
    cfg = comfy_env.PoolConfig()
    assert cfg.call_timeout == 2.5
    assert cfg.max_workers_per_env == 3
    assert cfg.sys_path == ("/a", "/b")
    assert cfg.env_vars == {"K": "V"}
    assert comfy_env.PoolConfig(call_timeout=9).call_timeout == 9  # explicit wins


def test_config_none_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMFY_ENV_CALL_TIMEOUT", "none")
    assert comfy_env.PoolConfig().call_timeout is None


@pytest.mark.parametrize(
    ("var", "value", "needle"),
    [
        ("COMFY_ENV_CALL_TIMEOUT", "soon", "COMFY_ENV_CALL_TIMEOUT"),
        ("COMFY_ENV_MAX_WORKERS_PER_ENV", "0", "max_workers_per_env"),
        ("COMFY_ENV_ENV_VARS", "{not json", "COMFY_ENV_ENV_VARS"),
        ("COMFY_ENV_LOG_LEVEL", "LOUD", "log_level"),
    ],
)
def test_bad_environment_values_name_the_problem(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(comfy_env.ConfigError, match=needle) as info:
        comfy_env.PoolConfig()
    error = info.value
    assert isinstance(error, comfy_env.ComfyEnvError) and isinstance(error, ValueError)
    assert (error.variable, error.value) == (var, value)
    assert error.field == var.removeprefix("COMFY_ENV_").lower()
    message = str(error)
    assert var in message and repr(value) in message and f"PoolConfig.{error.field}" in message
    assert "input_value" not in message


# Built from parts, so the structure test that finds every COMFY_ENV_* name the project reads
# does not take this deliberate misspelling for one.
_MISSPELLED = "COMFY_ENV_" + "CALL_TIMOUT"


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each unknown variable is said once per process: start this test with none said."""
    monkeypatch.setattr(comfy_env._settings, "_reported", set())
    caplog.set_level(logging.WARNING, logger="comfy_env")


def _said(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if name in r.getMessage()]


@pytest.mark.usefixtures("fresh_warnings")
def test_a_misspelled_variable_is_warned_about_once_naming_the_setting_meant(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(_MISSPELLED, "5")
    with comfy_env.Pool() as pool:  # the path without pydantic reads the environment too
        assert pool.settings.call_timeout is None
    assert comfy_env.PoolConfig().call_timeout is None
    said = _said(caplog, _MISSPELLED)
    assert len(said) == 1, said  # once per process, not once per pool or config
    assert "did you mean COMFY_ENV_CALL_TIMEOUT?" in said[0] and "ignored" in said[0]
    assert caplog.records[0].levelno == logging.WARNING


def test_a_misspelled_config_field_names_the_field_meant() -> None:
    """The variable's path said "did you mean"; the field's said only pydantic's "Extra
    inputs are not permitted"."""
    with pytest.raises(comfy_env.ConfigError) as info:
        comfy_env.PoolConfig(call_timout=5)  # type: ignore[call-arg]
    assert str(info.value) == (
        "PoolConfig(call_timout=5) is invalid: no such field; did you mean call_timeout?"
    )
    assert (info.value.field, info.value.value) == ("call_timout", 5)
    with pytest.raises(comfy_env.ConfigError, match=r"no such field$"):
        comfy_env.PoolConfig(zzz=1)  # type: ignore[call-arg]  # close to nothing: no guess
    # ``model_copy(update=...)`` does not validate; the pool does, also on a copy of the
    # defaults (which it took as they were, the misspelled name ignored).
    with pytest.raises(comfy_env.ConfigError, match=r"did you mean call_timeout\?$"):
        comfy_env.Pool(comfy_env.PoolConfig().model_copy(update={"call_timout": 3}))


@pytest.mark.parametrize(
    ("given", "named"),
    [(5, "not int"), ("x", "not str"), ({"call_timeout": 5}, "not dict")],
)
def test_a_pool_given_something_else_than_a_pool_config_says_so(given: object, named: str) -> None:
    """``Pool(5)`` said "'int' object is not iterable", ``Pool("x")`` "dictionary update
    sequence element ...", and a dict was taken without a word (it is no documented form)."""
    with pytest.raises(
        comfy_env.ArgumentError, match=rf"takes a comfy_env.PoolConfig or None, {named}"
    ):
        comfy_env.Pool(given)  # type: ignore[arg-type]
    with pytest.raises(comfy_env.ArgumentError, match="not the PoolConfig class itself"):
        comfy_env.Pool(comfy_env.PoolConfig)  # type: ignore[arg-type]


@pytest.mark.usefixtures("fresh_warnings")
def test_a_misspelled_variable_beside_a_real_one_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("COMFY_ENV_KILL_GRACE", "2")
    monkeypatch.setenv(_MISSPELLED, "5")
    monkeypatch.setenv("COMFY_ENV_" + "ZZZ", "1")  # close to nothing: named, no guess
    assert comfy_env.PoolConfig().kill_grace == 2.0
    assert len(_said(caplog, _MISSPELLED)) == 1
    (other,) = _said(caplog, "COMFY_ENV_" + "ZZZ")
    assert "did you mean" not in other


@pytest.mark.usefixtures("fresh_warnings")
def test_the_projects_own_variables_are_never_taken_for_misspellings(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Named here, not taken from OTHER_VARIABLES: a name dropped from that list must fail.
    ours = (
        "COMFY_ENV_HOST_ID",
        "COMFY_ENV_WORKER_ID",
        "COMFY_ENV_COMFYUI_CACHE",
        "COMFY_ENV_COMFYUI_SRC",
        "COMFY_ENV_DEV_CACHE",
        "COMFY_ENV_FAULT_SIDE",
        "COMFY_ENV_TEST_PACK_ENV_NUMPY",
    )
    for name in ours:
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("COMFY_ENV_SYS_PATH", os.pathsep)
    with comfy_env.Pool():
        pass
    comfy_env.PoolConfig()
    assert not [r for r in caplog.records if "not a comfy-env setting" in r.getMessage()]


def test_every_comfy_env_variable_the_project_uses_is_a_setting_or_listed() -> None:
    """A new COMFY_ENV_* variable read anywhere in the project (library, workers, dev.py, CI,
    examples, harnesses) must be a field or in OTHER_VARIABLES, or users setting it would be
    told it is a misspelling."""
    root = Path(__file__).resolve().parent.parent
    files = [root / "dev.py", root / ".ci" / "run", root / "README.md"]
    for folder in ("comfy_env", "workers", "tests", "tests_comfyui", "examples", "benchmarks"):
        # Not what lies in hidden folders: benchmarks/.peers holds the peers' installed venvs
        # (an older comfy-env among them), made by the benchmarks and ignored by git.
        files += [
            p
            for p in (root / folder).rglob("*")
            if p.suffix in (".py", ".sh", ".md")
            and not any(part.startswith(".") for part in p.relative_to(root).parts)
        ]
    # A name in quotes or backticks, or assigned (NAME=value): not a Python constant.
    names = re.compile(r"(?<![A-Za-z0-9_])(COMFY_ENV_[A-Z0-9_]*[A-Z0-9])(?=[\"'=`]|$)", re.M)
    found = {m for p in files if p.is_file() for m in names.findall(p.read_text())}
    settings = {"COMFY_ENV_" + name.upper() for name in comfy_env._settings.FIELDS}
    assert "COMFY_ENV_HOST_ID" in found and "COMFY_ENV_SYS_PATH" in found  # the scan works
    assert found - settings - comfy_env._settings.OTHER_VARIABLES == set()


def test_a_misspelled_variable_shows_in_the_command_line(tmp_path: Path) -> None:
    env = dict(os.environ, **{_MISSPELLED: "5"})
    done = subprocess.run(
        [sys.executable, "-m", "comfy_env", "call", "-", "builtins:int", "[7]"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "7"
    assert f"{_MISSPELLED} is set but is not a comfy-env setting" in done.stderr
    assert "did you mean COMFY_ENV_CALL_TIMEOUT?" in done.stderr


def test_a_bad_value_passed_in_code_names_the_field_and_value() -> None:
    with pytest.raises(comfy_env.ConfigError, match=r"PoolConfig\(call_timeout=-1\)") as info:
        comfy_env.PoolConfig(call_timeout=-1)
    assert (info.value.field, info.value.variable, info.value.value) == ("call_timeout", None, -1)


def test_unknown_config_field_is_refused() -> None:
    with pytest.raises(comfy_env.ConfigError, match="no_such_field"):
        comfy_env.PoolConfig(no_such_field=1)  # type: ignore[call-arg]


def _without_config_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("COMFY_ENV_"):
            monkeypatch.delenv(var)


def test_the_default_config_equals_the_fully_validated_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # PoolConfig() with nothing given and nothing in the environment skips pydantic's
    # validator (it is built lazily); the values must be exactly what validation gives.
    _without_config_variables(monkeypatch)
    fast = comfy_env.PoolConfig()
    validated = comfy_env.PoolConfig.model_validate({})
    assert fast == validated and fast.model_dump() == validated.model_dump()
    assert comfy_env.PoolConfig(**dict(fast)) == fast  # the defaults pass validation unchanged
    assert fast.model_fields_set == set()
    assert fast.env_vars is not comfy_env.PoolConfig().env_vars  # no default is shared
    with pytest.raises(ValidationError):
        fast.call_timeout = 3  # type: ignore[misc]


def test_the_default_config_still_reads_and_checks_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_config_variables(monkeypatch)
    monkeypatch.setenv("COMFY_ENV_SHM_PINNED_TTL", "7")
    assert comfy_env.PoolConfig().shm_pinned_ttl == 7.0
    monkeypatch.setenv("COMFY_ENV_SHM_PINNED_TTL", "-1")
    with pytest.raises(comfy_env.ConfigError, match="COMFY_ENV_SHM_PINNED_TTL"):
        comfy_env.PoolConfig()


def test_a_pool_takes_a_default_config_as_is_and_checks_any_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_config_variables(monkeypatch)
    default = comfy_env.PoolConfig()
    with comfy_env.Pool(default) as pool:
        assert pool.config is default
    # Equal to a default but of another type (model_copy skips validation): validated, so
    # refused (a boolean is no number of workers) rather than taken as the default 1.
    odd = default.model_copy(update={"max_workers_per_env": True})
    with pytest.raises(comfy_env.ConfigError, match=r"max_workers_per_env.*boolean"):
        comfy_env.Pool(odd)
    with comfy_env.Pool(default.model_copy(update={"max_workers_per_env": 1.0})) as pool:
        assert type(pool.config.max_workers_per_env) is int
    with pytest.raises(comfy_env.ConfigError, match="max_workers_per_env"):
        comfy_env.Pool(default.model_copy(update={"max_workers_per_env": 0}))


def test_the_pool_settings_defaults_are_the_config_defaults_field_by_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pool of defaults runs on Settings() without pydantic: every field must be what
    # PoolConfig's validation gives, value and type, in the model's field order.
    from comfy_env._settings import FIELDS, Settings

    _without_config_variables(monkeypatch)
    validated = comfy_env.PoolConfig.model_validate({})
    assert FIELDS == tuple(comfy_env.PoolConfig.model_fields)
    settings = Settings()
    for name in FIELDS:
        value = getattr(settings, name)
        assert value == getattr(validated, name), name
        assert type(value) is type(getattr(validated, name)), name
    assert Settings().env_vars is not settings.env_vars  # no default is shared
    with pytest.raises(AttributeError, match="read-only"):
        settings.call_timeout = 3.0
    given = comfy_env.PoolConfig(call_timeout=2.5, sys_path=("/x",))
    assert Settings.of(given).values() == dict(given)


def test_a_pool_of_defaults_builds_its_config_only_when_it_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_config_variables(monkeypatch)
    with comfy_env.Pool() as pool:
        assert pool._config is None  # runs on Settings; no model built yet
        # Set after the pool was made: the model shows what the pool runs on, not this.
        monkeypatch.setenv("COMFY_ENV_CALL_TIMEOUT", "7")
        config = pool.config
        assert pool.config is config
        assert type(config) is comfy_env.PoolConfig
        assert config == comfy_env.PoolConfig.model_validate({"call_timeout": None})
        assert config.model_fields_set == set()


def test_a_pool_without_a_config_still_reads_and_checks_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _without_config_variables(monkeypatch)
    monkeypatch.setenv("COMFY_ENV_CALL_TIMEOUT", "7")
    with comfy_env.Pool() as pool:
        assert pool.settings.call_timeout == 7.0
        assert pool.config.call_timeout == 7.0
    monkeypatch.setenv("COMFY_ENV_CALL_TIMEOUT", "-1")
    with pytest.raises(comfy_env.ConfigError, match="COMFY_ENV_CALL_TIMEOUT"):
        comfy_env.Pool()
    given = comfy_env.PoolConfig(call_timeout=3)
    with comfy_env.Pool(given) as pool:  # a config given wins over the environment
        assert pool.config == given and pool.settings.call_timeout == 3.0


def test_a_fresh_host_with_a_pool_of_defaults_does_not_import_pydantic() -> None:
    # The import-included first call: pydantic and building PoolConfig cost about 100 ms; a
    # pool that takes the defaults (Pool(), get_worker) must not pay them, and reading
    # pool.config must still give the validated model.
    code = (
        "import sys, comfy_env\n"
        "pool = comfy_env.Pool()\n"
        "w = comfy_env.get_worker(None)\n"
        "assert 'pydantic' not in sys.modules, 'loaded by Pool() or get_worker'\n"
        "assert pool.get_worker(None).call('comfy_env_worker.tasks:echo', 5) == 5\n"
        "assert 'pydantic' not in sys.modules, 'loaded by the first call'\n"
        "assert pool.config == comfy_env.PoolConfig.model_validate({})\n"
        "assert 'pydantic' in sys.modules\n"
        "pool.close(); comfy_env.shutdown()\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMFY_ENV_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_config_is_immutable() -> None:
    with pytest.raises(ValidationError):
        comfy_env.PoolConfig().call_timeout = 3  # type: ignore[misc]


def test_an_env_with_a_too_old_python_is_refused_at_once_and_not_retried(
    config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    # The launcher runs the real interpreter posing as Python 3.6 (sys.version_info), so the
    # boot line's own check refuses it, as a real 3.6 would be refused.
    _script(
        tmp_path / "env" / "bin" / "python",
        f'shift\nexec "{sys.executable}" -c '
        '\'import sys;sys.version_info=(3,6,15,"final",0);exec(sys.argv.pop(1))\' "$@"\n',
    )
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker(tmp_path / "env")
        with pytest.raises(WorkerStartError) as info:
            w.call("comfy_env_worker.tasks:echo", 1)
        message = str(info.value)
        assert "runs Python 3.6" in message and "need Python 3.8 or newer" in message
        assert "Traceback" not in message and info.value.unsupported
        spawns = w.stats().spawns
        for _ in range(3):  # said again at once, without starting the interpreter again
            with pytest.raises(WorkerStartError, match=r"runs Python 3\.6"):
                w.call("comfy_env_worker.tasks:echo", 1)
        assert w.stats().spawns == spawns == 1
        assert not w.stats().abandoned
