"""The crash matrix (issue 7): every place a call can break, times every way it can break.

One parametrized test, ``test_fault_matrix``, runs one cell per (where, how); its id is
``<where>-<how>``, e.g. ``run-segfault-ctypes``. The worker-side half of each fault lives in
``tests/tasks/fault.py``.

**Where** the fault strikes:

=====================  ==================================================================
``encode-args``        the host pickles an argument (its ``__reduce__`` is the fault); nothing
                       has been sent, the worker is untouched
``decode-args``        the worker unpickles an argument (it reduces to ``fault_tasks.do_fault``)
``run``                the function itself
``encode-result``      the worker pickles the result (its ``__reduce__`` is the fault)
``decode-result``      the host unpickles the result (the rebuild faults only where
                       ``COMFY_ENV_FAULT_SIDE`` is unset, i.e. in the host)
``ack-window``         right after a shared-memory reply went out, before the host's
                       ``consumed`` ack (a worker thread faults the moment the reply is sent);
                       the block is one the host has mapped already, see the focused test for
                       a fresh one
``start-before-hello`` a fake interpreter runs the real worker with ``handshake`` patched
``start-after-hello``  ... with ``apply_config`` patched (HELLO sent, READY not yet)
``start-canary``       ... with ``tasks.echo`` patched (the canary call)
``idle``               a worker thread faults after the call returned
``shm-write``          halfway through copying a large result into the worker's reply block
                       (``Block.write`` wrapped once, in that worker)
``logging``            the call's thread faults while three threads emit log records in band
=====================  ==================================================================

**How** (``fault_tasks.HOWS``): ``raise Exception``, ``KeyboardInterrupt``, ``sys.exit(0)`` and
``sys.exit(3)``, ``os._exit(7)``, a segfault (ctypes null read, ``faulthandler._sigsegv()``),
``os.abort()``, SIGKILL from outside (the test kills the pid while the fault waits), an endless
loop that ignores SIGTERM, closing the channel descriptor, a garbage header, an oversized
length, and a truncated payload (100 bytes announced, 10 sent, then ``os._exit(5)``).

**Each cell asserts** the exact outcome (the error's class and its facts: env, pid,
generation, exit code or signal, output tail), that it arrives within ``ERROR_BOUND``, that the
next call on that env succeeds on generation g+1 (g where the worker survived; a start-up
fault strikes once, so generation 1 fails and generation 2 serves), the stats invariant, and
that a call loop on another env (``foreign_venv``, started before the fault) was never
disturbed. Host-side cells whose fault would kill or hang the pytest process itself, or that
would need the worker's descriptor, are skipped with the reason.

Cells that expose a library bug are ``xfail(strict=True)`` with the bug in their reason
(``KNOWN_BUGS``), so the suite stays green and the bug stays recorded.

The focused tests below the matrix cover the lost-reply window with a shared-memory reply, a
worker stuck holding its send lock, sixteen callers while the worker is killed over and over,
and a spawn storm that trips the crash-loop breaker.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from conftest import TESTS_DIR
from tasks import fault as fault_tasks
from tasks import remote as remote_tasks

import comfy_env
from comfy_env import (
    CallTimeout,
    EnvAbandonedError,
    ProtocolError,
    RemoteError,
    RemoteTraceback,
    SerializationError,
    WorkerCrashed,
    WorkerStartError,
)

ERROR_BOUND = 10.0  # seconds from the faulting call to its outcome (CI is a loaded 2-core box)
CALL_TIMEOUT = 20.0  # safety net on every call: a hang fails its cell instead of the run
LOOP_TIMEOUT = 2.0  # the deadline of calls whose fault is an endless loop
LOOP_START_TIMEOUT = 3.0  # start_timeout of start-up cells whose fault is an endless loop
ACK_N = 393_216  # float32, 1.5 MiB: the size class (2 MiB) of the canary's reply block
SHM_N = 524_288  # float32, 2 MiB: out of band
FAULT_ENV = {fault_tasks.FAULT_SIDE_VAR: "worker"}

HOST_WHERES = ("encode-args", "decode-result")
CALL_WHERES = ("decode-args", "run", "encode-result", "shm-write", "logging")
BACKGROUND_WHERES = ("ack-window", "idle")
START_WHERES = ("start-before-hello", "start-after-hello", "start-canary")
WHERES = (
    "encode-args",
    "decode-args",
    "run",
    "encode-result",
    "decode-result",
    "ack-window",
    "start-before-hello",
    "start-after-hello",
    "start-canary",
    "idle",
    "shm-write",
    "logging",
)
assert set(WHERES) == {*HOST_WHERES, *CALL_WHERES, *BACKGROUND_WHERES, *START_WHERES}

ANY_EXIT = object()  # the exit code is not deterministic (but there must be one)

# How the worker process ends, for the faults that end it: (exit code, signal name).
DEATHS: dict[str, tuple[Any, str | None]] = {
    "os-exit-7": (7, None),
    "segfault-ctypes": (-signal.SIGSEGV, "SIGSEGV"),
    "segfault-faulthandler": (-signal.SIGSEGV, "SIGSEGV"),
    "abort": (-signal.SIGABRT, "SIGABRT"),
    "sigkill": (-signal.SIGKILL, "SIGKILL"),
    # The worker's watchdog sees the descriptor gone (exit 0), unless its serve loop first
    # fails on it (an OSError out of main: exit 1).
    "close-channel": (ANY_EXIT, None),
    "truncated-payload": (fault_tasks.TRUNCATED_EXIT_CODE, None),
}
# An exception that escapes the serve loop (only the shm-write stage lets one) ends the worker
# the way an uncaught exception ends any Python program.
ESCAPED: dict[str, tuple[Any, str | None]] = {
    "exception": (1, None),
    "keyboard-interrupt": (-signal.SIGINT, "SIGINT"),
    "sys-exit-0": (0, None),
    "sys-exit-3": (3, None),
}
FAULTHANDLER_REPORTS = {
    "SIGSEGV": "Fatal Python error: Segmentation fault",
    "SIGABRT": "Fatal Python error: Aborted",
}
GARBAGE = {"garbage-header": "bad frame magic", "oversized-length": "exceeds the limit"}
# Faults a worker thread survives in place (the process lives on).
SURVIVABLE_IN_A_THREAD = ("exception", "keyboard-interrupt", "sys-exit-0", "sys-exit-3", "loop")

_HOST_DEATH = (
    "the fault would run in the caller's own process: it would take pytest down with it "
    "(comfy-env isolates workers, not the host)"
)
_HOST_CHANNEL = (
    "only the worker writes on (or holds) the worker's end of the channel; no host-side "
    "codec code can reach it"
)
HOST_SKIPS = {
    "os-exit-7": _HOST_DEATH,
    "segfault-ctypes": _HOST_DEATH,
    "segfault-faulthandler": _HOST_DEATH,
    "abort": _HOST_DEATH,
    "loop": "an endless loop in the caller's own thread, outside the call's exchange: nothing "
    "can interrupt the host's own code, so the cell could only hang",
    "close-channel": _HOST_CHANNEL,
    "garbage-header": _HOST_CHANNEL,
    "oversized-length": _HOST_CHANNEL,
    "truncated-payload": _HOST_CHANNEL,
}

# Cells that expose a library bug (xfail, strict). Empty: the ones found so far are fixed.
KNOWN_BUGS: dict[str, str] = {}


@dataclass(frozen=True)
class Expect:
    """What one cell must observe.

    ``kind``: ``returns`` (the faulting call still returns its value), ``raises`` (``error``
    is raised; ``detail`` is RemoteError's type name, SystemExit's code or a regex on the
    message), ``crashed`` (WorkerCrashed with ``exitcode``/``signal``), ``timeout``,
    ``protocol`` (ProtocolError, ``detail`` a regex) or ``start-error``. ``replaced``: the
    next call runs on a new generation."""

    kind: str
    error: type[BaseException] | None = None
    detail: Any = None
    exitcode: Any = None
    signal: str | None = None
    replaced: bool = True


def expectation(where: str, how: str) -> Expect | str:
    """The expected outcome of a cell, or the reason it cannot be reached."""
    if where in HOST_WHERES:
        if how in HOST_SKIPS:
            return HOST_SKIPS[how]
        if how == "exception":
            detail = r"could not be unpickled in the host: FaultError: host-exception"
            if where == "encode-args":
                detail = r"cannot be pickled: FaultError: host-exception"
            return Expect("raises", SerializationError, detail, replaced=False)
        if where == "decode-result" and (how == "keyboard-interrupt" or "sys-exit" in how):
            # Raised while the host unpickles a result: a typed error for this call, never
            # the caller unwinding as KeyboardInterrupt/SystemExit (issue 11, item 7).
            name = "KeyboardInterrupt" if how == "keyboard-interrupt" else "SystemExit"
            detail = rf"could not be unpickled in the host: {name}"
            return Expect("raises", SerializationError, detail, replaced=False)
        if how == "keyboard-interrupt":
            return Expect("raises", KeyboardInterrupt, replaced=False)
        if how.startswith("sys-exit-"):
            return Expect("raises", SystemExit, int(how[-1]), replaced=False)
        assert how == "sigkill"  # killed from the host's codec code: the call is unharmed
        return Expect("returns")
    if where in START_WHERES:
        if how in DEATHS:
            detail = "during start-up"
        elif how == "loop":
            detail = "start_timeout"
        elif how in GARBAGE:
            detail = "failed its handshake: .*" + GARBAGE[how]
        elif where == "start-canary":
            detail = "canary call failed"
        else:  # raised out of the worker's main(): the process ends
            detail = "during start-up"
        return Expect("start-error", WorkerStartError, detail)
    if where in BACKGROUND_WHERES:
        return Expect("returns", replaced=how not in SURVIVABLE_IN_A_THREAD)
    if how in DEATHS:
        code, name = DEATHS[how]
        return Expect("crashed", WorkerCrashed, exitcode=code, signal=name)
    if how == "loop":
        return Expect("timeout", CallTimeout)
    if how in GARBAGE:
        return Expect("protocol", ProtocolError, GARBAGE[how])
    if where == "shm-write":
        code, name = ESCAPED[how]
        return Expect("crashed", WorkerCrashed, exitcode=code, signal=name)
    if how == "exception":
        if where == "decode-args":  # the call never ran: told as such, not as the bare error
            detail = r"could not be unpickled in the worker, so it did not run: FaultError"
            return Expect("raises", SerializationError, detail, replaced=False)
        if where == "encode-result":  # pickle, then cloudpickle, then a clear TypeError
            return Expect("raises", TypeError, r"FaultyResult.*cannot be pickled", replaced=False)
        return Expect("raises", fault_tasks.FaultError, rf"{where}-exception", replaced=False)
    if where == "decode-args" and how.startswith("sys-exit-"):  # a reducer's SystemExit too
        detail = r"could not be unpickled in the worker, so it did not run: SystemExit"
        return Expect("raises", SerializationError, detail, replaced=False)
    type_name = "KeyboardInterrupt" if how == "keyboard-interrupt" else "SystemExit"
    return Expect("raises", RemoteError, type_name, replaced=False)


def _cells() -> list[Any]:
    cells = []
    for where in WHERES:
        for how in fault_tasks.HOWS:
            cell = f"{where}-{how}"
            expected = expectation(where, how)
            marks: list[Any] = []
            if isinstance(expected, str):
                marks.append(pytest.mark.skip(reason=expected))
            elif cell in KNOWN_BUGS:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[cell]))
            cells.append(pytest.param(where, how, id=cell, marks=marks))
    return cells


CELLS = _cells()
assert not set(KNOWN_BUGS) - {c.id for c in CELLS}


# ---- helpers --------------------------------------------------------------------------------


def _wait(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _assert_invariant(w: comfy_env.Worker) -> None:
    s = w.stats()
    total = s.ok + s.raised + s.crashed + s.timed_out + s.cancelled + s.failed
    assert s.submitted == total + s.in_flight + s.queued, s


def _fake_interpreter(root: Path) -> Path:
    """An env whose ``bin/python`` runs the real worker through ``fault_tasks.boot``."""
    boot = (
        f"import sys;sys.path[0]=sys.argv[1];sys.path.insert(1,'{TESTS_DIR}');"
        "from tasks import fault;fault.boot(sys.argv[2:])"
    )
    interpreter = root / "bin" / "python"
    interpreter.parent.mkdir(parents=True)
    # The pool runs `python -c BOOT <runtime dir> <fd> <host pid> <log fd>`: keep the rest.
    interpreter.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" -c "{boot}" "$@"\n')
    interpreter.chmod(interpreter.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return root


class Killer(threading.Thread):
    """Waits for a worker to announce it is ready to be killed (``<marker>.kill-me``), then
    SIGKILLs it from outside, as the OOM killer or an operator would."""

    def __init__(self, marker: str) -> None:
        super().__init__(name="fault-killer", daemon=True)
        self.path = Path(marker + ".kill-me")
        self.killed: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            _wait(self.path.exists, 15.0, "the worker to wait for its SIGKILL")
            pid = int(self.path.read_text())
            mine = {p.pid for p in psutil.Process().children(recursive=True)}
            assert pid in mine, f"pid {pid} is not one of our workers"
            fault_tasks.kill_and_wait(pid)
            self.killed = pid
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def result(self) -> int:
        self.join(30)
        assert self.error is None, self.error
        assert self.killed is not None
        return self.killed


class Bystander:
    """A call loop on another env, running from before a fault until after its outcome; none
    of its calls may fail and its worker must stay the same process."""

    def __init__(self, pool: comfy_env.Pool, env: Path) -> None:
        self.worker = pool.get_worker(env)
        self.stop = threading.Event()
        self.calls = 0
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._loop, name="fault-bystander", daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.worker.run("comfy_env_worker.tasks:sleep", (0.02,), timeout=CALL_TIMEOUT)
            except BaseException as exc:  # noqa: BLE001 - reported by check()
                self.errors.append(exc)
                return
            self.calls += 1

    def __enter__(self) -> Bystander:
        self.worker.run("comfy_env_worker.tasks:echo", (0,), timeout=CALL_TIMEOUT)
        self.pid = self.worker.pid
        self.generation = self.worker.generation
        self.thread.start()
        _wait(lambda: self.calls > 0 or bool(self.errors), what="the bystander's first call")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)

    def check(self) -> None:
        """Stop the loop and assert that the other env never noticed anything."""
        self.__exit__()
        assert not self.errors, f"the other env was disturbed: {self.errors!r}"
        assert self.calls >= 1
        assert (self.worker.pid, self.worker.generation) == (self.pid, self.generation)
        stats = self.worker.stats()
        assert (stats.crashed, stats.failed, stats.timed_out, stats.raised) == (0, 0, 0, 0)


@contextmanager
def _records(message: str) -> Iterator[list[logging.LogRecord]]:
    """Worker records whose message starts with ``message``, as the host's logging sees them."""
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith(message):
                seen.append(record)

    handler = Collect()
    logger = logging.getLogger("comfy_env.worker")
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


# ---- the matrix -----------------------------------------------------------------------------


def _fault_call(w: comfy_env.Worker, where: str, how: str, marker: str, pid: int | None) -> Any:
    spec = (how, where, marker)
    timeout = LOOP_TIMEOUT if how == "loop" and where in CALL_WHERES else CALL_TIMEOUT
    if where == "encode-args":
        assert pid is not None
        return w.run(fault_tasks.identity, (fault_tasks.HostFaultyArg(how, pid),), timeout=timeout)
    if where == "decode-args":
        return w.run(fault_tasks.identity, (fault_tasks.FaultyArg(*spec),), timeout=timeout)
    if where == "run":
        return w.run(fault_tasks.do_fault, spec, timeout=timeout)
    if where == "encode-result":
        return w.run(fault_tasks.make_faulty_result, spec, timeout=timeout)
    if where == "decode-result":
        return w.run(fault_tasks.make_host_faulty_result, (how,), timeout=timeout)
    if where == "ack-window":
        return w.run(fault_tasks.ack_window_fault, (*spec, ACK_N), timeout=timeout)
    if where == "idle":
        return w.run(fault_tasks.arm_idle_fault, (*spec, 0.02), timeout=timeout)
    if where == "shm-write":
        return w.run(fault_tasks.shm_write_fault, (*spec, SHM_N), timeout=timeout)
    if where == "logging":
        return w.run(fault_tasks.log_then_fault, spec, timeout=timeout)
    assert where in START_WHERES
    return w.run(fault_tasks.identity, (1,), timeout=timeout)


def _check_returned(where: str, result: Any) -> None:
    if where == "encode-args":
        assert result == 0
    elif where == "decode-result":
        assert result == "rebuilt"
    elif where == "ack-window":
        assert isinstance(result, np.ndarray) and result.shape == (ACK_N,)
        assert bool((result == 7.0).all())
    else:
        assert (where, result) == ("idle", "armed")


def _check_error(
    expect: Expect,
    error: BaseException,
    w: comfy_env.Worker,
    cell: str,
    generation: int,
    pid: int | None,
) -> None:
    assert expect.error is not None
    if expect.kind == "raises":
        assert isinstance(error, expect.error), repr(error)
        if isinstance(error, RemoteError):
            assert error.type_name == expect.detail
        elif isinstance(error, SystemExit):
            assert error.code == expect.detail
        elif expect.detail is not None:
            assert re.search(expect.detail, str(error)), str(error)
        if isinstance(error, (fault_tasks.FaultError, RemoteError)) or type(error) is TypeError:
            assert isinstance(error.__cause__, RemoteTraceback)  # the worker's traceback
        return
    assert type(error) is expect.error, repr(error)
    assert isinstance(error, comfy_env.WorkerError)
    assert error.env == w.env
    if expect.kind == "start-error":
        assert isinstance(error, WorkerStartError)
        assert error.generation == 1
        assert re.search(expect.detail, str(error)), str(error)
        assert f"comfy-fault: {cell}" in error.stderr_tail, error.stderr_tail
        return
    assert (error.pid, error.generation) == (pid, generation)
    if expect.kind == "crashed":
        assert isinstance(error, WorkerCrashed)
        if expect.exitcode is ANY_EXIT:
            assert error.exitcode is not None, str(error)
        else:
            assert (error.exitcode, error.signal) == (expect.exitcode, expect.signal), str(error)
        assert error.call_id is not None and error.call_id > 1
        assert error.target is not None and error.target.startswith("tasks.fault:")
        assert f"comfy-fault: {cell}" in error.stderr_tail, error.stderr_tail
        if expect.signal in FAULTHANDLER_REPORTS:  # the Python stack of the crashing frame
            assert FAULTHANDLER_REPORTS[expect.signal] in error.stderr_tail, error.stderr_tail
    elif expect.kind == "timeout":
        assert isinstance(error, CallTimeout)
        assert error.target is not None and error.target.startswith("tasks.fault:")
    else:
        assert expect.kind == "protocol"
        assert re.search(expect.detail, str(error)), str(error)


def _counter(expect: Expect, where: str) -> str | None:
    """The stats counter the faulting call must have landed in (None: not counted at all)."""
    if expect.kind == "returns":
        return "ok"
    if expect.kind == "raises":
        if where == "encode-args":
            return None  # refused before it was submitted
        if expect.error is KeyboardInterrupt:
            return "cancelled"  # a Ctrl-C in the caller ends its call as cancelled
        return "raised"
    return {
        "crashed": "crashed",
        "timeout": "timed_out",
        "protocol": "failed",
        "start-error": "failed",
    }[expect.kind]


def _let_background_fault_strike(how: str, marker: str, pid: int | None) -> None:
    """A worker-thread fault runs on its own schedule: wait until it has struck (the process
    is dead, or the bytes are written) before the next call. (A channel descriptor closed by a
    worker thread leaves the process serving until its watchdog notices, within about a
    second; a call sent in that second is read and run by the doomed worker and fails with
    WorkerCrashed. The cell waits for the death: it is about a worker that died idle.)"""
    _wait(Path(marker + ".fired").exists, what="the fault to fire")
    if how in DEATHS:
        assert pid is not None
        _wait(lambda: _dead(pid), what=f"worker {pid} to die")
    elif how in GARBAGE:
        _wait(Path(marker + ".done").exists, what="the garbage to be written")


@pytest.mark.parametrize(("where", "how"), CELLS)
def test_fault_matrix(
    where: str, how: str, config: comfy_env.PoolConfig, foreign_venv: Path, tmp_path: Path
) -> None:
    expect = expectation(where, how)
    assert isinstance(expect, Expect)
    cell = f"{where}-{how}"
    marker = str(tmp_path / "fault")
    env_vars = dict(FAULT_ENV)
    updates: dict[str, Any] = {"env_vars": env_vars}
    env: Path | None = None
    if where in START_WHERES:
        env = _fake_interpreter(tmp_path / "env")
        env_vars.update(
            COMFY_ENV_FAULT_WHERE=where,
            COMFY_ENV_FAULT_HOW=how,
            COMFY_ENV_FAULT_MARKER=marker,
            COMFY_ENV_FAULT_ONCE="1",
        )
        if how == "loop":
            updates["start_timeout"] = LOOP_START_TIMEOUT
    with comfy_env.Pool(config.model_copy(update=updates)) as pool:
        with Bystander(pool, foreign_venv) as bystander, _records(fault_tasks.LOG_MESSAGE) as logs:
            w = pool.get_worker(env)
            if where not in START_WHERES:
                assert w.run(fault_tasks.identity, (0,), timeout=CALL_TIMEOUT) == 0
                if where == "ack-window":  # the reply block is reused, and mapped by the host
                    w.run(remote_tasks.filled, (1.0, ACK_N), timeout=CALL_TIMEOUT)
            generation, pid = w.generation, w.pid
            before = w.stats()
            killer = None
            if how == "sigkill" and where not in HOST_WHERES:
                killer = Killer(marker)
                killer.start()
            error: BaseException | None = None
            result: Any = None
            started = time.monotonic()
            try:
                result = _fault_call(w, where, how, marker, pid)
            except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt/SystemExit are outcomes
                error = exc
            elapsed = time.monotonic() - started
            if killer is not None:
                killed = killer.result()
                if where not in START_WHERES:
                    assert killed == pid

            # 1. the outcome, in bounded time
            if expect.kind == "returns":
                assert error is None, repr(error)
                _check_returned(where, result)
            else:
                assert error is not None, f"{cell}: no error, the call returned {result!r}"
                _check_error(expect, error, w, cell, generation, pid)
            assert elapsed < ERROR_BOUND, f"{cell}: outcome after {elapsed:.1f}s"
            if where in HOST_WHERES:
                if how == "sigkill":
                    assert pid is not None and _dead(pid)
            elif where not in BACKGROUND_WHERES:  # (those strike on their own schedule)
                assert Path(marker + ".fired").exists(), f"{cell}: the fault never struck"
            if where == "logging":
                assert logs, "no log record of the call reached the host before its outcome"
            counter = _counter(expect, where)
            stats = w.stats()
            if counter is None:
                assert stats.submitted == before.submitted
            else:
                assert stats.submitted == before.submitted + 1
                assert getattr(stats, counter) == getattr(before, counter) + 1, (counter, stats)
            _assert_invariant(w)

            # 2. the next call on that env succeeds, on the right generation
            if where in BACKGROUND_WHERES:
                _let_background_fault_strike(how, marker, pid)
            assert w.run(fault_tasks.identity, (42,), timeout=CALL_TIMEOUT) == 42
            if where in START_WHERES:
                assert w.generation == 2
            else:
                assert w.generation == generation + (1 if expect.replaced else 0)
                if not expect.replaced:
                    assert w.pid == pid
            stats = w.stats()
            assert (stats.in_flight, stats.queued) == (0, 0)
            _assert_invariant(w)

            # 3. the other env never noticed
            bystander.check()


# ---- focused tests --------------------------------------------------------------------------

MiB = 1024 * 1024


def test_a_shared_memory_reply_written_before_death_is_delivered(
    config: comfy_env.PoolConfig,
) -> None:
    """The lost-reply window, with the reply's buffer in the worker's shared memory: the worker
    exits the moment its reply is out, without waiting for the host's ack. (The reply block is
    one the host has mapped before; a fresh one is the xfail test below.)"""
    n = ACK_N
    with comfy_env.Pool(config.model_copy(update={"env_vars": FAULT_ENV})) as pool:
        w = pool.get_worker()
        w.run(remote_tasks.filled, (1.0, n), timeout=CALL_TIMEOUT)
        pid = w.pid
        out = w.run(fault_tasks.log_reply_then_die, (n, 9), timeout=CALL_TIMEOUT)
        assert out.shape == (n,) and bool((out == 3.0).all())
        assert pid is not None
        _wait(lambda: _dead(pid), what="the worker to die")
        assert w.run(fault_tasks.identity, (1,), timeout=CALL_TIMEOUT) == 1
        assert w.generation == 2
        stats = w.stats()
        assert (stats.ok, stats.crashed) == (3, 0)
        _assert_invariant(w)


def test_a_shared_memory_reply_survives_its_worker_being_reaped_before_it_is_read(
    config: comfy_env.PoolConfig,
) -> None:
    """The same window with a slow caller: a log handler (any slow logging sink) holds the
    caller on the record that precedes the reply until the dead worker has been reaped. The
    reply is complete in the socket; its data must still be delivered."""
    n = 3 * MiB // 4  # a fresh size class: the host has not mapped this block before
    with comfy_env.Pool(config.model_copy(update={"env_vars": FAULT_ENV})) as pool:
        w = pool.get_worker()
        w.run(fault_tasks.identity, (0,), timeout=CALL_TIMEOUT)
        pid = w.pid
        assert pid is not None

        class SlowSink(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.getMessage() != "fault-reply-follows":
                    return

                process = w._entry.slots[0].process
                assert process is not None

                def reaped() -> bool:
                    # The host's reactor has reaped the dead worker (the moment it used to
                    # unlink the worker's blocks, the unread reply's among them).
                    return process.exited.is_set()

                _wait(reaped, what="the worker to be reaped")

        sink = SlowSink()
        logger = logging.getLogger("comfy_env.worker")
        logger.addHandler(sink)
        try:
            out = w.run(fault_tasks.log_reply_then_die, (n, 9), timeout=CALL_TIMEOUT)
        finally:
            logger.removeHandler(sink)
        assert out.shape == (n,) and bool((out == 3.0).all())


def test_a_worker_stuck_holding_its_send_lock_times_out_and_is_replaced(
    pool: comfy_env.Pool,
) -> None:
    """A thread of the worker holds the send lock forever; the call's function returns, but its
    reply can never be written. The deadline ends the call and the pool recovers."""
    w = pool.get_worker()
    w.run(fault_tasks.identity, (0,), timeout=CALL_TIMEOUT)
    pid = w.pid
    started = time.monotonic()
    with pytest.raises(CallTimeout) as info:
        w.run(fault_tasks.hold_send_lock_then_return, timeout=1.0)
    assert time.monotonic() - started < ERROR_BOUND
    assert (info.value.pid, info.value.generation) == (pid, 1)
    assert pid is not None
    _wait(lambda: _dead(pid), what="the stuck worker to be stopped")
    assert w.run(fault_tasks.identity, (5,), timeout=CALL_TIMEOUT) == 5
    assert w.generation == 2
    stats = w.stats()
    assert (stats.timed_out, stats.ok, stats.in_flight) == (1, 2, 0)
    _assert_invariant(w)


def test_sixteen_callers_while_the_worker_is_killed_over_and_over(
    config: comfy_env.PoolConfig,
) -> None:
    """Every call either returns its own value or fails with WorkerCrashed; nothing hangs,
    nothing else is raised, and the counters add up."""
    cfg = config.model_copy(update={"max_restarts": 10_000, "restart_window": 1.0})
    with comfy_env.Pool(cfg) as pool:
        w = pool.get_worker()
        w.run(fault_tasks.identity, (0,), timeout=CALL_TIMEOUT)
        stop = threading.Event()
        lock = threading.Lock()
        outcomes = {"ok": 0, "crashed": 0}
        unexpected: list[BaseException] = []
        wrong: list[tuple[int, Any]] = []

        def caller(index: int) -> None:
            i = 0
            while not stop.is_set():
                value = index * 1_000_000 + i
                i += 1
                try:
                    got = w.run(fault_tasks.slow_identity, (value, 0.005), timeout=CALL_TIMEOUT)
                except WorkerCrashed:
                    with lock:
                        outcomes["crashed"] += 1
                    continue
                except BaseException as exc:  # noqa: BLE001 - reported below
                    with lock:
                        unexpected.append(exc)
                    return
                with lock:
                    outcomes["ok"] += 1
                    if got != value:
                        wrong.append((value, got))

        threads = [
            threading.Thread(target=caller, args=(k,), name=f"hammer-{k}") for k in range(16)
        ]
        for t in threads:
            t.start()
        kills = 0
        try:
            deadline = time.monotonic() + 4.0
            while time.monotonic() < deadline:
                time.sleep(0.15)
                pid = w.pid  # only a handshaken worker (idle or in a call) has one
                if pid is None or pid not in {p.pid for p in psutil.Process().children()}:
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not any(t.is_alive() for t in threads), "a caller hung"
        assert not unexpected, unexpected
        assert not wrong, wrong[:5]
        assert kills >= 5
        assert outcomes["ok"] > 0 and outcomes["crashed"] > 0
        assert w.run(fault_tasks.identity, (7,), timeout=CALL_TIMEOUT) == 7
        stats = w.stats()
        assert (stats.in_flight, stats.queued) == (0, 0)
        assert stats.crashed == outcomes["crashed"]
        assert stats.ok == outcomes["ok"] + 2
        assert stats.submitted == outcomes["ok"] + outcomes["crashed"] + 2
        _assert_invariant(w)
        assert not stats.abandoned
        assert stats.generation > 1


def test_a_spawn_storm_trips_the_breaker_and_spares_other_envs(
    config: comfy_env.PoolConfig, foreign_venv: Path, tmp_path: Path
) -> None:
    """A worker that segfaults on start, every time: each call reports its own start failure
    (one spawn per call, never a retry loop) until the breaker abandons the env; another env
    serves calls throughout."""
    max_restarts = 3
    broken = _fake_interpreter(tmp_path / "broken")
    env_vars = dict(
        FAULT_ENV,
        COMFY_ENV_FAULT_WHERE="start-before-hello",
        COMFY_ENV_FAULT_HOW="segfault-ctypes",
        COMFY_ENV_FAULT_MARKER=str(tmp_path / "fault"),
    )
    cfg = config.model_copy(update={"env_vars": env_vars, "max_restarts": max_restarts})
    with comfy_env.Pool(cfg) as pool, Bystander(pool, foreign_venv) as bystander:
        w = pool.get_worker(broken)
        for attempt in range(1, max_restarts + 2):
            started = time.monotonic()
            with pytest.raises(WorkerStartError) as info:
                w.run(fault_tasks.identity, (attempt,), timeout=CALL_TIMEOUT)
            assert time.monotonic() - started < ERROR_BOUND
            err = info.value
            assert err.generation == attempt
            assert "SIGSEGV" in str(err) and "during start-up" in str(err)
            assert "comfy-fault: start-before-hello-segfault-ctypes" in err.stderr_tail
            assert w.stats().spawns == attempt  # one spawn per call
            # The death is counted once the reactor has reaped it and drained its output.
            _wait(
                lambda a=attempt: w.stats().restarts_in_window >= a or w.stats().abandoned,
                what="the death to be recorded",
            )
        assert w.stats().abandoned
        started = time.monotonic()
        with pytest.raises(EnvAbandonedError) as abandoned:
            w.run(fault_tasks.identity, (0,), timeout=CALL_TIMEOUT)
        assert time.monotonic() - started < ERROR_BOUND
        assert str(broken) in str(abandoned.value)
        assert str(abandoned.value).count("start_failed") == max_restarts + 1
        stats = w.stats()
        assert stats.spawns == max_restarts + 1
        assert stats.failed == max_restarts + 2
        _assert_invariant(w)
        # The current interpreter's env is no more affected than the bystander's.
        assert pool.get_worker().run(fault_tasks.identity, (3,), timeout=CALL_TIMEOUT) == 3
        bystander.check()
