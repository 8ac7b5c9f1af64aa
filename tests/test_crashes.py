"""Death, replacement, timeouts and cancellation, with real worker processes."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import alive, reactor_held, wait_until
from tasks import remote as remote_tasks

import comfy_env
from comfy_env import CallTimeout, ProtocolError, WorkerCrashed
from comfy_env._reactor import Reactor
from comfy_env_worker.protocol import FrameReader, encode_header


def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    assert wait_until(lambda: not alive(pid), timeout), f"pid {pid} still alive"


def test_segfault_fails_that_call_with_the_full_story(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    with pytest.raises(WorkerCrashed) as info:
        w.call("comfy_env_worker.tasks:crash")
    err = info.value
    assert (err.env, err.pid, err.generation) == (w.env, pid, 1)
    assert (err.exitcode, err.signal) == (-signal.SIGSEGV, "SIGSEGV")
    assert err.target == "comfy_env_worker.tasks:crash"
    assert err.call_id is not None and err.call_id > 1
    assert "SIGSEGV" in str(err) and "native library" in str(err)
    # faulthandler's stack of the crashing Python frame reaches the caller.
    assert "Fatal Python error: Segmentation fault" in err.stderr_tail
    assert "in crash" in err.stderr_tail


def test_stderr_tail_is_one_string_of_the_last_lines_as_documented(
    config: comfy_env.PoolConfig,
) -> None:
    # Its type was undocumented (a str? a list of lines?): the docstring says, and it holds.
    assert "``stderr_tail`` is one ``str``" in (WorkerCrashed.__doc__ or "")
    assert "one ``str``" in (comfy_env.WorkerStartError.__doc__ or "")
    with comfy_env.Pool(config.model_copy(update={"stderr_tail_lines": 5})) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:noisy", 10)
        with pytest.raises(WorkerCrashed) as info:
            w.call("comfy_env_worker.tasks:crash")
    tail = info.value.stderr_tail
    assert isinstance(tail, str) and not tail.endswith("\n")
    # The last 5 lines: the end of faulthandler's stack, the noisy lines before it gone.
    assert len(tail.splitlines()) == 5 and "File " in tail
    assert "print line" not in tail and "stderr line" not in tail


def test_the_crashed_caller_collects_exit_and_last_words_without_the_reactor(
    pool: comfy_env.Pool,
) -> None:
    # The caller whose read saw the EOF reaps the worker and drains its output itself, so the
    # error does not wait for the reactor thread (crash detection's thread hand-off). Held
    # busy here, the reactor could tell nothing: the old path waited for it, gave up after
    # its bound and reported "still running" without a signal or the worker's last words.
    events: list[object] = []
    pool.subscribe(events.append)
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    with reactor_held(pool) as release:
        with pytest.raises(WorkerCrashed) as info:
            w.call("comfy_env_worker.tasks:crash")
        assert not release.is_set()  # the reactor was still held when the error was raised
    err = info.value
    assert (err.exitcode, err.signal, err.generation) == (-signal.SIGSEGV, "SIGSEGV", 1)
    assert "Fatal Python error: Segmentation fault" in err.stderr_tail
    # The reactor, free again, finds the exit reported: one death, one WorkerRetired.
    assert w.call("tasks.remote:add", 1, 1) == 2
    assert wait_until(lambda: any(type(e).__name__ == "WorkerRetired" for e in events), 10)
    time.sleep(0.2)  # a second report, if any, would arrive meanwhile
    retired = [e for e in events if isinstance(e, comfy_env.WorkerRetired)]
    assert [(e.generation, e.reason, e.signal) for e in retired] == [(1, "crashed", "SIGSEGV")]
    stats = w.stats()
    assert (stats.crashed, stats.ok, stats.spawns, w.generation) == (1, 2, 2, 2)


def test_the_crashed_caller_reports_the_death_before_it_raises(pool: comfy_env.Pool) -> None:
    # The breaker counts the death and subscribers get WorkerRetired from the caller's own
    # thread, before WorkerCrashed reaches it: held busy, the reactor (which reaps) could
    # tell neither. The worker is left unreaped until then, and reported once.
    events: list[object] = []
    pool.subscribe(events.append)
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    process = pool._entries[w.env].slots[0].process
    assert process is not None and process.popen is not None
    with reactor_held(pool) as release:
        with pytest.raises(WorkerCrashed) as info:
            w.call("tasks.hostile:die", 7)
        assert (info.value.exitcode, info.value.signal) == (7, None)
        assert w.stats().restarts_in_window == 1
        assert wait_until(lambda: any(type(e).__name__ == "WorkerRetired" for e in events), 10)
        assert process.popen.returncode is None  # the reactor reaps it, once free again
        assert not release.is_set()
    assert wait_until(lambda: process.exited.is_set(), 10)
    assert process.popen.returncode == 7 and process.returncode == 7
    time.sleep(0.2)  # a second report, if any, would arrive meanwhile
    retired = [e for e in events if isinstance(e, comfy_env.WorkerRetired)]
    assert [(e.generation, e.reason, e.exitcode) for e in retired] == [(1, "crashed", 7)]
    assert w.stats().restarts_in_window == 1


def test_last_words_without_a_newline_reach_the_crash_report(pool: comfy_env.Pool) -> None:
    # The output pipes never reach EOF while the host holds their write ends, so the output
    # is complete when the worker has exited: a last line without its newline still counts.
    w = pool.get_worker()
    with pytest.raises(WorkerCrashed) as info:
        w.call("tasks.hostile:die_mid_line", 5)
    assert info.value.exitcode == 5
    assert "half a line on stderr" in info.value.stderr_tail
    assert "half a line on stdout" in info.value.stderr_tail


def test_exit_status_is_read_before_the_reaping_and_leaves_the_zombie() -> None:
    from comfy_env._exitwatch import _peek_exit, exiting_status

    code = "import os, sys; sys.stdin.read(1); os._exit(int(sys.argv[1]))"
    for how, expected in (("exit 3", 3), ("exit 0", 0), ("SIGKILL", -signal.SIGKILL)):
        child = subprocess.Popen(
            [sys.executable, "-c", code, how.split()[-1] if how != "SIGKILL" else "0"],
            stdin=subprocess.PIPE,
        )
        try:
            assert exiting_status(child.pid) is None  # running
            assert _peek_exit(child) is None
            if how == "SIGKILL":
                child.kill()
            else:
                assert child.stdin is not None
                child.stdin.write(b"x")
                child.stdin.flush()
            # A zombie: both readings give the status, and neither reaps it.
            assert wait_until(lambda c=child: _peek_exit(c) is not None, 10)
            assert _peek_exit(child) == expected
            assert exiting_status(child.pid) == expected
            with open(f"/proc/{child.pid}/stat", "rb") as f:
                assert f.read().rpartition(b")")[2].split()[0] == b"Z"
            assert child.wait(5) == expected  # ours to reap
            assert _peek_exit(child) == expected  # known from the reaping now
            assert exiting_status(child.pid) is None  # gone from /proc
        finally:
            if child.stdin is not None:
                child.stdin.close()
            if child.returncode is None:
                child.kill()
                child.wait()


def test_next_call_after_a_crash_runs_on_the_next_generation(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    with pytest.raises(WorkerCrashed):
        w.call("comfy_env_worker.tasks:crash")
    first_pid = w.stats().workers[0].pid
    assert w.call("tasks.remote:add", 1, 1) == 2
    assert w.generation == 2
    assert w.pid != first_pid
    stats = w.stats()
    assert (stats.crashed, stats.ok, stats.spawns) == (1, 1, 2)


def test_the_call_that_killed_a_worker_is_never_replayed(
    pool: comfy_env.Pool, tmp_path: Path
) -> None:
    marker = tmp_path / "runs"
    with pytest.raises(WorkerCrashed):
        pool.get_worker().call(remote_tasks.count_then_crash, str(marker))
    assert marker.read_text() == "ran\n"


@pytest.mark.parametrize("code", [0, 7])
def test_os_exit_reports_the_exit_code(pool: comfy_env.Pool, code: int) -> None:
    with pytest.raises(WorkerCrashed) as info:
        pool.get_worker().call("comfy_env_worker.tasks:exit_now", code)
    assert (info.value.exitcode, info.value.signal) == (code, None)
    assert f"exited with code {code}" in str(info.value)


def test_a_worker_that_closes_its_channel_and_lives_on_is_not_said_to_be_killed_from_outside(
    pool: comfy_env.Pool,
) -> None:
    """The host kills a worker whose channel closed while it still ran: its SIGKILL is the
    host's, so the story is "closed its channel", not "the OOM killer or a kill -9"."""
    w = pool.get_worker()
    with pytest.raises(WorkerCrashed) as info:
        w.call("tasks.remote:close_channel_and_linger", 30.0)
    message = str(info.value)
    assert "closed its channel while still running" in message, message
    assert "from outside" not in message and "OOM" not in message, message
    assert w.call("tasks.remote:add", 1, 2) == 3 and w.generation == 2


def test_abort_is_reported_as_sigabrt(pool: comfy_env.Pool) -> None:
    with pytest.raises(WorkerCrashed) as info:
        pool.get_worker().call(os.abort)
    assert info.value.signal == "SIGABRT"


@pytest.mark.parametrize("wait_for_watcher", [True, False])
def test_idle_death_is_invisible_to_the_next_call(
    pool: comfy_env.Pool, wait_for_watcher: bool
) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    if wait_for_watcher:
        deadline = time.monotonic() + 5
        while w.stats().state != "retired" and time.monotonic() < deadline:
            time.sleep(0.005)
        assert w.stats().workers[0].retire_reason == "crashed"
    assert w.call("tasks.remote:add", 2, 2) == 4
    assert w.generation == 2
    stats = w.stats()
    assert (stats.crashed, stats.ok) == (0, 2)


def test_a_complete_reply_written_before_death_is_delivered(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    assert w.call(remote_tasks.reply_then_die) == "late"
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 2


def test_a_crash_does_not_disturb_another_env(pool: comfy_env.Pool, foreign_venv: Path) -> None:
    here = pool.get_worker()
    there = pool.get_worker(foreign_venv)
    here.call("comfy_env_worker.tasks:echo", 0)
    there.call("comfy_env_worker.tasks:echo", 0)
    there_pid = there.pid
    with pytest.raises(WorkerCrashed):
        here.call("comfy_env_worker.tasks:crash")
    assert there.call("comfy_env_worker.tasks:getpid") == there_pid
    assert there.generation == 1


def test_timeout_is_a_total_deadline_and_replaces_the_worker(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    with pytest.raises(CallTimeout) as info:
        # Prints every 20 ms: a silence timeout would never fire.
        w.run(remote_tasks.chatty_sleep, (30, 0.02), timeout=0.5)
    err = info.value
    assert isinstance(err, TimeoutError)
    assert (err.pid, err.generation, err.env) == (pid, 1, w.env)
    assert err.target == "tasks.remote:chatty_sleep"
    assert err.call_id is not None and err.timeout == 0.5
    assert str(err).endswith("was stopped (timeout 0.5s)")
    assert pid is not None
    _wait_gone(pid)
    assert w.call("tasks.remote:add", 5) == 5
    assert w.generation == 2
    assert w.stats().timed_out == 1


def test_timeout_escalates_to_sigkill_when_sigterm_is_ignored(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    assert pid is not None
    with pytest.raises(CallTimeout):
        w.run(remote_tasks.sleep_ignoring_sigterm, (30,), timeout=0.3)
    _wait_gone(pid, timeout=5)
    assert w.call("tasks.remote:add", 1) == 1


def test_default_timeout_comes_from_the_config(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config.model_copy(update={"call_timeout": 0.3})) as pool:
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)  # warm: the common call's own path
        with pytest.raises(CallTimeout) as info:
            w.call("comfy_env_worker.tasks:sleep", 30)
        assert (info.value.timeout, info.value.target) == (0.3, "comfy_env_worker.tasks:sleep")


def test_a_call_timeout_names_the_call_and_its_timeout_at_every_stage(
    config: comfy_env.PoolConfig,
) -> None:
    """Queued (no call id yet), and in ``submit``: each ``CallTimeout`` carries the timeout
    it was given and the call's target, and its message says the timeout."""
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        ahead = w.submit("tasks.remote:cooperative_loop", (3.0,))
        assert wait_until(lambda: w.stats().in_flight == 1)
        with pytest.raises(
            CallTimeout, match=r"queued .*\(call to tasks\.remote:add, timeout 0.2s\)$"
        ) as info:
            w.run("tasks.remote:add", (1,), timeout=0.2)
        assert (info.value.timeout, info.value.target, info.value.call_id) == (
            0.2,
            "tasks.remote:add",
            None,  # it never got one
        )
        late = w.submit("tasks.remote:add", (1,), timeout=0.25)
        with pytest.raises(CallTimeout) as info:
            late.result(timeout=10)
        assert (info.value.timeout, info.value.target) == (0.25, "tasks.remote:add")
        assert ahead.result(timeout=10) == "finished"


def test_non_positive_timeout_is_refused(pool: comfy_env.Pool) -> None:
    with pytest.raises(ValueError, match="timeout"):
        pool.get_worker().run("comfy_env_worker.tasks:echo", (1,), timeout=0)


def test_cancelling_acall_stops_and_replaces_the_worker(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    assert pid is not None

    async def main() -> None:
        task = asyncio.ensure_future(w.acall("comfy_env_worker.tasks:sleep", 30))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_gone(pid)
    assert w.call("tasks.remote:add", 3) == 3
    assert w.generation == 2
    deadline = time.monotonic() + 5
    while w.stats().cancelled != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.stats().cancelled == 1


def test_keyboard_interrupt_while_waiting_stops_the_worker(
    pool: comfy_env.Pool, ctrl_c: None
) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    assert pid is not None
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            w.call("comfy_env_worker.tasks:sleep", 30)
    finally:
        timer.join()
    _wait_gone(pid)
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 2
    stats = w.stats()
    assert (stats.cancelled, stats.in_flight) == (1, 0)


def test_garbage_on_the_channel_is_a_protocol_error_that_retires_the_worker(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    with pytest.raises(ProtocolError, match="bad frame magic"):
        w.call(remote_tasks.write_garbage)
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 2


def test_an_oversized_frame_length_is_a_protocol_error(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        w.call(remote_tasks.write_oversized_header)
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 2


def test_unknown_request_gets_an_error_reply_not_silence(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    process = w._entry.slots[0].process
    assert process is not None and process.sock is not None and process.reply_sock is not None
    # White box: speak to the idle worker directly with a frame type it does not know.
    process.sock.sendall(encode_header(99, 12345, 0))
    reader = FrameReader(process.reply_sock)
    ftype, _flags, call_id, payload = reader.read(time.monotonic() + 5)
    assert (ftype, call_id) == (10, 12345)  # FrameType.ERROR, same call id
    assert b"does not accept frame type 99" in payload
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 1


def test_worker_output_never_corrupts_the_channel(pool: comfy_env.Pool) -> None:
    assert pool.get_worker().call(remote_tasks.noisy, 200) == 200


def test_worker_output_reaches_host_logging(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    pool.get_worker().call(remote_tasks.noisy, 1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        messages = [r.getMessage() for r in caplog.records]
        if "print line 0" in messages and "stderr line 0" in messages:
            break
        time.sleep(0.01)
    records = {r.getMessage(): r for r in caplog.records}
    assert records["print line 0"].levelno == logging.INFO
    assert records["stderr line 0"].levelno == logging.WARNING
    assert records["print line 0"].name == "comfy_env.worker.current"


def test_stale_events_are_counted(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    with pytest.raises(WorkerCrashed):
        w.call("comfy_env_worker.tasks:crash")
    # The reader's EOF and the exit watcher both report the death; one of them is stale.
    deadline = time.monotonic() + 5
    while w.stats().stale_events_dropped < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.stats().stale_events_dropped == 1


def test_worker_runs_in_its_own_session_and_holds_only_its_channel(
    pool: comfy_env.Pool, tmp_path: Path, foreign_venv: Path
) -> None:
    extra = open(tmp_path / "held-open", "w")
    other_a, other_b = socket.socketpair()
    read_end, write_end = os.pipe()
    try:
        first = pool.get_worker(foreign_venv)  # another worker, spawned before ours
        first.call("comfy_env_worker.tasks:echo", 0)
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)
        pid = w.pid
        assert pid is not None
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid
        fds = sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))
        targets = {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in fds}
        assert not any("held-open" in t for t in targets.values())
        sockets = [t for t in targets.values() if t.startswith("socket:")]
        # Its own channel (a socketpair each way), not the other worker's.
        assert len(sockets) == 2, targets
        host_pipe = os.readlink(f"/proc/self/fd/{read_end}")
        assert host_pipe not in targets.values()
        assert targets[0] == "/dev/null"
        # stdio, the channel, its log pipe, its cancel pipe, and shared-memory blocks it
        # mapped itself
        assert targets[1].startswith("pipe:") and targets[2].startswith("pipe:")
        process = w._entry.slots[0].process
        assert process is not None and process.channel._cancel_fd is not None
        log_pipe = os.readlink(f"/proc/self/fd/{process.pipes._log_pipe.fileno()}")
        cancel_pipe = os.readlink(f"/proc/self/fd/{process.channel._cancel_fd}")
        assert cancel_pipe in targets.values()
        own = {log_pipe, cancel_pipe}
        rest = {fd for fd, t in targets.items() if fd > 2 and t not in sockets and t not in own}
        assert all(targets[fd].startswith("/dev/shm/ce-") for fd in rest), targets
    finally:
        extra.close()
        other_a.close()
        other_b.close()
        os.close(read_end)
        os.close(write_end)


@pytest.mark.parametrize("then", ["close", "next call"])
def test_a_retired_worker_whose_release_is_due_is_released_at_once_when_needed(
    monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """A crashed worker's socket and shared memory are released a moment after the crash
    (off the caller's way out). A pool closed before that moment, or a new generation taking
    the slot, releases them at once."""
    from comfy_env import _spawner
    from comfy_env._process import WorkerProcess

    monkeypatch.setattr(_spawner, "_DISPOSE_DELAY", 3600.0)
    pool = comfy_env.Pool(comfy_env.PoolConfig(max_restarts=100))
    try:
        w = pool.get_worker()
        w.call("comfy_env_worker.tasks:echo", 0)
        crashed = w._entry.slots[0].process
        assert isinstance(crashed, WorkerProcess)
        with pytest.raises(WorkerCrashed):
            w.call("comfy_env_worker.tasks:crash")
        assert not crashed.channel.disposed  # due in an hour
        if then == "next call":
            assert w.call("comfy_env_worker.tasks:echo", 1) == 1
            assert w.generation == 2 and crashed.channel.disposed
    finally:
        pool.close()
    assert crashed.channel.disposed
    # Its channel is closed, both halves.
    assert crashed.sock is not None and crashed.sock.fileno() == -1
    assert crashed.reply_sock is not None and crashed.reply_sock.fileno() == -1


def _reactor_counting_wakes() -> tuple[Reactor, list[str]]:
    """A started reactor whose wake-up bytes are counted (the name of each sender's thread)."""
    reactor = Reactor()
    reactor.start()
    wakes: list[str] = []
    real_wake = reactor._wake

    def counted_wake() -> None:
        wakes.append(threading.current_thread().name)
        real_wake()

    reactor._wake = counted_wake  # type: ignore[method-assign]
    return reactor, wakes


def test_the_reactor_runs_what_it_schedules_itself_without_waking_itself() -> None:
    """``call_soon``/``call_later`` from the reactor thread run in the loop's next turn
    without the wake-up byte (a write and two reads: system calls that hand the GIL to a
    caller on a crash's path); from any other thread they still wake it."""
    reactor, wakes = _reactor_counting_wakes()
    try:
        ran = threading.Event()
        timed = threading.Event()

        def on_reactor() -> None:
            reactor.call_soon(ran.set)
            reactor.call_later(0.01, timed.set)

        reactor.call_soon(on_reactor)  # from this thread: one wake-up
        assert ran.wait(5) and timed.wait(5)
        assert wakes == [threading.current_thread().name]
    finally:
        reactor.stop()


def test_a_timer_due_after_the_reactors_own_wake_up_needs_no_wake_up_byte() -> None:
    """From another thread, ``call_later`` wakes the loop only for a timer due before the
    moment the loop wakes by itself; a later one is armed at that wake-up. Every timer fires,
    none before it is due, in order."""
    import math

    reactor, wakes = _reactor_counting_wakes()
    try:
        fired: dict[str, float] = {}
        all_fired = threading.Event()

        def mark(name: str) -> Callable[[], None]:
            def fire() -> None:
                fired[name] = time.monotonic()
                if len(fired) == 3:
                    all_fired.set()

            return fire

        first = reactor.call_later(1.0, mark("first"))  # nothing scheduled: a byte
        assert len(wakes) == 1
        # Asleep until the first timer (not awake: -inf; not without timers: inf).
        assert wait_until(lambda: 0 < reactor._sleep_until < math.inf, 5)
        later = reactor.call_later(1.2, mark("later"))  # due after that wake-up: no byte
        assert len(wakes) == 1
        sooner = reactor.call_later(0.05, mark("sooner"))  # due before it: a byte
        assert len(wakes) == 2
        assert all_fired.wait(10), fired
        assert fired["sooner"] < fired["first"] < fired["later"]
        for name, handle in (("first", first), ("later", later), ("sooner", sooner)):
            assert fired[name] >= handle.when
    finally:
        reactor.stop()


def test_a_timer_too_far_for_the_os_to_wait_on_never_stops_the_reactor() -> None:
    """A timer due further away than the OS's longest wait (epoll: about 24.8 days) is slept
    for in bounded steps: the loop lives on and runs what comes after it (once, a grace timer
    of 1e30 s raised OverflowError in select and ended the pool's only service thread)."""
    reactor = Reactor()
    reactor.start()
    try:
        far = reactor.call_later(1e30, lambda: None)
        assert wait_until(lambda: reactor._sleep_until > 0, 5)  # asleep with the far timer
        ran = threading.Event()
        reactor.call_soon(ran.set)
        assert ran.wait(5)
        soon = threading.Event()
        reactor.call_later(0.01, soon.set)
        assert soon.wait(5)
        assert reactor._thread is not None and reactor._thread.is_alive()
        far.cancel()
    finally:
        reactor.stop()


def _failing_select(reactor: Reactor, failures: int | None) -> list[int]:
    """Make ``reactor``'s select raise ``failures`` times (None: always) before it works again;
    returns the list whose length counts the failures so far. Set before ``start``."""
    real_select = reactor._selector.select
    raised: list[int] = []

    def select(timeout: float | None = None) -> Any:
        if failures is None or len(raised) < failures:
            raised.append(1)
            raise OSError(errno.EINVAL, "select failed (test)")
        return real_select(timeout)

    reactor._selector.select = select  # type: ignore[method-assign]
    return raised


def test_a_failing_select_is_retried_and_the_reactor_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A select that fails is logged and retried: the pool's only service thread (exit
    notices, output, timers) lives on and runs what is scheduled after it."""
    reactor = Reactor()
    raised = _failing_select(reactor, 3)
    with caplog.at_level(logging.ERROR, logger="comfy_env.reactor"):
        reactor.start()
        try:
            fired = threading.Event()
            reactor.call_later(0.01, fired.set)
            assert fired.wait(5)
            assert reactor.run_sync(lambda: 42, timeout=5) == 42
            assert len(raised) == 3 and reactor.running and reactor.failure is None
        finally:
            reactor.stop()
    assert "select failed" in caplog.text


def test_a_callback_raising_system_exit_does_not_end_the_reactor(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a thread that is not the main one, SystemExit ends the thread without a word: a
    callback raising it (a subscriber calling sys.exit) is logged like any other failure."""
    reactor = Reactor()
    reactor.start()
    try:
        with caplog.at_level(logging.ERROR, logger="comfy_env.reactor"):
            reactor.call_soon(lambda: sys.exit(3))
            assert reactor.run_sync(lambda: "after", timeout=5) == "after"
        assert reactor.running
        assert "reactor callback failed" in caplog.text
    finally:
        reactor.stop()


def test_run_sync_raises_once_the_reactor_thread_has_ended(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A selector that never works again ends the loop (its failure kept and logged as
    critical): ``running`` turns false, and a spawn waiting in ``run_sync`` gets
    ``ReactorFailed`` instead of waiting for ever."""
    from comfy_env import _reactor

    monkeypatch.setattr(_reactor, "_FAILURE_PAUSE", 0.001)
    monkeypatch.setattr(_reactor, "_RUN_SYNC_CHECK", 0.05)
    reactor = Reactor()
    _failing_select(reactor, None)
    try:
        with caplog.at_level(logging.ERROR, logger="comfy_env.reactor"):
            reactor.start()
            assert reactor._thread is not None
            reactor._thread.join(10)
            assert not reactor._thread.is_alive()
        assert not reactor.running
        assert isinstance(reactor.failure, OSError)
        assert "service thread (comfy-env-reactor) has ended" in caplog.text
        with pytest.raises(_reactor.ReactorFailed, match="has ended") as info:
            reactor.run_sync(lambda: None)  # no timeout: would have waited for ever
        assert info.value.__cause__ is reactor.failure
    finally:
        reactor.stop()


def test_a_spawn_after_the_reactor_ended_is_a_start_error_not_a_hang(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool whose service thread has ended (here: a bug in its loop, made to happen) cannot
    launch a worker: the caller gets ``WorkerStartError`` saying why, at once, instead of a
    call that waits for ever for the thread to launch it."""
    import heapq

    from comfy_env import WorkerStartError, _reactor

    monkeypatch.setattr(_reactor, "_RUN_SYNC_CHECK", 0.05)
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker(None)
        assert w.call("tasks.remote:add", 1, 2) == 3
        reactor = pool._spawner.reactor
        assert reactor is not None and reactor._thread is not None
        # A timer entry the loop cannot read: its next turn raises TypeError outside any
        # callback, which ends the thread.
        reactor.call_soon(lambda: heapq.heappush(reactor._timers, (None, -1, None)))  # type: ignore[arg-type]
        reactor._thread.join(10)
        assert not reactor.running and isinstance(reactor.failure, TypeError)
        os.kill(w.pid, signal.SIGKILL)  # the next call finds the channel closed: a spawn
        assert wait_until(lambda: not alive(w.pid))
        with pytest.raises(WorkerStartError, match="service thread"):
            w.call("tasks.remote:add", 1, 2, timeout=30)
