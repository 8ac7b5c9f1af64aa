"""Ray-only promises (the contract shared with the local backend is in test_contract.py).

* an env that cannot host an actor (no ray, another Python minor) fails fast with a
  ``WorkerStartError`` naming the mismatch, never a hang; ``start_timeout`` bounds a start;
* arguments arrive writable and results are private, writable copies (never views of the
  read-only object store);
* a forked child of the host gets an inert pool and never talks to Ray;
* closing a pool kills its actors and leaves a Ray the application initialised running;
* a cluster the pool starts itself outlives the (short-lived) thread that made the first call,
  and is gone after ``close()``.

They run on the session's local cluster (``conftest.ray_cluster``), but for those about a
Ray the pool initialises itself: these run a fresh host. Skipped without ray.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import TESTS_DIR, other_python, ray_live_actors, wait_until

import comfy_env
from comfy_env import PoolClosedError, WorkerStartError

pytestmark = pytest.mark.ray


def _config(**overrides: object) -> comfy_env.PoolConfig:
    settings: dict[str, object] = {
        "backend": "ray",
        "sys_path": (str(TESTS_DIR),),
        "kill_grace": 0.5,
        "close_timeout": 5.0,
        "start_timeout": 90.0,
    }
    settings.update(overrides)
    return comfy_env.PoolConfig(**settings)


@pytest.fixture
def rpool() -> Iterator[comfy_env.Pool]:
    with comfy_env.Pool(_config()) as p:
        yield p


def test_an_env_without_ray_fails_fast_naming_it(
    foreign_venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Run from a directory holding an empty ``ray`` folder, as /tmp holds Ray's session
    # folder: the preflight saw it as the package ("module 'ray' has no attribute
    # '__version__'") instead of saying that ray is missing.
    (tmp_path / "ray").mkdir()
    monkeypatch.chdir(tmp_path)
    with comfy_env.Pool(_config()) as pool:
        w = pool.get_worker(str(foreign_venv))
        with pytest.raises(WorkerStartError) as info:
            w.call("tasks.remote:add", 1)
        assert "ray is not importable" in str(info.value), str(info.value)
        assert "__version__" not in str(info.value)
        assert "cannot host a Ray actor" in str(info.value)
        # Said again at the next call (the env may have been fixed), still without a hang.
        with pytest.raises(WorkerStartError):
            w.call("tasks.remote:add", 1)


def test_an_env_of_another_python_minor_fails_naming_both_versions(tmp_path: Path) -> None:
    here = sys.version_info[1]
    others = (other_python(minor) for minor in range(8, 15) if minor != here)
    found = next((p for p in others if p), None)
    if found is None:
        pytest.skip("no interpreter of another Python minor version on this machine")
    env = tmp_path / "other"
    subprocess.run([found, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    with comfy_env.Pool(_config()) as pool:
        with pytest.raises(WorkerStartError) as info:
            pool.get_worker(str(env)).call("tasks.remote:add", 1)
    text = str(info.value)
    assert f"the Ray cluster Python 3.{here}" in text and "runs Python 3." in text


def test_start_timeout_bounds_a_start() -> None:
    with comfy_env.Pool(_config(start_timeout=0.01)) as pool:
        with pytest.raises(WorkerStartError) as info:
            pool.get_worker().call("tasks.remote:add", 1)
    assert "start_timeout" in str(info.value)


def test_arguments_arrive_writable_and_results_are_private(rpool: comfy_env.Pool) -> None:
    np = pytest.importorskip("numpy")
    w = rpool.get_worker()
    arr = np.zeros(1 << 20, dtype=np.float64)  # 8 MiB: out of band both ways
    out = w.call("tasks.remote:add_in_place", arr, 2.0)
    assert float(out.sum()) == 2.0 * arr.size
    assert float(arr.sum()) == 0.0  # the host's array is not the worker's
    out += 1  # writable: not a view of Ray's read-only object store
    small = w.call("comfy_env_worker.tasks:echo", np.arange(10))
    assert small.flags.writeable


def test_a_forked_child_is_inert(rpool: comfy_env.Pool) -> None:
    w = rpool.get_worker()
    assert w.call("tasks.remote:add", 1) == 1
    pid = os.fork()
    if pid == 0:  # the child: never talks to Ray (it would hang), leaves without atexit
        code = 3
        try:
            w.call("tasks.remote:add", 1)
            code = 1
        except PoolClosedError:
            code = 0
        except BaseException:  # noqa: BLE001
            code = 2
        os._exit(code)
    deadline = time.monotonic() + 30
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert w.call("tasks.remote:add", 2) == 2  # the parent's pool is untouched
    assert w.generation == 1


def test_close_kills_the_actors_and_leaves_the_applications_ray_running() -> None:
    import ray

    pool = comfy_env.Pool(_config())
    pool.get_worker().call("tasks.remote:add", 1)
    assert len(ray_live_actors()) == 1
    pool.close()
    assert ray_live_actors() == {}  # killed, and Ray said so, before close returned
    assert ray.is_initialized()  # the session's cluster: not comfy-env's to shut down


def test_a_crash_is_published_as_events(rpool: comfy_env.Pool, tmp_path: Path) -> None:
    events: list[object] = []
    unsubscribe = rpool.subscribe(events.append)
    w = rpool.get_worker()
    w.call("tasks.remote:add", 1)
    with pytest.raises(comfy_env.WorkerCrashed):
        w.call("tasks.remote:count_then_crash", str(tmp_path / "runs"))
    assert w.call("tasks.remote:add", 1) == 1
    assert wait_until(lambda: any(type(e).__name__ == "WorkerRetired" for e in events))
    unsubscribe()
    names = [type(e).__name__ for e in events]
    assert names.count("WorkerReady") == 2
    retired = next(e for e in events if type(e).__name__ == "WorkerRetired")
    assert retired.generation == 1 and retired.reason == "crashed"  # type: ignore[attr-defined]


def test_a_sigterm_to_the_actor_fails_its_call_as_a_crash_and_the_next_call_runs(
    tmp_path: Path,
) -> None:
    """A SIGTERM from outside (a supervisor, ``docker stop`` of the node) to the actor process
    during a call: the call fails as ``WorkerCrashed`` naming SIGTERM, not at ``call_timeout``
    (Ray's own handler left the actor waiting for the call, serving nothing and never dead),
    and the next call runs on the next generation."""
    import signal
    import threading

    started = tmp_path / "started"
    with comfy_env.Pool(_config(call_timeout=60.0)) as pool:
        w = pool.get_worker()
        pid = w.call("tasks.remote:getpid")

        def terminate_once_running() -> None:
            if wait_until(started.exists, 60.0):
                os.kill(pid, signal.SIGTERM)

        killer = threading.Thread(target=terminate_once_running)
        killer.start()
        try:
            with pytest.raises(comfy_env.WorkerCrashed) as info:
                w.call("tasks.remote:touch_then_sleep", str(started), 300.0)
        finally:
            killer.join()
        assert started.exists()
        assert info.value.signal == "SIGTERM" and info.value.exitcode == -signal.SIGTERM
        assert info.value.generation == 1
        # An actor has no channel its code could close: the local worker's hint about
        # descriptors was given here too ("closed its channel while still running ...").
        assert "channel" not in str(info.value) and "descriptors" not in str(info.value)
        assert "was killed by SIGTERM" in str(info.value), str(info.value)
        assert wait_until(lambda: not psutil.pid_exists(pid), 30.0)
        assert w.call("tasks.remote:add", 1) == 1
        assert w.generation == 2


def test_an_actor_runs_under_the_envs_own_interpreter(tmp_path: Path) -> None:
    """Another venv (its own interpreter path, this Python, and ray through a .pth file onto
    the host's site-packages): its actor is started with Ray's py_executable."""
    import site

    env = tmp_path / "rayenv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    minor = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (env / "lib" / minor / "site-packages" / "host.pth").write_text(site.getsitepackages()[0])
    with comfy_env.Pool(_config()) as pool:
        w = pool.get_worker(str(env))
        assert w.call("tasks.remote:executable") == str(env / "bin" / "python")
        assert w.call("tasks.remote:prefix") == str(env)
        assert w.call("tasks.remote:add", 2, b=3) == 5


def test_cluster_endpoint_parses_what_ray_address_takes() -> None:
    from comfy_env._ray import cluster_endpoint

    assert cluster_endpoint("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert cluster_endpoint("ray://head.example:10001") == ("head.example", 10001)
    assert cluster_endpoint("[::1]:6379") == ("::1", 6379)
    assert cluster_endpoint("auto") is None  # Ray resolves these itself
    assert cluster_endpoint("local") is None
    assert cluster_endpoint("head.example") is None


def test_an_unreachable_cluster_address_is_a_start_error_not_a_hang() -> None:
    """``ray.init`` retries an address nothing answers on for minutes; the pool says so within
    ``start_timeout``. In a fresh host: this one has the session's Ray initialised, which a
    pool joins as it is (the address would not be used)."""
    code = (
        "import socket, time, comfy_env\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "config = comfy_env.PoolConfig(backend='ray', ray_address=f'127.0.0.1:{port}',"
        " start_timeout=5)\n"
        "with comfy_env.Pool(config) as pool:\n"
        "    try:\n"
        "        pool.get_worker().call('comfy_env_worker.tasks:echo', 1)\n"
        "    except comfy_env.WorkerStartError as exc:\n"
        "        print('START-ERROR', exc)\n"
        "    import ray\n"
        "    print('INITIALISED', ray.is_initialized())\n"
        "config = comfy_env.PoolConfig(backend='ray', ray_address='nonsense', start_timeout=5)\n"
        "with comfy_env.Pool(config) as pool:\n"
        "    try:\n"
        "        pool.get_worker().call('comfy_env_worker.tasks:echo', 1)\n"
        "    except comfy_env.WorkerStartError as exc:\n"
        "        print('MALFORMED', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "START-ERROR cannot reach the Ray cluster at '127.0.0.1:" in out.stdout, out.stdout
    assert "PoolConfig.ray_address" in out.stdout
    assert "INITIALISED False" in out.stdout  # nothing half-joined was left behind
    # The cluster's failure is told as the cluster's, not as "cannot create a Ray actor".
    assert "MALFORMED cannot join the Ray cluster at 'nonsense' (PoolConfig.ray_address)" in (
        out.stdout
    ), out.stdout


def test_a_death_notice_on_a_foreign_thread_registers_no_python_thread() -> None:
    """Ray calls the death notice on a thread of its own; after the pool's reactor stopped the
    notice starts a thread, which must not register Ray's thread with ``threading`` (a
    ``_DummyThread`` that would stay for the life of the process)."""
    import _thread
    import concurrent.futures
    import threading

    from comfy_env._ray import RayWorker

    class Stopped:
        running = False

    worker = RayWorker.__new__(RayWorker)
    seen: list[BaseException | None] = []
    worker.reactor = Stopped()  # type: ignore[assignment]
    worker.died = seen.append  # type: ignore[method-assign]
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.set_exception(RuntimeError("the actor died"))
    before = set(threading.enumerate())
    _thread.start_new_thread(worker._death_notice, (future,))
    wait_until(lambda: bool(seen), 10)
    assert isinstance(seen[0], RuntimeError)
    wait_until(lambda: not (set(threading.enumerate()) - before), 10)
    assert not [t for t in threading.enumerate() if t not in before]


# A fresh host whose pool starts Ray itself (this process has the session's Ray initialised,
# which a pool joins as it is). A child subreaper, so that Ray's processes stay its descendants
# even where their parent dies (the agents of a dead raylet); it prints their pids before
# anything that may kill it, so the test can check, and clean up, what outlives it.
_OWN_CLUSTER_HOST = """
import asyncio, ctypes, json, sys, threading
import numpy as np, psutil, comfy_env

ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER

def ray_processes():
    return {p.pid: p.name() for p in psutil.Process().children(recursive=True)}

config = comfy_env.PoolConfig(backend="ray", sys_path=[sys.argv[2]], start_timeout=120)
pool = comfy_env.Pool(config)
w = pool.get_worker()
if sys.argv[1] == "acall":
    # A cold acall starts the worker on a short-lived thread of its own.
    assert asyncio.run(w.acall("tasks.remote:add", 1)) == 1
    first = "comfy-env-acall"
else:
    thread = threading.Thread(target=w.call, args=("tasks.remote:add", 1), name="first-call")
    thread.start()
    first = "first-call"
for t in threading.enumerate():
    if t.name == first:
        t.join(30)  # the thread that made the first call has ended
print("RAY-PIDS", json.dumps(ray_processes()), flush=True)
arr = np.arange(8 << 20, dtype=np.float64)  # 64 MiB: through the object store both ways
print("ROUND-TRIP", bool(np.array_equal(w.call("comfy_env_worker.tasks:echo", arr), arr)))
print("RAY-PIDS", json.dumps(ray_processes()), flush=True)
states = {p.name(): p.status() for p in psutil.Process().children(recursive=True)}
print("STATES", json.dumps(states), flush=True)
pool.close()
print("CLOSED", flush=True)
"""


def _still_running(pids: set[int], since: float) -> list[str]:
    """Which of ``pids`` still run (exited: gone or a zombie) as processes started at or after
    ``since`` (a pid reused by an older process does not count)."""
    left = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.create_time() >= since and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.parametrize("first_call", ["acall", "thread"])
def test_a_cluster_started_from_a_short_lived_thread_outlives_it(first_call: str) -> None:
    """A pool that starts Ray itself from a thread that then ends (a cold ``acall``, a joined
    thread): a local cluster's processes die with the thread that started them, so the pool
    must not start it there. The object store serves a 64 MiB round trip, raylet and
    gcs_server run (not zombies) while the pool is open, and after ``close()`` nothing of the
    cluster is left."""
    pytest.importorskip("numpy")
    since = time.time() - 1.0
    out = subprocess.run(
        [sys.executable, "-c", _OWN_CLUSTER_HOST, first_call, str(TESTS_DIR)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    lines = out.stdout.splitlines()
    names: dict[str, str] = {}
    for line in lines:
        if line.startswith("RAY-PIDS "):
            names.update(json.loads(line.split(" ", 1)[1]))
    pids = {int(pid) for pid in names}
    # Ray may still be stopping a process after the host left (bounded); what still runs
    # then is left behind, and killed here so that a failure leaves nothing either.
    wait_until(lambda: not _still_running(pids, since), 20)
    left = _still_running(pids, since)
    for entry in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(int(entry.split()[0])).kill()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "ROUND-TRIP True" in lines, out.stdout
    states = json.loads(next(ln for ln in lines if ln.startswith("STATES "))[len("STATES ") :])
    for name in ("raylet", "gcs_server"):
        assert states.get(name) not in (None, psutil.STATUS_ZOMBIE), states
    assert "CLOSED" in lines
    assert not left, f"Ray processes left after close: {left}"


def test_a_kill_after_the_death_was_told_keeps_the_crash_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray tells an actor's death twice: the call's error on the caller's thread, the death
    notice on another. Whichever ``died`` wins reads the log; the gate answers the caller's
    ``ChannelClosed`` with a kill meanwhile. That kill is an answer to the death, not its cause:
    the crash keeps its signal and last words from the log, never "was stopped (ray.kill)"."""
    import threading
    from types import SimpleNamespace

    from comfy_env._generation import Birth
    from comfy_env._lifecycle import Stop
    from comfy_env._ray import RayWorker

    class Stopped:
        running = False

    class SlowCancel:
        """The winner's first step after taking the death, held until the kill was made."""

        def __init__(self) -> None:
            self.entered = threading.Event()
            self.release = threading.Event()

        def cancel(self) -> None:
            self.entered.set()
            self.release.wait(10)

    monkeypatch.setattr(
        RayWorker,
        "_log_tail",
        staticmethod(lambda pid: b"Fatal Python error: Segmentation fault\n"),
    )
    spec = SimpleNamespace(key="env", name="env")
    config = SimpleNamespace(stderr_tail_lines=20)
    reported: list[object] = []
    birth = Birth(
        spec,  # type: ignore[arg-type]
        1,
        config,  # type: ignore[arg-type]
        Stopped(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        reported.append,
        lambda p: None,
    )
    worker = RayWorker(None, birth)  # type: ignore[arg-type]
    worker.pid = 4242
    slow = SlowCancel()
    worker._escalation = slow
    notice = threading.Thread(target=worker.died, args=(RuntimeError("the actor died"),))
    notice.start()
    try:
        assert slow.entered.wait(10)  # the death notice won and reads the death
        worker.died(RuntimeError("the actor died"))  # the caller's thread: lost, returns
        worker.kill(Stop.KILL)  # the gate's answer to the caller's ChannelClosed
    finally:
        slow.release.set()
        notice.join(10)
    assert worker.returncode == -11
    assert worker.death_detail is not None and "stopped" not in worker.death_detail
    assert "Segmentation fault" in worker.log.tail()
    assert reported == [worker]


def test_an_actor_gets_its_envs_activation_and_env_vars_win(tmp_path: Path) -> None:
    """The actor's runtime applies the env's activation (VIRTUAL_ENV, its bin first on the
    actor's own PATH) from its CONFIG, then env_vars over it."""
    import site

    env = tmp_path / "rayenv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    minor = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (env / "lib" / minor / "site-packages" / "host.pth").write_text(site.getsitepackages()[0])
    with comfy_env.Pool(_config(env_vars={"VIRTUAL_ENV": "/mine"})) as pool:
        w = pool.get_worker(str(env))
        assert w.call("tasks.remote:environ", "VIRTUAL_ENV") == "/mine"
        path = str(w.call("tasks.remote:environ", "PATH")).split(os.pathsep)
        assert path[0] == str(env / "bin")
        assert path.count(str(env / "bin")) == 1  # prefixed once, not per CONFIG
