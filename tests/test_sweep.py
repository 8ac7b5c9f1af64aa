"""Sweeps must never touch a live host, nor anything not ours: a wall-clock step never makes a
live host look dead, a host in another PID namespace (own /proc or shared) is never swept nor
signalled by a wrong pid, the sweep removes only what is ours (and ``dry_run`` lists exactly
that), unlinking a worker's blocks never removes another user's file, owner checks prove death
or leave things alone, and a look-alike of a dead host's worker is never signalled.

Tests that need a private mount namespace (a small tmpfs over /dev/shm) run a host script in a
child made with ``unshare -m``; the test process itself stays in the normal namespace. They
skip cleanly where unshare or mount is not permitted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import (
    TESTS_DIR,
    needs_mount_namespace,
    root_only,
)
from conftest import host_result as _host_result
from conftest import reap_host as _reap_host

import comfy_env

LIVE_HOST = """
import sys, comfy_env
config = comfy_env.PoolConfig(sys_path=(sys.argv[1],))
with comfy_env.Pool(config) as pool:
    w = pool.get_worker()
    big = bytes(4 << 20)
    assert w.call("tasks.fault:identity", big) == big  # blocks on both sides now exist
    from comfy_env._process import host_id
    print(host_id(), w.pid, flush=True)
    sys.stdin.readline()  # the test sweeps now
    assert w.call("tasks.fault:identity", big) == big
    s = w.stats()
    print("AFTER", s.generation, s.crashed, s.spawns, flush=True)
"""


def _start_live_host(prefix: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", textwrap.dedent(LIVE_HOST), str(TESTS_DIR)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _finish_live_host(host: subprocess.Popen[str]) -> str:
    assert host.stdin is not None
    host.stdin.write("go\n")
    host.stdin.flush()
    out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err[-3000:]
    return out


def _leftovers_of(token: str) -> tuple[list[str], list[str]]:
    from comfy_env._rundir import runtime_root

    blocks = [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{token}-")]
    dirs = [d for d in os.listdir(runtime_root()) if d.startswith(f"host-{token}-")]
    return blocks, dirs


def test_a_wall_clock_step_never_makes_a_live_host_look_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    import psutil

    host = _start_live_host([])
    try:
        assert host.stdout is not None
        token, worker_pid = host.stdout.readline().split()
        blocks, dirs = _leftovers_of(token)
        assert blocks and dirs
        # NTP or a VM resume steps the clock by an hour: wall-clock start times all shift.
        real_create_time = psutil.Process.create_time
        monkeypatch.setattr(
            psutil.Process, "create_time", lambda self: real_create_time(self) + 3600
        )
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
        report = comfy_env.sweep()
        monkeypatch.undo()
        assert not set(report.blocks) & set(blocks)
        assert not set(report.runtime_dirs) & set(dirs)
        assert int(worker_pid) not in report.processes
        assert set(blocks) <= set(os.listdir("/dev/shm"))
        out = _finish_live_host(host)
    finally:
        _reap_host(host)
    assert "AFTER 1 0 1" in out  # the same worker served both calls: nothing was killed


def _pid_namespace_usable() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.skipif(not _pid_namespace_usable(), reason="needs unshare --pid (root)")
@pytest.mark.parametrize("mount_proc", [True, False], ids=["own-proc", "shared-proc"])
def test_a_host_in_another_pid_namespace_is_never_swept(mount_proc: bool) -> None:
    prefix = ["unshare", "--pid", "--fork"] + (["--mount-proc"] if mount_proc else [])
    host = _start_live_host(prefix)
    try:
        assert host.stdout is not None
        line = host.stdout.readline()
        assert line, host.communicate(timeout=30)[1][-3000:]
        token, _ = line.split()
        assert token.split("-")[2] != f"n{os.stat('/proc/self/ns/pid').st_ino}"
        blocks, dirs = _leftovers_of(token)
        assert blocks and dirs
        # Its pid means nothing here (or names another process): it must look "unknown",
        # never "dead".
        report = comfy_env.sweep()
        assert not set(report.blocks) & set(blocks)
        assert not set(report.runtime_dirs) & set(dirs)
        assert set(blocks) <= set(os.listdir("/dev/shm"))
        out = _finish_live_host(host)
    finally:
        _reap_host(host, group=True)
    assert "AFTER 1 0 1" in out


def _bare_pid_namespace_usable() -> bool:
    """``unshare --pid --fork`` without ``--mount-proc``: the child keeps our ``/proc``."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


# Runs as pid 1 of a new pid namespace that still sees its parent's /proc. A marked process M
# is listed there as /proc/R; an innocent, unmarked process is then made to get pid R *inside*
# the namespace, where pidfd_open(R) names it. Every process here dies with pid 1.
SHARED_PROC_HOST = """
import json, logging, os, signal, subprocess, time
from comfy_env import _descendants

said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("comfy_env").addHandler(Keep())

mark = "COMFY_ENV_TEST_MARK"
marked = subprocess.Popen(["sleep", "300"], env=dict(os.environ, **{mark: "m1"}),
                          start_new_session=True)
R = None
while R is None:
    for pid in _descendants.pids():
        if (mark + "=m1").encode() in (_descendants.environ_of(pid) or []):
            R = pid
# The next pid this namespace hands out is R (else fork until it is).
try:
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(R - 1))
except OSError:
    while True:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        if pid >= R - 1:
            break
innocent = subprocess.Popen(["sleep", "300"])
out = {"R": R, "innocent": innocent.pid, "marked": marked.pid}
out["killed"] = _descendants.kill_marked(mark, "m1")
out["killed_again"] = _descendants.kill_marked(mark, "m1")
# Where /proc looked ours by coincidence, the pidfd's own pid (fdinfo) still tells them apart.
_descendants.proc_is_ours = lambda: True
out["killed_trusting_proc"] = _descendants.kill_marked(mark, "m1")
time.sleep(0.3)  # a SIGKILL sent above would have landed by now (nothing is timed)
out["innocent_rc"] = innocent.poll()
out["marked_rc"] = marked.poll()
out["warnings"] = [m for m in said if "/proc does not show" in m]
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.skipif(not _bare_pid_namespace_usable(), reason="needs unshare --pid (root)")
def test_a_pid_namespace_sharing_our_proc_never_signals_a_process_by_the_wrong_pid() -> None:
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", SHARED_PROC_HOST],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = _host_result(proc)
    if out["innocent"] != out["R"]:
        pytest.skip("could not give the innocent process the marked one's /proc pid")
    # Before the fix the scan opened pidfd_open(R), the innocent process, read /proc/R's
    # environment (the marked one's) and SIGKILLed the innocent one.
    assert out["killed"] == [] and out["killed_again"] == []
    assert out["killed_trusting_proc"] == []
    assert out["innocent_rc"] is None
    assert out["marked_rc"] is None  # not ours to find here: it is left alone, not mistaken
    assert len(out["warnings"]) == 1, out["warnings"]


# Plants, in a private /dev/shm and a runtime root of its own, things named like a dead host's
# blocks and runtime dirs, of which only one block and one dir are ours to remove; then runs a
# dry-run sweep and a real one.
FOREIGN_LEFTOVERS_HOST = """
import json, os
import comfy_env
from comfy_env._identity import pid_namespace
from comfy_env._rundir import runtime_root

dead = 4_000_000
while os.path.exists(f"/proc/{dead}"):
    dead -= 1
owner = f"{dead}-t1-n{pid_namespace()}"
shm, root = "/dev/shm", runtime_root()
elsewhere = os.path.join(os.path.dirname(root), "elsewhere")
os.mkdir(elsewhere)
open(os.path.join(elsewhere, "keep"), "w").close()

def plant(path, kind):
    if kind == "dir":
        os.mkdir(path)
    elif kind == "link":
        os.symlink(elsewhere, path)
    else:
        open(path, "w").close()
    if kind == "foreign":
        os.chown(path, 65534, 65534)

for tag in ("ours", "foreign", "dir", "link"):
    plant(f"{shm}/ce-{owner}-h1-{tag}", tag if tag != "ours" else "file")
for tag in ("ours", "foreign", "file", "link"):
    plant(f"{root}/host-{owner}-{tag}", {"ours": "dir", "foreign": "dir"}.get(tag, tag))
os.chown(f"{root}/host-{owner}-foreign", 65534, 65534)
dry = comfy_env.sweep(dry_run=True)
real = comfy_env.sweep()
print("RESULT " + json.dumps({
    "owner": owner,
    "dry": [list(dry.blocks), list(dry.runtime_dirs)],
    "real": [list(real.blocks), list(real.runtime_dirs)],
    "shm_left": sorted(os.listdir(shm)),
    "root_left": sorted(n for n in os.listdir(root) if n.startswith("host-")),
    "elsewhere_left": os.listdir(elsewhere),
}))
"""


@needs_mount_namespace
@root_only
def test_a_sweep_removes_only_what_is_ours_and_dry_run_lists_exactly_that(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    proc = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$0" -c "$1"',
            sys.executable,
            FOREIGN_LEFTOVERS_HOST,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, XDG_RUNTIME_DIR=str(xdg)),
    )
    out = _host_result(proc)
    owner = out["owner"]
    # Before the fix root unlinked another user's file named like a dead host's block, and the
    # dry run listed a directory and symlinks the real sweep then could not (or must not) remove.
    assert out["dry"] == out["real"] == [[f"ce-{owner}-h1-ours"], [f"host-{owner}-ours"]]
    assert out["shm_left"] == [f"ce-{owner}-h1-{tag}" for tag in ("dir", "foreign", "link")]
    assert out["root_left"] == [f"host-{owner}-{tag}" for tag in ("file", "foreign", "link")]
    assert out["elsewhere_left"] == ["keep"]


@root_only
def test_unlinking_a_workers_blocks_never_removes_another_users_file() -> None:
    from comfy_env._process import host_id
    from comfy_env_worker import shm

    prefix = f"ce-{host_id()}-w{os.getpid()}-"
    ours, foreign = f"{prefix}ours", f"{prefix}foreign"
    for name in (ours, foreign):
        open(f"/dev/shm/{name}", "w").close()
    os.chown(f"/dev/shm/{foreign}", 65534, 65534)
    os.mkdir(f"/dev/shm/{prefix}dir")
    try:
        assert shm.unlink_blocks(prefix) == [ours]
        assert os.path.exists(f"/dev/shm/{foreign}") and os.path.isdir(f"/dev/shm/{prefix}dir")
    finally:
        for name in (ours, foreign):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        os.rmdir(f"/dev/shm/{prefix}dir")


def test_owner_checks_prove_death_or_leave_things_alone() -> None:
    from comfy_env._identity import owner_dead, pid_namespace, proc_stat
    from comfy_env._process import host_id

    ns = pid_namespace()
    assert ns is not None
    pid, ticks, my_ns = (int(x.lstrip("tn")) for x in host_id().split("-"))
    assert (my_ns, ticks) == (ns, proc_stat("self")[1])  # type: ignore[index]
    assert not owner_dead(pid, ticks, ns)  # us
    assert owner_dead(pid, ticks + 1, ns)  # our pid, another start: a reused pid
    dead = 4_000_000
    while os.path.exists(f"/proc/{dead}"):
        dead -= 1
    assert owner_dead(dead, ticks, ns)
    assert not owner_dead(dead, ticks, ns + 1)  # another namespace: cannot tell
    assert not owner_dead(dead, ticks, 0)  # no /proc when it was named: cannot tell
    # Earlier versions judged any ``<digits>-<digits>-`` name by wall-clock start time: our
    # names must never match their pattern, or a host of an older version sweeps us.
    import re

    old_pattern = re.compile(r"^(?:ce-|host-)(\d+)-(\d+)-")
    assert old_pattern.match(f"ce-{host_id()}-h1-1") is None
    assert old_pattern.match(f"host-{host_id()}-abc") is None


def test_a_look_alike_of_a_dead_hosts_worker_is_never_signalled(tmp_path: Path) -> None:
    from comfy_env._identity import pid_namespace
    from comfy_env._process import BOOT

    dead = 4_000_000
    while os.path.exists(f"/proc/{dead}"):
        dead -= 1
    runtime_dir = tmp_path / f"host-{dead}-t1-n{pid_namespace()}-abc"
    # Same launch line as a real worker of that dead host, but not launched by it.
    look_alike = subprocess.Popen(
        ["sh", "-c", "sleep 60; :", "-c", BOOT, str(runtime_dir), "3", str(dead), "4"],
        start_new_session=True,
    )
    try:
        report = comfy_env.sweep()
        assert look_alike.pid not in report.processes
        assert look_alike.poll() is None
    finally:
        os.killpg(look_alike.pid, 9)
        look_alike.wait(30)
