"""Worker output in the host's logging: levels, names, order, timeliness, native output, floods."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import psutil
import pytest
from conftest import TESTS_DIR, run_host, wait_until
from tasks import remote as remote_tasks

import comfy_env
from comfy_env._logs import LogLine, WorkerLog


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("comfy_env.worker")]


def test_levels_logger_names_and_context_are_preserved(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="comfy_env.worker")
    w = pool.get_worker()
    w.call(remote_tasks.log_things, 2)
    by_message = {r.getMessage(): r for r in _records(caplog)}
    info = by_message["info 0"]
    assert info.name == "comfy_env.worker.current"
    assert info.levelno == logging.INFO
    assert info.worker_logger == "mylib.sub"  # type: ignore[attr-defined]
    assert (info.pid, info.generation, info.env) == (w.pid, 1, w.env)  # type: ignore[attr-defined]
    assert by_message["careful: warning"].levelno == logging.WARNING
    failed = by_message["it failed"]
    assert failed.levelno == logging.ERROR and "ValueError: boom" in (failed.exc_text or "")
    assert "hidden at the default INFO level" not in by_message  # the worker's level applies


def test_logging_imported_late_by_the_call_is_routed_with_level_and_name(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    # The worker does not import logging at start-up (it costs milliseconds); the handler is
    # installed when the env's code first imports it, even after a find_spec without loading.
    caplog.set_level(logging.DEBUG, logger="comfy_env.worker")
    loaded_before = pool.get_worker().call(remote_tasks.log_after_first_import)
    assert loaded_before is False
    by_message = {r.getMessage(): r for r in _records(caplog)}
    routed = by_message["routed after a late import"]
    assert routed.levelno == logging.INFO
    assert routed.worker_logger == "late.import"  # type: ignore[attr-defined]
    assert "hidden at the default INFO level" not in by_message  # the worker's level applies


def test_everything_a_call_logs_is_emitted_before_it_returns_in_order(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    pool.get_worker().call(remote_tasks.log_things, 200)
    # No waiting: the records are already there, in the order they were logged.
    messages = [r.getMessage() for r in _records(caplog)]
    infos = [m for m in messages if m.startswith("info ")]
    assert infos == [f"info {i}" for i in range(200)]
    assert messages.index("info 199") < messages.index("careful: warning")


def test_output_between_calls_arrives_without_a_call(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    pool.get_worker().call(remote_tasks.log_later, 0.2)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        found = [r for r in _records(caplog) if r.getMessage() == "logged between calls"]
        if found:
            break
        time.sleep(0.01)
    assert found, "a record logged between calls never arrived"
    assert found[0].levelno == logging.ERROR
    assert found[0].worker_logger == "background"  # type: ignore[attr-defined]


def test_junk_on_the_log_pipe_is_said_once_and_later_records_still_arrive(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes on the log pipe that are not log frames are skipped with one warning naming the
    worker (they were dropped without a word); the worker is not harmed, and what it logs
    between calls afterwards arrives."""
    caplog.set_level(logging.INFO, logger="comfy_env")
    w = pool.get_worker()
    for round_ in (1, 2):
        w.call("tasks.remote:write_junk_on_the_log_pipe")
        w.call(remote_tasks.log_later, 0.2)

        def arrived(n: int = round_) -> bool:
            found = [r for r in _records(caplog) if r.getMessage() == "logged between calls"]
            return len(found) >= n

        assert wait_until(arrived, 5), "a record logged after the junk never arrived"
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "comfy_env" and "log pipe" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings  # once per worker, not per junk
    assert f"pid {w.pid}" in warnings[0] and "generation 1" in warnings[0], warnings
    assert w.generation == 1 and w.stats().crashed == 0 and w.stats().failed == 0


def test_print_to_a_file_still_writes_the_file(
    pool: comfy_env.Pool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    target = tmp_path / "out.txt"
    pool.get_worker().call(remote_tasks.print_to_file, str(target))
    assert target.read_text() == "into the file\n"
    stdout = [r for r in _records(caplog) if r.getMessage() == "to stdout"]
    assert stdout and stdout[0].stream == "stdout"  # type: ignore[attr-defined]
    assert not [r for r in _records(caplog) if r.getMessage() == "into the file"]


def test_native_output_is_captured_line_by_line(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    pool.get_worker().call(remote_tasks.native_output)
    deadline = time.monotonic() + 5
    wanted = {"hello from C printf": "native-stdout", "raw write to fd 2": "native-stderr"}
    while time.monotonic() < deadline:
        seen = {r.getMessage(): getattr(r, "stream", None) for r in _records(caplog)}
        if all(m in seen for m in wanted):
            break
        time.sleep(0.01)
    for message, stream in wanted.items():
        assert seen.get(message) == stream, seen


@pytest.mark.parametrize("native", [False, True], ids=["print", "native"])
def test_a_flood_is_bounded_counted_and_never_blocks_the_reply(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture, native: bool
) -> None:
    caplog.set_level(logging.INFO, logger="comfy_env")
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    rss_before = psutil.Process().memory_info().rss
    assert w.call(remote_tasks.flood, 50, native) == 50  # 50 MB of output, reply intact
    deadline = time.monotonic() + 10
    while w.stats().log_lines_dropped == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w.stats().log_lines_dropped > 0
    warnings = [r for r in caplog.records if "flooding its output" in r.getMessage()]
    assert len(warnings) == 1
    emitted = [r for r in _records(caplog) if r.getMessage().startswith("xxx")]
    assert len(emitted) < 50 * 1024  # bounded, not all 51200 lines
    grown = psutil.Process().memory_info().rss - rss_before
    assert grown < 200 * 1024 * 1024  # the host did not buffer the flood
    assert w.call("tasks.remote:add", 1) == 1


def test_an_unconfigured_host_prints_worker_lines_with_env_and_pid() -> None:
    code = """
        import comfy_env
        pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(%r,)))
        w = pool.get_worker()
        w.call("tasks.remote:log_things", 2)
        w.call("tasks.remote:print_to_file", %r)
        print("PID", w.pid, flush=True)
        pool.close()
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        host = run_host(code % (str(TESTS_DIR), os.path.join(tmp, "f")))
        out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    pid = int(out.split("PID", 1)[1])
    prefix = f"(current pid={pid}) "
    assert f"{prefix}info 0" in err and f"{prefix}info 1" in err
    assert f"{prefix}careful: warning" in err
    assert f"{prefix}to stdout" in err
    assert f"{prefix}Traceback" in err  # the exception text, every line prefixed
    assert "hidden at the default INFO level" not in err


def test_what_a_broken_interpreter_says_before_its_hello_is_prefixed_with_its_pid(
    tmp_path: Path,
) -> None:
    # An env whose interpreter prints a line and exits before any hello: the pid printed is
    # the launched process's (``$$`` of the script), never ``pid=None``.
    interp = tmp_path / "badenv" / "bin" / "python"
    interp.parent.mkdir(parents=True)
    interp.write_text('#!/bin/sh\necho "broken interpreter here $$"\nexit 7\n')
    interp.chmod(0o755)
    code = """
        import comfy_env
        pool = comfy_env.Pool(comfy_env.PoolConfig(max_restarts=5))
        try:
            pool.get_worker(%r).call("comfy_env_worker.tasks:echo", 1)
        except comfy_env.WorkerStartError as exc:
            print("START ERROR", exc.stderr_tail, flush=True)
        pool.close()
    """
    host = run_host(code % (str(tmp_path / "badenv"),))
    out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    assert "START ERROR broken interpreter here" in out, out
    pid = int(out.split("broken interpreter here", 1)[1].split()[0])
    assert f"(badenv pid={pid}) broken interpreter here {pid}" in err, err
    assert "pid=None" not in err


def test_a_line_before_any_pid_is_known_names_no_pid(capsys: pytest.CaptureFixture[str]) -> None:
    log = WorkerLog("/envs/ray-env", "ray-env", 1, 10)  # no pid yet, as an actor before hello
    log._print("said before the hello", None)
    log.pid = 4321
    log._print("said after it", None)
    err = capsys.readouterr().err
    assert err == "(ray-env) said before the hello\n(ray-env pid=4321) said after it\n"


def test_a_configured_host_gets_worker_lines_only_through_logging() -> None:
    code = """
        import logging, comfy_env
        logging.basicConfig(level=logging.INFO, format="LOGGED %%(name)s %%(message)s")
        pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(%r,)))
        w = pool.get_worker()
        w.call("tasks.remote:log_things", 1)
        print("PID", w.pid, flush=True)
        pool.close()
    """
    host = run_host(code % (str(TESTS_DIR),))
    out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    pid = int(out.split("PID", 1)[1])
    assert "LOGGED comfy_env.worker.current info 0" in err
    assert f"pid={pid})" not in err


def test_the_tail_keeps_a_record_written_before_a_crash_dump_that_arrived_first() -> None:
    # The race behind a crash report: a record logged just before a segfault travels in band,
    # faulthandler's dump on fd 2; the reactor can feed the dump before the caller reads the
    # record. The tail shows the record first, so that the dump ends it.
    log = WorkerLog("/envs/e", "e", 1, 10)
    log.logger.addHandler(logging.NullHandler())
    try:
        before = time.time()
        log.feed_native("stderr", b"Fatal Python error: Segmentation fault\nExtension modules: x\n")
        log.emit(LogLine(logging.WARNING, "pack", "said by the pack", None, before - 0.01, "log"))
        assert log.tail().splitlines() == [
            "said by the pack",
            "Fatal Python error: Segmentation fault",
            "Extension modules: x",
        ]
        # A record written after the dump arrived stays after it; so does one without a time.
        log.emit(LogLine(logging.WARNING, "pack", "later", None, time.time() + 0.01, "log"))
        log.emit(LogLine(logging.WARNING, "pack", "untimed", None, None, "log"))
        assert log.tail().splitlines()[-2:] == ["later", "untimed"]
        # A record older than the window (a worker clock far behind) moves no line.
        log.feed_native("stderr", b"native line\n")
        log.emit(LogLine(logging.WARNING, "pack", "stale", None, time.time() - 5.0, "log"))
        assert log.tail().splitlines()[-2:] == ["native line", "stale"]
    finally:
        log.logger.handlers.clear()
