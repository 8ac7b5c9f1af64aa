"""A large in-band reply to a warm ``acall`` is received and unpickled off the event loop.

The loop reads the reply frame's header; from a payload of ``_acall._BIG_REPLY`` bytes on, the
rest is received and unpickled on a short-lived thread of the call's own (``_acall._BigReply``),
and the call is settled on the loop. What they prove, with real workers:

* the result is unpickled on a thread other than the loop's, a small one still on the loop;
  LOG and EVENT frames before it are handled on the loop, first;
* every guarantee holds while that thread is mid-reply (the test holds it there, see
  ``_held_mid_reply``): a cancel drops the reply (never unpickled), counts once and keeps
  the worker; a second cancel kills it; a worker killed mid-reply is ``WorkerCrashed``; a
  deadline that passes mid-reply is ``CallTimeout`` and stops the worker;
* no thread and no descriptor outlives the call (the leak guard, ``conftest.py``).

No timing is asserted: what is checked is which thread did what, and the call's outcome.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import run_small
from tasks import remote as remote_tasks

import comfy_env
from comfy_env import CallEvent, CallTimeout, WorkerCrashed
from comfy_env_worker.protocol import FrameReader

BIG = 4 << 20  # characters: a reply frame well above _BIG_REPLY and the channel's buffers
MEDIUM = 512 << 10  # characters: a reply of many reads, under _BIG_REPLY


@pytest.fixture(autouse=True)
def _fresh_records() -> Iterator[None]:
    remote_tasks.UNPICKLED_ON.clear()
    yield
    remote_tasks.UNPICKLED_ON.clear()


def _counts(w: comfy_env.Worker) -> tuple[int, ...]:
    s = w.stats()
    assert s.submitted == (
        s.ok + s.raised + s.crashed + s.timed_out + s.cancelled + s.failed + s.in_flight + s.queued
    )
    return (s.ok, s.raised, s.crashed, s.timed_out, s.cancelled, s.failed, s.in_flight)


def test_a_large_in_band_reply_is_unpickled_off_the_loop_and_a_small_one_on_it(
    apool: comfy_env.Pool,
) -> None:
    from comfy_env import _acall

    w = apool.get_worker()
    w.call("tasks.remote:getpid")  # warm: the calls below run on the loop

    async def main() -> tuple[int, list[Any]]:
        loop_thread = threading.get_ident()
        results = [
            await w.acall("tasks.remote:recorded", BIG),
            await w.acall("tasks.remote:recorded", 1000),  # one read: the spin's fast path
            await w.acall("tasks.remote:recorded", MEDIUM),  # many reads, under _BIG_REPLY
        ]
        return loop_thread, results

    loop_thread, results = run_small(main)
    assert [len(r.payload) for r in results] == [BIG, 1000, MEDIUM]
    same = results[0].payload == remote_tasks.text(BIG)
    assert same
    big_on, small_on, medium_on = remote_tasks.UNPICKLED_ON
    assert big_on != loop_thread
    assert small_on == loop_thread and medium_on == loop_thread
    assert _counts(w) == (4, 0, 0, 0, 0, 0, 0)
    assert w.generation == 1
    assert _acall._BIG_REPLY > MEDIUM + 100  # (the medium reply's frame is under the bound)


def test_a_large_error_reply_is_raised_and_counted_once(apool: comfy_env.Pool) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:getpid")

    async def main() -> None:
        # (The function's own exception class, rebuilt in the host from the large frame.)
        with pytest.raises(remote_tasks.CustomError) as info:
            await w.acall("tasks.remote:raise_big", BIG)
        assert info.value.code == BIG
        same = info.value.text == remote_tasks.text(BIG)
        assert same  # (not compared in the assert: no pytest diff of 4 MiB)

    run_small(main)
    assert _counts(w) == (1, 1, 0, 0, 0, 0, 0)
    assert w.call("tasks.remote:add", 2, 3) == 5 and w.generation == 1  # in sync, kept


def test_events_and_logs_before_a_large_reply_run_on_the_loop_first(
    apool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    w = apool.get_worker()
    w.call("tasks.remote:getpid")
    seen: list[tuple[str, Any, int, int]] = []  # (kind, data, thread, results unpickled by then)

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("step "):
                seen.append(
                    (
                        "log",
                        record.getMessage(),
                        threading.get_ident(),
                        len(remote_tasks.UNPICKLED_ON),
                    )
                )

    def on_event(event: CallEvent) -> None:
        seen.append((event.kind, event.data, threading.get_ident(), len(remote_tasks.UNPICKLED_ON)))

    async def main() -> tuple[int, Any]:
        result = await w.arun("tasks.remote:events_then_recorded", (3, BIG), on_event=on_event)
        return threading.get_ident(), result

    handler = Seen()
    logger = logging.getLogger("comfy_env.worker")
    logger.addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="comfy_env.worker"):
            loop_thread, result = run_small(main)
    finally:
        logger.removeHandler(handler)
    assert len(result.payload) == BIG
    assert [(k, d) for k, d, _, _ in seen if k == "step"] == [("step", i) for i in range(3)]
    assert [d for k, d, _, _ in seen if k == "log"] == [f"step {i}" for i in range(3)]
    assert {t for _, _, t, _ in seen} == {loop_thread}
    assert {n for _, _, _, n in seen} == {0}  # all before the result was unpickled
    assert remote_tasks.UNPICKLED_ON != [loop_thread] and len(remote_tasks.UNPICKLED_ON) == 1
    assert _counts(w) == (2, 0, 0, 0, 0, 0, 0)


class _Held:
    """Holds the thread that receives a large reply at its first read, mid-reply: the loop
    has read the header and the start of the payload, the worker is blocked writing the rest
    into the full channel. The test acts, then ``release``s it."""

    def __init__(self, loop_thread: int) -> None:
        self.loop_thread = loop_thread
        self.paused = threading.Event()
        self.release = threading.Event()

    async def mid_reply(self) -> None:
        for _ in range(1000):  # (10 s at most; polled so the loop keeps running)
            if self.paused.is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the reply was never received off the loop")


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], _Held]]:
    holds: list[_Held] = []
    real = FrameReader.recv_into_nowait

    def recv_into_nowait(self: FrameReader, view: memoryview) -> int:
        hold = holds[-1] if holds else None
        if hold is not None and threading.get_ident() != hold.loop_thread:
            if not hold.paused.is_set():
                hold.paused.set()
                hold.release.wait(10.0)
        return real(self, view)

    monkeypatch.setattr(FrameReader, "recv_into_nowait", recv_into_nowait)

    def make() -> _Held:
        holds.append(_Held(threading.get_ident()))
        return holds[-1]

    yield make
    for hold in holds:
        hold.release.set()


def test_a_cancel_mid_reply_drops_the_reply_counts_once_and_keeps_the_worker(
    apool: comfy_env.Pool, held: Callable[[], _Held]
) -> None:
    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")

    async def main() -> None:
        hold = held()
        task = asyncio.ensure_future(w.acall("tasks.remote:recorded", BIG))
        await hold.mid_reply()
        task.cancel()
        await asyncio.sleep(0.05)  # the cancel reaches the call (CANCEL frame, grace armed)
        hold.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    run_small(main)
    assert remote_tasks.UNPICKLED_ON == []  # the reply crossed the cancel: never unpickled
    assert _counts(w) == (1, 0, 0, 0, 1, 0, 0)
    # The whole reply was read: the channel is in step, the worker (and its caches) kept.
    assert w.call("tasks.remote:add", 2, 3) == 5
    assert (w.pid, w.generation) == (pid, 1)


def test_a_second_cancel_mid_reply_kills_the_worker_and_counts_once(
    apool: comfy_env.Pool, held: Callable[[], _Held]
) -> None:
    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")

    async def main() -> None:
        hold = held()
        task = asyncio.ensure_future(w.acall("tasks.remote:recorded", 64 << 20))
        await hold.mid_reply()
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()  # a second cancellation: the worker is killed at once
        await asyncio.sleep(0.05)
        hold.release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_small(main)
    assert remote_tasks.UNPICKLED_ON == []
    assert _counts(w) == (1, 0, 0, 0, 1, 0, 0)
    assert w.call("tasks.remote:getpid") != pid and w.generation == 2


def test_a_worker_killed_mid_reply_is_a_crash_not_a_hang(
    apool: comfy_env.Pool, held: Callable[[], _Held]
) -> None:
    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")

    async def main() -> None:
        hold = held()
        call = asyncio.ensure_future(w.acall("tasks.remote:recorded", BIG))
        await hold.mid_reply()
        os.kill(pid, signal.SIGKILL)
        hold.release.set()
        with pytest.raises(WorkerCrashed, match="SIGKILL"):
            await call

    run_small(main)
    assert remote_tasks.UNPICKLED_ON == []
    assert _counts(w) == (1, 0, 1, 0, 0, 0, 0)
    assert w.call("tasks.remote:add", 2, 3) == 5 and w.generation == 2


def test_a_deadline_that_passes_mid_reply_stops_the_worker(
    apool: comfy_env.Pool, held: Callable[[], _Held]
) -> None:
    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")

    async def main() -> None:
        hold = held()
        call = asyncio.ensure_future(w.arun("tasks.remote:recorded", (BIG,), timeout=2.0))
        await hold.mid_reply()
        # The deadline's timer runs on this loop before this sleep ends (it was armed first,
        # to end sooner): the receiving thread is told to stop while it is held.
        await asyncio.sleep(2.0)
        hold.release.set()
        with pytest.raises(CallTimeout, match="missed its deadline"):
            await call

    run_small(main)
    assert remote_tasks.UNPICKLED_ON == []
    assert _counts(w) == (1, 0, 0, 1, 0, 0, 0)
    assert w.call("tasks.remote:getpid") != pid and w.generation == 2


def test_a_large_reply_is_received_whether_or_not_its_memory_can_be_mapped(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # From _MAPPED_REPLY bytes on the payload goes into memory mapped for it; where that
    # fails (no address space: strict overcommit) a bytearray takes it, as on the loop.
    from comfy_env import _acall

    w = apool.get_worker()
    w.call("tasks.remote:getpid")
    monkeypatch.setattr(_acall, "_MAPPED_REPLY", _acall._BIG_REPLY)
    mapped: list[int] = []
    real = _acall._MappedFrame

    class Refused(real):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def __init__(self, length: int, head: bytes) -> None:
            mapped.append(length)
            if len(mapped) > 1:
                raise OSError(12, "Cannot allocate memory")
            super().__init__(length, head)

    monkeypatch.setattr(_acall, "_MappedFrame", Refused)

    async def main() -> list[Any]:
        return [await w.acall("tasks.remote:recorded", BIG) for _ in range(2)]

    results = run_small(main)
    assert len(mapped) == 2 and all(n > BIG for n in mapped)  # mapped, then refused
    for result in results:
        same = result.payload == remote_tasks.text(BIG)
        assert same
    assert len(remote_tasks.UNPICKLED_ON) == 2
    assert _counts(w) == (3, 0, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("where", ["thread", "loop", "on the spot"])
def test_a_reply_reader_that_fails_stops_the_worker_and_fails_the_call_once(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    # No memory for the payload's buffer, in each of the three readers: the big reply's
    # thread, the loop's reader of a reply of many reads under _BIG_REPLY, and the on-the-spot
    # wait (made long here so that it reads the reply's start). The channel is left mid-frame,
    # so the worker is stopped (as a sync read's interrupt stops it); the error is the call's,
    # not a ProtocolError. Through the loop the reader used to stay registered and read on from
    # the middle of the frame (a ProtocolError blaming the worker); on the spot the error left
    # the slot in its call, and the next call waited for ever.
    from comfy_env import ProtocolError, _acall

    if where == "on the spot":
        monkeypatch.setattr(_acall, "_REPLY_SPIN", 30.0)
    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")

    class NoMemory:
        def __init__(self, *args: Any) -> None:
            raise MemoryError("no buffer for the reply")

    monkeypatch.setattr(_acall, "FrameBuffer", NoMemory)

    async def main() -> None:
        size = BIG if where == "thread" else MEDIUM
        with pytest.raises(MemoryError, match="no buffer for the reply") as info:
            await w.acall("tasks.remote:recorded", size)
        assert not isinstance(info.value, ProtocolError)

    run_small(main)
    monkeypatch.undo()
    assert remote_tasks.UNPICKLED_ON == []
    assert _counts(w) == (1, 0, 0, 0, 0, 1, 0)
    assert w.call("tasks.remote:getpid") != pid and w.generation == 2


def test_any_host_failure_before_the_reply_stops_the_worker_and_frees_the_slot(
    apool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A failure of the host's own anywhere between the request and its reply (here: setting
    # up the call's on_event sink) must not leave the slot in its call: the call fails with
    # that error, the worker is stopped, and the next call on the env runs on a fresh one.
    from comfy_env import _acall

    w = apool.get_worker()
    pid = w.call("tasks.remote:getpid")

    def broken(*args: Any) -> Any:
        raise RuntimeError("no sink today")

    monkeypatch.setattr(_acall, "event_handler", broken)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="no sink today"):
            await w.arun("tasks.remote:sleep_then", (0.2, 1), on_event=lambda e: None)

    run_small(main)
    monkeypatch.undo()
    assert _counts(w) == (1, 0, 0, 0, 0, 1, 0)
    assert w.run("tasks.remote:getpid", timeout=30) != pid and w.generation == 2
