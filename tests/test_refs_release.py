"""A dropped RemoteRef frees its object in the worker promptly, with no call to carry it.

Before, a garbage-collected (or discarded) ref was only queued, and released before the next
call on its worker: an object nobody held any more kept its memory for as long as no call came
(ComfyUI: until the idle reaper, 30 minutes by default). Now the finaliser wakes the pool's
reactor without taking a lock, and the reactor writes the release frame to the idle worker
under the entry's lock, so it can never interleave with a call's frames.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from conftest import alive, reactor_held, run_host, wait_until
from tasks import remote as remote_tasks

import comfy_env
from comfy_env import WorkerCrashed

MIB = 1 << 20


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


@pytest.fixture
def unraisable(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """What finalisers raised during the test (``sys.unraisablehook``: "Exception ignored
    in ..."), collected instead of printed."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    yield seen


@pytest.mark.parametrize("how", ["garbage collected", "discarded"])
def test_a_dropped_ref_frees_its_object_in_an_idle_worker_without_another_call(
    pool: comfy_env.Pool, how: str
) -> None:
    w = pool.get_worker()
    pid = w.call("tasks.remote:getpid")
    before = _rss(pid)
    ref = w.call_ref(remote_tasks.big_buffer, 128)
    holding = _rss(pid)
    assert holding - before >= 120 * MIB
    assert w.stats().live_refs == 1
    submitted = w.stats().submitted
    if how == "discarded":
        ref.discard()
    del ref
    gc.collect()
    # No call comes: the worker's memory returns all the same.
    assert wait_until(lambda: holding - _rss(pid) >= 120 * MIB, 5.0), (
        f"worker RSS {_rss(pid) / MIB:.0f} MiB, {holding / MIB:.0f} MiB holding the object"
    )
    assert wait_until(lambda: w.stats().live_refs == 0)
    assert not w._entry.dropped_refs
    stats = w.stats()
    assert stats.submitted == submitted  # released by a frame, not by a call
    assert (stats.generation, stats.state) == (1, "idle")
    assert w.call(remote_tasks.kept_objects) == 0  # the worker's table agrees


def test_a_ref_dropped_during_a_call_is_released_when_that_call_ends(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    pid = w.call("tasks.remote:getpid")
    ref = w.call_ref(remote_tasks.big_buffer, 128)
    holding = _rss(pid)
    call = w.submit("comfy_env_worker.tasks:sleep", (1.0,))
    assert wait_until(lambda: w.stats().state == "in_call")
    del ref
    gc.collect()
    assert w._entry.dropped_refs  # the worker is busy: nothing may be written to it now
    assert call.result(10) == 1.0
    assert wait_until(lambda: holding - _rss(pid) >= 120 * MIB, 5.0)
    assert wait_until(lambda: w.stats().live_refs == 0)
    assert w.stats().generation == 1


@pytest.mark.timeout(120)
def test_refs_dropped_from_other_threads_while_calls_run_never_disturb_a_call(
    config: comfy_env.PoolConfig, unraisable: list[Any]
) -> None:
    # Two workers, calls in flight on both from two threads (by reference, by RemoteRef,
    # through call_method), while two other threads drop refs of both workers as fast as they
    # can: every release goes out between calls, never inside one (a frame interleaved with a
    # call's would be a protocol error and retire the worker).
    with comfy_env.Pool(config.model_copy(update={"max_workers_per_env": 2})) as pool:
        w = pool.get_worker()
        kept = [w.call_ref(remote_tasks.make_counter, 1000 * i) for i in range(2)]
        dropped = [w.call_ref(remote_tasks.make_counter, i) for i in range(400)]
        stop = threading.Event()
        errors: list[BaseException] = []
        lock = threading.Lock()

        def caller(n: int) -> None:
            try:
                for i in range(300):
                    assert w.call("tasks.remote:add", i, n) == i + n
                    counter = kept[(i + n) % 2]
                    counter.call_method("add", 1)
                    w.call(remote_tasks.counter_value, counter)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        def dropper(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    with lock:
                        if not dropped:
                            return
                        ref = dropped.pop(rng.randrange(len(dropped)))
                    if rng.random() < 0.3:
                        ref.discard()
                    del ref  # (its __del__ runs here, on this thread)
                    if rng.random() < 0.05:
                        gc.collect()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(2)]
        threads += [threading.Thread(target=dropper, args=(s,)) for s in range(2)]
        for t in threads:
            t.start()
        for t in threads[:2]:
            t.join(90)
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert not dropped
        assert wait_until(lambda: w.stats().live_refs == 2, 10.0)
        stats = w.stats()
        assert (stats.crashed, stats.failed, stats.raised, stats.stale_events_dropped) == (
            0,
            0,
            0,
            0,
        )
        assert stats.spawns == 2, stats.workers  # neither worker was replaced
        assert all(worker.state == "idle" for worker in stats.workers), stats.workers
        for counter in kept:  # each kept object resolves; its worker holds nothing dropped
            beside = sum(1 for r in kept if r._slot is counter._slot)
            assert w.call(remote_tasks.kept_objects_beside, counter) == beside
        assert not unraisable


def test_a_dropped_ref_of_a_dead_generation_releases_nothing_in_the_next(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    old = w.call_ref(remote_tasks.make_counter, 7)
    with pytest.raises(WorkerCrashed):
        w.call("comfy_env_worker.tasks:crash")
    new = w.call_ref(remote_tasks.make_counter, 9)  # generation 2 reuses the id
    other = w.call_ref(remote_tasks.make_counter, 11)
    assert (old.generation, new.generation) == (1, 2) and old.id == new.id
    del old, other  # one of a dead generation, one of the live one
    gc.collect()
    assert wait_until(lambda: w.stats().live_refs == 1 and not w._entry.dropped_refs)
    assert w.call(remote_tasks.counter_value, new) == 9  # not released by the old ref's id
    assert w.call(remote_tasks.kept_objects) == 1
    assert w.generation == 2


def test_a_finaliser_inside_the_pool_s_own_locks_neither_blocks_nor_raises(
    pool: comfy_env.Pool, unraisable: list[Any]
) -> None:
    w = pool.get_worker()
    refs = [w.call_ref(remote_tasks.make_counter, i) for i in range(3)]
    entry = w._entry
    with entry.lock:  # (a gc pass in the pool's own code, under its entry lock)
        del refs[0]
        gc.collect()
    with pool._lock:
        del refs[0]
        gc.collect()
    reactor = pool._spawner.reactor
    assert reactor is not None
    reactor.run_sync(refs.clear, timeout=10)  # on the reactor thread itself
    gc.collect()
    assert wait_until(lambda: w.stats().live_refs == 0 and not entry.dropped_refs)
    assert w.call(remote_tasks.kept_objects) == 0
    assert not unraisable


def test_a_busy_reactor_delays_the_release_and_loses_nothing(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    refs = [w.call_ref(remote_tasks.make_counter, i) for i in range(5)]
    with reactor_held(pool):
        refs.clear()
        gc.collect()
        assert len(w._entry.dropped_refs) == 5  # queued while the reactor is busy
    assert wait_until(lambda: w.stats().live_refs == 0 and not w._entry.dropped_refs)
    assert w.call(remote_tasks.kept_objects) == 0


@pytest.mark.timeout(90)
def test_a_stopped_workers_full_channel_leaves_the_rest_to_the_next_call(
    pool: comfy_env.Pool,
) -> None:
    # The background release never blocks: once the channel of a worker that reads nothing
    # (stopped) is full, the refs stay queued, whole frames only, and the next call (whose
    # writes may block) releases them first.
    w = pool.get_worker()
    refs = [w.call_ref(remote_tasks.make_counter, i) for i in range(3000)]
    pid = w.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        while refs:
            refs.pop()  # one release frame each
            if not wait_until(lambda: not w._entry.dropped_refs, 1.0):
                break
        else:
            pytest.fail("the channel of a stopped worker never filled")
        assert w.stats().state == "idle"  # not retired: no fragment was written
    finally:
        os.kill(pid, signal.SIGCONT)
    assert w._entry.dropped_refs
    assert w.call(remote_tasks.kept_objects) == len(refs)
    assert not w._entry.dropped_refs and w.stats().live_refs == len(refs)
    assert w.generation == 1


def test_a_ref_dropped_after_its_pool_closed_is_inert(
    config: comfy_env.PoolConfig, unraisable: list[Any]
) -> None:
    with comfy_env.Pool(config) as pool:
        ref = pool.get_worker().call_ref(remote_tasks.make_counter)
    del ref
    gc.collect()
    assert not unraisable


@pytest.mark.timeout(60)
def test_finalisers_at_interpreter_exit_raise_nothing() -> None:
    # Refs still held at exit (a module global, a reference cycle the last gc pass frees, a
    # ref of a pool closed before): their finalisers run while atexit closes the pools and
    # modules are torn down.
    host = run_host(
        """
        import gc, comfy_env
        pool = comfy_env.Pool()
        w = pool.get_worker()
        KEPT = w.call_ref("comfy_env_worker.tasks:echo", [1, 2, 3])

        class Cycle:
            pass

        c = Cycle()
        c.me = c
        c.ref = w.call_ref("comfy_env_worker.tasks:echo", "in a cycle")
        del c
        closed = comfy_env.Pool()
        LATE = closed.get_worker().call_ref("comfy_env_worker.tasks:echo", 1)
        closed.close()
        gc.disable()  # the cycle is left for the interpreter's last collection
        print(w.pid, flush=True)
        # no close(): interpreter exit closes the pool, then the refs go
        """
    )
    out, err = host.communicate(timeout=50)
    assert host.returncode == 0, err
    assert "Exception ignored" not in err and "Traceback" not in err, err
    pid = int(out.split()[0])
    assert wait_until(lambda: not alive(pid), 5.0)
