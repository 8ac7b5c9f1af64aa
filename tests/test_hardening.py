"""Hostile and unlucky machines (issue 11): a full /dev/shm, a hostile runtime root, sweeps
that cannot tell live from dead, unbounded frames and lines, values the OS cannot take,
exceptions that fight back, malformed status files.

Tests that need a private mount namespace (a small tmpfs over /dev/shm) run a host script in a
child made with ``unshare -m``; the test process itself stays in the normal namespace. They
skip cleanly where unshare or mount is not permitted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from conftest import TESTS_DIR

import comfy_env

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


# ---- 2. the runtime root must be ours, or refused ---------------------------------------------

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's dir")


@pytest.fixture
def shared_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh stand-in for /tmp as the only runtime-root candidate (no XDG_RUNTIME_DIR)."""
    from comfy_env import _rundir

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(_rundir, "_private", None)
    return tmp


def _root_after_warning(caplog: pytest.LogCaptureFixture) -> tuple[str, list[str]]:
    from comfy_env._rundir import runtime_root

    with caplog.at_level(logging.WARNING, logger="comfy_env"):
        root = runtime_root()
        again = runtime_root()
    assert again == root
    warnings = [r.getMessage() for r in caplog.records if "not safe to use" in r.getMessage()]
    return root, warnings


def test_a_symlink_planted_at_the_runtime_root_is_never_followed(
    shared_tmp: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "attacker"
    target.mkdir()
    (shared_tmp / f"comfy-env-{os.getuid()}").symlink_to(target)
    root, warnings = _root_after_warning(caplog)
    try:
        assert not root.startswith(str(target)) and os.path.realpath(root) != str(target)
        assert len(warnings) == 1 and "symbolic link" in warnings[0]
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
        assert os.listdir(target) == []
    finally:
        shutil.rmtree(root)


@root_only
@pytest.mark.parametrize("mode", [0o777, 0o700])
def test_another_users_runtime_root_is_refused_with_one_warning(
    shared_tmp: Path, caplog: pytest.LogCaptureFixture, mode: int
) -> None:
    foreign = shared_tmp / f"comfy-env-{os.getuid()}"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)
    foreign.chmod(mode)
    root, warnings = _root_after_warning(caplog)
    try:
        assert root != str(foreign)
        assert len(warnings) == 1 and "belongs to uid 65534" in warnings[0]
        assert os.stat(root).st_uid == os.getuid()
        assert os.listdir(foreign) == []
    finally:
        shutil.rmtree(root)


def test_our_own_root_with_loose_permissions_is_tightened(shared_tmp: Path) -> None:
    from comfy_env._rundir import runtime_root

    ours = shared_tmp / f"comfy-env-{os.getuid()}"
    ours.mkdir()
    ours.chmod(0o777)
    assert runtime_root() == str(ours)
    assert stat.S_IMODE(os.stat(ours).st_mode) == 0o700


def test_a_status_dir_that_is_a_symlink_is_a_typed_error(
    shared_tmp: Path, tmp_path: Path
) -> None:
    from comfy_env import RuntimeRootError
    from comfy_env._status import status_dir

    root = shared_tmp / f"comfy-env-{os.getuid()}"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "status").symlink_to(elsewhere)
    with pytest.raises(RuntimeRootError, match="symbolic link") as info:
        status_dir()
    assert info.value.path == str(root / "status")


def test_no_usable_root_at_all_is_a_typed_error_not_a_permission_error(
    shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from comfy_env import ComfyEnvError, RuntimeRootError
    from comfy_env._rundir import runtime_root

    (shared_tmp / f"comfy-env-{os.getuid()}").write_text("not a directory")

    def refuse(*_a: object, **_k: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(RuntimeRootError, match=r"not a directory|cannot open") as info:
        runtime_root()
    assert isinstance(info.value, ComfyEnvError)
    assert "XDG_RUNTIME_DIR" in str(info.value)


def test_a_pool_under_a_hostile_root_runs_its_calls_from_a_private_root(
    shared_tmp: Path, tmp_path: Path, config: comfy_env.PoolConfig
) -> None:
    from comfy_env._rundir import runtime_root

    target = tmp_path / "attacker"
    target.mkdir()
    (shared_tmp / f"comfy-env-{os.getuid()}").symlink_to(target)
    try:
        with comfy_env.Pool(config) as pool:
            assert pool.get_worker().call("remote_tasks:add", 1, 2) == 3
        assert os.listdir(target) == []
    finally:
        shutil.rmtree(runtime_root())
