"""Fault injection for tests/test_faults.py: what a worker does to misbehave, on purpose.

Everything here is importable on both sides (the ``config`` fixture puts ``tests/`` on the
worker's ``sys.path``). The one entry point that breaks a process is ``do_fault(how, where,
marker)``; the other functions only decide *when* it runs: while the worker unpickles the
arguments, runs the function, pickles the result, writes a shared-memory block, emits log
records, right after the reply, while idle, or during its own start-up (``boot``).

Safety: ``do_fault`` refuses to run unless ``COMFY_ENV_FAULT_SIDE=worker`` is set, which the
tests set only through ``PoolConfig.env_vars``; a test bug can therefore never segfault, abort
or spin the pytest process. Host-side faults go through ``host_fault``, which only raises or
kills the worker, and refuses to run inside a worker.

Markers: ``do_fault`` leaves ``<marker>.fired`` just before it acts, ``<marker>.done`` after a
fault the process survives in place (garbage written, channel closed), and ``<marker>.kill-me``
holding its pid when it waits to be killed from outside (``sigkill``). Each line it writes to
fd 2 (``comfy-fault: <where>-<how>``) must reach the caller's error as output tail.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

FAULT_SIDE_VAR = "COMFY_ENV_FAULT_SIDE"
HOWS = (
    "exception",
    "keyboard-interrupt",
    "sys-exit-0",
    "sys-exit-3",
    "os-exit-7",
    "segfault-ctypes",
    "segfault-faulthandler",
    "abort",
    "sigkill",
    "loop",
    "close-channel",
    "garbage-header",
    "oversized-length",
    "truncated-payload",
)
TRUNCATED_EXIT_CODE = 5


class FaultError(Exception):
    """The exception a fault raises; it exists in host and worker, so it is re-raised as
    itself in the host."""


def in_worker() -> bool:
    return os.environ.get(FAULT_SIDE_VAR) == "worker"


def _touch(path: str, text: str = "") -> None:
    """Create ``path`` atomically (a reader never sees it half written)."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _current_call_id() -> int:
    """The id of the call the worker's main thread is running, or 0 outside a call."""
    try:
        from tasks import remote as remote_tasks

        return remote_tasks.CURRENT_CALL_ID_PROBE()
    except RuntimeError:
        return 0


def _send_raw(data: bytes) -> None:
    """Write raw bytes on the worker's channel, between whole frames (under the send lock once
    the serve loop runs), as a confused worker would."""
    from comfy_env_worker import main

    channel = main.CHANNEL
    assert channel is not None, "no channel: not inside a worker"
    worker = main.WORKER
    if worker is None:  # still starting: nothing else writes yet
        channel.sendall(data)
        return
    with worker.outbox.lock:
        channel.sendall(data)


def _ignore_sigterm() -> None:
    """Ignore SIGTERM for the whole process, from any thread (``signal.signal`` only works in
    the main thread; the C call works everywhere)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGTERM, ctypes.c_void_p(1))  # SIG_IGN


def do_fault(how: str, where: str, marker: str) -> None:
    """Break this worker process in the way ``how`` names. Returns only for the faults the
    process survives in place (``garbage-header``, ``oversized-length``, ``close-channel``)."""
    if not in_worker():
        raise RuntimeError(f"refusing to inject {how!r} outside a worker ({FAULT_SIDE_VAR})")
    from comfy_env_worker import protocol

    os.write(2, f"comfy-fault: {where}-{how}\n".encode())
    _touch(marker + ".fired", str(os.getpid()))
    if how == "exception":
        raise FaultError(f"{where}-{how}")
    if how == "keyboard-interrupt":
        raise KeyboardInterrupt(f"{where}-{how}")
    if how == "sys-exit-0":
        sys.exit(0)
    if how == "sys-exit-3":
        sys.exit(3)
    if how == "os-exit-7":
        os._exit(7)
    if how == "segfault-ctypes":
        ctypes.string_at(0)
    if how == "segfault-faulthandler":
        faulthandler._sigsegv()  # type: ignore[attr-defined]
    if how == "abort":
        os.abort()
    if how == "sigkill":
        _touch(marker + ".kill-me", str(os.getpid()))
        time.sleep(60)  # the test kills us long before
        raise AssertionError("nobody killed this worker")
    if how == "loop":
        _ignore_sigterm()
        while True:
            pass
    if how == "close-channel":
        from comfy_env_worker import main

        assert main.CHANNEL is not None
        # Both halves of the channel (a socketpair each way), as a worker closing "its
        # channel" would.
        requests = main.WORKER.requests if main.WORKER is not None else None
        os.close(main.CHANNEL.fileno())
        if requests is not None and requests is not main.CHANNEL:
            os.close(requests.fileno())
    elif how == "garbage-header":
        _send_raw(b"\x00\x01 this is not a comfy-env frame header \xff\xfe")
    elif how == "oversized-length":
        _send_raw(protocol.encode_header(protocol.FrameType.REPLY_OK, _current_call_id(), 2**61))
    elif how == "truncated-payload":
        header = protocol.encode_header(protocol.FrameType.REPLY_OK, _current_call_id(), 100)
        _send_raw(header + b"0123456789")  # 10 of the 100 bytes announced
        os._exit(TRUNCATED_EXIT_CODE)
    else:
        raise ValueError(f"unknown fault {how!r}")
    _touch(marker + ".done")


def host_fault(how: str, worker_pid: int) -> None:
    """A fault in the host's own codec path: raise, or kill the worker from outside (and wait
    until it is dead). Anything that would take the host down is refused."""
    if in_worker():
        raise RuntimeError("host_fault ran inside a worker")
    if how == "exception":
        raise FaultError(f"host-{how}")
    if how == "keyboard-interrupt":
        raise KeyboardInterrupt(f"host-{how}")
    if how == "sys-exit-0":
        sys.exit(0)
    if how == "sys-exit-3":
        sys.exit(3)
    if how == "sigkill":
        kill_and_wait(worker_pid)
        return
    raise RuntimeError(f"refusing to inject {how!r} into the host")


def kill_and_wait(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL ``pid`` and wait until it is dead (a zombie or reaped)."""
    import psutil

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.002)
    raise AssertionError(f"pid {pid} survived SIGKILL")


# ---- where: the arguments ---------------------------------------------------------------------


def identity(value: Any) -> Any:
    return value


def slow_identity(value: Any, seconds: float) -> Any:
    time.sleep(seconds)
    return value


def fault_value(how: str, where: str, marker: str) -> None:
    """Rebuilds a ``FaultyArg`` in the worker: the fault strikes while the worker unpickles."""
    do_fault(how, where, marker)


class FaultyArg:
    """An argument that pickles fine in the host and faults while the worker unpickles it."""

    def __init__(self, how: str, where: str, marker: str) -> None:
        self.spec = (how, where, marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (fault_value, self.spec)


class HostFaultyArg:
    """An argument whose pickling in the host is the fault (before anything is sent)."""

    def __init__(self, how: str, worker_pid: int) -> None:
        self.how = how
        self.worker_pid = worker_pid

    def __reduce__(self) -> tuple[Any, ...]:
        host_fault(self.how, self.worker_pid)
        return (int, (0,))  # only reached when the fault let pickling go on (sigkill)


# ---- where: the result ------------------------------------------------------------------------


def rebuilt_result() -> str:
    return "rebuilt"


class FaultyResult:
    """A result whose pickling in the worker is the fault."""

    def __init__(self, how: str, where: str, marker: str) -> None:
        self.spec = (how, where, marker)

    def __reduce__(self) -> tuple[Any, ...]:
        do_fault(*self.spec)
        return (rebuilt_result, ())


def make_faulty_result(how: str, where: str, marker: str) -> FaultyResult:
    return FaultyResult(how, where, marker)


def rebuild_host_side(how: str, worker_pid: int) -> str:
    """Unpickling a ``HostFaultyResult``: harmless in a worker, the fault in the host."""
    if not in_worker():
        host_fault(how, worker_pid)
    return "rebuilt"


class HostFaultyResult:
    """A result that pickles fine in the worker and faults while the host unpickles it."""

    def __init__(self, how: str, worker_pid: int) -> None:
        self.how = how
        self.worker_pid = worker_pid

    def __reduce__(self) -> tuple[Any, ...]:
        return (rebuild_host_side, (self.how, self.worker_pid))


def make_host_faulty_result(how: str) -> HostFaultyResult:
    return HostFaultyResult(how, os.getpid())


# ---- where: after the reply, and idle ---------------------------------------------------------


def _after_reply(action: Any) -> None:
    """Run ``action`` on a thread as soon as the running call's reply has been sent."""
    from comfy_env_worker import main

    worker = main.WORKER
    assert worker is not None

    def wait_then_act() -> None:
        while True:
            with worker.outbox.lock:
                if not worker.outbox.in_call:  # the reply went out in this locked section
                    break
            time.sleep(0.0002)
        action()

    threading.Thread(target=wait_then_act, name="fault-after-reply", daemon=True).start()


def ack_window_fault(how: str, where: str, marker: str, n: int) -> Any:
    """Returns a large array (a reply through shared memory, pinned until the host's
    ``consumed`` ack) and faults on a thread the moment the reply is out."""
    import numpy as np

    _after_reply(lambda: do_fault(how, where, marker))
    return np.full(n, 7.0, dtype=np.float32)


def arm_idle_fault(how: str, where: str, marker: str, delay: float) -> str:
    """Returns at once; a thread faults ``delay`` seconds later, while the worker is idle."""

    def later() -> None:
        time.sleep(delay)
        do_fault(how, where, marker)

    threading.Thread(target=later, name="fault-idle", daemon=True).start()
    return "armed"


def log_reply_then_die(n: int, code: int) -> Any:
    """Logs a record in band (it precedes the reply on the channel), returns a large array,
    and exits the moment the reply is out, without waiting for the host's ack."""
    import numpy as np

    logging.getLogger("fault.reply").warning("fault-reply-follows")
    _after_reply(lambda: os._exit(code))
    return np.full(n, 3.0, dtype=np.float32)


def hold_send_lock_then_return() -> str:
    """A thread takes the worker's send lock and never gives it back; then the call returns,
    so its reply can never be written."""
    from comfy_env_worker import main

    worker = main.WORKER
    assert worker is not None
    held = threading.Event()

    def hog() -> None:
        with worker.outbox.lock:
            held.set()
            time.sleep(3600)

    threading.Thread(target=hog, name="fault-lock-hog", daemon=True).start()
    held.wait(10)
    return "never delivered"


# ---- where: writing a shared-memory block -----------------------------------------------------


def shm_write_fault(how: str, where: str, marker: str, n: int) -> Any:
    """Returns a large array; the worker's copy of it into its reply block faults halfway
    (``Block.write`` is wrapped once, in this worker only)."""
    import numpy as np

    from comfy_env_worker import shm

    original = shm.Block.write

    def write(self: Any, offset: int, data: memoryview) -> None:
        shm.Block.write = original  # type: ignore[method-assign]
        half = data.nbytes // 2
        original(self, offset, data[:half])
        do_fault(how, where, marker)
        original(self, offset + half, data[half:])

    shm.Block.write = write  # type: ignore[method-assign]
    return np.full(n, 5.0, dtype=np.float32)


# ---- where: log frames ------------------------------------------------------------------------

LOG_MESSAGE = "fault-log"


def log_then_fault(how: str, where: str, marker: str, threads: int = 3) -> int:
    """Threads log steadily (in band, during the call); once records are flowing, the call's
    own thread faults while they keep logging."""
    stop = threading.Event()
    sent = [0]
    log = logging.getLogger("fault.logging")

    def chatter(index: int) -> None:
        i = 0
        while not stop.is_set():
            log.warning("%s thread %d record %d", LOG_MESSAGE, index, i)
            sent[0] += 1
            i += 1
            time.sleep(0.005)

    workers = [
        threading.Thread(target=chatter, args=(k,), name=f"fault-log-{k}", daemon=True)
        for k in range(threads)
    ]
    for t in workers:
        t.start()
    deadline = time.monotonic() + 10
    while sent[0] < 20 and time.monotonic() < deadline:
        time.sleep(0.002)
    try:
        do_fault(how, where, marker)
    finally:
        stop.set()
        for t in workers:
            t.join(5)
    return sent[0]


# ---- where: start-up (a fake interpreter runs the real worker through ``boot``) ----------------


def boot(argv: list[str]) -> None:
    """Run the real worker with a fault armed at one start-up stage, named by the environment:
    ``COMFY_ENV_FAULT_WHERE`` (``start-before-hello``, ``start-after-hello``,
    ``start-canary``), ``COMFY_ENV_FAULT_HOW``, ``COMFY_ENV_FAULT_MARKER``. With
    ``COMFY_ENV_FAULT_ONCE=1`` only the first process to start faults; later ones are healthy.
    Like the pool's BOOT, it waits for the host's GO byte before importing from the runtime
    dir (``argv[0]`` is the channel's descriptor)."""
    if os.read(int(argv[0]), 1) != b"\x01":
        os._exit(0)
    from comfy_env_worker import main as worker_main
    from comfy_env_worker import tasks

    where = os.environ["COMFY_ENV_FAULT_WHERE"]
    how = os.environ["COMFY_ENV_FAULT_HOW"]
    marker = os.environ["COMFY_ENV_FAULT_MARKER"]
    armed = True
    if os.environ.get("COMFY_ENV_FAULT_ONCE") == "1":
        try:
            os.close(os.open(marker + ".once", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            armed = False
    if armed:
        worker_cls: Any = worker_main.Worker
        if where == "start-before-hello":
            send_hello = worker_cls.send_hello

            def faulty_send_hello(self: Any) -> None:
                do_fault(how, where, marker)
                send_hello(self)

            worker_cls.send_hello = faulty_send_hello
        elif where == "start-after-hello":
            apply_config = worker_cls.apply_config

            def faulty_apply_config(self: Any, config: dict[str, Any]) -> None:
                do_fault(how, where, marker)
                apply_config(self, config)

            worker_cls.apply_config = faulty_apply_config
        elif where == "start-canary":
            echo = tasks.echo

            def faulty_echo(value: Any) -> Any:
                do_fault(how, where, marker)
                return echo(value)

            tasks.echo = faulty_echo
        else:
            raise ValueError(f"unknown start-up stage {where!r}")
    worker_main.main(argv)
