"""When a host dies, its watcher cleans up at once, without a sweep: a setsid descendant is
stopped the moment its host dies (and swept when the watcher died too), a host killed by its
first call leaves nothing, a dead host's blocks, runtime dir and status file go at once (never
a look-alike's), and a host that execs keeps its leftovers until its death is proven. A closed
pool leaves no watcher, and the watcher starts without the package's ``__init__`` or heavy
imports.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import (
    TESTS_DIR,
    alive,
    run_host,
    wait_until,
)
from conftest import gone as _gone
from conftest import kill_quietly as _kill_quietly
from conftest import reap_host as _reap_host

import comfy_env

_DEAD_HOST_SCRIPT = """
import sys, time, comfy_env
pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(sys.argv[1],)))
w = pool.get_worker()
descendant = w.call("tasks.hostile:spawn_setsid_sleeper", False)
while pool._spawner.watcher is None:  # started on the reactor once the first worker is ready
    time.sleep(0.01)
print(descendant, w.pid, pool._spawner.watcher.pid, flush=True)
time.sleep(60)
"""


def _host_with_a_setsid_descendant() -> tuple[subprocess.Popen[str], int, int, int]:
    host = run_host(_DEAD_HOST_SCRIPT, str(TESTS_DIR))
    assert host.stdout is not None
    line = host.stdout.readline()
    assert line, host.communicate(timeout=30)
    descendant, worker_pid, watcher_pid = (int(x) for x in line.split())
    return host, descendant, worker_pid, watcher_pid


def test_a_setsid_descendant_is_stopped_the_moment_its_host_dies() -> None:
    host, descendant, worker_pid, watcher_pid = _host_with_a_setsid_descendant()
    try:
        assert alive(descendant) and alive(watcher_pid)
        host.kill()  # SIGKILL: the host runs no code at all
        host.communicate(timeout=30)
        assert wait_until(lambda: _gone(worker_pid), 10)
        # No sweep runs: the host's watcher saw its pipe close and stopped the descendant.
        assert wait_until(lambda: _gone(descendant), 10), "a setsid descendant outlived its host"
        assert wait_until(lambda: _gone(watcher_pid), 10), "the watcher outlived its job"
    finally:
        _reap_host(host)
        _kill_quietly(descendant)
        _kill_quietly(watcher_pid)


def test_a_setsid_descendant_of_a_host_killed_with_its_watcher_is_swept() -> None:
    host, descendant, worker_pid, watcher_pid = _host_with_a_setsid_descendant()
    try:
        os.kill(watcher_pid, 9)  # the backstop case: the watcher dies first, then the host
        assert wait_until(lambda: _gone(watcher_pid), 10)
        host.kill()
        host.communicate(timeout=30)
        assert wait_until(lambda: _gone(worker_pid), 10)
        assert alive(descendant)  # nothing of the dead host was left to stop it
        report = comfy_env.sweep()
        assert descendant in report.processes
        assert wait_until(lambda: _gone(descendant), 10)
    finally:
        _reap_host(host)
        _kill_quietly(descendant)


def test_a_closed_pool_leaves_no_watcher(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config) as pool:
        pool.get_worker().call("comfy_env_worker.tasks:echo", 1)
        assert wait_until(lambda: pool._spawner.watcher is not None)
        watcher = pool._spawner.watcher
        assert watcher is not None and alive(watcher.pid)
    assert watcher.popen.returncode == 0  # told to quit, not killed
    assert _gone(watcher.pid)


def test_the_watcher_starts_without_the_package_init_or_heavy_imports() -> None:
    # Every pool starts a watcher that sleeps in a read until its host ends: its start should
    # be little more than an interpreter's. Run its real body (told to quit at once) and look
    # at what it imported: not the package's __init__ (the public API, typing, pydantic's
    # config), nor logging, typing or signal, which it needs only once its host died.
    from comfy_env import _watcher

    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(_watcher.__file__)))
    done = subprocess.run(
        [
            *(sys.executable, "-I", "-S", "-X", "importtime", "-c", _watcher._BODY),
            *(package_parent, "COMFY_ENV_TEST_MARK", "nobody"),  # its argv
        ],
        input=b"q",
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.decode().splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "comfy_env._descendants" in imported  # (the body ran, importing what it needs)
    heavy = {"comfy_env", "comfy_env._config", "typing", "logging", "signal", "enum", "re"}
    assert not imported & heavy, sorted(imported & heavy)


# A host that made shared-memory blocks on both sides (host ``-h``, worker ``-w``), a runtime
# dir and a status file, and whose watcher runs; then it waits, or execs (argv[2] == "exec").
_LEAVING_HOST_SCRIPT = """
import os, sys, time, comfy_env
from comfy_env._identity import host_id
from comfy_env._rundir import runtime_root
pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(sys.argv[1],)))
w = pool.get_worker()
big = bytes(4 << 20)
assert w.call("tasks.fault:identity", big) == big  # blocks on both sides now exist
status = os.path.join(runtime_root(), "status", host_id() + ".json")
while pool._spawner.watcher is None or not os.path.exists(status):
    time.sleep(0.01)
print(host_id(), w.pid, pool._spawner.watcher.pid, flush=True)
if sys.argv[2] == "exec":  # the watcher's write end is close-on-exec: its pipe closes now
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)"])
time.sleep(60)
"""


def _host_with_leftovers(then: str) -> tuple[subprocess.Popen[str], str, int, int]:
    host = run_host(_LEAVING_HOST_SCRIPT, str(TESTS_DIR), then)
    assert host.stdout is not None
    line = host.stdout.readline()
    assert line, host.communicate(timeout=30)
    token, worker_pid, watcher_pid = line.split()
    return host, token, int(worker_pid), int(watcher_pid)


def _leftovers_of_host(token: str) -> dict[str, list[str]]:
    """What the host ``token`` made, by kind (look-alikes, named ``...-foreign``/``-link``,
    left out)."""
    from comfy_env._rundir import runtime_root

    root = runtime_root()
    blocks = [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{token}-")]
    dirs = [d for d in os.listdir(root) if d.startswith(f"host-{token}-")]
    status = os.path.join(root, "status", f"{token}.json")
    return {
        "host blocks": [n for n in blocks if n.startswith(f"ce-{token}-h") and "foreign" not in n],
        "worker blocks": [n for n in blocks if n.startswith(f"ce-{token}-w")],
        "runtime dirs": [d for d in dirs if not d.endswith("-link")],
        "status file": [status] if os.path.lexists(status) else [],
    }


_QUICK_DEATH_HOST = """
import os, signal, sys, comfy_env
from comfy_env._identity import host_id
pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(sys.argv[1],)))
print(host_id(), flush=True)
# The first call, a moment after its worker is ready (its runtime dir made), kills this host.
pool.get_worker().call("os:kill", os.getpid(), signal.SIGKILL)
"""


def test_a_host_killed_by_its_first_call_leaves_nothing_without_a_sweep(tmp_path: Path) -> None:
    # The watcher came 50 ms after the first worker was ready: a host killed before then left
    # its runtime dir and status file until some later pool's sweep. Now the watcher exists
    # before any of them, and removes them at once. (A runtime root of its own: any other
    # pool starting on this machine meanwhile would sweep the shared one.)
    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR), XDG_RUNTIME_DIR=str(base))
    host = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_QUICK_DEATH_HOST), str(TESTS_DIR)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    root = base / "comfy-env"
    try:
        assert host.stdout is not None
        token = host.stdout.readline().strip()
        assert token, host.communicate(timeout=30)
        host.wait(30)
        assert host.returncode == -signal.SIGKILL

        def left() -> list[str]:
            made = [n for n in os.listdir(root) if n.startswith(f"host-{token}-")]
            status = root / "status"
            if status.is_dir():
                made += [n for n in os.listdir(status) if n.startswith(token)]
            return made

        assert wait_until(lambda: not left(), 10), left()
    finally:
        if host.poll() is None:
            host.kill()
        host.communicate(timeout=30)
        comfy_env.sweep()  # (its blocks, where the old code left them: not for the leak guard)
        shutil.rmtree(base, ignore_errors=True)


def _plant_look_alikes(token: str, tmp_path: Path) -> list[str]:
    """Things the dying host's watcher must leave alone: a live host's block (this process's),
    another dead host's runtime dir and status file (a sweep's business, not the watcher's),
    and where we are root a block of another uid named like the dying host's and a symlink
    named like its runtime dir."""
    from comfy_env._identity import host_id, pid_namespace
    from comfy_env._rundir import runtime_root

    root = runtime_root()
    other_dead = f"{os.getpid()}-t1-n{pid_namespace()}"  # our pid, another start: dead
    made = [
        f"/dev/shm/ce-{host_id()}-h0-lookalike",
        os.path.join(root, f"host-{other_dead}-lookalike"),
        os.path.join(root, "status", f"{other_dead}.json"),
    ]
    Path(made[0]).write_bytes(b"")
    os.mkdir(made[1], 0o700)
    Path(made[2]).write_text("{}")
    if os.geteuid() == 0:
        foreign = f"/dev/shm/ce-{token}-h0-foreign"
        Path(foreign).write_bytes(b"")
        os.chown(foreign, 65534, 65534)
        link = os.path.join(root, f"host-{token}-link")
        os.symlink(tmp_path, link)
        made += [foreign, link]
    return made


def _remove_look_alikes(paths: list[str]) -> None:
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_dead_hosts_blocks_runtime_dir_and_status_file_go_at_once_without_a_sweep(
    how: str, tmp_path: Path
) -> None:
    host, token, worker_pid, watcher_pid = _host_with_leftovers("wait")
    look_alikes = _plant_look_alikes(token, tmp_path)
    try:
        before = _leftovers_of_host(token)
        assert all(before.values()), before
        host.send_signal(getattr(signal, how))  # no handler: no atexit, no close()
        host.communicate(timeout=30)
        # No pool starts in this process (so no sweep runs): the host's watcher alone saw the
        # death and removed what the host left.
        assert wait_until(lambda: not any(_leftovers_of_host(token).values()), 5), (
            _leftovers_of_host(token)
        )
        assert wait_until(lambda: _gone(watcher_pid), 10), "the watcher outlived its job"
        assert _gone(worker_pid)
        survivors = [p for p in look_alikes if os.path.lexists(p)]
        assert survivors == look_alikes, "the watcher removed another host's things"
        assert os.path.isdir(tmp_path)  # a symlink is removed at most, never followed
    finally:
        _reap_host(host)
        _kill_quietly(watcher_pid)
        _remove_look_alikes(look_alikes)


def test_a_host_that_execs_keeps_its_leftovers_until_its_death_is_proven() -> None:
    host, token, worker_pid, watcher_pid = _host_with_leftovers("exec")
    try:
        # The exec closed the watcher's pipe without "q": it stopped the marked workers. The
        # end of file is no proof of death: the host lives on (same pid, same start).
        assert wait_until(lambda: _gone(worker_pid), 10)
        time.sleep(0.5)  # room for a watcher that took the end of file for a death to act
        left = _leftovers_of_host(token)
        del left["worker blocks"]  # its workers saw their channel close and unlinked their own
        assert all(left.values()), f"a live host's things were removed: {left}"
        host.kill()
        host.communicate(timeout=30)
        # Now it is dead, and its watcher, still waiting for the proof, removes them.
        assert wait_until(lambda: not any(_leftovers_of_host(token).values()), 5), (
            _leftovers_of_host(token)
        )
        assert wait_until(lambda: _gone(watcher_pid), 10)
    finally:
        _reap_host(host)
        _kill_quietly(watcher_pid)
