"""Shared memory that runs out: a full or tiny /dev/shm makes calls stream their buffers inline
(one warning, ``doctor`` says WARN), never kills a worker or the host with SIGBUS, and a block
that cannot be reserved is an ``OSError`` at once, not a SIGBUS later.

Tests that need a private mount namespace (a small tmpfs over /dev/shm) run a host script in a
child made with ``unshare -m``; the test process itself stays in the normal namespace. They
skip cleanly where unshare or mount is not permitted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import (
    TESTS_DIR,
    needs_mount_namespace,
)
from conftest import host_result as _host_result

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
    out["equal"] = [worker.call("tasks.fault:identity", payload) == payload for _ in range(3)]
    stats = worker.stats()
    out["shared_memory"] = stats.shared_memory
    out["spawns"] = stats.spawns
    out["crashed"] = stats.crashed
    out["generation"] = stats.generation
out["shm_warnings"] = [w for w in warnings if "shared memory is unavailable" in w]
import contextlib, io
from comfy_env._cli import main
text = io.StringIO()
with contextlib.redirect_stdout(text):
    out["doctor_rc"] = main(["doctor", "--json"])
steps = json.loads(text.getvalue())["steps"]
out["doctor_shm"] = [
    s.get("facts", {}).get("shared_memory") for s in steps if s["name"] == "shared memory"
]
print("RESULT " + json.dumps(out))
"""


def _run_in_small_shm(size: str, fill_mib: int, nbytes: int) -> dict[str, object]:
    script = (
        f"mount -t tmpfs -o size={size} tmpfs /dev/shm && "
        + (
            f"dd if=/dev/zero of=/dev/shm/someone-else bs=1M count={fill_mib} 2>/dev/null && "
            if fill_mib
            else ""
        )
        + 'exec "$0" -c "$1" "$2" "$3"'
    )
    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    proc = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            script,
            sys.executable,
            textwrap.dedent(SMALL_SHM_HOST),
            str(nbytes),
            str(TESTS_DIR),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    # Before the fix the host died of SIGBUS (rc -7) writing its argument into the block.
    return _host_result(proc)


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
    assert out["doctor_rc"] == 0 and out["doctor_shm"] == ["unavailable"]  # a WARN, not a FAIL


def test_a_block_that_cannot_be_reserved_is_an_oserror_not_a_later_sigbus() -> None:
    from comfy_env_worker import shm

    r, w = os.pipe()  # not a file: fallocate fails like a full tmpfs would, with OSError
    try:
        with pytest.raises(OSError):
            shm.reserve(w, 1 << 20)
    finally:
        os.close(r)
        os.close(w)
