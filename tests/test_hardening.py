"""Hostile and unlucky machines (issue 11): a full /dev/shm, a hostile runtime root, sweeps
that cannot tell live from dead, unbounded frames and lines, values the OS cannot take,
exceptions that fight back, malformed status files.

Tests that need a private mount namespace (a small tmpfs over /dev/shm) run a host script in a
child made with ``unshare -m``; the test process itself stays in the normal namespace. They
skip cleanly where unshare or mount is not permitted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import TESTS_DIR

# ---- 1. shared memory that runs out -----------------------------------------------------------


def _namespace_usable() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


needs_mount_namespace = pytest.mark.skipif(
    not _namespace_usable(), reason="needs unshare -m and mount (root in a Linux namespace)"
)

SMALL_SHM_HOST = """
import json, logging, sys
import comfy_env

warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())
logging.getLogger("comfy_env").addHandler(Keep())

nbytes = int(sys.argv[1])
config = comfy_env.PoolConfig(sys_path=(sys.argv[2],), start_timeout=60)
out = {}
with comfy_env.Pool(config) as pool:
    worker = pool.get_worker()
    payload = bytes(range(256)) * (nbytes // 256)
    out["equal"] = [worker.call("fault_tasks:identity", payload) == payload for _ in range(3)]
    stats = worker.stats()
    out["shared_memory"] = stats.shared_memory
    out["spawns"] = stats.spawns
    out["crashed"] = stats.crashed
    out["generation"] = stats.generation
out["shm_warnings"] = [w for w in warnings if "shared memory is unavailable" in w]
print("RESULT " + json.dumps(out))
"""


def _run_in_small_shm(size: str, fill_mib: int, nbytes: int) -> dict[str, object]:
    script = (
        f"mount -t tmpfs -o size={size} tmpfs /dev/shm && "
        + (f"dd if=/dev/zero of=/dev/shm/someone-else bs=1M count={fill_mib} 2>/dev/null && "
           if fill_mib else "")
        + 'exec "$0" -c "$1" "$2" "$3"'
    )
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, textwrap.dedent(SMALL_SHM_HOST),
         str(nbytes), str(TESTS_DIR)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    # Before the fix the host died of SIGBUS (rc -7) writing its argument into the block.
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    result: dict[str, object] = json.loads(line[0][len("RESULT "):])
    return result


@needs_mount_namespace
@pytest.mark.parametrize(
    ("size", "fill_mib", "nbytes"),
    [("1M", 0, 4 << 20), ("3M", 0, 2 << 20), ("64M", 60, 8 << 20)],
    ids=["1MiB", "3MiB", "64MiB-60MiB-used"],
)
def test_a_full_dev_shm_streams_inline_and_kills_nothing(
    size: str, fill_mib: int, nbytes: int
) -> None:
    out = _run_in_small_shm(size, fill_mib, nbytes)
    assert out["equal"] == [True, True, True]
    assert out["shared_memory"] == "unavailable"
    assert out["spawns"] == 1 and out["generation"] == 1  # the canary passed; nothing died
    assert out["crashed"] == 0
    assert len(out["shm_warnings"]) == 1  # type: ignore[arg-type]


def test_a_block_that_cannot_be_reserved_is_an_oserror_not_a_later_sigbus() -> None:
    from comfy_env_worker import shm

    r, w = os.pipe()  # not a file: fallocate fails like a full tmpfs would, with OSError
    try:
        with pytest.raises(OSError):
            shm.reserve(w, 1 << 20)
    finally:
        os.close(r)
        os.close(w)
