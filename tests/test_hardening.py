"""Hostile and unlucky machines (issue 11): a full /dev/shm, a hostile runtime root, sweeps
that cannot tell live from dead, unbounded frames and lines, values the OS cannot take,
exceptions that fight back, malformed status files.

Tests that need a private mount namespace (a small tmpfs over /dev/shm) run a host script in a
child made with ``unshare -m``; the test process itself stays in the normal namespace. They
skip cleanly where unshare or mount is not permitted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TESTS_DIR, alive, private_shm_mount_usable, run_host, wait_until

import comfy_env

# ---- 1. shared memory that runs out -----------------------------------------------------------


needs_mount_namespace = pytest.mark.skipif(
    not private_shm_mount_usable(), reason="needs unshare -m and mount (root in a Linux namespace)"
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


def _reap_host(host: subprocess.Popen[Any], group: bool = False) -> None:
    """Kill a host subprocess a test left running (its whole process group with ``group``)
    and reap it."""
    if host.poll() is None:
        if group:
            os.killpg(host.pid, 9)
        else:
            host.kill()
        host.communicate(timeout=30)


def _host_result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The ``RESULT <json>`` line a host script printed, once it exited 0."""
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(line[0][len("RESULT ") :])
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
    monkeypatch.setenv("TMPDIR", str(tmp))  # where the root is looked for
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where a private fallback is made
    monkeypatch.setattr(_rundir, "_private", None)
    monkeypatch.setattr(_rundir, "_warned", set(), raising=False)  # each test sees its own warnings
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


def test_a_status_dir_that_is_a_symlink_is_a_typed_error(shared_tmp: Path, tmp_path: Path) -> None:
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
            assert pool.get_worker().call("tasks.remote:add", 1, 2) == 3
        assert os.listdir(target) == []
    finally:
        shutil.rmtree(runtime_root())


# The root's parent must be safe too: whoever may write to a directory above the root without
# the sticky bit can rename the root away and put their own (with their own comfy_env_worker)
# at the same path, which the host uses at every later spawn.


def _unsafe_parent_warnings(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "for the runtime root" in r.getMessage() and name in r.getMessage()
    ]


@pytest.fixture
def unsafe_tmp(tmp_path: Path) -> Path:
    """A world-writable directory without the sticky bit (ours: only its mode is wrong)."""
    ww = tmp_path / "ww"
    ww.mkdir()
    ww.chmod(0o777)
    return ww


def _unsafe_place(kind: str, tmp_path: Path, unsafe_tmp: Path) -> tuple[Path, Path]:
    """(the TMPDIR to set, the directory the warning must name) for each unsafe kind."""
    if kind == "world-writable":
        return unsafe_tmp, unsafe_tmp
    if kind == "symlink-into-world-writable":  # the path as written is fine, its realpath not
        real = unsafe_tmp / "real"
        real.mkdir(mode=0o700)
        (tmp_path / "link").symlink_to(real)
        return tmp_path / "link", unsafe_tmp
    if kind == "ancestor-of-another-uid":
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o755)
        (foreign / "mine").mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        return foreign / "mine", foreign
    assert kind == "symlink-of-another-uid"
    (tmp_path / "real").mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    os.lchown(link, 65534, 65534)
    return link, link


@pytest.mark.parametrize(
    "kind",
    [
        "world-writable",
        "symlink-into-world-writable",
        pytest.param("ancestor-of-another-uid", marks=root_only),
        pytest.param("symlink-of-another-uid", marks=root_only),
    ],
)
def test_an_unsafe_tmpdir_is_never_the_roots_parent_the_next_safe_one_is(
    shared_tmp: Path,
    tmp_path: Path,
    unsafe_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    from comfy_env._rundir import runtime_root

    tmpdir, named = _unsafe_place(kind, tmp_path, unsafe_tmp)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setenv("TMP", str(shared_tmp))  # sticky and world-writable, as /tmp: accepted
    with caplog.at_level(logging.WARNING, logger="comfy_env"):
        root = runtime_root()
        assert runtime_root() == root
    assert root == str(shared_tmp / f"comfy-env-{os.getuid()}")
    warnings = _unsafe_parent_warnings(caplog, str(named))
    assert len(warnings) == 1, caplog.text
    assert str(shared_tmp) in warnings[0]  # where the root went instead
    made = [p for p in tmp_path.rglob("comfy-env-*") if shared_tmp not in p.parents]
    assert made == []


def test_a_world_writable_xdg_runtime_dir_without_the_sticky_bit_is_not_used(
    shared_tmp: Path,
    unsafe_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from comfy_env._rundir import runtime_root

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(unsafe_tmp))  # ours, but mode 0777
    with caplog.at_level(logging.WARNING, logger="comfy_env"):
        root = runtime_root()
        assert runtime_root() == root
    assert root == str(shared_tmp / f"comfy-env-{os.getuid()}")
    warnings = _unsafe_parent_warnings(caplog, str(unsafe_tmp))
    assert len(warnings) == 1 and "XDG_RUNTIME_DIR" in warnings[0], caplog.text
    assert "without the sticky bit" in warnings[0]
    assert os.listdir(unsafe_tmp) == []


def test_the_private_fallback_root_is_made_in_a_safe_place_not_in_an_unsafe_tmpdir(
    shared_tmp: Path,
    tmp_path: Path,
    unsafe_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from comfy_env._rundir import runtime_root

    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    (xdg / "comfy-env").symlink_to(tmp_path)  # the shared root is refused: a private one
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    monkeypatch.setenv("TMPDIR", str(unsafe_tmp))
    monkeypatch.setenv("TMP", str(shared_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile would choose $TMPDIR
    with caplog.at_level(logging.WARNING, logger="comfy_env"):
        root = runtime_root()
    try:
        assert os.path.dirname(root) == str(shared_tmp)
        assert os.path.basename(root).startswith(f"comfy-env-{os.getuid()}-private-")
        assert os.listdir(unsafe_tmp) == []
        assert len(_unsafe_parent_warnings(caplog, str(unsafe_tmp))) == 1
    finally:
        shutil.rmtree(root)


def test_no_safe_place_for_a_private_root_is_a_typed_error_naming_the_unsafe_dir(
    shared_tmp: Path, unsafe_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from comfy_env import RuntimeRootError, _rundir

    # Every temp dir this machine offers is unsafe (here: the one there is).
    monkeypatch.setenv("TMPDIR", str(unsafe_tmp))
    only = [(str(unsafe_tmp), "$TMPDIR")]
    monkeypatch.setattr(_rundir, "_temp_dirs", lambda: only, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(unsafe_tmp))
    with pytest.raises(RuntimeRootError, match="without the sticky bit") as info:
        _rundir.runtime_root()
    assert str(unsafe_tmp) in str(info.value)
    # Named once: tempfile's own choice, the same directory, is not listed again.
    assert "tempfile.gettempdir()" not in info.value.reason, info.value.reason
    assert os.listdir(unsafe_tmp) == []


SWAP_ATTACK = r"""
import os, sys
runtime_dir, marker = sys.argv[1], sys.argv[2]
root = os.path.dirname(runtime_dir)
try:
    os.rename(root, root + ".moved")  # needs only write permission on the root's parent
except OSError as exc:
    print("refused", exc.errno)
    sys.exit(0)
pkg = os.path.join(runtime_dir, "comfy_env_worker")
os.makedirs(pkg)
with open(os.path.join(pkg, "__init__.py"), "w") as f:
    f.write("open(%r, 'w').write('ran as uid %%d' %% __import__('os').getuid())\n" % marker)
print("swapped")
"""


PRIVATE_ROOT_HOST = """
import sys, comfy_env
from comfy_env._rundir import runtime_root
worker = comfy_env.get_worker()
assert worker.call("operator:add", 1, 2) == 3
print(runtime_root(), worker.pid, flush=True)
sys.stdin.readline()
comfy_env.shutdown()
"""


@root_only
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_another_user_cannot_swap_the_root_away_before_a_respawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: comfy_env.PoolConfig
) -> None:
    from comfy_env import _rundir
    from comfy_env._process import host_id

    # Where user 65534 can reach: tmp_path's parents are mode 0700.
    base = Path(tempfile.mkdtemp(dir="/tmp", prefix="comfy-env-test-"))
    try:
        base.chmod(0o711)
        ww = base / "ww"
        ww.mkdir()
        ww.chmod(0o777)  # world-writable, not sticky: anyone may rename entries
        marker = base / "planted-code-ran"
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
        monkeypatch.setenv("TMPDIR", str(ww))
        monkeypatch.setenv("TMP", str(base))
        monkeypatch.setattr(_rundir, "_private", None)
        monkeypatch.setattr(_rundir, "_warned", set(), raising=False)
        with comfy_env.Pool(config) as pool:
            worker = pool.get_worker()
            assert worker.call("tasks.remote:add", 1, 2) == 3
            root = _rundir.runtime_root()
            runtime_dir = next(
                os.path.join(root, d)
                for d in os.listdir(root)
                if d.startswith(f"host-{host_id()}-")
            )
            attack = subprocess.run(
                [
                    *("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"),
                    *(sys.executable, "-c", SWAP_ATTACK, runtime_dir, str(marker)),
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert attack.returncode == 0, attack.stderr
            with pytest.raises(comfy_env.WorkerCrashed):
                worker.call("tasks.remote:kill_self", 9)
            assert worker.call("tasks.remote:add", 2, 3) == 5  # a fresh generation, our code
            assert worker.stats().generation == 2
        assert not marker.exists()
        assert attack.stdout.split()[0] == "refused"
        assert root == str(base / f"comfy-env-{os.getuid()}")  # $TMPDIR skipped for $TMP
    finally:
        shutil.rmtree(base)


# ---- the private root outlives the pools; a bad status dir never breaks close() -------------

EXIT_WITHOUT_CLOSE = """
import sys, comfy_env
config = comfy_env.PoolConfig(sys_path=(sys.argv[1],))
pool = comfy_env.Pool(config)  # never closed: the exit hook closes it
print(pool.get_worker().call("tasks.remote:add", 1, 2), flush=True)
import comfy_env._rundir as r
print(r.runtime_root(), flush=True)
"""


def test_a_host_on_a_private_root_exits_cleanly_and_the_private_root_goes(
    shared_tmp: Path, tmp_path: Path
) -> None:
    target = tmp_path / "attacker"
    target.mkdir()
    (shared_tmp / f"comfy-env-{os.getuid()}").symlink_to(target)  # a private root, then
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(PYTHONPATH=str(TESTS_DIR), TMPDIR=str(shared_tmp))
    host = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(EXIT_WITHOUT_CLOSE), str(TESTS_DIR)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert host.returncode == 0, host.stderr
    out = host.stdout.split()
    assert out[0] == "3"
    assert os.path.dirname(out[1]) == str(shared_tmp) and "-private-" in out[1]
    # The one warning about the root, and nothing else: no traceback from the exit hook, no
    # status file that could not be written (the root was removed before the pool closed).
    lines = host.stderr.splitlines()
    assert len(lines) == 1 and "not safe to use" in lines[0], host.stderr
    assert not os.path.exists(out[1])  # removed at exit, after the pool closed
    assert os.listdir(shared_tmp) == [f"comfy-env-{os.getuid()}"]
    assert os.listdir(target) == []


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_a_status_dir_that_is_not_ours_never_makes_close_or_the_sweep_raise(
    shared_tmp: Path,
    tmp_path: Path,
    config: comfy_env.PoolConfig,
    caplog: pytest.LogCaptureFixture,
    planted: str,
) -> None:
    root = shared_tmp / f"comfy-env-{os.getuid()}"
    root.mkdir(mode=0o700)
    status = root / "status"
    if planted == "file":
        status.write_text("")
    else:
        (tmp_path / "elsewhere").mkdir()
        status.symlink_to(tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, logger="comfy_env"):
        pool = comfy_env.Pool(config)
        try:
            assert pool.get_worker().call("tasks.remote:add", 1, 2) == 3
            report = comfy_env.sweep()  # as the pool's start-up sweep does, on its reactor
        finally:
            pool.close()
        assert pool.closed
        pool.close()  # idempotent, and quiet the second time
    assert report.status_files == ()
    messages = [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    skipped = [m for m in messages if "sweep skipped" in m]
    unwritable = [m for m in messages if "cannot write this host's status file" in m]
    assert skipped and all(str(status) in m for m in skipped)
    assert len(unwritable) == 1 and str(status) in unwritable[0], caplog.text
    if planted == "symlink":
        assert os.listdir(tmp_path / "elsewhere") == []
    else:
        assert status.is_file()


@root_only
def test_the_private_root_of_a_killed_host_is_swept_and_a_live_ones_never(
    shared_tmp: Path,
) -> None:
    from comfy_env._rundir import runtime_root

    foreign = shared_tmp / f"comfy-env-{os.getuid()}"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)  # every host here falls back to a private root
    hosts = [
        subprocess.Popen(
            [sys.executable, "-c", PRIVATE_ROOT_HOST],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        roots, workers = [], []
        for host in hosts:
            assert host.stdout is not None
            line = host.stdout.readline()
            assert line, host.communicate(timeout=30)[1][-3000:]
            root, worker = line.split()
            roots.append(root)
            workers.append(int(worker))
        dead_root, live_root = roots
        assert os.path.dirname(dead_root) == str(shared_tmp)
        assert os.path.basename(dead_root).startswith(f"comfy-env-{os.getuid()}-private-")
        # The backstop case: its watcher (which removes the root at once) is killed first.
        watcher = _watcher_of(hosts[0].pid)
        os.kill(watcher, 9)
        assert wait_until(lambda: not alive(watcher), 10)
        hosts[0].kill()  # no atexit: before the fix its private root stayed for good
        hosts[0].communicate(timeout=30)
        assert wait_until(lambda: not alive(workers[0]), 10)
        # Look-alikes named for the same dead host: none is ours to remove.
        look_alikes = [f"{dead_root}-{kind}" for kind in ("foreign", "loose", "link")]
        for path in look_alikes[:2]:
            os.mkdir(path, 0o700)
        os.chown(look_alikes[0], 65534, 65534)
        os.chmod(look_alikes[1], 0o777)
        os.symlink(dead_root, look_alikes[2])
        dry = comfy_env.sweep(dry_run=True)
        assert dry.private_roots == (dead_root,) and os.path.isdir(dead_root)
        report = comfy_env.sweep()
        assert report.private_roots == (dead_root,)
        assert not os.path.exists(dead_root)
        assert all(os.path.lexists(path) for path in look_alikes)
        assert os.path.isdir(live_root) and alive(workers[1])
        assert hosts[1].stdin is not None
        hosts[1].stdin.write("\n")
        hosts[1].stdin.flush()
        _, err = hosts[1].communicate(timeout=60)
        assert hosts[1].returncode == 0, err[-3000:]
        assert not os.path.exists(live_root)  # its own atexit removed it
    finally:
        for host in hosts:
            _reap_host(host, group=True)
        shutil.rmtree(runtime_root(), ignore_errors=True)  # this process's own private root


def _watcher_of(host_pid: int) -> int:
    """The pid of the host watcher ``host_pid`` started (a child running ``watch_host``)."""
    import psutil

    def find() -> int | None:
        for child in psutil.Process(host_pid).children():
            with contextlib.suppress(psutil.Error):
                if any("watch_host" in arg for arg in child.cmdline()):
                    return child.pid
        return None

    assert wait_until(lambda: find() is not None, 10), "the host started no watcher"
    found = find()
    assert found is not None
    return found


@root_only
def test_the_private_root_of_a_killed_host_goes_with_its_watcher(shared_tmp: Path) -> None:
    from comfy_env._rundir import runtime_root

    foreign = shared_tmp / f"comfy-env-{os.getuid()}"
    foreign.mkdir()
    os.chown(foreign, 65534, 65534)  # the host falls back to a private root
    host = subprocess.Popen(
        [sys.executable, "-c", PRIVATE_ROOT_HOST],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert host.stdout is not None
        line = host.stdout.readline()
        assert line, host.communicate(timeout=30)[1][-3000:]
        root = line.split()[0]
        assert os.path.basename(root).startswith(f"comfy-env-{os.getuid()}-private-")
        watcher = _watcher_of(host.pid)
        host.kill()  # no atexit, and no sweep runs here: only its watcher can remove the root
        host.communicate(timeout=30)
        assert wait_until(lambda: not os.path.exists(root), 5), os.listdir(root)
        assert wait_until(lambda: not alive(watcher), 10)
    finally:
        _reap_host(host, group=True)
        shutil.rmtree(runtime_root(), ignore_errors=True)  # this process's own private root


# ---- 3. sweeps must never touch a live host ---------------------------------------------------

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


# ---- 5. config and arguments that the OS or the clock cannot take -----------------------------

TIME_FIELDS = (
    "call_timeout",
    "start_timeout",
    "cancel_grace",
    "kill_grace",
    "close_timeout",
    "idle_timeout",
    "ping_after_idle",
    "ping_timeout",
    "restart_window",
    "abandon_for",
    "shm_pinned_ttl",
)


@pytest.mark.parametrize("field", TIME_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 1e300, 10**30])
def test_config_timeouts_the_clock_cannot_take_are_validation_errors(
    field: str, value: float
) -> None:
    with pytest.raises(comfy_env.ConfigError, match=field):
        comfy_env.PoolConfig(**{field: value})


def test_config_timeouts_from_the_environment_are_checked_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMFY_ENV_CLOSE_TIMEOUT", "inf")
    with pytest.raises(comfy_env.ConfigError, match=r"CLOSE_TIMEOUT|close_timeout"):
        comfy_env.PoolConfig()


def test_a_config_copied_past_validation_is_checked_when_the_pool_takes_it(
    config: comfy_env.PoolConfig,
) -> None:
    bad = config.model_copy(update={"close_timeout": math.inf})
    with pytest.raises(comfy_env.ConfigError, match="close_timeout"):
        comfy_env.Pool(bad)


def _numeric_fields() -> list[str]:
    """Every ``PoolConfig`` field that holds a number (``int``, ``float``, or one of them or
    None), read from the model: a new numeric field is covered without editing this test."""
    numbers = {int, float, int | None, float | None}
    return [n for n, f in comfy_env.PoolConfig.model_fields.items() if f.annotation in numbers]


@pytest.mark.parametrize("field", _numeric_fields())
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_no_number_for_any_numeric_config_field(field: str, value: bool) -> None:
    # pydantic would take True as 1: call_timeout=True was a one-second deadline.
    with pytest.raises(comfy_env.ConfigError, match=f"{field}.*boolean"):
        comfy_env.PoolConfig(**{field: value})


def test_the_numeric_config_fields_are_the_ones_expected() -> None:
    assert len(_numeric_fields()) == 19  # the list above is not empty by accident


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e300, -1.0, 0, True, "5"])
def test_per_call_timeouts_the_clock_cannot_take_are_argument_errors(
    pool: comfy_env.Pool, value: object
) -> None:
    worker = pool.get_worker()
    with pytest.raises(comfy_env.ArgumentError, match="timeout"):
        worker.run("tasks.remote:add", (1, 2), timeout=value)  # type: ignore[arg-type]
    stats = worker.stats()
    assert stats.spawns == 0 and stats.crashed == 0  # refused before anything ran
    assert worker.run("tasks.remote:add", (1, 2), timeout=30) == 3


@pytest.mark.parametrize(
    ("env_vars", "needle"),
    [
        ({"A=B": "x"}, "A=B"),
        ({"A\0B": "x"}, "NUL"),
        ({"": "x"}, "non-empty"),
        ({"A": "x\0y"}, "NUL"),
    ],
)
def test_env_vars_execve_cannot_take_are_validation_errors(
    env_vars: dict[str, str], needle: str
) -> None:
    with pytest.raises(comfy_env.ConfigError, match="env_vars") as info:
        comfy_env.PoolConfig(env_vars=env_vars)
    assert needle in str(info.value)


def test_paths_with_nul_are_validation_errors() -> None:
    with pytest.raises(comfy_env.ConfigError, match="sys_path"):
        comfy_env.PoolConfig(sys_path=("a\0b",))
    with pytest.raises(comfy_env.ConfigError, match="cwd"):
        comfy_env.PoolConfig(cwd="a\0b")


def test_an_interpreter_that_cannot_be_executed_is_an_env_error(tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o644)
    with pytest.raises(comfy_env.EnvError):
        comfy_env.resolve_env(env)


@root_only
def test_an_env_dir_without_permission_is_an_env_error(tmp_path: Path) -> None:
    env = tmp_path / "private-env"
    (env / "bin").mkdir(parents=True)
    os.symlink(sys.executable, env / "bin" / "python")
    env.chmod(0o700)  # root's; the probe below runs as nobody
    tmp_path.chmod(0o755)
    code = (
        "import sys, comfy_env\n"
        "try:\n"
        "    comfy_env.resolve_env(sys.argv[1])\n"
        "except comfy_env.EnvError as exc:\n"
        "    print('EnvError', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(env)],
        capture_output=True,
        text=True,
        timeout=60,
        user=65534,
        env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
    )
    if "ImportError" in out.stderr or "ModuleNotFoundError" in out.stderr:
        pytest.skip(f"nobody cannot import comfy_env here: {out.stderr[-300:]}")
    assert out.stdout.startswith("EnvError"), out.stdout + out.stderr
    assert "permission denied" in out.stdout


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


# ---- 4. every frame and line bounded, in both directions -------------------------------------


@pytest.fixture
def small_frames(config: comfy_env.PoolConfig) -> Iterator[comfy_env.Pool]:
    cfg = config.model_copy(update={"max_frame_bytes": 1 << 20})
    with comfy_env.Pool(cfg) as pool:
        yield pool


def _unharmed(worker: comfy_env.Worker) -> None:
    assert worker.call("tasks.hostile:add", 1, 2) == 3
    stats = worker.stats()
    assert (stats.generation, stats.spawns, stats.crashed) == (1, 1, 0)


def test_an_exception_too_large_for_a_frame_arrives_clipped_and_the_worker_lives(
    small_frames: comfy_env.Pool,
) -> None:
    worker = small_frames.get_worker()
    for _ in range(3):  # repeated: nothing counts toward the breaker
        with pytest.raises((comfy_env.RemoteError, ValueError)) as info:
            worker.call("tasks.hostile:raise_big", 2 << 20)
        text = str(info.value)
        assert "characters cut" in text and len(text) < (1 << 20)
    _unharmed(worker)


def test_a_log_record_too_large_for_a_frame_arrives_clipped(
    small_frames: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    worker = small_frames.get_worker()
    with caplog.at_level(logging.INFO, logger="comfy_env.worker"):
        assert worker.call("tasks.hostile:log_big", 2 << 20) == "logged"
    clipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LLLL")]
    assert clipped and "characters cut" in clipped[0] and len(clipped[0]) < (1 << 20)
    _unharmed(worker)


# The bound README promises ("cut into lines of 64 KiB"), spelled here rather than imported
# from the modules that cut: a test comparing against their own constant passes for any cap.
README_LINE_CAP = 64 * 1024


def test_python_output_without_newlines_is_cut_into_bounded_lines(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    worker = pool.get_worker()
    with caplog.at_level(logging.INFO, logger="comfy_env.worker"):
        # 4 MiB one character at a time, then 4 MiB in one write: both linear.
        assert worker.call("tasks.hostile:print_big_no_newline", 1 << 20, 1) == "printed"
        assert worker.call("tasks.hostile:print_big_no_newline", 4 << 20, 4 << 20) == "printed"
    lines = [r.getMessage() for r in caplog.records if getattr(r, "stream", "") == "stdout"]
    assert lines and max(len(line) for line in lines) <= README_LINE_CAP
    assert sum(len(line) for line in lines) + worker.stats().log_lines_dropped * (
        README_LINE_CAP
    ) >= (5 << 20)
    _unharmed(worker)


def test_native_output_without_newlines_is_cut_in_linear_time_within_the_flood_budget(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    worker = pool.get_worker()
    with caplog.at_level(logging.INFO, logger="comfy_env.worker"):
        # 32 MiB without a newline: before, quadratic (minutes) and the reply starved.
        assert worker.run("tasks.hostile:native_no_newline", (32 << 20,), timeout=120) == (
            "written"
        )
        assert wait_until(lambda: worker.stats().log_lines_dropped > 0, 30)
    pieces = [
        r.getMessage() for r in caplog.records if getattr(r, "stream", "").startswith("native")
    ]
    assert pieces and max(len(p) for p in pieces) <= README_LINE_CAP
    _unharmed(worker)


def test_a_peer_announcing_a_huge_frame_gets_no_memory_for_it() -> None:
    import socket
    import tracemalloc

    from comfy_env_worker.protocol import HEADER, MAGIC, ChannelClosed, FrameReader, FrameType

    a, b = socket.socketpair()
    try:
        reader = FrameReader(a, 4 << 30)
        b.sendall(HEADER.pack(MAGIC, FrameType.REPLY_OK, 0, 3 << 30, 1) + b"\0" * 1000)
        b.close()
        tracemalloc.start()
        try:
            with pytest.raises(ChannelClosed) as info:
                reader.read()
            _, peak = tracemalloc.get_traced_memory()
            held = info.value  # a caller keeping the error must not keep the payload
            current, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert held is not None
        assert peak < 128 << 20  # not 3 GiB up front
        assert current < 1 << 20
    finally:
        a.close()


def test_a_fake_interpreter_announcing_a_huge_hello_is_refused_at_once(tmp_path: Path) -> None:
    env = tmp_path / "fake-env"
    (env / "bin").mkdir(parents=True)
    fake = env / "bin" / "python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import os, struct, sys, time\n"
        "from comfy_env_worker.protocol import HEADER, MAGIC, FrameType\n"
        "fd = int(sys.argv[8])  # the replies half of the channel\n"
        "os.write(fd, HEADER.pack(MAGIC, FrameType.HELLO, 0, 2 << 30, 0) + b'x' * 100)\n"
        "time.sleep(30)\n"
    )
    fake.chmod(0o755)
    worker_dir = Path(comfy_env.__file__).parent.parent / "workers"
    cfg = comfy_env.PoolConfig(env_vars={"PYTHONPATH": str(worker_dir)}, kill_grace=0.2)
    with comfy_env.Pool(cfg) as pool:
        with pytest.raises(comfy_env.WorkerStartError, match="exceeds the limit"):
            pool.get_worker(str(env)).call("tasks.hostile:add", 1, 2)


# ---- 7. exceptions that fight back ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["str", "reduce", "base"])
def test_an_exception_whose_str_repr_or_reduce_raises_still_gets_a_reply(
    pool: comfy_env.Pool, kind: str
) -> None:
    from tasks import hostile as hardening_tasks

    worker = pool.get_worker()
    with pytest.raises((comfy_env.RemoteError, hardening_tasks.StrRaises)) as info:
        worker.call("tasks.hostile:raise_fighting", kind)
    expected = {"str": "StrRaises", "reduce": "ReduceRaises", "base": "BaseEverythingRaises"}
    error = info.value
    if isinstance(error, comfy_env.RemoteError):
        assert expected[kind] in error.type_name
        assert error.traceback_text
        if kind == "reduce":
            assert "reduce text" in error.message  # what could be salvaged
    else:  # it unpickled here: re-raised as itself, with the remote traceback as its cause
        assert kind == "str" and isinstance(error.__cause__, comfy_env.RemoteTraceback)
    _unharmed(worker)


@pytest.mark.parametrize("kind", ["exit", "interrupt"])
def test_systemexit_while_the_host_unpickles_an_exception_is_a_typed_error(
    pool: comfy_env.Pool, kind: str
) -> None:
    worker = pool.get_worker()
    with pytest.raises(comfy_env.RemoteError, match="HostRebuildRaises"):
        worker.call("tasks.hostile:raise_host_rebuild", kind)
    _unharmed(worker)


# ---- 8. comfy-env status against malformed state files ----------------------------------------


def _live_foreign_host_name() -> str:
    """A status file name of a host that is alive (pid 1 of this namespace), not this one."""
    from comfy_env._identity import pid_namespace, proc_stat

    stat_1 = proc_stat(1)
    assert stat_1 is not None
    return f"1-t{stat_1[1]}-n{pid_namespace()}.json"


def _valid_document(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "schema": 1,
        "host_id": "1-t1-n1",
        "pid": 1,
        "start_ms": 1000,
        "updated_at": 1000.0,
        "pools": [],
    }
    doc.update(over)
    return doc


MALFORMED = {
    "deeply-nested": b"[" * 200_000 + b"]" * 200_000,
    "infinity": json.dumps(_valid_document(updated_at=math.inf)).encode(),
    "nan": json.dumps(_valid_document(start_ms=math.nan)).encode(),
    "overflowing-float": json.dumps(_valid_document())
    .replace('"start_ms": 1000', '"start_ms": 1e999')
    .encode(),
    "huge-int": json.dumps(_valid_document())
    .replace('"pid": 1,', '"pid": ' + "9" * 5000 + ",")
    .encode(),
    "huge-file": b'{"pad": "' + b"x" * (5 << 20) + b'"}',
    "not-json": b"\xff\xfe garbage",
    "wrong-shape": b'{"pools": 5}',
}


@pytest.mark.parametrize("kind", [*MALFORMED, "fifo", "directory"])
def test_status_skips_malformed_state_files_with_a_note_and_never_hangs(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from comfy_env._cli import main
    from comfy_env._status import read_status, status_dir

    path = os.path.join(status_dir(), _live_foreign_host_name())
    if kind == "fifo":
        os.mkfifo(path, 0o600)  # opening it for reading would block without O_NONBLOCK
    elif kind == "directory":
        os.mkdir(path, 0o700)
    else:
        with open(path, "wb") as f:
            f.write(MALFORMED[kind])
    try:
        notes: list[str] = []
        hosts = read_status(notes=notes)
        assert all(h.pid != 1 for h in hosts)
        assert any(path in note for note in notes), notes
        assert main(["status", "--json"]) == 0
        out, err = capsys.readouterr()
        assert any(path in note for note in json.loads(out)["notes"])
        assert main(["status"]) == 0
        out, err = capsys.readouterr()
        assert "note:" in err
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)


# ---- 6. shutdown and descendants -------------------------------------------------------------


def _gone(pid: int) -> bool:
    return not alive(pid)


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def test_a_setsid_descendant_is_stopped_when_its_generation_dies(pool: comfy_env.Pool) -> None:
    worker = pool.get_worker()
    descendant = worker.call("tasks.hostile:spawn_setsid_sleeper", False)
    try:
        assert alive(descendant)
        with pytest.raises(comfy_env.WorkerCrashed):
            worker.call("tasks.hostile:die", 3)
        assert wait_until(lambda: _gone(descendant), 10), "a setsid descendant outlived its worker"
    finally:
        _kill_quietly(descendant)


def test_a_descendant_scan_still_due_at_close_runs_at_close(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scan for a dead generation's setsid descendants runs on a reactor timer after the
    # exit (off the crash report's path). Here the timer is set far out: only close() can run
    # the scan, also for a generation the pool no longer lists (its slot holds generation 2).
    from comfy_env import _exitwatch

    monkeypatch.setattr(_exitwatch, "_MARKED_SCAN_DELAY", 3600.0)
    with comfy_env.Pool(config) as pool:
        worker = pool.get_worker()
        descendant = worker.call("tasks.hostile:spawn_setsid_sleeper", False)
        try:
            with pytest.raises(comfy_env.WorkerCrashed):
                worker.call("tasks.hostile:die", 3)
            assert worker.call("tasks.hostile:add", 1, 2) == 3  # generation 2
            assert alive(descendant)  # its scan is due in an hour
        except BaseException:
            _kill_quietly(descendant)
            raise
    try:
        assert wait_until(lambda: _gone(descendant), 10), "a due scan did not run at close"
    finally:
        _kill_quietly(descendant)


def test_a_setsid_descendant_is_stopped_at_close(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config) as pool:
        descendant = pool.get_worker().call("tasks.hostile:spawn_setsid_sleeper", False)
    try:
        assert wait_until(lambda: _gone(descendant), 10), "a setsid descendant outlived close()"
    finally:
        _kill_quietly(descendant)


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


def _links(fds: list[int]) -> set[str]:
    out = set()
    for fd in fds:
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def _open_links() -> set[str]:
    return _links([int(fd) for fd in os.listdir("/proc/self/fd")])


def test_a_dead_generation_holds_no_host_descriptors_while_a_descendant_keeps_its_pipes(
    pool: comfy_env.Pool,
) -> None:
    worker = pool.get_worker()
    # It cleared its environment: no mark finds it, and it keeps stdout/stderr open.
    descendant = worker.call("tasks.hostile:spawn_setsid_sleeper", True)
    try:
        process = pool._entries[worker.env].slots[0].process
        assert process is not None and process.popen is not None
        streams = (process.pipes._stdout, process.pipes._stderr, process.pipes._log_pipe)
        # Both ends: the host keeps the write ends open until the reaping (see launch).
        pipes = [p.fileno() for p in streams if p] + list(process.pipes._held_ends)
        assert len(pipes) == 6
        held = _links(pipes)
        assert held and all(link.startswith("pipe:") for link in held)
        with pytest.raises(comfy_env.WorkerCrashed):
            worker.call("tasks.hostile:die", 3)
        assert alive(descendant)
        assert wait_until(lambda: not (held & _open_links()), 10), "the dead generation's pipes"
        assert worker.call("tasks.hostile:add", 1, 2) == 3
    finally:
        _kill_quietly(descendant)


def test_close_while_many_envs_start_is_one_bounded_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from comfy_env._exitwatch import ExitWatch
    from comfy_env._outputpipes import OutputPipes

    real = os.path.realpath(sys.executable)
    pidfile = tmp_path / "escaped.pids"
    envs = []
    for i in range(12):
        env = tmp_path / f"slow{i}"
        (env / "bin").mkdir(parents=True)
        python = env / "bin" / "python"
        # A slow start that ignores SIGTERM, with a descendant that escaped every stop (own
        # session, empty environment) holding the output pipes: close() must escalate for
        # every env, and draining output waits for nothing but a deadline.
        python.write_text(
            "#!/bin/sh\n"
            f"setsid env -i /bin/sleep 60 & echo $! >> {pidfile}\n"
            'trap "" TERM\n'
            "sleep 60\n"
            f'exec {real} "$@"\n'
        )
        python.chmod(0o755)
        envs.append(str(env))
    closer: list[threading.Thread] = []
    deadlines: list[float] = []
    # (``WorkerProcess.wait_exit`` and ``wait_output`` are these parts' bound methods.)
    for part, name in ((ExitWatch, "wait_exit"), (OutputPipes, "wait")):
        original = getattr(part, name)

        def recording(self: Any, timeout: float, _original: Any = original) -> Any:
            if closer and threading.current_thread() is closer[0]:
                deadlines.append(time.monotonic() + timeout)
            return _original(self, timeout)

        monkeypatch.setattr(part, name, recording)
    cfg = comfy_env.PoolConfig(close_timeout=1.0, kill_grace=5.0, start_timeout=120)
    pool = comfy_env.Pool(cfg)
    errors: list[BaseException] = []

    def call(env: str) -> None:
        try:
            pool.get_worker(env).call("tasks.hostile:add", 1, 2)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(env,)) for env in envs]
    try:
        for t in threads:
            t.start()
        assert wait_until(lambda: len(pool._spawner.processes) == len(envs), 60)
        assert wait_until(lambda: len(pidfile.read_text().split()) == len(envs), 30)
        closer.append(threading.current_thread())
        started = time.monotonic()
        pool.close()
        for t in threads:
            t.join(30)
        assert len(errors) == len(envs)
        assert all(isinstance(e, comfy_env.PoolClosedError) for e in errors), errors
        # Every wait close() made ended by one shared deadline per phase: close_timeout, then
        # 2 s for SIGKILL to land, then 0.5 s to drain output (plus slack for a busy machine),
        # never a wait per env (12 envs x 0.5 s of draining alone would pass the bound).
        assert deadlines
        assert max(deadlines) - started <= 1.0 + 2.0 + 0.5 + 2.0
    finally:
        pool.close()
        if pidfile.exists():
            for pid in pidfile.read_text().split():
                _kill_quietly(int(pid))


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
