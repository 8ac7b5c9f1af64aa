"""Concurrency, queueing, stats, shutdown and process-exit behaviour of the pool."""

from __future__ import annotations

import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from conftest import alive as _alive
from conftest import run_host as _run_host
from conftest import wait_until as _wait

import comfy_env
import comfy_env_worker
from comfy_env import PoolClosedError, WorkerCrashed
from comfy_env._process import runtime_root

_OUTCOMES = ("ok", "raised", "crashed", "timed_out", "cancelled", "failed")


def _invariant_holds(stats: comfy_env.EnvStats) -> bool:
    total = sum(getattr(stats, f) for f in _OUTCOMES) + stats.in_flight + stats.queued
    return stats.submitted == total


def test_concurrent_first_calls_spawn_the_env_once(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    barrier = threading.Barrier(8)
    results: list[int] = []

    def call() -> None:
        barrier.wait()
        results.append(w.call("comfy_env_worker.tasks:getpid"))

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    assert w.stats().spawns == 1


def test_callers_of_a_busy_env_are_served_in_fifo_order(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    served: list[tuple[int, int]] = []  # (worker's monotonic clock when it ran the call, i)
    blocker = threading.Thread(target=w.call, args=("comfy_env_worker.tasks:sleep", 0.5))
    blocker.start()
    assert _wait(lambda: w.stats().in_flight == 1)
    threads = []
    for i in range(5):
        t = threading.Thread(target=lambda i=i: served.append(w.call("tasks.remote:stamp", i)))
        t.start()
        threads.append(t)
        assert _wait(lambda n=i + 1: w.stats().queued == n)  # queued in this order
    blocker.join()
    for t in threads:
        t.join()
    # The order the worker *ran* them in (not the order the threads woke up afterwards).
    assert [i for _, i in sorted(served)] == [0, 1, 2, 3, 4]


def test_max_workers_per_env_runs_calls_in_parallel(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config.model_copy(update={"max_workers_per_env": 2})) as pool:
        w = pool.get_worker()
        pids: list[int] = []
        barrier = threading.Barrier(2)

        def call() -> None:
            barrier.wait()
            pids.append(w.call(_sleep_then_pid, 0.3))

        threads = [threading.Thread(target=call) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = w.stats()
        assert len(set(pids)) == 2
        assert stats.spawns == 2
        assert {ws.generation for ws in stats.workers} == {1, 2}
        assert all(ws.state == "idle" for ws in stats.workers)


def _sleep_then_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_stats_invariant_holds_under_concurrent_calls_and_crashes(
    config: comfy_env.PoolConfig, foreign_venv: Path
) -> None:
    # Crashes are the point here, so the crash-loop breaker gets out of the way.
    update = {"max_workers_per_env": 2, "max_restarts": 1000}
    with comfy_env.Pool(config.model_copy(update=update)) as pool:
        workers = [pool.get_worker(), pool.get_worker(foreign_venv)]
        stop = threading.Event()
        errors: list[BaseException] = []
        samples: list[bool] = []

        def hammer(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(25):
                w = rng.choice(workers)
                try:
                    roll = rng.random()
                    if roll < 0.1:
                        w.call("comfy_env_worker.tasks:crash")
                    elif roll < 0.2:
                        w.call(int, "not a number")
                    elif roll < 0.25:
                        w.run("comfy_env_worker.tasks:sleep", (5,), timeout=0.05)
                    else:
                        assert w.call("tasks.remote:add", seed, 1) == seed + 1
                except (WorkerCrashed, ValueError, comfy_env.CallTimeout):
                    pass
                except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
                    errors.append(exc)

        def sample() -> None:
            while not stop.is_set():
                samples.extend(_invariant_holds(s) for s in pool.stats().values())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        sampler.join()
        assert not errors, errors
        assert samples and all(samples)
        for stats in pool.stats().values():
            assert _invariant_holds(stats)
            assert stats.in_flight == 0 and stats.queued == 0
        total = sum(s.submitted for s in pool.stats().values())
        assert total == 6 * 25


def test_close_stops_every_worker_and_later_calls_raise(config: comfy_env.PoolConfig) -> None:
    pool = comfy_env.Pool(config.model_copy(update={"max_workers_per_env": 2}))
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    assert pid is not None
    pool.close()
    assert not _alive(pid)
    with pytest.raises(PoolClosedError):
        w.call("comfy_env_worker.tasks:echo", 1)
    with pytest.raises(PoolClosedError):
        pool.get_worker()
    pool.close()  # idempotent


def test_close_fails_running_and_queued_calls_with_pool_closed(
    config: comfy_env.PoolConfig,
) -> None:
    pool = comfy_env.Pool(config)
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    errors: list[BaseException] = []

    def call() -> None:
        try:
            w.call("comfy_env_worker.tasks:sleep", 30)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    assert _wait(lambda: w.stats().in_flight == 1 and w.stats().queued == 2)
    started = time.monotonic()
    pool.close()
    for t in threads:
        t.join(10)
    assert time.monotonic() - started < 10
    assert len(errors) == 3
    assert all(isinstance(e, PoolClosedError) for e in errors), errors
    stats = w.stats()
    assert _invariant_holds(stats) and stats.failed == 3


def test_a_call_whose_worker_close_stopped_before_its_launch_gets_pool_closed(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # close() lands between the slot's new generation and its launch on the reactor (29 of
    # 48 calls in a try with many envs starting): the call is failed by the close, told as
    # PoolClosedError, never as a WorkerStartError "stopped before it was launched".
    from comfy_env._process import WorkerProcess

    original = WorkerProcess.launch
    launching = threading.Event()

    def launch_once_stopped(self: WorkerProcess, *args: object, **kwargs: object) -> None:
        launching.set()
        assert _wait(lambda: self.watch.kill_requested, 30)  # close() stopped it: launch now
        original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(WorkerProcess, "launch", launch_once_stopped)
    pool = comfy_env.Pool(config)
    w = pool.get_worker()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            w.call("comfy_env_worker.tasks:echo", 0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        assert launching.wait(30)
        pool.close()
    finally:
        caller.join(30)
        pool.close()
    assert len(errors) == 1 and isinstance(errors[0], PoolClosedError), errors
    stats = w.stats()
    assert _invariant_holds(stats) and stats.failed == 1 and stats.restarts_in_window == 0


def test_close_stops_workers_in_parallel(config: comfy_env.PoolConfig, tmp_path: Path) -> None:
    envs = []
    for i in range(4):
        env = tmp_path / f"env{i}" / "bin"
        env.mkdir(parents=True)
        (env / "python").symlink_to(sys.executable)
        envs.append(tmp_path / f"env{i}")
    pool = comfy_env.Pool(config.model_copy(update={"kill_grace": 1.0, "close_timeout": 5}))
    workers = [pool.get_worker(e) for e in envs]
    for w in workers:
        w.call("comfy_env_worker.tasks:echo", 0)
    outcomes: list[BaseException] = []

    def call(w: comfy_env.Worker) -> None:
        try:
            w.call("tasks.remote:sleep_ignoring_sigterm", 30)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcomes.append(exc)

    threads = [threading.Thread(target=call, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    assert _wait(lambda: all(w.stats().in_flight == 1 for w in workers))
    started = time.monotonic()
    pool.close()
    elapsed = time.monotonic() - started
    for t in threads:
        t.join()
    # Each worker ignores SIGTERM and needs the 1 s escalation; one after another takes 4 s.
    assert elapsed < 3.0, elapsed
    assert len(outcomes) == 4 and all(isinstance(e, PoolClosedError) for e in outcomes)


def test_interpreter_exit_stops_workers_and_removes_the_runtime_dir() -> None:
    host = _run_host(
        """
        import comfy_env, os
        w = comfy_env.get_worker()
        w.call("comfy_env_worker.tasks:echo", 1)
        print(w.pid, flush=True)
        # no close(): interpreter exit must clean up
        """
    )
    out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    pid = int(out.split()[0])
    assert _wait(lambda: not _alive(pid), 5)
    leftovers = [d for d in os.listdir(runtime_root()) if d.startswith(f"host-{host.pid}-")]
    assert leftovers == []
    assert "resource_tracker" not in err and "Traceback" not in err


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "os._exit"])
def test_workers_die_within_two_seconds_of_their_host(how: str) -> None:
    host = _run_host(
        """
        import comfy_env, os, signal, sys, time
        w = comfy_env.get_worker()
        w.call("comfy_env_worker.tasks:echo", 1)
        print(w.pid, flush=True)
        if sys.argv[1] == "os._exit":
            os._exit(0)
        time.sleep(60)
        """,
        how,
    )
    assert host.stdout is not None
    pid = int(host.stdout.readline())
    if how != "os._exit":
        host.send_signal(getattr(signal, how))
    host.wait(30)
    assert _wait(lambda: not _alive(pid), 2.0), f"worker {pid} outlived its host ({how})"
    host.communicate()
    # A host killed outright leaves blocks and its runtime dir; the sweep removes them.
    comfy_env.sweep()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{host.pid}-")]
    assert not [d for d in os.listdir(runtime_root()) if d.startswith(f"host-{host.pid}-")]


def test_workers_survive_the_exit_of_the_thread_that_first_called() -> None:
    # PR_SET_PDEATHSIG fires when the *thread* that forked a child exits; the pool forks from
    # its own long-lived thread so a short-lived caller thread cannot take workers down.
    host = _run_host(
        """
        import comfy_env, threading, time
        w = comfy_env.get_worker()
        t = threading.Thread(target=w.call, args=("comfy_env_worker.tasks:echo", 1))
        t.start(); t.join()
        pid = w.pid
        time.sleep(0.3)
        print(pid, w.call("comfy_env_worker.tasks:getpid"), w.generation, flush=True)
        """
    )
    out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    first, second, generation = out.split()
    assert first == second and generation == "1"


def test_importing_comfy_env_has_no_side_effects() -> None:
    code = """
        import atexit, threading, sys
        import logging, concurrent.futures, subprocess, selectors  # stdlib's own atexit hooks
        before = atexit._ncallbacks()
        import comfy_env
        assert threading.active_count() == 1, threading.enumerate()
        assert atexit._ncallbacks() == before, "atexit registered at import"
        assert not comfy_env._shutdown._hooks_installed
        print("ok")
    """
    host = _run_host(code)
    out, err = host.communicate(timeout=60)
    assert out.strip() == "ok", err


def test_demo_command_runs(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "comfy_env", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WorkerCrashed: signal=SIGSEGV" in result.stdout
    assert "generation 2" in result.stdout
    assert "CallTimeout" in result.stdout


def test_the_runtime_package_is_byte_compiled_once_and_recompiled_when_stale(
    tmp_path: Path,
) -> None:
    # The runtime directory is filled from packages whose byte code is current (pip compiles
    # on install); a missing or older .pyc is compiled before the copy, so workers import
    # byte code rather than compiling the runtime at every start.
    from comfy_env._runtime_store import _byte_code_current, _precompile

    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for path in (package / "__init__.py", package / "sub" / "mod.py"):
        path.write_text("X = 1\n")
    assert not _byte_code_current(str(package))
    _precompile(str(package))
    tag = sys.implementation.cache_tag
    compiled = package / "sub" / "__pycache__" / f"mod.{tag}.pyc"
    assert compiled.exists() and _byte_code_current(str(package))
    later = compiled.stat().st_mtime_ns + 10**9
    os.utime(package / "sub" / "mod.py", ns=(later, later))  # edited after it was compiled
    assert not _byte_code_current(str(package))
    _precompile(str(package))
    assert _byte_code_current(str(package))


def _files(top: str) -> dict[str, os.stat_result]:
    return {
        os.path.relpath(os.path.join(d, f), top): os.lstat(os.path.join(d, f))
        for d, _, files in os.walk(top)
        for f in files
    }


@pytest.fixture
def own_runtime_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A runtime root of this test's own: the machine's shared one may hold the stores of
    other package versions (an older checkout's CI run keeps its store for an hour), and
    these tests remove and plant stores."""
    from comfy_env._rundir import runtime_root

    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    root = runtime_root()
    assert root == str(base / "comfy-env")
    return root


def test_without_xdg_runtime_dir_the_root_is_where_tempfile_would_put_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fallback root is found without importing tempfile, but in the same place.
    import tempfile

    from comfy_env._rundir import _candidate

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches its choice
    mine = tmp_path / "tmp"
    mine.mkdir()
    cases = [
        {"TMPDIR": str(mine)},
        {"TMPDIR": str(tmp_path / "missing"), "TMP": str(mine)},
        {"TMPDIR": str(tmp_path / "missing")},
        {},
    ]
    for env in cases:
        for name in ("TMPDIR", "TEMP", "TMP"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        tempfile.tempdir = None
        expected = os.path.join(tempfile.gettempdir(), f"comfy-env-{os.getuid()}")
        assert _candidate() == expected, env


def test_runtime_dirs_are_hard_links_into_one_store_of_ours(own_runtime_root: str) -> None:
    # A fresh host links its runtime dir from a content-addressed store made by the first
    # host: same files (inode, size, time), directories of its own, nothing followed.
    from comfy_env._runtime_store import RuntimeDir

    first, second = RuntimeDir().ready(), RuntimeDir().ready()
    try:
        root = own_runtime_root
        stores = [n for n in os.listdir(root) if n.startswith("store-")]
        assert len(stores) == 1
        store = os.path.join(root, stores[0])
        assert stat.S_IMODE(os.lstat(store).st_mode) == 0o700
        assert os.lstat(store).st_uid == os.getuid()
        linked = _files(store)
        assert any(p.startswith("comfy_env_worker/") for p in linked)
        assert any(p.startswith("cloudpickle/") for p in linked)
        for path in (first, second):
            mine = _files(path)
            assert mine.keys() == linked.keys()
            assert all(mine[p].st_ino == linked[p].st_ino for p in mine)
            assert not os.path.samefile(os.path.join(path, "comfy_env_worker"), store)
    finally:
        shutil.rmtree(first)
        shutil.rmtree(second)


def test_a_store_planted_as_a_symlink_is_never_used(tmp_path: Path, own_runtime_root: str) -> None:
    # The store's name is predictable: a symlink (or anything not ours) at it is refused and
    # the host copies the packages itself; nothing is read from the planted target.
    from comfy_env import _runtime_store

    root = own_runtime_root
    assert not [name for name in os.listdir(root) if name.startswith("store-")]
    sources = [
        ("comfy_env_worker", os.path.dirname(comfy_env_worker.__file__)),
        ("cloudpickle", os.path.dirname(cloudpickle.__file__)),
    ]
    for _, source in sources:
        _runtime_store._precompile(source)
    planted = tmp_path / "planted"
    (planted / "comfy_env_worker").mkdir(parents=True)
    (planted / "comfy_env_worker" / "main.py").write_text("raise SystemExit('planted')\n")
    (planted / "cloudpickle").mkdir()
    link = os.path.join(root, "store-" + _runtime_store._content_key(sources))
    os.symlink(planted, link)
    path = _runtime_store.RuntimeDir().ready()
    try:
        main = os.path.join(path, "comfy_env_worker", "main.py")
        assert "planted" not in Path(main).read_text()
        assert os.lstat(main).st_ino != (planted / "comfy_env_worker" / "main.py").stat().st_ino
        assert os.path.islink(link)  # left alone, not followed, not replaced
    finally:
        shutil.rmtree(path)
        os.unlink(link)


def test_a_worker_starts_without_the_heavy_stdlib_modules() -> None:
    # Start-up cost (issue 16): the worker's channel is the C socket type, its locks and
    # watchdog come from _thread, logging loads when the env's code first imports it. Asked
    # through sys.modules itself, so the question imports nothing. (What the env's own code
    # imports is its business: this is only the runtime's share. ctypes is not asked about:
    # the watchdog loads it 0.1 s after the handshake, to arm the parent-death signal.)
    with comfy_env.Pool() as pool:
        worker = pool.get_worker(None)
        assert worker.call("comfy_env_worker.tasks:echo", 1) == 1
        heavy = ("socket", "selectors", "threading", "logging", "typing", "dataclasses")
        loaded = [name for name in heavy if worker.call("sys:modules.__contains__", name)]
        assert loaded == []


def test_the_runtime_dir_is_filled_while_the_first_worker_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first spawn launches its interpreter, then fills the runtime dir; BOOT waits for the
    # host's GO byte, so a fill slower than the interpreter's start is still never seen half
    # made.
    import psutil

    from comfy_env import _process, _runtime_store

    fill = _runtime_store._fill_runtime_dir
    children_at_fill: list[list[str]] = []

    def slow_fill(path: str, root: str) -> None:
        children_at_fill.append([" ".join(c.cmdline()) for c in psutil.Process().children()])
        time.sleep(0.5)  # the interpreter is up long before this ends
        fill(path, root)

    monkeypatch.setattr(_runtime_store, "_fill_runtime_dir", slow_fill)
    with comfy_env.Pool() as pool:
        worker = pool.get_worker(None)
        assert worker.call("comfy_env_worker.tasks:echo", 7) == 7
        assert len(children_at_fill) == 1
        assert any(_process.BOOT in cmdline for cmdline in children_at_fill[0])
    assert len(children_at_fill) == 1  # filled once per pool


def test_the_runtime_dir_is_named_before_the_launch_and_made_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Off the first call's path: the pool names the dir (the worker's command line carries
    # it) and makes it once the worker's interpreter is starting, before GO.
    import psutil

    from comfy_env import _process, _runtime_store
    from comfy_env._identity import host_id

    make = _runtime_store.make_private_dir
    made: list[tuple[list[str], str | None]] = []

    def recording(parent: str, prefix: str, suffix: str | None = None) -> str:
        made.append(([" ".join(c.cmdline()) for c in psutil.Process().children()], suffix))
        return make(parent, prefix, suffix)

    monkeypatch.setattr(_runtime_store, "make_private_dir", recording)
    with comfy_env.Pool() as pool:
        worker = pool.get_worker(None)
        assert worker.call("comfy_env_worker.tasks:echo", 3) == 3
        assert pool._spawner.runtime_dir is not None
        path = pool._spawner.runtime_dir.path
        [(children, suffix)] = made
        assert suffix is not None and os.path.basename(path) == f"host-{host_id()}-{suffix}"
        assert any(_process.BOOT in cmdline and path in cmdline for cmdline in children)
        assert os.path.isdir(os.path.join(path, "comfy_env_worker"))


def test_a_named_private_dir_that_is_taken_is_refused(own_runtime_root: str) -> None:
    from comfy_env._rundir import make_private_dir, private_dir_suffix

    suffix = private_dir_suffix()
    path = make_private_dir(own_runtime_root, "host-test-", suffix)
    try:
        assert os.path.basename(path) == f"host-test-{suffix}"
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
        with pytest.raises(FileExistsError):
            make_private_dir(own_runtime_root, "host-test-", suffix)
    finally:
        os.rmdir(path)


def test_a_runtime_dir_that_cannot_be_filled_fails_the_start_and_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from comfy_env import WorkerStartError, _runtime_store

    fill = _runtime_store._fill_runtime_dir
    attempts: list[str] = []

    def failing_once(path: str, root: str) -> None:
        attempts.append(path)
        if len(attempts) == 1:
            raise OSError(28, "No space left on device")
        fill(path, root)

    monkeypatch.setattr(_runtime_store, "_fill_runtime_dir", failing_once)
    with comfy_env.Pool() as pool:
        worker = pool.get_worker(None)
        with pytest.raises(WorkerStartError, match=r"runtime directory .*No space left"):
            worker.call("comfy_env_worker.tasks:echo", 1)
        assert worker.call("comfy_env_worker.tasks:echo", 2) == 2  # the next start fills it
        assert attempts[0] == attempts[1]
        stats = worker.stats()
        assert stats.failed == 1 and stats.ok == 1 and stats.spawns == 2


def test_boot_without_go_exits_quietly_and_imports_nothing(tmp_path: Path) -> None:
    # A host that closes the channel before GO (it died, or could not fill the dir): the
    # interpreter leaves without touching the runtime dir, with nothing on stderr.
    import socket

    from comfy_env._process import BOOT

    mine, theirs = socket.socketpair()
    missing = tmp_path / "never-made"
    proc = subprocess.Popen(
        [sys.executable, "-c", BOOT, str(missing), str(theirs.fileno()), "0"],
        pass_fds=(theirs.fileno(),),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    theirs.close()
    mine.close()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert (out, err) == (b"", b"")
    assert not missing.exists()


def test_a_store_that_cannot_be_linked_from_is_copied_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A store pruned by a host of another version while this host links from it: copy.
    from comfy_env import _runtime_store

    def fail(source: str, dest: str) -> None:
        raise FileNotFoundError(source)

    monkeypatch.setattr(_runtime_store, "link_tree", fail)
    path = _runtime_store.RuntimeDir().ready()
    try:
        main = os.path.join(path, "comfy_env_worker", "main.py")
        source = os.path.join(os.path.dirname(comfy_env_worker.__file__), "main.py")
        assert Path(main).read_bytes() == Path(source).read_bytes()
        assert os.lstat(main).st_ino != os.lstat(source).st_ino
        assert os.lstat(main).st_nlink == 1  # a copy, not a link into the store
    finally:
        shutil.rmtree(path)


def _edit(path: Path, text: str) -> None:
    later = path.stat().st_mtime_ns + 10**9
    path.write_text(text)
    os.utime(path, ns=(later, later))


def test_a_store_of_other_package_files_is_replaced(tmp_path: Path, own_runtime_root: str) -> None:
    # The key covers every file's path, size and time: edited packages get a new store; the
    # old one is pruned once unused for an hour (two versions in use side by side keep both).
    from comfy_env import _runtime_store

    package = tmp_path / "comfy_env_worker"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    sources = [("comfy_env_worker", str(package))]
    root = own_runtime_root
    old = _runtime_store._runtime_store(root, sources)
    assert old is not None and os.path.isdir(old)
    assert _runtime_store._runtime_store(root, sources) == old  # same files: the same store
    _edit(package / "__init__.py", "X = 2\n")
    new = _runtime_store._runtime_store(root, sources)
    assert new is not None and new != old
    assert os.path.isdir(old)  # used a moment ago: kept
    assert Path(new, "comfy_env_worker", "__init__.py").read_text() == "X = 2\n"
    hour_ago = time.time() - _runtime_store._STORE_IDLE_S - 60
    os.utime(old, (hour_ago, hour_ago))
    _edit(package / "__init__.py", "X = 3\n")
    newest = _runtime_store._runtime_store(root, sources)
    assert newest is not None and newest not in (old, new)
    assert not os.path.exists(old)  # unused for an hour: pruned
    assert os.path.isdir(new)
    shutil.rmtree(new)
    shutil.rmtree(newest)
