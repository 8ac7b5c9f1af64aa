"""Memory cgroup leaves (``comfy_env._memlimit``): a process moved into a leaf is killed by the
kernel past the leaf's limit, and the leaf's facts say so. Real processes and the machine's real
cgroup hierarchy; skipped where this process may not make leaves (not root, no writable
hierarchy)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from comfy_env import _memlimit

MiB = 1024 * 1024

pytestmark = pytest.mark.skipif(
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
        leaf.remove()
    assert not os.path.exists(leaf.path)


def test_a_process_within_its_limit_runs_and_counts_no_kill() -> None:
    leaf = _memlimit.Leaf.make(256 * MiB)
    assert leaf is not None
    try:
        done = _run_in_leaf(leaf, 32)
        assert done.returncode == 0 and "allocated" in done.stdout
        assert leaf.facts().oom_kills == 0
    finally:
        leaf.remove()


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
