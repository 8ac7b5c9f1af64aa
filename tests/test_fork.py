"""Fork safety: a forked child owns none of its parent's workers and keeps none alive."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
import warnings

from conftest import alive as _alive
from conftest import run_host as _run_host

import comfy_env
from comfy_env import PoolClosedError
from comfy_env._inflight import CALLS_IN_FLIGHT


def _channel_inodes(pool: comfy_env.Pool) -> set[str]:
    """The socket inodes of the host's channel ends."""
    out = set()
    for entry in pool._entries.values():
        for slot in entry.slots:
            proc = slot.process
            for end in (proc.sock, proc.reply_sock) if proc is not None else ():
                if end is not None and end.fileno() >= 0:
                    out.add(os.readlink(f"/proc/self/fd/{end.fileno()}"))
    return out


def _child_report(pool: comfy_env.Pool, parent_inodes: set[str]) -> dict[str, object]:
    """What a forked child sees; runs in the child."""
    report: dict[str, object] = {"calls_in_flight": len(CALLS_IN_FLIGHT)}
    try:
        pool.get_worker().call("comfy_env_worker.tasks:getpid")
        report["inherited_call"] = "succeeded"
    except PoolClosedError as exc:
        report["inherited_call"] = str(exc)
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            mine.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    report["holds_parent_channels"] = sorted(parent_inodes & mine)
    fresh = comfy_env.get_worker()
    report["fresh_pid"] = fresh.call("comfy_env_worker.tasks:getpid")
    report["calls_in_flight_after"] = len(CALLS_IN_FLIGHT)
    comfy_env.shutdown()
    return report


def _fork_and_report(pool: comfy_env.Pool) -> dict[str, object]:
    inodes = _channel_inodes(pool)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child; reports through the pipe and never returns
        os.close(r)
        code = 0
        try:
            data = json.dumps(_child_report(pool, inodes)).encode()
            os.write(w, data)
        except BaseException as exc:  # noqa: BLE001
            os.write(w, json.dumps({"error": repr(exc)}).encode())
            code = 1
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    report = json.loads(b"".join(chunks))
    assert os.waitstatus_to_exitcode(status) == 0, report
    return report  # type: ignore[no-any-return]


def test_os_fork_child_gets_an_inert_pool_and_a_fresh_default_pool(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    parent_pid = w.call("comfy_env_worker.tasks:getpid")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        report = _fork_and_report(pool)
    assert "inherited by fork" in str(report["inherited_call"])
    assert report["holds_parent_channels"] == []
    assert report["fresh_pid"] != parent_pid
    # The parent is untouched: same worker, same generation, still answering.
    assert w.call("comfy_env_worker.tasks:getpid") == parent_pid
    assert w.generation == 1 and w.stats().spawns == 1


def test_a_forked_child_inherits_none_of_the_parents_calls_in_flight(
    pool: comfy_env.Pool,
) -> None:
    # A call in flight on another thread of the parent must not keep the child's readers
    # from polling (CALLS_IN_FLIGHT counts this process's calls; that thread is not in the
    # child).
    w = pool.get_worker()
    w.call("tasks.remote:add", 1, 1)
    running = w.submit("tasks.remote:busy_loop", (1.0,))
    deadline = time.monotonic() + 10
    while len(CALLS_IN_FLIGHT) != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(CALLS_IN_FLIGHT) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        report = _fork_and_report(pool)
    assert report["calls_in_flight"] == 0
    assert report["calls_in_flight_after"] == 0
    assert running.result(10) > 0
    assert CALLS_IN_FLIGHT == set()


def _mp_child(queue: multiprocessing.Queue[object], worker: comfy_env.Worker) -> None:
    try:
        worker.call("comfy_env_worker.tasks:getpid")
        queue.put("succeeded")
    except PoolClosedError as exc:
        queue.put(str(exc))


def test_multiprocessing_fork_child_cannot_use_the_parents_workers(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    pid = w.call("comfy_env_worker.tasks:getpid")
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[object] = ctx.Queue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        proc = ctx.Process(target=_mp_child, args=(queue, w))
        proc.start()
    outcome = queue.get(timeout=60)
    proc.join(30)
    queue.close()
    queue.join_thread()
    assert proc.exitcode == 0
    assert "inherited by fork" in str(outcome)
    assert w.call("comfy_env_worker.tasks:getpid") == pid


def test_workers_die_with_their_host_even_while_a_forked_child_lives() -> None:
    host = _run_host(
        """
        import os, time, warnings, comfy_env
        warnings.simplefilter("ignore", DeprecationWarning)
        w = comfy_env.get_worker()
        w.call("comfy_env_worker.tasks:echo", 1)
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(w.pid, child, flush=True)
        time.sleep(60)
        """
    )
    assert host.stdout is not None
    worker_pid, child_pid = map(int, host.stdout.readline().split())
    try:
        host.kill()
        host.wait(30)
        deadline = time.monotonic() + 2.0
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _alive(worker_pid), "the forked child kept the worker alive"
        assert _alive(child_pid)
        report = comfy_env.sweep()  # the killed host could not unlink its blocks
        assert all(f"-{host.pid}-" in name for name in report.blocks)
    finally:
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        host.communicate()


def test_ctrl_c_to_the_host_group_interrupts_the_call_not_the_worker_directly() -> None:
    host = _run_host(
        """
        import os, signal, sys, time, comfy_env
        # Python's Ctrl-C handler, as a host started from a terminal has (one started as a
        # background job, SIGINT ignored, would never install it).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        got_term = []
        signal.signal(signal.SIGTERM, lambda *a: got_term.append(1))
        w = comfy_env.get_worker()
        w.call("comfy_env_worker.tasks:echo", 1)
        first = w.pid
        print("ready", first, flush=True)
        try:
            w.call("comfy_env_worker.tasks:sleep", 30)
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        # The host's own SIGTERM handler still runs with a pool in use.
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        print(w.call("comfy_env_worker.tasks:echo", "after"), w.generation, len(got_term),
              flush=True)
        """
    )
    assert host.stdout is not None
    tag, worker_pid = host.stdout.readline().split()
    assert tag == "ready"
    time.sleep(0.3)
    os.killpg(host.pid, signal.SIGINT)  # the terminal's Ctrl-C: the host's whole group
    out, err = host.communicate(timeout=60)
    lines = out.split("\n")
    assert lines[0] == "interrupted", out + err
    assert lines[1] == "after 2 1", out + err  # replaced (generation 2), handler ran once
    assert host.returncode == 0, err
    assert not _alive(int(worker_pid))
