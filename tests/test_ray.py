"""Ray-only promises (the contract shared with the local backend is in test_contract.py).

* an env that cannot host an actor (no ray, another Python minor) fails fast with a
  ``WorkerStartError`` naming the mismatch, never a hang; ``start_timeout`` bounds a start;
* arguments arrive writable and results are private, writable copies (never views of the
  read-only object store);
* a forked child of the host gets an inert pool and never talks to Ray;
* closing a pool kills its actors and leaves a Ray the application initialised running.

All run on the session's local cluster (``conftest.ray_cluster``); skipped without ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TESTS_DIR, other_python, wait_until

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


def test_an_env_without_ray_fails_fast_naming_it(foreign_venv: Path) -> None:
    with comfy_env.Pool(_config()) as pool:
        w = pool.get_worker(str(foreign_venv))
        with pytest.raises(WorkerStartError) as info:
            w.call("remote_tasks:add", 1)
        assert "ray is not importable" in str(info.value)
        assert "cannot host a Ray actor" in str(info.value)
        # Said again at the next call (the env may have been fixed), still without a hang.
        with pytest.raises(WorkerStartError):
            w.call("remote_tasks:add", 1)


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
            pool.get_worker(str(env)).call("remote_tasks:add", 1)
    text = str(info.value)
    assert f"the Ray cluster Python 3.{here}" in text and "runs Python 3." in text


def test_start_timeout_bounds_a_start() -> None:
    with comfy_env.Pool(_config(start_timeout=0.01)) as pool:
        with pytest.raises(WorkerStartError) as info:
            pool.get_worker().call("remote_tasks:add", 1)
    assert "start_timeout" in str(info.value)


def test_arguments_arrive_writable_and_results_are_private(rpool: comfy_env.Pool) -> None:
    np = pytest.importorskip("numpy")
    w = rpool.get_worker()
    arr = np.zeros(1 << 20, dtype=np.float64)  # 8 MiB: out of band both ways
    out = w.call("remote_tasks:add_in_place", arr, 2.0)
    assert float(out.sum()) == 2.0 * arr.size
    assert float(arr.sum()) == 0.0  # the host's array is not the worker's
    out += 1  # writable: not a view of Ray's read-only object store
    small = w.call("comfy_env_worker.tasks:echo", np.arange(10))
    assert small.flags.writeable


def test_a_forked_child_is_inert(rpool: comfy_env.Pool) -> None:
    w = rpool.get_worker()
    assert w.call("remote_tasks:add", 1) == 1
    pid = os.fork()
    if pid == 0:  # the child: never talks to Ray (it would hang), leaves without atexit
        code = 3
        try:
            w.call("remote_tasks:add", 1)
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
    assert w.call("remote_tasks:add", 2) == 2  # the parent's pool is untouched
    assert w.generation == 1


def test_close_kills_the_actors_and_leaves_the_applications_ray_running() -> None:
    import ray

    from comfy_env import _ray

    pool = comfy_env.Pool(_config())
    pool.get_worker().call("remote_tasks:add", 1)
    assert len(_ray.live_actors()) == 1
    pool.close()
    assert _ray.live_actors() == {}  # killed, and Ray said so, before close returned
    assert ray.is_initialized()  # the session's cluster: not comfy-env's to shut down


def test_a_crash_is_published_as_events(rpool: comfy_env.Pool, tmp_path: Path) -> None:
    events: list[object] = []
    unsubscribe = rpool.subscribe(events.append)
    w = rpool.get_worker()
    w.call("remote_tasks:add", 1)
    with pytest.raises(comfy_env.WorkerCrashed):
        w.call("remote_tasks:count_then_crash", str(tmp_path / "runs"))
    assert w.call("remote_tasks:add", 1) == 1
    assert wait_until(lambda: any(type(e).__name__ == "WorkerRetired" for e in events))
    unsubscribe()
    names = [type(e).__name__ for e in events]
    assert names.count("WorkerReady") == 2
    retired = next(e for e in events if type(e).__name__ == "WorkerRetired")
    assert retired.generation == 1 and retired.reason == "crashed"  # type: ignore[attr-defined]


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
        assert w.call("remote_tasks:executable") == str(env / "bin" / "python")
        assert w.call("remote_tasks:prefix") == str(env)
        assert w.call("remote_tasks:add", 2, b=3) == 5


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
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "START-ERROR cannot reach the Ray cluster at '127.0.0.1:" in out.stdout, out.stdout
    assert "PoolConfig.ray_address" in out.stdout
    assert "INITIALISED False" in out.stdout  # nothing half-joined was left behind


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
