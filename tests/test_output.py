"""What libraries write in a worker, as it reaches the host: progress bars (tqdm's ``\\r``
updates) on ``sys.stderr`` and on fd 2, and a host that turned logging off."""

from __future__ import annotations

import logging

import pytest
from conftest import TESTS_DIR, run_host, wait_until
from tasks import fault as fault_tasks
from tasks import output as output_tasks

import comfy_env

BAR_DONE = "100%|##########| 200/200"


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("comfy_env.worker")]


@pytest.mark.parametrize("native", [False, True], ids=["sys.stderr", "fd2"])
def test_a_progress_bar_arrives_as_a_few_states_and_its_final_line(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture, native: bool
) -> None:
    """tqdm writes ``"\\r" + bar`` and flushes, with no newline until it closes. The host
    got one WARNING record per update (``sys.stderr``: 202 records, each starting with
    ``\\r``, the last an empty line) or one line holding every state (fd 2). Now: the latest
    state at most every PROGRESS_INTERVAL, then the final state as the line, no ``\\r``."""
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    assert pool.get_worker().call(output_tasks.progress, 200, native) == 200
    assert wait_until(lambda: BAR_DONE in _messages(caplog)), _messages(caplog)
    bar = _messages(caplog)
    assert bar[-1] == BAR_DONE
    assert all("\r" not in m and m.strip() for m in bar), bar
    assert len(bar) < 20, bar  # 201 updates written in a few milliseconds


@pytest.mark.parametrize("native", [False, True], ids=["sys.stderr", "fd2"])
def test_a_bar_right_after_another_shows_its_first_state_at_once(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture, native: bool
) -> None:
    """The states' interval ran per stream across bars: a bar drawn within 2 s of the last
    state of the one before showed nothing until its newline (back-to-back tqdm bars stayed
    invisible while they ran). A bar's end restarts it."""
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    pool.get_worker().call(output_tasks.bar_after_a_bar, native)
    assert wait_until(lambda: "second bar 0/5" in _messages(caplog), 5), _messages(caplog)
    assert _messages(caplog).index("100%|##########| 5/5") < _messages(caplog).index(
        "second bar 0/5"
    )


def test_a_counter_printed_with_end_cr_leaves_its_last_state(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """``print(i, end="\\r")`` then ``print()``: what a terminal shows, the last count."""
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    pool.get_worker().call(output_tasks.count_with_cr, 500)
    lines = _messages(caplog)
    assert lines[-1] == "500/500" and "\r" not in "".join(lines), lines
    assert len(lines) < 20, lines


def test_logging_disable_silences_worker_lines_in_an_unconfigured_host() -> None:
    """A host that never configured logging gets worker lines printed with a prefix; after
    ``logging.disable(logging.CRITICAL)`` it printed them anyway."""
    code = """
        import logging, comfy_env
        logging.disable(logging.CRITICAL)
        pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(%r,)))
        w = pool.get_worker()
        w.call("tasks.remote:log_things", 2)
        print("PID", w.pid, flush=True)
        pool.close()
    """
    host = run_host(code % (str(TESTS_DIR),))
    out, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    assert "PID" in out
    assert "info 0" not in err and "careful: warning" not in err, err


@pytest.mark.parametrize(
    ("quieted", "shown"),
    [
        ("comfy_env.worker", ("careful: warning",)),
        ("comfy_env.worker.%(env)s", ("careful: warning",)),
        ("comfy_env.worker.other-env", ("info 0", "info 1", "careful: warning")),
    ],
)
def test_a_level_set_on_a_worker_logger_quiets_the_printing_of_an_unconfigured_host(
    quieted: str, shown: tuple[str, ...]
) -> None:
    """README's ``setLevel(logging.WARNING)  # quieter workers`` did nothing while the host
    had no handler: the prefixed printing ignored every level."""
    code = """
        import logging, sys, comfy_env
        from comfy_env._envs import resolve_env
        pool = comfy_env.Pool(comfy_env.PoolConfig(sys_path=(%r,)))
        w = pool.get_worker()
        name = sys.argv[1] %% {"env": resolve_env(None).name}
        logging.getLogger(name).setLevel(logging.WARNING)
        w.call("tasks.remote:log_things", 2)
        pool.close()
    """
    host = run_host(code % (str(TESTS_DIR),), quieted)
    _, err = host.communicate(timeout=60)
    assert host.returncode == 0, err
    printed = [line for line in err.splitlines() if "pid=" in line]
    assert [line.split(") ", 1)[1] for line in printed][: len(shown)] == list(shown), err
    assert ("info 0" in err) == ("info 0" in shown), err


def test_sys_stdout_takes_bytes_through_buffer_and_reconfigure_like_a_real_one(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """``sys.stdout.buffer`` and ``sys.stdout.reconfigure`` were missing: code that writes
    bytes, or reconfigures stdout at import (as some node packs do), failed the call with
    AttributeError."""
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    assert pool.get_worker().call(output_tasks.bytes_and_reconfigure) == ["TypeError"]
    stdout = [r.getMessage() for r in caplog.records if getattr(r, "stream", None) == "stdout"]
    assert stdout == ["caf\u00e9 split", "bad \ufffd byte"], stdout


@pytest.mark.parametrize("how", ["native", "flushed"])
def test_an_unfinished_line_before_a_crash_is_in_the_crash_report(
    config: comfy_env.PoolConfig, how: str
) -> None:
    """What README promises for a crash right after output without a newline: native
    output's unfinished line, and a flushed ``print(..., end="")``, are the report's last
    words."""
    config = config.model_copy(update={"env_vars": {fault_tasks.FAULT_SIDE_VAR: "worker"}})
    with comfy_env.Pool(config) as pool:
        with pytest.raises(comfy_env.WorkerCrashed) as info:
            pool.get_worker().call(output_tasks.partial_line_then_crash, how, f"step 17 {how} ")
    assert f"step 17 {how} " in info.value.stderr_tail.splitlines(), info.value.stderr_tail


def test_warnings_and_rich_records_arrive_as_readme_says(
    pool: comfy_env.Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """README ("Worker output in your logging"): a warning is shown once per location as
    ``stderr`` lines, a DeprecationWarning not at all (Python's filters); a record's
    exception and stack arrive as ``exc_text``, ``extra`` fields do not, a failed format is
    Python's "--- Logging error ---" on stderr, any argument is rendered in the worker."""
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    w = pool.get_worker()
    for category in ("user", "user", "deprecation"):
        w.call(output_tasks.warn_three_times, category)
    warned = [r for r in caplog.records if "Warning: careful with" in r.getMessage()]
    assert [(r.levelno, r.stream) for r in warned] == [(logging.WARNING, "stderr")], warned  # type: ignore[attr-defined]
    assert "UserWarning: careful with user" in warned[0].getMessage()
    caplog.clear()
    w.call(output_tasks.log_odd_records)
    by_message = {r.getMessage(): r for r in caplog.records}
    assert "ValueError: exc boom" in (by_message["with exception"].exc_text or "")
    assert "Stack (most recent call last)" in (by_message["with stack"].exc_text or "")
    assert not hasattr(by_message["with extra"], "request_id")
    assert "--- Logging error ---" in by_message
    assert any(m.startswith("a lock as arg <unlocked _thread.lock") for m in by_message)
