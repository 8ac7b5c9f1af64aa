"""The ``comfy-env`` command line: doctor, call, sweep and status, on real worker processes.

Commands run in-process through ``comfy_env._cli.main`` (output captured with ``capsys``), and
``status`` as a subprocess where a fresh process matters (another host's view, a stdout whose
reader is already gone). A reader that leaves early is a real pipe whose read end is closed.
Each command closes its own pool before returning; a status file published here is removed
before the test ends.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import comfy_env
from comfy_env._cli import main
from comfy_env._pool import snapshot_pool
from comfy_env._process import host_id
from comfy_env._status import PUBLISH_SETTLE_DELAY, StatusPublisher, read_status, status_dir
from comfy_env_worker.shm import shm_available

TESTS_DIR = Path(__file__).resolve().parent

DOCTOR_STEPS = (
    "config",
    "resolve env",
    "spawn + handshake + canary",
    "versions",
    "warm round trip",
    "numpy",
    "shared memory",
)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def remote_tasks_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the CLI's own pool (``PoolConfig()``) import tests/tasks/remote.py."""
    monkeypatch.setenv("COMFY_ENV_SYS_PATH", str(TESTS_DIR))


# ---- doctor ----------------------------------------------------------------------------------


def test_doctor_current_interpreter(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "doctor")
    assert code == 0, out + err
    for step in DOCTOR_STEPS:
        line = next(ln for ln in out.splitlines() if step in ln)
        assert line.split()[0] == "ok", line
        if step != "versions":
            assert " ms" in line, line
    if shm_available():
        assert "through shared memory" in out
    assert "healthy" in out.splitlines()[-1]
    assert sys.executable in out


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "doctor", "-", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["ok"] is True
    assert [s["name"] for s in doc["steps"]] == list(DOCTOR_STEPS)
    shm = doc["steps"][-1]["facts"]
    assert shm["equal"] is True and shm["via_shared_memory"] is shm_available()
    assert shm["kind"] == "numpy array" and shm["bytes"] >= 4 * 1024 * 1024
    versions = doc["steps"][3]["facts"]
    assert versions["worker_executable"] == sys.executable
    assert versions["protocol"] is not None


def test_doctor_foreign_venv(capsys: pytest.CaptureFixture[str], foreign_venv: Path) -> None:
    code, out, err = run_cli(capsys, "doctor", str(foreign_venv))
    assert code == 0, out + err
    assert str(foreign_venv / "bin" / "python") in out
    # The bare venv has no numpy: the probe falls back to bytes and still uses shared memory.
    assert "cannot import numpy" in out
    assert "bytes object round trip" in out


def test_doctor_shows_what_activation_sets_and_warns_of_a_failing_script(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    env = tmp_path / "condaenv"
    (env / "conda-meta").mkdir(parents=True)
    (env / "bin").mkdir()
    (env / "bin" / "python").symlink_to(sys.executable)
    scripts = env / "etc" / "conda" / "activate.d"
    scripts.mkdir(parents=True)
    (scripts / "gdal.sh").write_text('export GDAL_DATA="$CONDA_PREFIX/share/gdal"\n')
    (scripts / "zz_broken.sh").write_text("echo 'no such file' >&2\nexit 1\n")
    code, out, err = run_cli(capsys, "doctor", str(env), "--json")
    assert code == 0, out + err  # a warning, not a failure: the worker runs
    doc = json.loads(out)
    resolve = next(s for s in doc["steps"] if s["name"] == "resolve env")
    assert resolve["status"] == "WARN"
    activation = resolve["facts"]["activation"]
    assert activation["kind"] == "conda"
    assert activation["variables"]["GDAL_DATA"] == f"{env}/share/gdal"
    assert activation["path_prefix"] == [str(env / "bin")]
    assert len(activation["failures"]) == 1 and "zz_broken.sh" in activation["failures"][0]
    assert "no such file" in resolve["detail"]


def test_doctor_missing_env(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-env"
    code, out, err = run_cli(capsys, "doctor", str(missing))
    assert code == 1
    assert "FAIL  resolve env" in out
    assert "EnvError" in out and "tried:" in out and str(missing) in out
    assert "resolve env failed" in err

    empty = tmp_path / "empty-env"
    empty.mkdir()
    code, _, err = run_cli(capsys, "doctor", str(empty))
    # The summary line named the heading only ("...; tried:"): now its first path too.
    assert f"tried: {empty}/bin/python (and 6 more, above)" in err.splitlines()[-1], err
    code, out, _ = run_cli(capsys, "doctor", str(empty), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    error = doc["steps"][-1]["error"]
    assert error["type"] == "EnvError"
    assert str(empty / "bin" / "python") in error["tried"]
    assert str(empty / "bin" / "python3") in doc["steps"][-1]["detail"]


def test_doctor_broken_interpreter(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    env = tmp_path / "broken"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text('#!/bin/sh\necho "broken interpreter: libpython missing" >&2\nexit 3\n')
    python.chmod(0o755)
    code, out, err = run_cli(capsys, "doctor", str(env))
    assert code == 1
    assert "FAIL  spawn + handshake + canary" in out
    assert "WorkerStartError" in out and "exited with code 3" in out
    assert "broken interpreter: libpython missing" in out
    assert "spawn + handshake + canary failed" in err


def test_doctor_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(capsys, "doctor", "--timeout", "-1")[0] == 2
    assert run_cli(capsys, "doctor", "a", "b")[0] == 2


# ---- call ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("remote_tasks_path")
def test_call_positional(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "call", "-", "tasks.remote:add", "[2, 3]")
    assert code == 0, err
    assert out.strip() == "5"


@pytest.mark.usefixtures("remote_tasks_path")
def test_call_kwargs_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "call", sys.executable, "tasks.remote:add", '{"a": 2, "b": 40}', "--json"
    )
    assert code == 0, err
    doc = json.loads(out)
    assert doc["ok"] is True and doc["result"] == 42 and doc["result_is_repr"] is False
    assert doc["generation"] == 1 and isinstance(doc["pid"], int)
    # No arguments at all, and a result JSON cannot hold: its repr, flagged.
    code, out, _ = run_cli(capsys, "call", "-", "builtins:object", "--json", "--timeout", "30")
    assert code == 0
    doc = json.loads(out)
    assert doc["result_is_repr"] is True and doc["result"].startswith("<object object")


def test_call_missing_function(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "call", "-", "comfy_env_worker.tasks:no_such_fn", "[]")
    assert code == 1
    assert out == ""
    assert "comfy-env: AttributeError:" in err and "no_such_fn" in err
    code, out, _ = run_cli(capsys, "call", "-", "comfy_env_worker.tasks:no_such_fn", "--json")
    assert code == 1
    assert json.loads(out)["error"]["type"] == "AttributeError"


def test_call_worker_errors(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(
        capsys, "call", "-", "comfy_env_worker.tasks:sleep", "[10]", "--timeout", "0.3"
    )
    assert code == 1
    assert "comfy-env: CallTimeout:" in err
    code, out, err = run_cli(capsys, "call", "-", "comfy_env_worker.tasks:crash", "--json")
    assert code == 1
    error = json.loads(out)["error"]
    assert error["type"] == "WorkerCrashed" and error["signal"] == "SIGSEGV"
    assert "Segmentation fault" in err  # the worker's own output, forwarded live


@pytest.mark.parametrize(
    ("target", "args", "needle"),
    [
        ("builtins:int", "[1,", "not valid JSON"),
        ("builtins:int", "3", "must be a JSON array"),
        ("builtins", "[1]", "TARGET must be"),
        ("builtins:int:x", "[1]", "TARGET must be"),
    ],
)
def test_call_bad_usage(
    capsys: pytest.CaptureFixture[str], target: str, args: str, needle: str
) -> None:
    code, out, err = run_cli(capsys, "call", "-", target, args)
    assert code == 2
    assert out == ""
    assert needle in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("call", "-", "builtins:int", "[1,", "--json"), "not valid JSON"),
        (("call", "-", "builtins", "--json"), "TARGET must be"),
        (("call", "--json"), "the following arguments are required: ENV, TARGET"),
        (("status", "--bogus", "--json"), "unrecognized arguments: --bogus"),
        (("doctor", "-", "--timeout", "-1", "--json"), "--timeout"),
    ],
)
def test_bad_usage_under_json_is_a_json_document_on_stdout_too(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], needle: str
) -> None:
    """A script parsing ``--json`` output got empty input for a usage error (exit 2): the
    error was only argparse's text on stderr."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    document = json.loads(out)
    assert document["ok"] is False and document["error"]["type"] == "UsageError"
    assert needle in document["error"]["message"] and needle in err


_DEEP = "[" * 5000 + "]" * 5000  # 10 KB of JSON, 5000 levels: past the JSON reader's depth


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("call", "-", "builtins:len", _DEEP), "nested too deeply"),
        (("call", "-", "builtins:len", _DEEP, "--json"), "nested too deeply"),
        (("call", "-", "builtins:len", "[[]]", "--timeout", "inf"), "--timeout"),
        (("call", "-", "builtins:len", "[[]]", "--timeout", "1e300"), "--timeout"),
        (("call", "-", "builtins:len", "[[]]", "--timeout", "1e300", "--json"), "--timeout"),
        (("doctor", "-", "--timeout", "1e300"), "--timeout"),
    ],
)
def test_arguments_past_what_can_be_read_or_waited_for_are_bad_usage(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], needle: str
) -> None:
    """Deeply nested JSON_ARGS was a RecursionError traceback with an empty stdout, and a
    --timeout of 1e300 a failed call (exit 1) where inf was bad usage (exit 2)."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    assert needle in err and "Traceback" not in err
    if "--json" in argv:
        document = json.loads(out)
        assert document["ok"] is False and document["error"]["type"] == "UsageError"
        assert needle in document["error"]["message"]
    else:
        assert out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ("status",),
        ("status", "--json"),
        ("sweep", "--dry-run"),
        ("call", "-", "builtins:len", "[[]]"),
    ],
)
def test_a_command_started_with_stdout_closed_prints_no_traceback(argv: tuple[str, ...]) -> None:
    """``comfy-env status >&-``: Python's sys.stdout is None; the final flush raised an
    AttributeError traceback."""
    result = subprocess.run(
        ["sh", "-c", 'exec "$0" -m comfy_env "$@" >&-', sys.executable, *argv],
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1  # the output went nowhere: as for a reader that left early


def test_a_subcommand_s_help_says_only_what_applies_to_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every subcommand's help ended with "ENV is an env directory ...", also those that
    take no ENV (status, sweep)."""
    for command, takes_env in (("status", False), ("sweep", False), ("call", True)):
        code, out, _ = run_cli(capsys, command, "--help")
        assert code == 0
        assert ("ENV is an env directory" in out) == takes_env, (command, out)


def test_call_with_a_bad_setting_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `call` builds Pool() (no pydantic unless a variable is set): a bad COMFY_ENV_* value
    # is still checked, and still a usage error naming the variable.
    monkeypatch.setenv("COMFY_ENV_CALL_TIMEOUT", "-1")
    code, out, err = run_cli(capsys, "call", "-", "builtins:int", "[1]")
    assert code == 2
    assert out == ""
    assert "invalid COMFY_ENV_* setting" in err and "COMFY_ENV_CALL_TIMEOUT" in err


@pytest.mark.parametrize(
    "argv",
    [("doctor",), ("doctor", "-", "--json"), ("demo", "--env", "/nonexistent/comfy-env-env")],
    ids=["doctor", "doctor-json", "demo"],
)
def test_every_command_that_reads_the_settings_exits_2_on_a_bad_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...]
) -> None:
    # The help text promises 2 for an invalid COMFY_ENV_* setting; doctor and demo gave 1.
    monkeypatch.setenv("COMFY_ENV_KILL_GRACE", "x")
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, out + err
    assert "COMFY_ENV_KILL_GRACE" in err and "valid number" in err


def test_doctor_s_last_line_says_why_the_config_failed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COMFY_ENV_KILL_GRACE", "x")
    _, out, err = run_cli(capsys, "doctor")
    assert "FAIL  config" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("comfy-env: doctor: config failed: ConfigError: "), last
    assert "COMFY_ENV_KILL_GRACE='x' is not a valid PoolConfig.kill_grace" in last, last


def test_doctor_warns_about_a_misspelled_setting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    misspelled = "COMFY_ENV_" + "KILL_GRCE"  # in parts: not a name the project reads
    monkeypatch.setenv(misspelled, "2")
    code, out, err = run_cli(capsys, "doctor", "-", "--json")
    assert code == 0, out + err
    config = json.loads(out)["steps"][0]
    assert config["status"] == "WARN" and config["facts"]["unknown"] == [misspelled]
    assert misspelled not in config["facts"]["overrides"]
    assert f"{misspelled} is not a comfy-env setting" in config["detail"]
    assert "did you mean COMFY_ENV_KILL_GRACE?" in config["detail"]


# ---- sweep -----------------------------------------------------------------------------------


def test_sweep_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "sweep", "--json")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == {
        "blocks",
        "runtime_dirs",
        "processes",
        "status_files",
        "private_roots",
        "dry_run",
    }
    assert doc["dry_run"] is False  # said either way, not only with --dry-run
    assert all(isinstance(doc[k], list) for k in doc if k != "dry_run")
    code, out, _ = run_cli(capsys, "sweep")
    assert code == 0 and out.strip()


# ---- status ----------------------------------------------------------------------------------


@pytest.fixture
def published(pool: comfy_env.Pool) -> Iterator[tuple[comfy_env.Worker, StatusPublisher]]:
    worker = pool.get_worker(None)
    worker.call("comfy_env_worker.tasks:echo", 1)
    publisher = StatusPublisher(lambda: [snapshot_pool(pool)])
    try:
        yield worker, publisher
    finally:
        publisher.remove()
        assert not os.path.exists(publisher.path)


def _our_host(doc: dict[str, Any]) -> dict[str, Any]:
    return next(h for h in doc["hosts"] if h["pid"] == os.getpid())


def test_status_lists_published_host(
    capsys: pytest.CaptureFixture[str],
    published: tuple[comfy_env.Worker, StatusPublisher],
) -> None:
    worker, publisher = published
    path = publisher.publish()
    assert path is not None and path == publisher.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(status_dir()).st_mode) == 0o700
    assert not os.path.basename(status_dir()).startswith("host-")

    code, out, _ = run_cli(capsys, "status", "--json")
    assert code == 0
    host = _our_host(json.loads(out))
    assert host["other_pid_namespace"] is False and host["note"] is None  # our namespace
    (env,) = [e for e in host["envs"] if e["env"] == worker.env]
    assert env["interpreter"] == worker.interpreter
    assert env["submitted"] == env["ok"] == 1 and env["spawns"] == 1
    (slot,) = env["workers"]
    assert slot["pid"] == worker.pid and slot["generation"] == 1 and slot["state"] == "idle"
    assert slot["rss_bytes"] > 1024 * 1024
    assert 0 <= slot["idle_seconds"] < 60

    code, out, _ = run_cli(capsys, "status")
    assert code == 0
    assert f"host pid {os.getpid()}" in out
    assert f"env {worker.env}" in out
    assert f"pid {worker.pid}, generation 1, idle, rss" in out

    # A fresh process finds the same host in the file.
    result = subprocess.run(
        [sys.executable, "-m", "comfy_env", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    host = _our_host(json.loads(result.stdout))
    assert [w["pid"] for e in host["envs"] for w in e["workers"]] == [worker.pid]


def test_status_follows_changes(published: tuple[comfy_env.Worker, StatusPublisher]) -> None:
    worker, publisher = published
    publisher.publish()
    worker.call("comfy_env_worker.tasks:echo", 2)
    with pytest.raises(comfy_env.WorkerCrashed):
        worker.call("comfy_env_worker.tasks:crash")
    publisher.publish()
    (host,) = [h for h in read_status() if h.pid == os.getpid()]
    (env,) = host.envs
    assert (env.submitted, env.ok, env.crashed) == (3, 2, 1)
    (slot,) = env.workers
    assert slot.state == "retired" and slot.retire_reason == "crashed" and slot.rss_bytes is None
    # After remove(), publish() writes nothing.
    publisher.remove()
    assert publisher.publish() is None
    assert not os.path.exists(publisher.path)


def test_status_publish_soon_is_throttled(
    published: tuple[comfy_env.Worker, StatusPublisher],
) -> None:
    _, publisher = published
    scheduled: list[tuple[float, Any]] = []
    publisher.publish_soon(lambda delay, fn: scheduled.append((delay, fn)))
    publisher.publish_soon(lambda delay, fn: scheduled.append((delay, fn)))
    # Pending: asked once; a moment later, never at once (the changing caller is still busy).
    assert len(scheduled) == 1 and scheduled[0][0] == PUBLISH_SETTLE_DELAY
    scheduled[0][1]()
    assert os.path.exists(publisher.path)
    publisher.publish_soon(lambda delay, fn: scheduled.append((delay, fn)))
    assert len(scheduled) == 2 and 0 < scheduled[1][0] <= publisher.min_interval


def _dead_pid() -> int:
    pid = 4_000_000
    while psutil.pid_exists(pid):
        pid -= 1
    return pid


def test_status_removes_stale_file_of_dead_host(capsys: pytest.CaptureFixture[str]) -> None:
    directory = status_dir()
    pid = _dead_pid()
    start_ms = int(time.time() * 1000) - 60_000
    ns = os.stat("/proc/self/ns/pid").st_ino
    ticks = int(host_id().split("-")[1][1:])
    stale = os.path.join(directory, f"{pid}-t{ticks}-n{ns}.json")
    stale_tmp = os.path.join(directory, f".{pid}-t{ticks}-n{ns}.json.tmp")
    # Our own pid with another start time: a host that died and whose pid was reused.
    reused = os.path.join(directory, f"{os.getpid()}-t{ticks - 1}-n{ns}.json")
    document = {
        "host_id": f"{pid}-t{ticks}-n{ns}",
        "pid": pid,
        "start_ms": start_ms,
        "updated_at": start_ms / 1000,
        "pools": [{"pool": "x", "envs": [{"env": "/ghost", "workers": []}]}],
    }
    try:
        for path in (stale, stale_tmp, reused):
            with open(path, "w") as f:
                json.dump(document, f)
        code, out, _ = run_cli(capsys, "status", "--json")
        assert code == 0
        doc = json.loads(out)
        assert all(h["pid"] != pid for h in doc["hosts"])
        assert all(e["env"] != "/ghost" for h in doc["hosts"] for e in h["envs"])
        for path in (stale, stale_tmp, reused):
            assert not os.path.exists(path), path
    finally:
        for path in (stale, stale_tmp, reused):
            if os.path.exists(path):
                os.unlink(path)


def test_status_loads_neither_logging_nor_typing_nor_threads(tmp_path: Path) -> None:
    # `comfy-env status` is the command run most, often in a loop: it starts an interpreter,
    # and logging, typing, threading and json were half of its time over a bare one. With a
    # dead host's stale status file, so that the clean-up runs too.
    root = tmp_path / "runtime"
    root.mkdir(mode=0o700)
    status = root / "comfy-env" / "status"
    status.mkdir(parents=True, mode=0o700)
    pid = _dead_pid()
    ticks = int(host_id().split("-")[1][1:])
    ns = os.stat("/proc/self/ns/pid").st_ino
    stale = status / f"{pid}-t{ticks}-n{ns}.json"
    stale.write_text(json.dumps({"host_id": stale.stem, "pid": pid, "pools": []}))
    heavy = {"logging", "typing", "threading", "json", "pydantic", "psutil"}
    out, loaded = _modules_loaded_by(["status"], root, heavy)
    assert loaded == [], out
    assert "no live comfy-env hosts" in out
    assert not stale.exists()


def _modules_loaded_by(argv: list[str], root: Path, heavy: set[str]) -> tuple[str, list[str]]:
    """What ``comfy-env <argv>`` printed in a fresh interpreter whose runtime root is
    ``root``, and which of the modules ``heavy`` it imported (sorted)."""
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "from comfy_env._cli import main\n"
        f"assert main({argv!r}) == 0\n"
        f"print(sorted(set({sorted(heavy)!r}) & set(sys.modules) - before))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMFY_ENV_")}
    env["XDG_RUNTIME_DIR"] = str(root)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    *said, loaded = out.stdout.splitlines()
    return "\n".join(said), ast.literal_eval(loaded)


def test_sweep_loads_neither_the_process_machinery_nor_logging(tmp_path: Path) -> None:
    # `comfy-env sweep` needs the leftovers' names and the identity checks, not the code
    # that launches workers (sockets, subprocess, the lifecycle) nor logging: those were a
    # third of its start. A dry run, so that nothing of this machine's is removed; what is
    # imported does not depend on it.
    root = tmp_path / "runtime"
    root.mkdir(mode=0o700)
    heavy = {"logging", "typing", "threading", "json", "socket", "subprocess"}
    heavy |= {"comfy_env._process", "comfy_env._lifecycle", "pydantic", "psutil"}
    out, loaded = _modules_loaded_by(["sweep", "--dry-run"], root, heavy)
    assert loaded == [], out
    assert "nothing to remove" in out or "would remove" in out, out


def test_status_marks_a_host_of_another_pid_namespace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A host in a container sharing our runtime directory: pid 1 there, its worker pid 4.
    Neither number is a process here, and its death cannot be proven: status must say so."""
    ours = os.stat("/proc/self/ns/pid").st_ino
    token = f"1-t123-n{ours + 1}"  # a namespace that is not ours
    path = os.path.join(status_dir(), f"{token}.json")
    updated = time.time() - 3600
    document = {
        "host_id": token,
        "pid": 1,
        "start_ms": int(updated * 1000),
        "updated_at": updated,
        "argv": ["comfyui.py"],
        "pools": [
            {
                "pool": "p",
                "envs": [
                    {
                        "env": "/in/the/container/.venv",
                        "workers": [{"slot": 0, "pid": 4, "generation": 1, "state": "idle"}],
                    }
                ],
            }
        ],
    }
    with open(path, "w") as f:
        json.dump(document, f)
    try:
        code, out, _ = run_cli(capsys, "status", "--json")
        assert code == 0
        (host,) = [h for h in json.loads(out)["hosts"] if h["host_id"] == token]
        assert host["other_pid_namespace"] is True
        assert "another pid namespace" in host["note"]
        assert "cannot be told" in host["note"]
        assert host["envs"][0]["workers"][0]["rss_bytes"] is None  # pid 4 is not measured here
        code, out, _ = run_cli(capsys, "status")
        assert code == 0
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("host pid 1 "))
        assert "another pid namespace" in lines[at + 1] and "cannot be told" in lines[at + 1]
        assert os.path.exists(path)  # never proven dead: left alone
    finally:
        os.unlink(path)


def test_status_sees_a_second_host_process(capsys: pytest.CaptureFixture[str]) -> None:
    """A pool publishes its state by itself: another host's workers show up in status."""
    code = (
        "import time, comfy_env\n"
        "w = comfy_env.get_worker()\n"
        "w.call('comfy_env_worker.tasks:echo', 1)\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    host = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert host.stdout is not None
        worker_pid = int(host.stdout.readline())
        deadline = time.monotonic() + 10
        seen: list[int] = []
        while time.monotonic() < deadline:
            code_, out, _ = run_cli(capsys, "status", "--json")
            assert code_ == 0
            hosts = [h for h in json.loads(out)["hosts"] if h["pid"] == host.pid]
            seen = [w["pid"] for h in hosts for e in h["envs"] for w in e["workers"]]
            if worker_pid in seen:
                break
            time.sleep(0.1)
        assert worker_pid in seen
    finally:
        host.kill()
        host.communicate(timeout=30)
        comfy_env.sweep()
        main(["sweep"])  # also removes the killed host's status file
        capsys.readouterr()


def test_status_is_current_within_a_second_of_the_last_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A host that made a few quick calls and then idles must not show them in flight for
    ever: changes inside the publish throttle window are written when it ends."""
    code = (
        "import time, comfy_env\n"
        "w = comfy_env.get_worker()\n"
        "for i in range(5):\n"
        "    w.call('comfy_env_worker.tasks:echo', i)\n"
        "print(w.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    host = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert host.stdout is not None
        int(host.stdout.readline())  # the host made its calls and now idles
        time.sleep(1.5)  # the throttle window (0.5 s) plus slack; no waiting loop on purpose
        code_, out, _ = run_cli(capsys, "status", "--json")
        assert code_ == 0
        (h,) = [h for h in json.loads(out)["hosts"] if h["pid"] == host.pid]
        (env,) = h["envs"]
        assert (env["submitted"], env["ok"], env["in_flight"]) == (5, 5, 0)
    finally:
        host.kill()
        host.communicate(timeout=30)
        comfy_env.sweep()
        main(["sweep"])
        capsys.readouterr()


def test_changes_racing_to_open_the_status_window_open_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads whose changes both find the status throttle's window closed open it once:
    one write and one window's end queued, the other change marked for that end (the
    decisions are made under the throttle's lock)."""
    import threading

    from comfy_env import _status

    queued: list[object] = []  # what the throttle gave the reactor's call_later
    writes: list[object] = []

    class Publisher:
        def publish_soon(self, call_later: object) -> None:
            writes.append(call_later)

    monkeypatch.setattr(_status, "host_publisher", lambda snapshots: Publisher())
    first_asks = threading.Event()
    second_done = threading.Event()

    def call_later(delay: float, fn: object) -> None:
        queued.append(fn)

    def timer() -> object:
        # The first thread stops here, its test of the window done, until the second thread's
        # change went through.
        if threading.current_thread().name == "first":
            first_asks.set()
            assert second_done.wait(10)
        return call_later

    throttle = _status.StatusThrottle(lambda: [], timer)
    first = threading.Thread(target=throttle.changed, name="first")
    first.start()
    assert first_asks.wait(10)
    throttle.changed()
    second_done.set()
    first.join(10)
    assert not first.is_alive()
    assert len(writes) == 1 and len(queued) == 1  # one write, one window
    (window_end,) = queued
    window_end()  # type: ignore[operator]
    assert len(writes) == 2  # the marked change, written at the window's end
    assert len(queued) == 2  # ... in a window of its own
    queued[1]()  # type: ignore[operator]
    assert len(writes) == 2 and len(queued) == 2  # nothing changed since: the window closes
    throttle.changed()
    assert len(writes) == 3 and len(queued) == 3  # the next change opens it again


def test_call_error_text_names_the_type_once(capsys: pytest.CaptureFixture[str]) -> None:
    # SystemExit comes back as RemoteError, whose own text starts with the type name.
    code, _, err = run_cli(capsys, "call", "-", "sys:exit", '["bad mesh"]')
    assert code == 1
    assert "comfy-env: SystemExit: bad mesh" in err
    assert "SystemExit: SystemExit" not in err
    code, out, _ = run_cli(capsys, "call", "-", "sys:exit", '["bad mesh"]', "--json")
    error = json.loads(out)["error"]
    assert (error["type"], error["message"]) == ("SystemExit", "bad mesh")


def test_doctor_says_an_env_python_is_too_old(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    interp = tmp_path / "old" / "bin" / "python"
    interp.parent.mkdir(parents=True)
    interp.write_text(
        "#!/bin/sh\nshift\n"
        f'exec "{sys.executable}" -c '
        '\'import sys;sys.version_info=(3,6,15,"final",0);exec(sys.argv.pop(1))\' "$@"\n'
    )
    interp.chmod(0o755)
    code, out, err = run_cli(capsys, "doctor", str(tmp_path / "old"))
    assert code == 1
    assert "runs Python 3.6" in out + err and "need Python 3.8 or newer" in out + err


def test_sweep_dry_run_reports_and_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from comfy_env._process import runtime_root

    pid = _dead_pid()
    ns = os.stat("/proc/self/ns/pid").st_ino
    ticks = int(host_id().split("-")[1][1:])
    dead = f"{pid}-t{ticks}-n{ns}"  # a host id whose process is gone
    leftover_dir = os.path.join(runtime_root(), f"host-{dead}-dryrun")
    leftover_status = os.path.join(status_dir(), f"{dead}.json")
    os.makedirs(leftover_dir)
    with open(leftover_status, "w") as f:
        json.dump({"host_id": dead, "pid": pid}, f)
    try:
        code, out, _ = run_cli(capsys, "sweep", "--dry-run", "--json")
        assert code == 0
        doc = json.loads(out)
        assert doc["dry_run"] is True
        assert os.path.basename(leftover_dir) in doc["runtime_dirs"]
        assert os.path.basename(leftover_status) in doc["status_files"]
        assert os.path.isdir(leftover_dir) and os.path.exists(leftover_status)  # untouched
        code, out, _ = run_cli(capsys, "sweep", "--dry-run")
        assert code == 0 and "would remove" in out and os.path.basename(leftover_dir) in out
        assert os.path.isdir(leftover_dir)
        code, out, _ = run_cli(capsys, "sweep", "--json")
        assert os.path.basename(leftover_dir) in json.loads(out)["runtime_dirs"]
        assert not os.path.exists(leftover_dir) and not os.path.exists(leftover_status)
    finally:
        shutil.rmtree(leftover_dir, ignore_errors=True)
        if os.path.exists(leftover_status):
            os.unlink(leftover_status)


# ---- a reader that leaves early (`| head`) ---------------------------------------------------


class _HeadPipe(io.TextIOWrapper):
    """Text into a real pipe whose reader, like ``head -n LINES``, leaves after LINES lines:
    the read end is closed once they are written, so the next write meets a closed pipe."""

    def __init__(self, lines: int) -> None:
        self._read_fd, write_fd = os.pipe()
        super().__init__(open(write_fd, "wb", buffering=0), line_buffering=True)
        self._lines_left = lines

    def write(self, text: str) -> int:
        written = super().write(text)
        self._lines_left -= text.count("\n")
        if self._lines_left <= 0 and self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1
        return written

    def close(self) -> None:
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1
        with contextlib.suppress(BrokenPipeError):  # still buffered: goes nowhere
            super().close()


def test_demo_piped_into_head_exits_quietly_and_leaves_no_worker(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Five lines: the fifth is the first call's, so a worker is running when the reader leaves;
    # the leak guard proves the demo's pool still closed it.
    head = _HeadPipe(5)
    monkeypatch.setattr(sys, "stdout", head)
    try:
        code = main(["demo"])
    finally:
        monkeypatch.undo()
        head.close()
    assert code == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("buffered", [True, False], ids=["block-buffered", "unbuffered"])
def test_a_closed_stdout_ends_the_command_with_1_and_no_traceback(buffered: bool) -> None:
    # Block-buffered (a pipe's default), the output meets the closed pipe at the final flush;
    # unbuffered, at the first print.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_fd, write_fd = os.pipe()
    os.close(read_fd)  # the reader is gone before the command writes anything
    try:
        result = subprocess.run(
            [sys.executable, "-m", "comfy_env", "status"],
            stdout=write_fd,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            timeout=60,
        )
    finally:
        os.close(write_fd)
    assert (result.returncode, result.stderr) == (1, "")
