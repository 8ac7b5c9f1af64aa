"""Memory cgroup leaves (``comfy_env._memlimit``): a process moved into a leaf is killed by the
kernel past the leaf's limit, and the leaf's facts say so. Real processes and the machine's real
cgroup hierarchy; skipped where this process may not make leaves (not root, no writable
hierarchy)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from comfy_env import _memlimit

MiB = 1024 * 1024
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

needs_cgroup = pytest.mark.skipif(
    not _memlimit.hierarchy()[0], reason=f"no memory cgroup here: {_memlimit.hierarchy()[2]}"
)

# Waits for one byte on stdin (as a worker waits for its go byte), then allocates and touches
# ``argv[1]`` MiB, 8 MiB at a time.
_ALLOCATE = (
    "import sys\n"
    "sys.stdin.buffer.read(1)\n"
    "held = [bytearray(8 << 20) for _ in range(int(sys.argv[1]) // 8)]\n"
    "print('allocated', flush=True)\n"
)


def _removed(leaf: _memlimit.Leaf) -> bool:
    """Remove the leaf, waiting the moment the kernel takes to let a killed process go."""
    deadline = time.monotonic() + 5
    while not leaf.remove():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _run_in_leaf(leaf: _memlimit.Leaf, mib: int) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _ALLOCATE, str(mib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    leaf.adopt(proc.pid)
    out, _ = proc.communicate("x", timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@needs_cgroup
def test_a_process_past_its_leaf_s_limit_is_killed_by_the_kernel_and_the_facts_say_so() -> None:
    leaf = _memlimit.Leaf.make(64 * MiB)
    assert leaf is not None
    try:
        done = _run_in_leaf(leaf, 256)
        assert done.returncode == -signal.SIGKILL
        assert "allocated" not in done.stdout
        facts = leaf.facts()
        assert facts.oom_kills >= 1
        assert facts.limit == 64 * MiB
        assert facts.peak is None or facts.peak >= 48 * MiB
        assert facts.how.startswith("cgroup v")
    finally:
        assert _removed(leaf)
    assert not os.path.exists(leaf.path)


@needs_cgroup
def test_a_process_within_its_limit_runs_and_counts_no_kill() -> None:
    leaf = _memlimit.Leaf.make(256 * MiB)
    assert leaf is not None
    try:
        done = _run_in_leaf(leaf, 32)
        assert done.returncode == 0 and "allocated" in done.stdout
        assert leaf.facts().oom_kills == 0
    finally:
        assert _removed(leaf)


@needs_cgroup
def test_an_empty_leaf_of_a_dead_host_is_removed_by_the_next_host() -> None:
    parent = _memlimit.hierarchy()[1]
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = os.path.join(parent, f"comfy-env-{int(dead.stdout)}-1")
    os.mkdir(stale)
    code = "from comfy_env import _memlimit\nleaf = _memlimit.Leaf.make(64 << 20)\nleaf.remove()\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    if os.path.exists(stale):  # (the pid was reused by a live process: nothing to conclude)
        os.rmdir(stale)
        pytest.skip("the dead host's pid was taken again")


# ---- the pool: PoolConfig.memory_limit -------------------------------------------------------


def _allocate(mib: int) -> int:
    held = [bytearray(8 << 20) for _ in range(mib // 8)]
    return len(held)


_PARENT = (
    _memlimit.hierarchy()[1] or "/nonexistent"
)  # (before any test replaces what hierarchy() says)


def _our_leaves() -> list[str]:
    if not os.path.isdir(_PARENT):
        return []
    return [n for n in os.listdir(_PARENT) if n.startswith(f"comfy-env-{os.getpid()}-")]


@needs_cgroup
def test_a_worker_past_its_memory_limit_fails_that_call_with_worker_out_of_memory() -> None:
    import comfy_env

    config = comfy_env.PoolConfig(memory_limit=128 * MiB, sys_path=(str(TESTS_DIR),))
    with comfy_env.Pool(config) as pool:
        worker = pool.get_worker()
        assert worker.call("test_memlimit:_allocate", 32) == 4  # within the limit
        pid = worker.pid
        with pytest.raises(comfy_env.WorkerOutOfMemory) as out:
            worker.call("test_memlimit:_allocate", 512)
        error = out.value
        assert isinstance(error, comfy_env.WorkerCrashed)
        assert error.how.startswith("cgroup v") and error.limit == 128 * MiB
        assert error.peak is None or error.peak >= 100 * MiB
        assert error.signal == "SIGKILL" and error.pid == pid
        assert "memory limit of 128.0 MiB" in str(error)
        assert worker.call("test_memlimit:_allocate", 32) == 4  # a fresh worker
        assert worker.generation == 2
    deadline = time.monotonic() + 5
    while _our_leaves() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _our_leaves() == []


def test_without_a_cgroup_the_worker_s_own_rlimit_ends_it_the_same_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import comfy_env

    monkeypatch.setattr(_memlimit, "_found", ("", "", "no cgroup, for this test"))
    config = comfy_env.PoolConfig(memory_limit=256 * MiB, sys_path=(str(TESTS_DIR),))
    with comfy_env.Pool(config) as pool:
        worker = pool.get_worker()
        with pytest.raises(comfy_env.WorkerOutOfMemory) as out:
            worker.call("test_memlimit:_allocate", 1024)
        assert out.value.how == "RLIMIT_DATA"
        assert out.value.limit == 256 * MiB
        assert out.value.peak and out.value.peak > 64 * MiB
        assert "RLIMIT_DATA" in str(out.value)
        assert worker.call("test_memlimit:_allocate", 16) == 2
    assert _our_leaves() == []


_HOST_IN_A_SMALL_CGROUP = """
import sys
import comfy_env
sys.path.insert(0, sys.argv[-1])
config = comfy_env.PoolConfig(sys_path=(sys.argv[-1],))
with comfy_env.Pool(config) as pool:
    worker = pool.get_worker()
    try:
        worker.call("test_memlimit:_allocate", 1024)
    except comfy_env.WorkerOutOfMemory as exc:
        print("OOM", exc.how, exc.limit, exc.signal)
    print("NEXT", worker.call("test_memlimit:_allocate", 8))
"""


@needs_cgroup
def test_a_worker_the_kernel_s_oom_killer_takes_without_a_limit_is_reported_out_of_memory() -> None:
    # The host runs in a cgroup of 384 MiB and sets no memory_limit: the worker's allocation
    # makes the kernel's OOM killer pick the biggest process there, the worker.
    leaf = _memlimit.Leaf.make(384 * MiB)
    assert leaf is not None
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; sys.stdin.read(1); exec(sys.argv[1])",
                _HOST_IN_A_SMALL_CGROUP,
                str(TESTS_DIR),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        leaf.adopt(proc.pid)
        out, err = proc.communicate("x", timeout=120)
    finally:
        assert _removed(leaf)
    assert proc.returncode == 0, err[-2000:]
    assert "OOM OOM killer None SIGKILL" in out, (out, err[-2000:])
    assert "NEXT 1" in out


def test_memory_limits_the_kernel_cannot_take_are_refused_up_front() -> None:
    import comfy_env

    for bad in (1000, -1, True, 2**63, 1.5):
        with pytest.raises((comfy_env.ConfigError, ValueError)):
            comfy_env.PoolConfig(memory_limit=bad)
