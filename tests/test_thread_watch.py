"""The first sign of a worker's death: its named threads end before its channel closes.

A killed worker's channel reaches EOF only once the kernel has freed its whole address space;
its watchdog and sentinel threads end long before. The host watches them (``_watchdog``) and
shuts the channel down as soon as one has ended while the process is exiting. Real workers,
real SIGKILLs; nothing here times anything: the tests look at which path told the caller."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import reactor_held, wait_until

import comfy_env
from comfy_env import WorkerCrashed, _watchdog
from comfy_env._channel import _ALARM_AFTER
from comfy_env._process import WorkerProcess
from comfy_env_worker.protocol import (
    ALARM_RECHECKS,
    SENTINEL_THREAD_NAME,
    WATCHDOG_THREAD_NAME,
    ChannelClosed,
    FrameReader,
    FrameType,
    encode_header,
)


def _thread_names(pid: int) -> set[str]:
    names = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) != pid:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    names.add(f.read().strip())
            except OSError:
                pass
    return names


def _torn_down(pid: int) -> bool:
    """Whether our child ``pid`` is a zombie by now, or reaped already."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _process(w: comfy_env.Worker) -> WorkerProcess:
    process = w._entry.slots[0].process
    assert isinstance(process, WorkerProcess)
    return process


def _watched(w: comfy_env.Worker) -> WorkerProcess:
    """Start ``w``'s worker and wait until the host watches both its named threads."""
    w.call("comfy_env_worker.tasks:echo", 0)
    process = _process(w)
    assert wait_until(lambda: len(process.watch.threads._watched_fds) == 2, 5.0), (
        process.watch.threads._watched_fds
    )
    return process


def _thread_pidfds_work() -> bool:
    """Whether this kernel gives pidfds of single threads (Linux 6.9+)."""
    try:
        fd = os.pidfd_open(threading.get_native_id(), _watchdog.PIDFD_THREAD)
    except (OSError, AttributeError):
        return False
    os.close(fd)
    return True


needs_thread_pidfds = pytest.mark.skipif(
    not _thread_pidfds_work(), reason="no pidfds of single threads here (Linux 6.9+)"
)


def test_a_worker_names_its_watchdog_and_sentinel_threads(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    assert pid is not None
    wanted = {WATCHDOG_THREAD_NAME, SENTINEL_THREAD_NAME}
    assert wait_until(lambda: wanted <= _thread_names(pid), 5.0), _thread_names(pid)
    assert len(_watchdog.named_threads(pid)) == 2


def test_a_worker_starts_its_threads_while_the_host_answers_its_hello(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Off the first call's path: the watchdog and the sentinel start between HELLO and CONFIG,
    # not after READY, where they took the GIL in turns with the canary. The host holds
    # CONFIG back until it sees both threads (or gives up): they must not need CONFIG.
    import psutil

    from comfy_env import _handshake
    from comfy_env import _process as process_module

    make_config = _handshake.worker_config
    seen_before_config: list[bool] = []

    def config_once_threads_run(*args: Any, **kwargs: Any) -> Any:
        [worker] = [
            child for child in psutil.Process().children() if process_module.BOOT in child.cmdline()
        ]
        wanted = {WATCHDOG_THREAD_NAME, SENTINEL_THREAD_NAME}
        seen_before_config.append(wait_until(lambda: wanted <= _thread_names(worker.pid), 5.0))
        return make_config(*args, **kwargs)

    monkeypatch.setattr(_handshake, "worker_config", config_once_threads_run)
    with comfy_env.Pool() as pool:
        assert pool.get_worker().call("comfy_env_worker.tasks:echo", 5) == 5
    assert seen_before_config == [True]


@needs_thread_pidfds
def test_the_host_watches_both_named_threads(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    process = _watched(w)
    assert not process.exit_noticed


def _kill_holding_512_mib(
    pool: comfy_env.Pool, w: comfy_env.Worker, hold_reactor: bool
) -> tuple[BaseException, bool]:
    """Kill ``w``'s worker while a call holds 512 MiB in it (a teardown of tens of ms) and
    return the call's error and whether the worker was a zombie (or reaped) when the caller
    had it. ``hold_reactor``: the pool's reactor cannot run from just before the kill until
    the caller has its error, and the caller's wait is by then a watched one."""
    pid = w.pid
    assert pid is not None
    failed: list[BaseException] = []
    torn_down: list[bool] = []

    def call() -> None:
        try:
            w.call("tasks.remote:hold_memory_and_sleep", 512, 60)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            failed.append(exc)
            torn_down.append(_torn_down(pid))

    caller = threading.Thread(target=call)
    caller.start()

    def holding() -> bool:
        with open(f"/proc/{pid}/status") as f:
            rss = next(line for line in f if line.startswith("VmRSS:"))
        return int(rss.split()[1]) > 400 * 1024

    assert wait_until(holding, 30.0)
    if hold_reactor:
        time.sleep(_ALARM_AFTER * 2)  # the caller's wait is a watched one by now
        with reactor_held(pool):
            os.kill(pid, signal.SIGKILL)
            caller.join(30)
    else:
        os.kill(pid, signal.SIGKILL)
        caller.join(30)
    assert not caller.is_alive()
    (err,) = failed
    return err, torn_down[0]


@needs_thread_pidfds
def test_a_killed_worker_is_told_before_its_teardown_ends() -> None:
    """A worker holding 512 MiB takes tens of ms to be torn down after a SIGKILL; its
    channel closes only then. The caller hears of it from the named threads' end instead,
    with the same status the reaping reports."""
    config = comfy_env.PoolConfig(sys_path=[os.path.dirname(__file__)], max_restarts=100)
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        process = _watched(w)
        err, torn_down = _kill_holding_512_mib(pool, w, hold_reactor=False)
        assert isinstance(err, WorkerCrashed), err
        assert (err.exitcode, err.signal) == (-signal.SIGKILL, "SIGKILL")
        assert process.exit_noticed, "the crash was seen at the EOF, not at the threads' end"
        # Told while the kernel was still freeing its 512 MiB: not a zombie yet (its EOF
        # would have come only after that, a moment before it became one).
        assert not torn_down
        assert wait_until(lambda: process.exited.is_set(), 10.0)
        assert process.returncode == -signal.SIGKILL  # what the reaping says, the same
        assert process.watch.threads._watched_fds == set()
        assert w.call("comfy_env_worker.tasks:echo", 3) == 3  # the next generation serves


@needs_thread_pidfds
def test_a_named_thread_ending_while_the_worker_lives_changes_nothing(
    pool: comfy_env.Pool,
) -> None:
    """An exec, or a watchdog ending alone, ends a named thread but not the process: the host
    must not take it for a death. Replayed here on a live worker, through the reactor."""
    w = pool.get_worker()
    process = _watched(w)
    reactor = pool._spawner.reactor
    assert reactor is not None
    fd = sorted(process.watch.threads._watched_fds)[0]
    reactor.run_sync(lambda: process.watch.threads._on_thread_exit(fd))
    watched = process.watch.threads._watched_fds
    assert watched and fd not in watched  # the other stays watched
    # Its rechecks (the main thread might just not have begun to exit) end without a word.
    checks = process.watch.threads._EXIT_RECHECKS * process.watch.threads._EXIT_RECHECK_DELAY
    threading.Event().wait(checks + 0.05)
    assert not process.exit_noticed
    pid = w.pid
    assert w.call("comfy_env_worker.tasks:echo", 7) == 7
    assert w.pid == pid and w.generation == 1


@needs_thread_pidfds
def test_a_call_sent_to_a_dying_worker_runs_on_the_next_one() -> None:
    """The worker is killed idle; the next call's request goes out before the host has heard
    (its reactor is held), then the named threads' end shuts the channel down. Our request is
    still unread there: the call never ran, so it runs on a fresh worker instead of failing
    (what the reset of the worker's own exit would have told, tens of ms later)."""
    config = comfy_env.PoolConfig(sys_path=[os.path.dirname(__file__)], max_restarts=100)
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:hold_memory_and_sleep", 512, 0)  # kept: a long teardown
        process = _watched(w)
        pid = w.pid
        assert pid is not None
        results: list[Any] = []
        with reactor_held(pool):
            os.kill(pid, signal.SIGKILL)
            caller = threading.Thread(
                target=lambda: results.append(w.call("tasks.remote:add", 2, 3))
            )
            caller.start()
            # The request is on its way (or sent); let the reactor hear of the threads' end.
            threading.Event().wait(0.005)
        caller.join(30)
        assert results == [5]
        assert process.exit_noticed, "the dying worker's EOF came first: nothing was tested"
        assert w.generation == 2 and w.pid != pid
        stats = pool.stats()[w.env]
        assert (stats.ok, stats.crashed) == (3, 0)  # hold, echo, add


def _watches_of(pool: comfy_env.Pool, process: WorkerProcess) -> list[int]:
    """The descriptors the pool's reactor still watches for ``process``."""
    reactor = pool._spawner.reactor
    assert reactor is not None

    def owner(callback: Any) -> Any:
        callback = getattr(callback, "func", callback)  # a functools.partial
        return getattr(callback, "__self__", None)

    keys = reactor.run_sync(lambda: list(reactor._selector.get_map().values()))
    return [key.fd for key in keys if owner(key.data) is process]


@needs_thread_pidfds
def test_a_thread_end_and_the_exit_in_one_wake_up_leave_no_watch_behind() -> None:
    """The reactor, busy while the worker dies, then sees the named threads' end and the
    process's exit in one wake-up. The notice takes the exit's pidfd off the reactor for a
    moment (so that nothing wakes it while the caller reports the crash); the exit callback
    still queued in that same wake-up must not act on it: it would schedule the reaping, the
    watch would be restored, and the reaping would close a descriptor still watched, which the
    next worker's pidfd (the same number) could not be watched under."""
    config = comfy_env.PoolConfig(max_restarts=100)
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        process = _watched(w)
        pid = w.pid
        assert pid is not None
        with reactor_held(pool):
            os.kill(pid, signal.SIGKILL)
            assert wait_until(lambda: _torn_down(pid), 10.0)
        assert wait_until(lambda: process.exited.is_set(), 10.0)
        assert process.returncode == -signal.SIGKILL
        assert process.exit_noticed, "the exit came alone: nothing was tested"
        assert wait_until(lambda: not _watches_of(pool, process), 5.0), _watches_of(pool, process)
        assert process.watch.threads._watched_fds == set()
        for value in range(3):  # the next generations start, are watched, and serve
            assert w.call("comfy_env_worker.tasks:echo", value) == value
        assert w.generation == 2
        # Closed with the channel (the retired worker's ``dispose``).
        watch = process.watch
        assert wait_until(lambda: not watch.threads._fds and watch.threads.stat_fd is None, 5.0)


# ---- the caller's own alarms (FrameReader.set_alarms) ----


def _alarms_armed(process: WorkerProcess) -> bool:
    """Whether ``process``'s channel reader watches the named threads (its own pidfds)."""
    reader = process.reader
    return reader is not None and len(reader.alarm_fds) == 2


def _frame(call_id: int, payload: bytes = b"x") -> bytes:
    return encode_header(FrameType.REPLY_OK, call_id, len(payload)) + payload


@contextlib.contextmanager
def _alarmed_reader(
    answers: list[bool], after: float = 0.05
) -> Iterator[tuple[FrameReader, socket.socket, int, list[float]]]:
    """A reader of one end of a socketpair, with one alarm: a pipe whose write end the test
    holds. ``on_alarm`` pops its answers; the times it was asked are recorded."""
    ours, theirs = socket.socketpair()
    alarm_r, alarm_w = os.pipe()
    asked: list[float] = []

    def on_alarm() -> bool:
        asked.append(time.monotonic())
        return answers.pop(0) if answers else False

    try:
        reader = FrameReader(ours)
        reader.set_read_timeout(after)
        reader.set_alarms([alarm_r], on_alarm)
        yield reader, theirs, alarm_w, asked
    finally:
        for fd in (alarm_r, alarm_w):
            os.close(fd)
        ours.close()
        theirs.close()


def _later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()))
    thread.start()
    return thread


def test_a_read_that_ends_within_the_timeout_never_asks_the_alarms() -> None:
    """The common call pays nothing: one blocking read, even with an alarm ready at once."""
    with _alarmed_reader([], after=1.0) as (reader, peer, alarm_w, asked):
        os.write(alarm_w, b"!")
        sender = _later(0.02, lambda: peer.sendall(_frame(7)))
        assert reader.read()[2] == 7
        sender.join()
        assert asked == []


def test_an_alarm_that_tells_of_a_death_ends_a_long_read_as_at_eof() -> None:
    with _alarmed_reader([True]) as (reader, _peer, alarm_w, asked):
        start = time.monotonic()
        ringer = _later(0.15, lambda: os.write(alarm_w, b"!"))
        with pytest.raises(ChannelClosed) as err:
            reader.read()
        ringer.join()
        assert not err.value.partial
        assert len(asked) == 1 and asked[0] - start >= 0.15


def test_an_alarm_that_is_not_a_death_is_asked_again_then_dropped() -> None:
    """A thread that ended alone: asked again for a while (a killed worker's main thread may
    not have begun to exit yet), then no longer watched; the read goes on."""
    with _alarmed_reader([]) as (reader, peer, alarm_w, asked):
        os.write(alarm_w, b"!")  # rings at the first watched wait, and stays readable
        sender = _later(0.3, lambda: peer.sendall(_frame(9)))
        assert reader.read()[2] == 9
        sender.join()
        assert len(asked) == 1 + ALARM_RECHECKS and reader.alarm_fds == []


def test_an_alarm_that_rang_before_the_death_was_told_hears_of_it_when_asked_again() -> None:
    """A killed worker's named thread ended before its main thread began to exit (a busy
    machine): the first answer is "alive"; a later one tells the death."""
    with _alarmed_reader([False, False, True]) as (reader, _peer, alarm_w, asked):
        ringer = _later(0.1, lambda: os.write(alarm_w, b"!"))
        with pytest.raises(ChannelClosed):
            reader.read()
        ringer.join()
        assert len(asked) == 3


def test_bytes_sent_before_a_death_are_read_before_its_alarm() -> None:
    """A reply written just before the worker died is delivered, not taken for a crash: a
    watched wait that finds both the bytes and the alarm ready takes the bytes."""
    with _alarmed_reader([True]) as (reader, peer, alarm_w, asked):
        peer.sendall(_frame(3))
        os.write(alarm_w, b"!")
        reader._await_watched(None, False)  # the watched wait, both ready at once
        assert reader.read()[2] == 3
        assert asked == []


def test_an_alarm_mid_frame_ends_the_read_as_a_partial_frame() -> None:
    with _alarmed_reader([True]) as (reader, peer, alarm_w, asked):
        peer.sendall(_frame(4, b"abcdef")[:-3])
        ringer = _later(0.15, lambda: os.write(alarm_w, b"!"))
        with pytest.raises(ChannelClosed) as err:
            reader.read()
        ringer.join()
        assert err.value.partial and len(asked) == 1


def test_a_deadline_holds_while_the_alarms_are_watched() -> None:
    with _alarmed_reader([]) as (reader, _peer, _alarm_w, asked):
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.read(start + 0.2)
        assert 0.2 <= time.monotonic() - start < 2.0
        assert asked == []


@needs_thread_pidfds
def test_a_caller_hears_of_a_death_itself_while_the_reactor_is_busy() -> None:
    """A caller waiting long for its reply watches the worker's named threads itself: a
    worker holding 512 MiB, killed while the pool's reactor cannot run, is reported before
    the kernel has freed its memory (the channel's EOF would come only after that)."""
    config = comfy_env.PoolConfig(sys_path=[os.path.dirname(__file__)], max_restarts=100)
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        process = _watched(w)
        assert wait_until(lambda: _alarms_armed(process), 5.0), process.watch.threads._fds
        err, torn_down = _kill_holding_512_mib(pool, w, hold_reactor=True)
        assert isinstance(err, WorkerCrashed), err
        assert (err.exitcode, err.signal) == (-signal.SIGKILL, "SIGKILL")
        assert not torn_down, "the crash was seen at the EOF, not at the threads' end"
        assert wait_until(lambda: process.exited.is_set(), 10.0)
        assert process.returncode == -signal.SIGKILL
        assert w.call("comfy_env_worker.tasks:echo", 3) == 3
    assert (
        process.watch.threads._fds == [] and process.watch.threads.stat_fd is None
    )  # closed by dispose


@needs_thread_pidfds
def test_a_channel_that_refuses_the_read_timeout_leaves_the_watch_to_the_reactor(
    pool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the channel refuses the receive timeout, the caller gets no pidfds of its own and
    the reactor alone watches the named threads; calls go on as before."""

    def refuse(*_args: Any) -> None:
        raise OSError("SO_RCVTIMEO refused")

    monkeypatch.setattr(FrameReader, "set_read_timeout", refuse)
    w = pool.get_worker()
    process = _watched(w)
    assert process.reader is not None and process.reader.read_timeout == 0
    assert process.reader.alarm_fds == []  # the reactor watches alone
    assert w.call("comfy_env_worker.tasks:echo", 5) == 5


def test_a_wait_begun_before_the_alarms_were_set_picks_them_up() -> None:
    """The first call may begin before the worker's named threads are found: its wait, on
    the socket alone, looks again every read timeout and then watches the alarms too."""
    ours, theirs = socket.socketpair()
    alarm_r, alarm_w = os.pipe()
    try:
        reader = FrameReader(ours)
        reader.set_read_timeout(0.05)
        asked: list[bool] = []

        def arm_and_ring() -> None:
            time.sleep(0.12)
            reader.set_alarms([alarm_r], lambda: asked.append(True) or True)
            os.write(alarm_w, b"!")

        armer = _later(0, arm_and_ring)
        with pytest.raises(ChannelClosed):
            reader.read()
        armer.join()
        assert asked == [True]
    finally:
        for fd in (alarm_r, alarm_w):
            os.close(fd)
        ours.close()
        theirs.close()


@needs_thread_pidfds
def test_a_request_left_unread_is_told_after_the_dying_worker_let_go_of_it() -> None:
    """Whether our request was read is asked after the death is known, maybe late: once the
    teardown has released the worker's socket, the count of unread bytes is 0, and the reset
    the kernel left pending on ours must tell it instead."""
    config = comfy_env.PoolConfig(sys_path=[os.path.dirname(__file__)], max_restarts=100)
    with comfy_env.Pool(config) as pool:
        w = pool.get_worker()
        w.call("tasks.remote:hold_memory_and_sleep", 256, 0)  # kept: a teardown of ms
        process = _watched(w)
        pid = w.pid
        assert pid is not None and process.sock is not None
        with reactor_held(pool):
            os.kill(pid, signal.SIGKILL)
            process.sock.sendall(encode_header(FrameType.PING, 0, 0))  # never read
            assert wait_until(lambda: _torn_down(pid), 10.0)  # its socket is gone
            process.watch.noticed_status = -signal.SIGKILL  # what the notice would have read
            assert process.request_unread()
        assert w.call("comfy_env_worker.tasks:echo", 1) == 1  # the next generation serves
