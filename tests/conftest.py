"""Shared fixtures, and the leak guard that runs around every test.

The leak guard snapshots this process's children, open descriptors, threads, comfy-env runtime
directories and ``/dev/shm`` entries before a test, and after it waits (bounded) for them to
return to that snapshot. Anything that survives fails the test by name: a worker process, a
zombie, a socket, a pipe, a reactor thread, a runtime dir or a shared-memory block.

Ray (tests marked ``ray``): one local cluster serves the whole session (``ray_cluster``, started
by the leak guard of the first Ray test, before its snapshot, and shut down at the end of the
session; the Ray tests run last, so the rest of the suite runs without it). The cluster's own
processes come and go as Ray likes (it prestarts and retires pooled workers), so the process
probe leaves the cluster's process tree out, and a probe of its own checks what is ours in it:
no actor that comfy-env created during the test is alive afterwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest

import comfy_env
from comfy_env._process import runtime_root

TESTS_DIR = Path(__file__).resolve().parent


def _fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass  # the listing's own descriptor, already closed
    return out


# The direct children that make up the session's Ray cluster (gcs, raylet, agents), once it runs.
_RAY_ROOTS: set[int] = set()


def _ray_tree() -> set[int]:
    """The pids of the Ray cluster's processes: its roots and all their descendants."""
    tree = set()
    for pid in _RAY_ROOTS:
        try:
            root = psutil.Process(pid)
            tree.add(pid)
            tree.update(p.pid for p in root.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return tree


def _children() -> set[tuple[int, float]]:
    out = set()
    ray_tree = _ray_tree() if _RAY_ROOTS else set()
    for child in psutil.Process().children(recursive=True):
        if child.pid in ray_tree:
            continue  # Ray's business; our actors in it are checked by _ray_actors
        try:
            out.add((child.pid, child.create_time()))
        except psutil.NoSuchProcess:
            pass
    return out


def _ray_actors() -> set[str]:
    """Actors comfy-env created that Ray has not reported dead (with their pids)."""
    return {f"actor {a} pid {p}" for a, p in ray_live_actors().items()}


def ray_live_actors() -> dict[str, int | None]:
    """Actors this process created through comfy-env whose death Ray has not reported yet
    (actor id -> pid once known); empty while the Ray backend was never imported."""
    ray_backend = sys.modules.get("comfy_env._ray")
    if ray_backend is None:
        return {}
    with ray_backend._actors_lock:
        return dict(ray_backend._live_actors)


def _zombies() -> list[int]:
    zombies = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                zombies.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return zombies


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def _runtime_dirs() -> set[str]:
    root = runtime_root()
    prefix = f"host-{os.getpid()}-"
    return {d for d in os.listdir(root) if d.startswith(prefix)}


def _shm() -> set[str]:
    try:
        # Only this process's blocks (its workers' carry its pid too): other programs on the
        # machine, or benchmarks running beside the suite, must not fail a test.
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{os.getpid()}-")}
    except FileNotFoundError:  # pragma: no cover - not Linux
        return set()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: runs on the session's local Ray cluster")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Ray tests last (stable order otherwise): the cluster starts once, late."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the session (skips when ray is not installed)."""
    ray = pytest.importorskip("ray")
    before = {p.pid for p in psutil.Process().children()}
    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=256 << 20,
            log_to_driver=False,
        )
    _RAY_ROOTS.update(p.pid for p in psutil.Process().children() if p.pid not in before)
    # Warm up: the driver opens its connections (raylet, object store, pub-sub) on first use
    # and keeps them for the session; they belong to the cluster, not to the first Ray test.
    with comfy_env.Pool(comfy_env.PoolConfig(backend="ray", start_timeout=120.0)) as pool:
        pool.get_worker().call("comfy_env_worker.tasks:echo", 1)
    yield
    ray.shutdown()
    _RAY_ROOTS.clear()


@pytest.fixture(autouse=True)
def no_ctrl_c_carried_over() -> None:
    """Each test starts as if no Ctrl-C had reached the pool: a test that interrupts calls
    leaves the process-wide time of the last one behind, and for ``STORM_SECONDS`` after it
    every call takes the held path (``_interrupts.in_storm``), which the next test did not ask
    for."""
    from comfy_env import _interrupts

    _interrupts.LAST_INTERRUPT[0] = _interrupts.NEVER


@pytest.fixture(autouse=True)
def leak_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("ray") is not None:
        # Before the snapshot: the cluster's processes and threads are not the test's.
        request.getfixturevalue("ray_cluster")
    before = {
        "child processes": _children(),
        "descriptors": _fds(),
        "threads": _threads(),
        "runtime dirs": _runtime_dirs(),
        "/dev/shm blocks": _shm(),
        "Ray actors": _ray_actors(),
    }
    yield
    probes = {
        "child processes": _children,
        "descriptors": _fds,
        "threads": _threads,
        "runtime dirs": _runtime_dirs,
        "/dev/shm blocks": _shm,
        "Ray actors": _ray_actors,
    }
    deadline = time.monotonic() + 5.0
    while True:
        leaked = {}
        for name, probe in probes.items():
            extra = probe() - before[name]  # type: ignore[operator]
            if extra:
                leaked[name] = extra
        zombies = _zombies()
        if zombies:
            leaked["zombies"] = set(zombies)
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if leaked:
        for pid_time in leaked.get("child processes", ()):
            try:
                psutil.Process(pid_time[0]).kill()
            except psutil.NoSuchProcess:
                pass
        pytest.fail(f"{request.node.nodeid} leaked: {leaked}", pytrace=False)


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Python's own Ctrl-C handler (``KeyboardInterrupt``) for the test, where this process
    was started with SIGINT ignored: a shell starts a background job (``cmd &``) so, and the
    process then never installs it. Tests that send SIGINT to themselves need the handler a
    program started from a terminal has; the previous one is put back after."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("needs the main thread (signal handlers are set there)")
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def config() -> comfy_env.PoolConfig:
    """A config whose workers can import the test helpers in tests/tasks/remote.py."""
    return comfy_env.PoolConfig(sys_path=(str(TESTS_DIR),), kill_grace=0.5, close_timeout=3.0)


@pytest.fixture
def pool(config: comfy_env.PoolConfig) -> Iterator[comfy_env.Pool]:
    with comfy_env.Pool(config) as p:
        yield p


@pytest.fixture
def default_pool_cleanup() -> Iterator[None]:
    yield
    comfy_env.shutdown()


@pytest.fixture(scope="session")
def foreign_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bare venv (no pip, no comfy_env, no third-party packages) made with ``python -m venv``."""
    path = tmp_path_factory.mktemp("envs") / "foreign"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path


def private_shm_mount_usable(size: str = "1M") -> bool:
    """Can a test mount a private tmpfs over /dev/shm in a mount namespace of its own
    (``unshare -m``, root on Linux)? Tests that need one skip or fall back otherwise."""
    import shutil

    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs /dev/shm"],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def alive(pid: int) -> bool:
    """Is ``pid`` a running process (a zombie counts as gone)?"""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def reactor_held(pool: comfy_env.Pool) -> Iterator[threading.Event]:
    """Keep the pool's reactor thread busy inside the block (it reaps and reports exits);
    yields the event that frees it, set on the way out."""
    reactor = pool._spawner.reactor
    assert reactor is not None
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(30)

    reactor.call_soon(hold)
    try:
        assert held.wait(10)
        yield release
    finally:
        release.set()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def stop_consumed_acks(channel: Any) -> None:
    """Make the host send no more CONSUMED acks on ``channel`` (a ``comfy_env._channel.Channel``):
    loans returned later are dropped and a reply copied out is not acked, so the worker keeps
    those reply blocks pinned until its TTL (``shm_pinned_ttl``) or its death."""
    loans = channel.loans

    def take_returns() -> bytes:
        loans.returned.clear()
        return b""

    loans.take_returns = take_returns
    channel.send_consumed = lambda call_id, flags=0: None


def run_host(code: str, *args: str) -> subprocess.Popen[str]:
    """A separate host process (its own session) running ``code``; tests/ is importable."""
    import textwrap

    env = dict(os.environ, PYTHONPATH=str(TESTS_DIR))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def reap_host(host: subprocess.Popen[Any], group: bool = False) -> None:
    """Kill a host subprocess a test left running (its whole process group with ``group``)
    and reap it."""
    if host.poll() is None:
        if group:
            os.killpg(host.pid, 9)
        else:
            host.kill()
        host.communicate(timeout=30)


def host_result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The ``RESULT <json>`` line a host script printed, once it exited 0."""
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(line[0][len("RESULT ") :])
    return result


def gone(pid: int) -> bool:
    """Has ``pid`` exited (a zombie counts as gone)?"""
    return not alive(pid)


def kill_quietly(pid: int) -> None:
    """SIGKILL ``pid`` if it still exists (cleanup of a process a test made escape)."""
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


# Skip markers for tests that need privileges: a private tmpfs over /dev/shm in a mount
# namespace of their own, or root (to make a directory owned by another user).
needs_mount_namespace = pytest.mark.skipif(
    not private_shm_mount_usable(), reason="needs unshare -m and mount (root in a Linux namespace)"
)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another user's dir")


def other_python(minor: int) -> str | None:
    """An interpreter of Python 3.<minor> on this machine, if there is one."""
    import glob
    import shutil

    candidates = [shutil.which(f"python3.{minor}")]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.{minor}.*/bin/python3.{minor}"))
    for found in candidates:
        if found:
            try:
                out = subprocess.run(
                    [found, "-c", "import sys; print(sys.version_info[1])"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out.returncode == 0 and out.stdout.strip() == str(minor):
                return found
    return None


_T = TypeVar("_T")


def run_small(main: Callable[[], Awaitable[_T]]) -> _T:
    """Run ``main()`` on a fresh loop whose default executor has 2 threads (the asyncio
    tests: a path that borrowed the loop's executor would show as a third thread)."""

    async def wrapper() -> _T:
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers=2)
        )
        return await main()

    return asyncio.run(wrapper())


@pytest.fixture
def apool() -> Iterator[comfy_env.Pool]:
    """A pool with short grace and close times (cancel 3 s, kill 0.5 s, close 3 s), tests/
    importable: the asyncio and call-control tests."""
    cfg = comfy_env.PoolConfig(
        sys_path=(str(TESTS_DIR),), kill_grace=0.5, close_timeout=3.0, cancel_grace=3.0
    )
    with comfy_env.Pool(cfg) as p:
        yield p
