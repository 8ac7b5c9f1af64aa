"""Functions the tests run inside workers (importable there via PoolConfig.sys_path)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any


class CustomError(Exception):
    """An exception class that exists in both host and worker."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(code, text)
        self.code = code
        self.text = text


class FieldError(Exception):
    """An exception class with its own ``__str__``: its text does not come from its args."""

    def __init__(self, field: str) -> None:
        super().__init__(field)
        self.field = field

    def __str__(self) -> str:
        return f"audit failed on field {self.field}"


def add(a: int, b: int = 0) -> int:
    return a + b


def raise_custom(code: int) -> None:
    raise CustomError(code, "custom failure")


def raise_local_class() -> None:
    class LocalOnly(Exception):
        pass

    raise LocalOnly("defined inside a function: cannot be unpickled by the host")


def system_exit(code: int) -> None:
    sys.exit(code)


def return_unpicklable() -> Any:
    return threading.Lock()


def stamp(i: int) -> tuple[int, int]:
    """When the worker ran this call (CLOCK_MONOTONIC is shared by all processes), and i."""
    return time.monotonic_ns(), i


def sleep_then(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def getpid() -> int:
    return os.getpid()


def environ(name: str) -> str | None:
    return os.environ.get(name)


def sys_path() -> list[str]:
    return list(sys.path)


def can_import(name: str) -> bool:
    import importlib

    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def prefix() -> str:
    return sys.prefix


def executable() -> str:
    return sys.executable


def chatty_sleep(seconds: float, interval: float) -> None:
    """Prints steadily: a silence timeout would never fire, a total deadline does."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        print("still working", flush=True)
        time.sleep(interval)


def noisy(n: int) -> int:
    """Writes to every output path the worker has; the channel must stay clean."""
    for i in range(n):
        print("print line", i)
        sys.stderr.write(f"stderr line {i}\n")
        os.write(1, b"raw fd1 \x00\xff garbage\n")
        os.write(2, b"raw fd2 CE\x04 fake header\n")
    return n


def count_then_crash(path: str) -> None:
    """Appends a line to ``path`` and segfaults: a replayed call would append twice."""
    with open(path, "a") as fh:
        fh.write("ran\n")
    import ctypes

    ctypes.string_at(0)


def crash_in_this_frame() -> None:
    """A SIGSEGV whose innermost Python frame is this function (``ctypes.memset`` is a C
    function: it adds no Python frame of its own)."""
    import ctypes

    ctypes.memset(0, 0, 1)


def write_garbage() -> None:
    """Writes bytes that are not a frame onto the channel, then returns normally."""
    from comfy_env_worker import main

    assert main.CHANNEL is not None
    main.CHANNEL.sendall(b"this is not a frame header at all")


def write_oversized_header() -> None:
    from comfy_env_worker import main, protocol

    assert main.CHANNEL is not None
    main.CHANNEL.sendall(protocol.encode_header(protocol.FrameType.REPLY_OK, 0, 2**61))


def close_channel_and_linger(seconds: float) -> None:
    """Lets go of the channel (both directions; ``/dev/null`` takes their descriptors, so the
    watchdog sees no closed descriptor) and lives on, as code that closes descriptors it does
    not own might."""
    from comfy_env_worker import main

    assert main.CHANNEL is not None and main.WORKER is not None
    null = os.open(os.devnull, os.O_RDWR)
    for sock in {main.CHANNEL, main.WORKER.requests}:
        os.dup2(null, sock.fileno())
    os.close(null)
    time.sleep(seconds)


def write_junk_on_the_log_pipe() -> None:
    """Writes bytes that are not a log frame on the worker's log pipe (as code writing on a
    descriptor it does not own might)."""
    from comfy_env_worker import main

    assert main.WORKER is not None and main.WORKER.outbox.log_fd is not None
    os.write(main.WORKER.outbox.log_fd, b"this is not a log frame at all, nor its header")


def reply_then_die() -> None:
    """Writes a complete reply for the running call, then dies before returning."""
    import pickle

    from comfy_env_worker import main, protocol

    assert main.CHANNEL is not None
    call_id = CURRENT_CALL_ID_PROBE()
    protocol.send_frame(main.CHANNEL, protocol.FrameType.REPLY_OK, call_id, pickle.dumps("late"))
    os._exit(9)


def CURRENT_CALL_ID_PROBE() -> int:
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "run_call":
            return int(frame.f_locals["call_id"])
        frame = frame.f_back  # type: ignore[assignment]
    raise RuntimeError("not inside a call")


def kill_self(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(5)


def sleep_ignoring_sigterm(seconds: float) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)


def buffer_owner(arr: Any) -> str:
    """What memory a received array lives in: 'mmap' for a zero-copy shared-memory view."""
    base = arr
    while getattr(base, "base", None) is not None:
        base = base.base
    if isinstance(base, memoryview):
        obj = base.obj
        if type(obj).__name__ == "PickleBuffer":
            with obj.raw() as raw:
                obj = raw.obj
        while isinstance(obj, memoryview):
            obj = obj.obj
        return type(obj).__name__
    return type(base).__name__


def identities(big: Any, again: Any, shared: Any, shared_again: Any, looped: Any) -> Any:
    """What arrived as one object (``is``), and the arguments themselves, sent back."""
    seen = (big is again, shared is shared_again, shared[0] is big, looped["self"] is looped)
    return seen, (big, again, shared, shared_again, looped)


def filled(value: float, n: int, dtype: str = "float32") -> Any:
    import numpy as np

    return np.full(n, value, dtype=dtype)


def filled_once_stopped(path: str, host_pid: int, value: float, n: int) -> Any:
    """Write ``path`` (the test's cue to stop the host), wait until the host ``host_pid`` is
    stopped (state T), then return ``filled(value, n)``: the reply goes out to a host that
    cannot read it yet."""
    with open(path + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # whole when it appears
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(f"/proc/{host_pid}/stat", "rb") as stat:
            if stat.read().rsplit(b")", 1)[1].split()[0] == b"T":
                break
        time.sleep(0.005)
    return filled(value, n)


def filled_in_a_block_that_vanishes(value: float, n: int) -> Any:
    """Return ``filled(value, n)`` in a reply block that is unlinked just before the reply goes
    out (as a hand-cleaned /dev/shm would do): the host finds the block gone."""
    from comfy_env_worker import main

    worker = main.WORKER
    assert worker is not None
    original = worker.reply_oob

    def reply_oob(call_id: int, data: Any, table: Any, block: Any, *rest: Any) -> None:
        del worker.reply_oob  # once
        if block is not None and worker.pool is not None:
            worker.pool.give_up(block)
        original(call_id, data, table, block, *rest)

    worker.reply_oob = reply_oob  # type: ignore[method-assign]
    return filled(value, n)


_KEPT: list[Any] = []


def keep_and_return(arr: Any) -> Any:
    """Stores the argument (a view of the host's block) beyond the call and returns it."""
    _KEPT.append(arr)
    return arr


def keep(arr: Any) -> int:
    """Stores the argument (a view of the host's block) beyond the call."""
    _KEPT.append(arr)
    return len(_KEPT)


def kept_sum(index: int) -> float:
    return float(_KEPT[index].sum())


def kept_count() -> int:
    return len(_KEPT)


def keep_then_fail(arr: Any, how: str) -> Any:
    """Stores the argument (a view of the host's block) beyond the call, then fails: raises
    (``how="raise"``), or returns a result over the frame limit (``how="too-big"``)."""
    _KEPT.append(arr)
    if how == "raise":
        raise ValueError("kept the argument, then failed")
    return list(range(400_000))  # pickles to about 1.8 MB: over a 1 MiB frame limit


def forge_oob_reply(name_kind: str) -> None:
    """Writes an out-of-band reply whose table points somewhere it must not."""
    import pickle

    from comfy_env_worker import main, protocol, shm

    assert main.CHANNEL is not None and main.WORKER is not None
    call_id = CURRENT_CALL_ID_PROBE()
    if name_kind == "foreign":
        table = [("shm", "ce-1-1-w1-1", 0, 16)]
    elif name_kind == "path":
        table = [("shm", "../../etc/passwd", 0, 16)]
    elif name_kind == "echo-path":  # "your own block", naming a file outside /dev/shm
        table = [("echo", "../../etc/passwd", 0, 16)]
    elif name_kind == "echo-not-yours":  # "your own block", naming one of ours
        pool = main.WORKER.pool
        assert pool is not None
        table = [("echo", pool.acquire(1).name, 0, 16)]
    else:  # a real block of ours, but a range far outside it
        pool = main.WORKER.pool
        assert pool is not None
        block = pool.acquire(1)
        table = [("shm", block.name, block.size - 8, 4096)]
    head = pickle.dumps((table, [], []), protocol=5)
    body = pickle.dumps(None, protocol=5)
    payload = shm._U32.pack(len(head)) + head + body
    main.CHANNEL.sendall(
        protocol.encode_header(
            protocol.FrameType.REPLY_OK, call_id, len(payload), protocol.FLAG_OOB
        )
        + payload
    )
    time.sleep(30)


def register_release_hook(path: str) -> None:
    """Registers a release hook that records it ran (as an env's code would drop caches)."""
    import comfy_env_worker

    def hook() -> None:
        with open(path, "a") as fh:
            fh.write("released\n")

    comfy_env_worker.on_release(hook)


class Counter:
    """A stateful object to keep resident in a worker."""

    def __init__(self, start: int = 0) -> None:
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value


def make_counter(start: int = 0) -> Counter:
    return Counter(start)


def counter_value(counter: Counter) -> int:
    return counter.value


def kept_objects_beside(obj: Any) -> int:
    """``kept_objects`` in the worker holding ``obj`` (a RemoteRef argument binds the call)."""
    return kept_objects()


def big_buffer(megabytes: int) -> bytearray:
    """A buffer of ``megabytes`` MiB, every page of it written (resident in the worker)."""
    return bytearray(b"\x01") * (megabytes << 20)


def kept_objects() -> int:
    from comfy_env_worker import refs

    return refs.count()


def log_things(n: int) -> int:
    import logging

    log = logging.getLogger("mylib.sub")
    log.debug("hidden at the default INFO level")
    for i in range(n):
        log.info("info %d", i)
    log.warning("careful: %s", "warning")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed")
    return n


def log_later(delay: float) -> None:
    import logging

    def later() -> None:
        time.sleep(delay)
        logging.getLogger("background").error("logged between calls")

    threading.Thread(target=later, daemon=True).start()


def print_to_file(path: str) -> None:
    with open(path, "w") as fh:
        print("into the file", file=fh)
    print("to stdout")


def native_output() -> None:
    import ctypes

    libc = ctypes.CDLL(None)
    libc.printf(b"hello from C printf\n")
    libc.fflush(None)
    os.write(2, b"raw write to fd 2\n")


def flood(megabytes: int, native: bool) -> int:
    line = "x" * 1023
    if native:
        chunk = (line + "\n").encode() * 1024
        for _ in range(megabytes):
            os.write(1, chunk)
    else:
        for _ in range(megabytes * 1024):
            print(line)
    return megabytes


# ---- call control (tests/test_call_control.py, tests/test_acall.py) ----


def cooperative_loop(seconds: float) -> str:
    """Works in small steps and stops when the host cancels (raise_if_cancelled)."""
    import comfy_env_worker

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        comfy_env_worker.raise_if_cancelled()
        time.sleep(0.01)
    return "finished"


def wait_for_file(path: str, seconds: float) -> str:
    """Runs until ``path`` exists (the test decides when the call ends, however slow the
    machine), for at most ``seconds``."""
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.01)
    return "finished"


def polite_loop(seconds: float) -> str:
    """Polls cancelled() and returns early (a partial result) instead of raising."""
    import comfy_env_worker

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if comfy_env_worker.cancelled():
            return "stopped early"
        time.sleep(0.01)
    return "finished"


def busy_loop(seconds: float) -> int:
    """Pure Python that never checks: only an asynchronous exception stops it."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


def ignore_cancel(seconds: float) -> str:
    """Swallows the cancel (even the asynchronous one): only the kill stops it."""
    import comfy_env_worker

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(0.01)
        except comfy_env_worker.Cancelled:
            pass
    return "finished"


def report(n: int, kinds: tuple[str, ...] = ()) -> int:
    """``n`` progress updates as fast as possible, then one event per kind."""
    import comfy_env_worker

    for i in range(1, n + 1):
        comfy_env_worker.progress(i, n, stage="loop")
    for kind in kinds:
        comfy_env_worker.emit(kind, {"kind": kind})
    return n


def emit_too_big(size: int, progress: bool = False) -> str:
    """An event (or a progress update) whose data is ``size`` bytes, then one small event;
    returns what the oversized one raised in the worker."""
    import comfy_env_worker

    try:
        if progress:
            comfy_env_worker.progress(1, 1, blob=b"p" * size)
        else:
            comfy_env_worker.emit("big", b"e" * size)
    except Exception as exc:  # noqa: BLE001 - the test reads what it was
        outcome = f"{type(exc).__name__}: {exc}"
    else:
        outcome = "sent"
    comfy_env_worker.emit("small", 1)
    return outcome


def events_later(delay: float, n: int) -> str:
    """Sleeps, then ``n`` events and the reply at once: read on the loop, not in the spin, and
    often in one read (tests/test_acall_races.py)."""
    import comfy_env_worker

    time.sleep(delay)
    for i in range(n):
        comfy_env_worker.emit("step", i)
    return "done"


def events_in_order(n: int) -> int:
    """Interleaves emit and progress; every emit flushes the progress before it."""
    import comfy_env_worker

    for i in range(n):
        comfy_env_worker.emit("step", i)
        comfy_env_worker.progress(i + 1, n)
    return n


CALLS_SEEN = 0


def count_calls() -> int:
    """A module-level cache: survives between calls of one worker process."""
    global CALLS_SEEN
    CALLS_SEEN += 1
    return CALLS_SEEN


def log_after_first_import() -> bool:
    """Import ``logging`` for the first time in this worker (after asking for its spec without
    loading it, as availability checks do), log, and say whether it had been loaded before."""
    import importlib.util

    loaded_before = "logging" in sys.modules
    importlib.util.find_spec("logging")
    import logging

    log = logging.getLogger("late.import")
    log.debug("hidden at the default INFO level")
    log.info("routed after a late import")
    return loaded_before


def write_garbage_later(delay: float) -> None:
    """Returns at once; ``delay`` seconds later a thread writes bytes nobody asked for onto the
    channel, while the worker is idle."""
    from comfy_env_worker import main

    channel = main.CHANNEL
    assert channel is not None

    def later() -> None:
        time.sleep(delay)
        channel.sendall(b"unasked bytes on an idle channel")

    threading.Thread(target=later, daemon=True).start()


def hold_array(arr: Any, seconds: float) -> float:
    """Holds an out-of-band argument while it works in small steps, stopping when the host
    cancels (tests/test_acall.py: cancellation and deadlines with buffers)."""
    import comfy_env_worker

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        comfy_env_worker.raise_if_cancelled()
        time.sleep(0.01)
    return float(arr.sum())


def blob(n: int) -> bytes:
    """``n`` bytes, pickled inline (plain bytes never go out of band): a reply frame larger
    than one read of the channel."""
    return bytes(range(256)) * (n // 256) + b"x" * (n % 256)


def text(n: int) -> str:
    """A string of ``n`` characters: always pickled in band (a str never goes out of band)."""
    return "".join(chr(97 + i % 26) for i in range(26)) * (n // 26) + "z" * (n % 26)


UNPICKLED_ON: list[int] = []  # host side: the threads that unpickled a ``Recorded``, in order


def _unpickle_recorded(payload: str) -> Recorded:
    UNPICKLED_ON.append(threading.get_ident())
    return Recorded(payload)


class Recorded:
    """A result that notes which of the host's threads unpickled it (``UNPICKLED_ON``)."""

    def __init__(self, payload: str) -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_recorded, (self.payload,))


def recorded(n: int) -> Recorded:
    """A ``Recorded`` of ``n`` characters, pickled in band."""
    return Recorded(text(n))


def raise_big(n: int) -> None:
    """Raises an error whose message is ``n`` characters: a large REPLY_ERR frame."""
    raise CustomError(n, text(n))


def events_then_recorded(n: int, size: int) -> Recorded:
    """``n`` events and a log line each (in band, before the reply), then a large result."""
    import logging

    import comfy_env_worker

    for i in range(n):
        comfy_env_worker.emit("step", i)
        logging.getLogger("remote_tasks").warning("step %d", i)
    return recorded(size)


# ---- backends (tests/test_contract.py, tests/test_ray.py) ----


def report_then_wait(n: int, seconds: float) -> str:
    """``n`` events, then a cooperative wait: the events must reach the host while it runs."""
    import comfy_env_worker

    for i in range(n):
        comfy_env_worker.emit("step", i)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        comfy_env_worker.raise_if_cancelled()
        time.sleep(0.01)
    return "finished"


def touch_then_sleep(path: str, seconds: float) -> None:
    """Creates ``path`` (the call is running now), then sleeps: a signal from outside lands in
    the call."""
    with open(path, "w"):
        pass
    time.sleep(seconds)


def add_in_place(arr: Any, n: float) -> Any:
    """Changes its argument in place: arguments must arrive writable."""
    arr += n
    return arr


_HELD: list[bytes] = []


def hold_memory_and_sleep(mib: int, seconds: float) -> None:
    """Touch ``mib`` MiB (kept until the worker dies: its teardown then takes tens of ms), then
    sleep."""
    _HELD.append(b"\x01" * (mib << 20))
    time.sleep(seconds)


def allocate_mib(mib: int) -> int:
    """Allocate and touch ``mib`` MiB, 8 MiB at a time; return how many 8 MiB pieces."""
    held = [bytearray(8 << 20) for _ in range(mib // 8)]
    return len(held)
