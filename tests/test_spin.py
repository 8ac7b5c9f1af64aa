"""Polling before sleeping (``PoolConfig.spin_wait``, ``FrameReader.spin_wait``).

A reader that polls must still read every frame whole, keep its deadline and see an EOF; the
pool's caller and its worker both poll by default, not while they share one pinned CPU, and
never with ``spin_wait=0``. Real worker processes throughout; nothing here asserts a time.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

import comfy_env
from comfy_env._inflight import CALLS_IN_FLIGHT
from comfy_env._process import WorkerProcess
from comfy_env_worker import protocol
from comfy_env_worker.protocol import (
    HEADER,
    MAGIC,
    ChannelClosed,
    FrameReader,
    FrameType,
)

TASK = "tasks.hostile:spin_state"


def _frame(call_id: int, payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, FrameType.REPLY_OK, 0, len(payload), call_id) + payload


def _process(pool: comfy_env.Pool) -> WorkerProcess:
    (entry,) = pool._entries.values()
    process = entry.slots[0].process
    assert isinstance(process, WorkerProcess)
    return process


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


@pytest.fixture
def restore_affinity() -> Iterator[set[int]]:
    mine = os.sched_getaffinity(0)
    try:
        yield mine
    finally:
        os.sched_setaffinity(0, mine)


def test_a_polling_reader_reads_frames_that_come_before_during_and_after_its_budget(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    reader = FrameReader(a)
    reader.spin_wait(0.002, os.getpid())
    assert reader.spins() == (len(os.sched_getaffinity(0)) > 1)
    b.sendall(_frame(1, b"ready"))  # already there: no polling at all
    assert reader.read() == (FrameType.REPLY_OK, 0, 1, b"ready")

    def later() -> None:
        b.sendall(_frame(2, b"soon"))  # within the budget: found by a poll
        time.sleep(0.02)
        b.sendall(_frame(3, b"late"))  # after it: found by the blocking read

    writer = threading.Thread(target=later)
    writer.start()
    try:
        assert reader.read() == (FrameType.REPLY_OK, 0, 2, b"soon")
        assert reader.read() == (FrameType.REPLY_OK, 0, 3, b"late")
    finally:
        writer.join()
    b.close()
    with pytest.raises(ChannelClosed):
        reader.read()  # EOF is readable: polling ends and the read reports it


def test_a_reader_polls_only_after_a_wait_that_polling_would_have_caught(
    pair: tuple[socket.socket, socket.socket], restore_affinity: set[int]
) -> None:
    if len(restore_affinity) < 2:
        pytest.skip("one CPU: the reader never polls here")
    a, b = pair
    reader = FrameReader(a)
    reader.spin_wait(0.001, os.getpid())
    assert reader.spins()
    timer = threading.Timer(0.03, b.sendall, (_frame(1, b"slow"),))
    timer.start()
    try:
        assert reader.read()[3] == b"slow"  # 30 ms: longer than the 1 ms budget
    finally:
        timer.join()
    assert not reader.spins()  # the next wait sleeps at once, and is timed
    b.sendall(_frame(2, b"quick"))
    assert reader.read()[3] == b"quick"  # waited about nothing
    assert reader.spins()  # polling would have caught it: the next wait polls again


def test_a_polling_reader_keeps_a_deadline_shorter_than_its_budget(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    polled_until: list[float] = []
    poll_until = FrameReader.poll_until

    def recording(self: FrameReader, end: float) -> bool:
        polled_until.append(end)
        return poll_until(self, end)

    monkeypatch.setattr(FrameReader, "poll_until", recording)
    a, _b = pair
    reader = FrameReader(a)
    reader.spin_wait(0.01, os.getpid())  # the longest budget PoolConfig allows
    deadline = time.monotonic() + 0.001
    with pytest.raises(TimeoutError):
        reader.read(deadline)
    with pytest.raises(TimeoutError):
        reader.read(time.monotonic() - 1.0)  # already passed
    # Polling itself stopped at the deadline, not at the end of the budget.
    if len(os.sched_getaffinity(0)) > 1:
        assert polled_until
    assert all(end <= deadline for end in polled_until)


def test_no_polling_while_both_ends_are_pinned_to_one_cpu(
    pair: tuple[socket.socket, socket.socket], restore_affinity: set[int]
) -> None:
    cpus = sorted(restore_affinity)
    reader = FrameReader(pair[0])
    # The peer here is this very thread: pinned to one CPU, the two ends share it.
    os.sched_setaffinity(0, {cpus[0]})
    reader.spin_wait(0.001, threading.get_native_id())
    assert not reader.spins()
    os.sched_setaffinity(0, restore_affinity)
    reader.spin_wait(0.001, threading.get_native_id())  # spin_wait re-checks at once
    assert reader.spins() == (len(cpus) > 1)
    reader.spin_wait(0.0, threading.get_native_id())
    assert not reader.spins()


def test_on_one_pinned_cpu_the_masks_are_read_again_every_so_many_frames(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    looks: list[int] = []

    def pinned(peer_pid: int) -> bool:
        looks.append(peer_pid)
        return True

    monkeypatch.setattr(protocol, "shares_one_cpu", pinned)
    a, b = pair
    reader = FrameReader(a)
    reader.spin_wait(0.001, 4242)
    for i in range(2 * protocol.SPIN_RECHECK_READS + 2):
        b.sendall(_frame(i, b"x"))
        assert reader.read()[2] == i
    # The first frame looks, then one look per SPIN_RECHECK_READS frames: never per frame.
    assert looks == [4242] * 3


def test_a_peer_that_cannot_be_seen_counts_as_running_elsewhere(
    pair: tuple[socket.socket, socket.socket], restore_affinity: set[int]
) -> None:
    os.sched_setaffinity(0, {min(restore_affinity)})
    reader = FrameReader(pair[0])
    reader.spin_wait(0.001, 2**22 + 12345)  # above pid_max's default: no such process
    assert reader.spins()


def test_caller_and_worker_poll_and_calls_run_as_before(
    config: comfy_env.PoolConfig, restore_affinity: set[int]
) -> None:
    assert comfy_env.PoolConfig().spin_wait == 100e-6  # the default
    # The longest budget: every wait here between two calls is shorter, so both ends poll.
    with comfy_env.Pool(config.model_copy(update={"spin_wait": 0.01})) as pool:
        worker = pool.get_worker(None)
        assert [worker.call("tasks.remote:add", i, 1) for i in range(200)] == list(range(1, 201))
        many_cpus = len(restore_affinity) > 1
        worker.call(TASK)  # its first call imports the task's module: a long wait
        assert worker.call(TASK) == (0.01, many_cpus)
        reader = _process(pool).reader
        assert reader is not None and reader.spins() == many_cpus


def test_no_polling_while_the_process_makes_more_than_one_call(
    pair: tuple[socket.socket, socket.socket], restore_affinity: set[int]
) -> None:
    if len(restore_affinity) < 2:
        pytest.skip("one CPU: the reader never polls here")
    reader = FrameReader(pair[0])
    reader.spin_wait(0.001, os.getpid(), CALLS_IN_FLIGHT)  # as the host's handshake does
    mine, another = object(), object()
    assert CALLS_IN_FLIGHT == set() and reader.spins()
    CALLS_IN_FLIGHT.add(mine)  # this thread's own call: it may poll
    try:
        assert reader.spins()
        CALLS_IN_FLIGHT.add(another)  # another thread's call too: it may not
        try:
            assert not reader.spins()
        finally:
            CALLS_IN_FLIGHT.discard(another)
    finally:
        CALLS_IN_FLIGHT.discard(mine)
    assert reader.spins()


def test_every_call_is_in_flight_while_it_runs_and_only_then(pool: comfy_env.Pool) -> None:
    worker = pool.get_worker(None)
    seen: list[int] = []
    # on_event runs on the caller's thread while its call is in flight.
    worker.run("tasks.remote:report", (2,), on_event=lambda _: seen.append(len(CALLS_IN_FLIGHT)))
    assert seen == [1, 1]
    # An asyncio call counts too (a sync caller's reader must not poll meanwhile).
    asyncio.run(
        worker.arun(
            "tasks.remote:report", (2,), on_event=lambda _: seen.append(len(CALLS_IN_FLIGHT))
        )
    )
    assert seen == [1, 1, 1, 1] and CALLS_IN_FLIGHT == set()
    running = worker.submit("tasks.remote:busy_loop", (0.5,))
    deadline = time.monotonic() + 10
    while not CALLS_IN_FLIGHT and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(CALLS_IN_FLIGHT) == 1  # the submitted call, on a thread of its own
    running.result(10)
    assert CALLS_IN_FLIGHT == set()
    with pytest.raises(comfy_env.RemoteError):
        worker.call("tasks.remote:system_exit", 3)
    with pytest.raises(comfy_env.CallTimeout):
        worker.run("tasks.remote:busy_loop", (5.0,), timeout=0.2)
    with pytest.raises(comfy_env.SerializationError):
        worker.call("tasks.remote:add", threading.Lock())
    assert CALLS_IN_FLIGHT == set()


def test_no_polling_on_either_side_when_caller_and_worker_share_one_pinned_cpu(
    pool: comfy_env.Pool, restore_affinity: set[int]
) -> None:
    worker = pool.get_worker(None)
    worker.call(TASK)
    process = _process(pool)
    assert process.pid is not None
    cpu = {min(restore_affinity)}
    os.sched_setaffinity(0, cpu)  # this thread: the caller
    os.sched_setaffinity(process.pid, cpu)  # the worker's serving thread
    reader = process.reader
    assert reader is not None
    reader.spin_wait(pool.config.spin_wait, process.pid)  # re-check now, not in 50 ms
    assert not reader.spins()
    time.sleep(0.06)  # the worker re-checks after SPIN_RECHECK seconds
    assert worker.call(TASK) == (pool.config.spin_wait, False)


def test_spin_wait_zero_never_polls(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config.model_copy(update={"spin_wait": 0.0})) as pool:
        worker = pool.get_worker(None)
        assert worker.call(TASK) == (0.0, False)
        reader = _process(pool).reader
        assert reader is not None and not reader.spins()


def test_spin_wait_reads_the_environment_and_refuses_bad_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COMFY_ENV_SPIN_WAIT", "0.0002")
    assert comfy_env.PoolConfig().spin_wait == 0.0002
    monkeypatch.delenv("COMFY_ENV_SPIN_WAIT")
    for bad in (-1e-6, 0.5, float("nan")):
        with pytest.raises(comfy_env.ConfigError, match="spin_wait"):
            comfy_env.PoolConfig(spin_wait=bad)
