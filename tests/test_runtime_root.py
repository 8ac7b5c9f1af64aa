"""The runtime root must be ours, or refused: a symlink planted at the root is never followed,
another user's root is refused with one warning, our own with loose permissions is tightened,
an unsafe TMPDIR or XDG_RUNTIME_DIR is never the root's parent, and a hostile root leaves a
pool running from a private root made in a safe place (or a typed error naming the unsafe
dir). Another user cannot swap the root away before a respawn. The private root outlives the
pools and goes with the host (at exit, by the sweep, or with the watcher of a killed host); a
status dir that is not ours never makes ``close()`` or the sweep raise.
"""

from __future__ import annotations

import contextlib
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
from conftest import (
    TESTS_DIR,
    alive,
    root_only,
    wait_until,
)
from conftest import reap_host as _reap_host

import comfy_env


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
