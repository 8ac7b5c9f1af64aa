"""Peer driver: runs one peer's side of a benchmark inside that peer's venv.

The suite (``run_all.py``) never imports a peer library itself: loky, pebble and anyio live in
``benchmarks/.peers/venv``, the published comfy-env 0.4.46 in ``benchmarks/.peers/old-comfy-env``
(it shares our import name), and the stdlib pools run here too, under the suite's own
interpreter, so every peer is measured the same way. This script is started with the peer
venv's interpreter and is the *caller* of the peer: it times its own calls with
``time.perf_counter_ns`` and reports the numbers, so the suite's control messages are never
inside a timed region.

Modes::

    driver.py serve METHOD            JSON-lines server on stdin/stdout (one peer per process)
    driver.py first-call METHOD       one fresh host: time pool creation -> first result, print
    driver.py host-probe ROOT N,N,..  comfy_env host threads/fds with N workers (our venv only)

``serve`` requests are ``{"op": ..., **params}`` and each gets exactly one JSON line back:

``info``      python and library versions
``start``     create the pool/executor, warm it with one call; answers the worker pids
``pids``      the worker pids now
``small n``   n sequential ``echo(i)`` calls; answers mean microseconds per call
``alloc nbytes`` / ``free``  create / drop the float32 array for ``payload``
``payload n`` n sequential round trips ``echo(array)``; answers seconds per call
``crash``     SIGKILL the worker mid-call; answers detection and recovery milliseconds and
              the exception type the caller got (``raised``)
``stop``      close the peer and exit

Library output is sent to stderr (the suite logs it): the protocol uses a private copy of the
original stdout descriptor. At most two copies of a payload array are alive here (the
argument and the result, dropped before the next call).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from bench_tasks import echo, getpid, sleep, touch_pages

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ECHO_TARGET = "comfy_env_worker.tasks:echo"
CRASH_SETTLE_S = 0.25  # time between submitting sleep(10) and the kill: the call is running


class NotMeasured(Exception):
    """This peer has no meaningful form of the requested measurement."""


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def measure_crash(
    pid: int, blocking: Callable[[], Any], recover: Callable[[], Any]
) -> dict[str, Any]:
    """Run ``blocking`` (a call that is in progress in worker ``pid``, or waits for one) in a
    thread, SIGKILL ``pid`` from here, and time the kill -> the thread's exception
    (detection) and the kill -> ``recover()`` returning a result (recovery)."""
    seen: dict[str, Any] = {}

    def waiter() -> None:
        try:
            blocking()
            seen["raised"] = "nothing: the call returned normally"
        except Exception as exc:  # noqa: BLE001 - any exception is the detection
            seen["t"] = time.perf_counter_ns()
            seen["raised"] = type(exc).__name__
        seen["t"] = seen.get("t", time.perf_counter_ns())

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(CRASH_SETTLE_S)
    t_kill = time.perf_counter_ns()
    os.kill(pid, signal.SIGKILL)
    thread.join(30.0)
    if thread.is_alive():
        raise RuntimeError("the call did not fail within 30 s of its worker's SIGKILL")
    recover()
    t_ok = time.perf_counter_ns()
    return {
        "detect_ms": (seen["t"] - t_kill) / 1e6,
        "recover_ms": (t_ok - t_kill) / 1e6,
        "raised": seen["raised"],
    }


# --------------------------------------------------------------------------- peers


class Peer:
    """One peer's pool with one worker. Subclasses fill in start/call/pids/close/crash."""

    dist: str | None = None  # distribution whose version is reported

    def __init__(self) -> None:
        self.array: Any = None
        self.closed = False

    def start(self) -> None:
        raise NotImplementedError

    def call(self, x: Any) -> Any:
        raise NotImplementedError

    def pids(self) -> list[int]:
        raise NotImplementedError

    def crash(self) -> dict[str, Any]:
        raise NotMeasured("no crash measurement for this peer")

    def shutdown(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.array = None
            self.shutdown()

    # ---- ops

    def op_info(self) -> dict[str, Any]:
        version = _version(self.dist) if self.dist else None  # None: part of the stdlib
        return {"python": sys.version.split()[0], "version": version, "pid": os.getpid()}

    def op_start(self) -> dict[str, Any]:
        self.start()
        if self.call(12345) != 12345:
            raise RuntimeError("the peer did not echo its argument")
        return {"pids": self.pids()}

    def op_pids(self) -> dict[str, Any]:
        return {"pids": self.pids()}

    def op_small(self, n: int) -> dict[str, Any]:
        call = self.call
        t0 = time.perf_counter_ns()
        for i in range(n):
            call(i)
        return {"us": (time.perf_counter_ns() - t0) / n / 1000.0}

    def op_alloc(self, nbytes: int) -> dict[str, Any]:
        import numpy as np

        self.array = None
        self.array = np.full(nbytes // 4, 1.5, dtype=np.float32)
        return {}

    def op_free(self) -> dict[str, Any]:
        self.array = None
        return {}

    def op_payload(self, n: int) -> dict[str, Any]:
        a = self.array
        total = 0
        for _ in range(n):
            t0 = time.perf_counter_ns()
            b = self.call(a)
            touch_pages(b)
            total += time.perf_counter_ns() - t0
            if b.nbytes != a.nbytes or b.dtype != a.dtype:
                raise RuntimeError("the peer returned a different array")
            del b
        return {"s": total / n / 1e9}

    def op_crash(self) -> dict[str, Any]:
        return self.crash()


class PPEPeer(Peer):
    """``concurrent.futures.ProcessPoolExecutor(max_workers=1)``, default start method."""

    def start(self) -> None:
        import concurrent.futures

        self.ex = concurrent.futures.ProcessPoolExecutor(max_workers=1)

    def call(self, x: Any) -> Any:
        return self.ex.submit(echo, x).result()

    def pids(self) -> list[int]:
        return [self.ex.submit(getpid).result()]

    def crash(self) -> dict[str, Any]:
        import concurrent.futures

        pid = self.pids()[0]
        fut = self.ex.submit(sleep, 10.0)

        def recover() -> None:
            self.ex.shutdown(wait=True)
            self.ex = concurrent.futures.ProcessPoolExecutor(max_workers=1)
            self.call(1)

        return measure_crash(pid, fut.result, recover)

    def shutdown(self) -> None:
        self.ex.shutdown(wait=True, cancel_futures=True)


class MPPoolPeer(Peer):
    """``multiprocessing.Pool(1)``, default start method, ``apply``."""

    def start(self) -> None:
        import multiprocessing

        self.pool = multiprocessing.Pool(1)

    def call(self, x: Any) -> Any:
        return self.pool.apply(echo, (x,))

    def pids(self) -> list[int]:
        return [self.pool.apply(getpid)]

    def crash(self) -> dict[str, Any]:
        raise NotMeasured(
            "multiprocessing.Pool replaces a killed worker but never completes its task "
            "(apply() would wait forever)"
        )

    def shutdown(self) -> None:
        self.pool.close()
        self.pool.join()


class LokyPeer(Peer):
    """``loky.get_reusable_executor(max_workers=1)`` (loky's own spawn-like start)."""

    dist = "loky"

    def start(self) -> None:
        import loky

        self.ex = loky.get_reusable_executor(max_workers=1, timeout=3600)

    def call(self, x: Any) -> Any:
        return self.ex.submit(echo, x).result()

    def pids(self) -> list[int]:
        return [self.ex.submit(getpid).result()]

    def crash(self) -> dict[str, Any]:
        import loky

        pid = self.pids()[0]
        fut = self.ex.submit(sleep, 10.0)

        def recover() -> None:
            self.ex = loky.get_reusable_executor(max_workers=1, timeout=3600)
            self.call(1)

        return measure_crash(pid, fut.result, recover)

    def shutdown(self) -> None:
        self.ex.shutdown(wait=True, kill_workers=True)


class PebblePeer(Peer):
    """``pebble.ProcessPool(max_workers=1)``, ``schedule(...).result()``."""

    dist = "pebble"

    def start(self) -> None:
        import pebble

        self.pool = pebble.ProcessPool(max_workers=1)

    def call(self, x: Any) -> Any:
        return self.pool.schedule(echo, args=(x,)).result()

    def pids(self) -> list[int]:
        return [self.pool.schedule(getpid).result()]

    def crash(self) -> dict[str, Any]:
        pid = self.pids()[0]
        fut = self.pool.schedule(sleep, args=(10.0,))
        return measure_crash(pid, fut.result, lambda: self.call(1))  # pebble respawns itself

    def shutdown(self) -> None:
        self.pool.close()
        self.pool.join(timeout=10)
        if self.pool.active:
            self.pool.stop()
            self.pool.join(timeout=10)


class AnyioPeer(Peer):
    """``anyio.to_process.run_sync`` driven by anyio's own event loop.

    One long-lived loop runs in a blocking portal (anyio keeps its worker processes per event
    loop); each batch is one coroutine awaiting ``run_sync`` sequentially, timed inside the
    loop."""

    dist = "anyio"

    def start(self) -> None:
        from anyio.from_thread import start_blocking_portal

        self._cm = start_blocking_portal()
        self.portal = self._cm.__enter__()

    @staticmethod
    async def _run(func: Callable[..., Any], *args: Any) -> Any:
        from anyio import to_process

        return await to_process.run_sync(func, *args)

    def call(self, x: Any) -> Any:
        return self.portal.call(self._run, echo, x)

    def pids(self) -> list[int]:
        return [int(self.portal.call(self._run, getpid))]

    @staticmethod
    async def _batch(n: int) -> float:
        from anyio import to_process

        run_sync = to_process.run_sync
        t0 = time.perf_counter_ns()
        for i in range(n):
            await run_sync(echo, i)
        return (time.perf_counter_ns() - t0) / n / 1000.0

    def op_small(self, n: int) -> dict[str, Any]:
        return {"us": float(self.portal.call(self._batch, n))}

    def shutdown(self) -> None:
        self._cm.__exit__(None, None, None)


class OldComfyEnvPeer(Peer):
    """comfy-env 0.4.46: ``comfy_env.isolation.workers.subprocess.SubprocessWorker``.

    Its isolation API runs ``call_module(module=..., func=..., **kwargs)`` in a persistent
    worker of a given interpreter (keyword arguments only). Here the interpreter is this
    venv's own and ``bench_tasks`` is put on the worker's path. After its worker dies a
    ``SubprocessWorker`` refuses further calls ("has been shut down"), so recovery is a new
    ``SubprocessWorker`` and its first call."""

    dist = "comfy-env"

    def start(self) -> None:
        from comfy_env.isolation.workers.subprocess import SubprocessWorker

        self.worker = SubprocessWorker(python=sys.executable, sys_path=[BENCH_DIR], name="bench")

    def call(self, x: Any) -> Any:
        return self.worker.call_module(module="bench_tasks", func="echo", x=x)

    def pids(self) -> list[int]:
        return [int(self.worker.call_module(module="bench_tasks", func="getpid"))]

    def crash(self) -> dict[str, Any]:
        pid = self.pids()[0]
        worker = self.worker

        def blocking() -> None:
            worker.call_module(module="bench_tasks", func="sleep", seconds=10.0)

        def recover() -> None:
            worker.shutdown()
            self.start()
            self.call(1)

        return measure_crash(pid, blocking, recover)

    def shutdown(self) -> None:
        self.worker.shutdown()


PEERS: dict[str, type[Peer]] = {
    "ProcessPoolExecutor": PPEPeer,
    "multiprocessing.Pool": MPPoolPeer,
    "loky": LokyPeer,
    "pebble": PebblePeer,
    "anyio.to_process": AnyioPeer,
    "comfy-env 0.4.46": OldComfyEnvPeer,
}


def serve(method: str) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the peer prints goes to the log, never into the protocol
    peer = PEERS[method]()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            op = request.pop("op")
            try:
                if op == "stop":
                    peer.close()
                    answer: dict[str, Any] = {}
                else:
                    answer = getattr(peer, f"op_{op}")(**request)
            except NotMeasured as exc:
                answer = {"error": f"n/a: {exc}"}
            except Exception as exc:  # noqa: BLE001 - reported to the suite, which goes on
                traceback.print_exc()
                answer = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            proto.write(json.dumps(answer) + "\n")
            if op == "stop":
                break
    finally:
        peer.close()
    return 0


# --------------------------------------------------------------------------- first call

_MIN_WORKER = r"""
import pickle, socket, struct, sys
s = socket.socket(fileno=int(sys.argv[1]))
L = struct.Struct("<Q")
def recv(n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            sys.exit(0)
        buf += chunk
    return bytes(buf)
while True:
    fn, args = pickle.loads(recv(L.unpack(recv(8))[0]))
    out = pickle.dumps(args[0], protocol=5)
    s.sendall(L.pack(len(out)) + out)
"""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the minimal worker closed the channel")
        buf += chunk
    return bytes(buf)


def fc_bare() -> tuple[float, float]:
    """Reference: a bare interpreter, Popen -> one byte written to an inherited pipe."""
    r, w = os.pipe()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.write({w}, b'x')"],
        pass_fds=(w,),
        stdin=subprocess.DEVNULL,
    )
    os.close(w)
    if os.read(r, 1) != b"x":
        raise RuntimeError("the bare interpreter did not write its byte")
    elapsed = time.perf_counter() - t0
    os.close(r)
    proc.wait()
    return 0.0, elapsed


def fc_minimal() -> tuple[float, float]:
    """Reference: hand-written minimal worker, socketpair + ``python -c``, one pickled
    request ``("echo", (1,))`` and its pickled reply."""
    length = struct.Struct("<Q")
    t0 = time.perf_counter()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, "-c", _MIN_WORKER, str(theirs.fileno())],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
    )
    theirs.close()
    request = pickle.dumps(("echo", (1,)), protocol=5)
    mine.sendall(length.pack(len(request)) + request)
    reply = pickle.loads(_recv_exact(mine, length.unpack(_recv_exact(mine, 8))[0]))
    elapsed = time.perf_counter() - t0
    if reply != 1:
        raise RuntimeError("the minimal worker answered wrongly")
    mine.close()
    proc.wait()
    return 0.0, elapsed


_LOAD_S: float | None = None  # comfy_env: loading Pool after the import


def fc_comfy_env() -> tuple[float, float]:
    global _LOAD_S
    t = time.perf_counter()
    import comfy_env

    imported = time.perf_counter() - t
    # The package loads its public names on first use (the pool's machinery): timed apart, so
    # that the first call's figure stays pool creation -> result and the import figures add
    # up to everything a fresh host pays. ``Pool()`` takes the defaults (and COMFY_ENV_*
    # settings) without building a PoolConfig, so pydantic is not loaded (``_settings``);
    # ``Pool(PoolConfig())`` would load it (about 100 ms here).
    t = time.perf_counter()
    pool_cls = comfy_env.Pool
    _LOAD_S = time.perf_counter() - t
    t0 = time.perf_counter()
    pool = pool_cls()
    try:
        if pool.get_worker(None).call(ECHO_TARGET, 1) != 1:
            raise RuntimeError("comfy_env answered wrongly")
        elapsed = time.perf_counter() - t0
    finally:
        pool.close()
    return imported, elapsed


def _fc_ppe(method: str) -> tuple[float, float]:
    t = time.perf_counter()
    import concurrent.futures
    import multiprocessing

    imported = time.perf_counter() - t
    t0 = time.perf_counter()
    ex = concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context(method)
    )
    try:
        if ex.submit(echo, 1).result() != 1:
            raise RuntimeError("ProcessPoolExecutor answered wrongly")
        elapsed = time.perf_counter() - t0
    finally:
        ex.shutdown(wait=True)
    return imported, elapsed


def fc_loky() -> tuple[float, float]:
    t = time.perf_counter()
    import loky

    imported = time.perf_counter() - t
    t0 = time.perf_counter()
    ex = loky.get_reusable_executor(max_workers=1)
    try:
        if ex.submit(echo, 1).result() != 1:
            raise RuntimeError("loky answered wrongly")
        elapsed = time.perf_counter() - t0
    finally:
        ex.shutdown(wait=True, kill_workers=True)
    return imported, elapsed


def fc_pebble() -> tuple[float, float]:
    t = time.perf_counter()
    import pebble

    imported = time.perf_counter() - t
    t0 = time.perf_counter()
    pool = pebble.ProcessPool(max_workers=1)
    try:
        if pool.schedule(echo, args=(1,)).result() != 1:
            raise RuntimeError("pebble answered wrongly")
        elapsed = time.perf_counter() - t0
    finally:
        pool.close()
        pool.join(timeout=10)
    return imported, elapsed


def fc_old_comfy_env() -> tuple[float, float]:
    t = time.perf_counter()
    from comfy_env.isolation.workers.subprocess import SubprocessWorker

    imported = time.perf_counter() - t
    t0 = time.perf_counter()
    worker = SubprocessWorker(python=sys.executable, sys_path=[BENCH_DIR], name="bench")
    try:
        if worker.call_module(module="bench_tasks", func="echo", x=1) != 1:
            raise RuntimeError("comfy-env 0.4.46 answered wrongly")
        elapsed = time.perf_counter() - t0
    finally:
        worker.shutdown()
    return imported, elapsed


FIRST_CALL: dict[str, Callable[[], tuple[float, float]]] = {
    "bare interpreter": fc_bare,
    "minimal worker": fc_minimal,
    "comfy_env": fc_comfy_env,
    "ProcessPoolExecutor (fork)": lambda: _fc_ppe("fork"),
    "ProcessPoolExecutor (spawn)": lambda: _fc_ppe("spawn"),
    "loky": fc_loky,
    "pebble": fc_pebble,
    "comfy-env 0.4.46": fc_old_comfy_env,
}


def first_call(method: str) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        imported, elapsed = FIRST_CALL[method]()
        answer = {"import_s": imported, "s": elapsed}
        if _LOAD_S is not None:
            answer["load_s"] = _LOAD_S
        proto.write(json.dumps(answer) + "\n")
    except Exception as exc:  # noqa: BLE001 - reported to the suite, which goes on
        traceback.print_exc()
        proto.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}) + "\n")
    return 0


# --------------------------------------------------------------------------- host probe


def _host_snapshot(workers: int, stage: str) -> dict[str, Any]:
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return {
        "workers": workers,
        "stage": stage,
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss_mib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "python_threads": sorted(t.name for t in threading.enumerate()),
    }


def host_probe(root: str, counts: list[int]) -> int:
    """Threads, fds and RSS of a fresh host as its pool grows to each of ``counts`` workers
    (one per fake env under ``root``), and after ``close``."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        rows = _host_rows(root, counts)
        proto.write(json.dumps({"rows": rows}) + "\n")
    except Exception as exc:  # noqa: BLE001 - reported to the suite, which goes on
        traceback.print_exc()
        proto.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}) + "\n")
    return 0


def _host_rows(root: str, counts: list[int]) -> list[dict[str, Any]]:
    from benchlib import make_fake_envs

    import comfy_env

    envs = make_fake_envs(root, max(counts))
    rows = [_host_snapshot(0, "after import")]
    pool = comfy_env.Pool()
    try:
        rows.append(_host_snapshot(0, "pool created"))
        started = 0
        for n in counts:
            for env in envs[started:n]:
                if pool.get_worker(env).call(ECHO_TARGET, 0) != 0:
                    raise RuntimeError("comfy_env answered wrongly")
            started = n
            time.sleep(0.2)  # let the reactor settle (output pipes, pidfds registered)
            rows.append(_host_snapshot(n, "idle workers"))
    finally:
        pool.close()
    time.sleep(0.2)
    rows.append(_host_snapshot(0, "after close"))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        return serve(argv[1])
    if len(argv) >= 2 and argv[0] == "first-call":
        return first_call(argv[1])
    if len(argv) >= 3 and argv[0] == "host-probe":
        return host_probe(argv[1], [int(n) for n in argv[2].split(",")])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
