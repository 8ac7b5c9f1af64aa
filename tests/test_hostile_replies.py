"""What a worker or a peer sends that could hurt the host is bounded or refused: every frame and
line is bounded in both directions (an exception or log record too large for a frame arrives
clipped, output without newlines is cut into bounded lines in linear time, a peer or a fake
interpreter announcing a huge frame gets no memory for it), and exceptions that fight back
(``__str__``, ``__repr__`` or ``__reduce__`` raising, ``SystemExit`` while the host unpickles)
still get a reply or a typed error. The worker lives through all of it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    wait_until,
)

import comfy_env


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


# ---- exceptions that fight back ------------------------------------------------------------


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
