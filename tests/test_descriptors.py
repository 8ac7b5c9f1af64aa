"""A host out of file descriptors gets typed errors and keeps its workers: descriptors exhausted
while a worker runs (a reply is ``HostResourceError``, a spawn ``WorkerStartError``), at any step
of the first spawn (0, 1, 2, ... descriptors to spare), and before the first worker; the next
call works once descriptors are free again. Each case runs in a host subprocess that lowers its
own ``RLIMIT_NOFILE``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import (
    TESTS_DIR,
)
from conftest import host_result as _host_result

EMFILE_HOST = """
import json, os, resource, sys, time, comfy_env

def exhaust():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    return soft, hard, held

def restore(limits):
    soft, hard, held = limits
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

out = {}
config = comfy_env.PoolConfig(sys_path=(sys.argv[1],))
with comfy_env.Pool(config) as pool:
    w = pool.get_worker()
    small = bytes(2 << 20)
    assert w.call("tasks.fault:identity", small) == small
    # The pool's watcher is launched 50 ms after the first worker is ready, on the reactor:
    # its Popen opens descriptors and closes them again, so a launch beside ``exhaust`` freed
    # a slot or two, and the call below got its block (seen under load). Wait for it.
    while pool._spawner.watcher is None:
        time.sleep(0.01)
    fds = len(os.listdir("/proc/self/fd"))
    # 1. Out of descriptors while opening a reply block the worker has just made.
    bigger = bytes(8 << 20)
    limits = exhaust()
    try:
        w.call("tasks.fault:identity", bigger)
        out["reply"] = "no error"
    except Exception as exc:
        out["reply"] = type(exc).__name__
    finally:
        restore(limits)
    assert w.call("tasks.fault:identity", bigger) == bigger
    s = w.stats()
    out["after_reply"] = [s.generation, s.crashed, s.failed, s.spawns]
    # 2. Out of descriptors at spawn.
    pid = w.pid
    os.kill(pid, 9)
    def dead(pid):
        try:  # reaped (gone) or a zombie; it may be reaped between any two looks
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True
    while not dead(pid):
        time.sleep(0.01)
    time.sleep(0.2)
    limits = exhaust()
    try:
        w.call("tasks.remote:add", 1, 2)
        out["spawn"] = "no error"
    except Exception as exc:
        out["spawn"] = type(exc).__name__
    finally:
        restore(limits)
    out["after_spawn"] = w.call("tasks.remote:add", 1, 2)
    out["fds_before_after"] = [fds, len(os.listdir("/proc/self/fd"))]
print("RESULT " + json.dumps(out))
"""


def test_a_host_out_of_descriptors_gets_typed_errors_and_keeps_its_worker() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EMFILE_HOST), str(TESTS_DIR)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(TESTS_DIR)),
    )
    out = _host_result(proc)
    assert out["reply"] == "HostResourceError"  # was ProtocolError, and the worker retired
    assert out["after_reply"] == [1, 0, 1, 1]  # same worker, nothing counted as a death
    assert out["spawn"] == "WorkerStartError"
    assert out["after_spawn"] == 3
    before, after = out["fds_before_after"]
    assert after <= before


_SPARE_DESCRIPTORS_HOST = """
import os, resource, sys, comfy_env
pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(sys.argv[1],)))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
for _ in range(int(sys.argv[2])):
    os.close(held.pop())
try:
    pool.get_worker().call("tasks.hostile:add", 1, 2)
    print("RESULT ok")
except Exception as exc:
    print("RESULT", type(exc).__name__, exc)
for fd in held:
    os.close(fd)
try:
    print("AFTER", pool.get_worker().call("tasks.hostile:add", 1, 2))
except Exception as exc:
    print("AFTER", type(exc).__name__, exc)
pool.close()
"""


@pytest.mark.timeout(240)
def test_a_host_short_of_descriptors_at_any_step_of_its_first_spawn_gets_a_typed_error() -> None:
    # With 0, 1, 2, ... descriptors to spare, the first spawn runs out at each of its steps in
    # turn (the host's token read from /proc, the runtime root, the channel, the cancel pipe,
    # the launch, the runtime dir): every one is a WorkerStartError, never a raw OSError or a
    # RuntimeRootError (the root is fine; the host is short), and the next call, with
    # descriptors again, runs.
    seen = set()
    for spare in range(0, 40):
        proc = subprocess.run(
            [sys.executable, "-c", _SPARE_DESCRIPTORS_HOST, str(TESTS_DIR), str(spare)],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=str(TESTS_DIR)),
        )
        assert proc.returncode == 0, (spare, proc.stderr[-3000:])
        result = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))
        assert result == "RESULT ok" or result.startswith("RESULT WorkerStartError"), (
            spare,
            result,
            proc.stderr[-2000:],
        )
        assert "AFTER 3" in proc.stdout, (spare, proc.stdout, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (spare, proc.stderr[-2000:])
        seen.add(result.split(":")[0])
        if result == "RESULT ok":
            break
    assert "RESULT ok" in seen and len(seen) >= 3, seen  # it went through the steps


def test_a_host_out_of_descriptors_before_its_first_worker_gets_a_typed_error() -> None:
    code = """
    import os, resource, sys, comfy_env
    pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(sys.argv[1],)))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    try:
        pool.get_worker().call("tasks.hostile:add", 1, 2)
        print("RESULT no error")
    except Exception as exc:
        print("RESULT", type(exc).__name__)
    for fd in held:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print("AFTER", pool.get_worker().call("tasks.hostile:add", 1, 2))
    pool.close()
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(TESTS_DIR)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(TESTS_DIR)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT WorkerStartError" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "AFTER 3" in proc.stdout
