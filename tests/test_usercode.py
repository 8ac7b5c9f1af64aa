"""The env's code misbehaving inside a worker without crashing it (sixteenth round).

Native libraries and node packs do things to their own process that the worker runtime relies
on: they close descriptors (daemon-style libraries), fork, spawn children that inherit what
they can, install signal handlers, change process-wide settings, reconfigure logging and
monkeypatch modules. The promise stays: the call (and later calls) work, or the worker is
retired with a typed error that names the cause and the next call runs on a fresh worker;
no hang past the configured timeouts, no wrong result, no leaked process, descriptor or
block. The env's code is in ``tests/tasks/usercode.py``; every test uses real workers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psutil
import pytest
from conftest import TESTS_DIR, alive, wait_until

import comfy_env

T = "tasks.usercode:"


@pytest.fixture
def upool() -> Iterator[comfy_env.Pool]:
    config = comfy_env.PoolConfig(
        sys_path=(str(TESTS_DIR),), call_timeout=20.0, kill_grace=0.5, close_timeout=3.0
    )
    with comfy_env.Pool(config) as p:
        yield p


def _worker_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("comfy_env.worker")]


def _gone(pid: int) -> bool:
    return not alive(pid)


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


# ---- fork in the env's code ---------------------------------------------------------------


def test_a_process_forked_by_the_call_never_answers_it(upool: comfy_env.Pool) -> None:
    """``os.fork()`` whose child returns from the function (instead of ``os._exit``): the
    child answered the call with its own result and then served the host's next requests
    in the worker's place, while the worker waited for it forever."""
    w = upool.get_worker()
    worker_pid = w.call(T + "pid")
    result = w.call(T + "fork_child_returns_first", "a")
    assert result == f"parent-a-{worker_pid}"
    assert [w.call(T + "pid") for _ in range(3)] == [worker_pid] * 3
    stats = w.stats()
    assert (stats.generation, stats.crashed) == (1, 0)


def test_a_forked_child_that_returns_later_never_reads_the_next_request(
    upool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker answers first; its child returns while the next call runs. The child's
    late answer came out of turn (``ProtocolError`` for an innocent call), or it read the
    next request itself."""
    caplog.set_level(logging.WARNING, logger="comfy_env.worker")
    w = upool.get_worker()
    worker_pid = w.call(T + "pid")
    assert w.call(T + "fork_child_returns_later", "b", 0.2) == f"parent-b-{worker_pid}"
    assert w.call("comfy_env_worker.tasks:sleep", 0.5) == 0.5  # the child returns meanwhile
    assert [w.call(T + "pid") for _ in range(3)] == [worker_pid] * 3
    assert w.stats().generation == 1
    assert wait_until(
        lambda: any("forked by the env's code" in r.getMessage() for r in _worker_records(caplog))
    )


def test_a_lingering_forked_child_logs_through_the_log_pipe_and_never_dirties_the_channel(
    upool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """A forked child that outlives the call and keeps printing and logging: its lines went
    in band on the worker's channel, so between calls the worker looked as if it wrote out
    of turn and was retired (losing its caches), or a line cut into a reply."""
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    w = upool.get_worker()
    child = w.call(T + "fork_child_lingers", 30.0)
    for _ in range(20):
        assert w.call("comfy_env_worker.tasks:sleep", 0.01) == 0.01
    assert w.stats().generation == 1
    assert w.stats().crashed == 0
    assert wait_until(
        lambda: any(r.getMessage() == "child logging" for r in _worker_records(caplog))
    )
    assert alive(child)
    upool.close()
    assert wait_until(lambda: _gone(child)), "the forked child outlived the pool"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocessing_inside_a_worker_works_and_leaves_nothing(
    upool: comfy_env.Pool, method: str
) -> None:
    w = upool.get_worker()
    worker_pid = w.call(T + "pid")
    assert w.call(T + "mp_pool", method) == [0, 1, 4, 9]
    assert w.call(T + "pid") == worker_pid
    leftovers = _descendants(worker_pid)  # spawn: its resource tracker, until the worker ends
    upool.close()
    assert wait_until(lambda: all(_gone(pid) for pid in leftovers))


def test_a_child_holding_inherited_descriptors_never_hides_the_worker_s_death(
    upool: comfy_env.Pool,
) -> None:
    """``subprocess.Popen(close_fds=False)`` children (one in the worker's group, one in a
    session of its own) outlive the worker: its crash is still reported at once, and they
    are stopped with its generation."""
    w = upool.get_worker()
    grouped = w.call(T + "popen_lingers", 60.0, False)
    own_session = w.call(T + "popen_lingers_in_session", 60.0)
    with pytest.raises(comfy_env.WorkerCrashed) as info:
        w.call(T + "die")
    assert info.value.exitcode == 3
    assert wait_until(lambda: _gone(grouped) and _gone(own_session))
    assert w.call(T + "echo", 1) == 1
    assert w.stats().generation == 2


# ---- descriptors ----------------------------------------------------------------------------


def test_closing_every_descriptor_is_a_typed_error_that_names_the_cause(
    upool: comfy_env.Pool,
) -> None:
    """``os.closerange(3, 65536)`` in the call closes the channel: the crash report said
    only that the worker was killed, with Python's 'lost sys.stderr' noise as last words.
    Now the worker's last words say why, or (when the host's kill of a worker whose
    channel closed under it comes first) the host's message names the probable cause."""
    w = upool.get_worker()
    with pytest.raises(comfy_env.WorkerCrashed) as info:
        w.call(T + "closerange_all")
    assert "os.closerange" in str(info.value)
    assert "lost sys.stderr" not in info.value.stderr_tail
    assert w.call(T + "echo", 1) == 1
    assert w.stats().generation == 2


def _channel_fds(pid: int) -> dict[str, int]:
    """The worker's descriptors, from its command line (``BOOT rundir requests host log
    cancel replies``)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().split(b"\0")
    return {
        "requests": int(args[4]),
        "log": int(args[6]),
        "cancel": int(args[7]),
        "replies": int(args[8]),
    }


def test_a_channel_descriptor_closed_during_a_call_is_said_and_the_next_call_runs_anew(
    upool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """The requests descriptor closed by the call: the reply still goes out, then the worker
    says why it leaves (a bare traceback of its serve loop before) and the next call runs
    on a fresh worker."""
    caplog.set_level(logging.WARNING, logger="comfy_env.worker")
    w = upool.get_worker()
    worker_pid = w.call(T + "pid")
    assert w.call(T + "close_fd", _channel_fds(worker_pid)["requests"]) == worker_pid
    assert wait_until(
        lambda: any(
            "closed or replaced by code in the worker" in r.getMessage()
            for r in _worker_records(caplog)
        )
    )
    assert not any("Traceback" in r.getMessage() for r in _worker_records(caplog))
    assert w.call(T + "echo", 1) == 1
    assert w.call(T + "pid") != worker_pid


def test_a_replies_descriptor_closed_during_a_call_is_a_typed_error_naming_the_cause(
    upool: comfy_env.Pool,
) -> None:
    w = upool.get_worker()
    worker_pid = w.call(T + "pid")
    with pytest.raises(comfy_env.WorkerCrashed) as info:
        w.call(T + "close_fd", _channel_fds(worker_pid)["replies"])
    assert "os.closerange" in str(info.value)
    assert w.call(T + "echo", 1) == 1
    assert w.stats().generation == 2


@pytest.mark.parametrize(
    "steps",
    [
        [("dup2_devnull_over", ([0, 1, 2],))],
        [("close_fd", (1,)), ("close_fd", (2,))],
        [("set_std_stream", ("stdout", "none")), ("set_std_stream", ("stderr", "none"))],
        [("set_std_stream", ("stdout", "closed")), ("set_std_stream", ("stderr", "closed"))],
        [("set_std_stream", ("stdout", "devnull"))],
        [("close_fd", ("log",)), ("close_fd", ("cancel",))],
    ],
    ids=[
        "dup2-over-stdio",
        "close-1-and-2",
        "std-streams-none",
        "std-streams-closed",
        "stdout-replaced",
        "close-log-and-cancel-pipes",
    ],
)
def test_stdio_and_side_pipes_taken_away_leave_calls_working(
    upool: comfy_env.Pool, steps: list[tuple[str, tuple[object, ...]]]
) -> None:
    w = upool.get_worker()
    worker_pid = w.call(T + "pid")
    fds = _channel_fds(worker_pid)
    for fn, args in steps:
        w.call(T + fn, *[fds.get(a, a) if isinstance(a, str) else a for a in args])
    assert w.call(T + "say", "still here") == "still here"
    with pytest.raises(ValueError, match="user error"):
        w.call(T + "raise_error")
    assert w.call(T + "log", "logged") == "logged"
    assert w.call(T + "pid") == worker_pid


# ---- process-wide settings and signals ------------------------------------------------------


@pytest.mark.parametrize(
    "fn, args",
    [
        ("set_signal", ("SIGTERM", "ignore")),
        ("set_signal", ("SIGINT", "raise")),
        ("set_signal", ("SIGCHLD", "ignore")),
        ("set_signal", ("SIGPIPE", "default")),
        ("setsid", ()),
        ("setpgrp", ()),
        ("set_umask", (0o777,)),
        ("chdir_deleted", ()),
        ("limit_files", (32,)),
        ("recursion_limit", (150,)),
        ("gc_disable", ()),
        ("threading_excepthook", ()),
        ("logging_reconfigure", ("shutdown",)),
    ],
)
def test_process_wide_settings_changed_by_the_call_leave_the_worker_serving(
    upool: comfy_env.Pool, fn: str, args: tuple[object, ...]
) -> None:
    import numpy as np

    w = upool.get_worker()
    worker_pid = w.call(T + "pid")
    w.call(T + fn, *args)
    assert w.call(T + "echo", 1) == 1
    with pytest.raises(ValueError, match="user error"):
        w.call(T + "raise_error")
    array = np.arange(1 << 16, dtype=np.uint8)  # through shared memory both ways
    assert (w.call(T + "echo", array) == array).all()
    assert w.call(T + "pid") == worker_pid


def test_a_worker_ignoring_sigterm_is_still_stopped_at_its_deadline(
    upool: comfy_env.Pool,
) -> None:
    w = upool.get_worker()
    worker_pid = w.call(T + "set_signal", "SIGTERM", "ignore")
    with pytest.raises(comfy_env.CallTimeout):
        w.run("comfy_env_worker.tasks:sleep", (30.0,), timeout=0.3)
    assert wait_until(lambda: _gone(worker_pid))
    assert w.call(T + "echo", 1) == 1


def test_a_thread_still_talking_at_close_never_holds_close_up(upool: comfy_env.Pool) -> None:
    w = upool.get_worker()
    worker_pid = w.call(T + "thread_keeps_talking", 60.0, False)  # a non-daemon thread
    assert w.call("comfy_env_worker.tasks:sleep", 0.05) == 0.05
    upool.close()
    assert _gone(worker_pid)


# ---- monkeypatched modules ----------------------------------------------------------------


def test_a_patched_pickle_never_breaks_replies_errors_or_records(
    upool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """``pickle.dumps = None`` and ``pickle.loads = None`` in the env's code: records were
    dropped unseen, the next exception killed the worker, and the next call with a buffer
    was taken for a protocol error."""
    import numpy as np

    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    w = upool.get_worker()
    worker_pid = w.call(T + "patch", "pickle", "dumps", "none")
    w.call(T + "patch", "pickle", "loads", "none")
    assert w.call(T + "log", "after the patch") == "after the patch"
    assert any(r.getMessage() == "after the patch" for r in _worker_records(caplog))
    with pytest.raises(ValueError, match="user error"):
        w.call(T + "raise_error")
    array = np.arange(1 << 16, dtype=np.uint8)
    assert (w.call(T + "echo", array) == array).all()
    assert w.call(T + "pid") == worker_pid


@pytest.mark.parametrize("value", ["none", "frozen"])
def test_a_patched_clock_neither_kills_the_idle_worker_nor_makes_it_spin(
    upool: comfy_env.Pool, value: str
) -> None:
    """``time.monotonic`` replaced: None killed the worker in its next wait for a call; a
    frozen clock made that wait poll forever, a CPU burnt while idle."""
    w = upool.get_worker()
    worker_pid = w.call(T + "patch", "time", "monotonic", value)
    process = psutil.Process(worker_pid)
    before = sum(process.cpu_times()[:2])
    # Idle for a while (wait_until sleeps in between); a spinning worker burns it all.
    wait_until(lambda: False, timeout=1.0)
    burnt = sum(process.cpu_times()[:2]) - before
    assert burnt < 0.5, f"the idle worker used {burnt:.2f} s of CPU in 1 s"
    assert w.call(T + "echo", 1) == 1
    events: list[comfy_env.CallEvent] = []
    assert w.run(T + "progress_and_cancelled", on_event=events.append) is False
    assert w.call(T + "pid") == worker_pid


def test_a_deleted_select_poll_leaves_the_worker_serving(upool: comfy_env.Pool) -> None:
    w = upool.get_worker()
    worker_pid = w.call(T + "patch", "select", "poll", "delete")
    assert w.call("comfy_env_worker.tasks:sleep", 0.05) == 0.05
    assert w.call(T + "pid") == worker_pid


def test_sigterm_ignored_in_every_worker_keeps_close_bounded(upool: comfy_env.Pool) -> None:
    """close() of a pool whose busy worker ignores SIGTERM: the SIGKILL after the grace."""
    w = upool.get_worker()
    worker_pid = w.call(T + "set_signal", "SIGTERM", "ignore")
    call = w.submit("comfy_env_worker.tasks:sleep", (60.0,))
    assert wait_until(call.running)
    upool.close()
    assert _gone(worker_pid)
    with pytest.raises(comfy_env.ComfyEnvError):
        call.result(timeout=10)
