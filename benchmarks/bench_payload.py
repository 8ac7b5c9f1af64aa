"""Measurement 2: payload round trip ``f(a) = a`` for large float32 numpy arrays.

What is measured
----------------
For each size (1, 16, 64, 256 MiB; 1 MiB in quick mode) the time from handing ``a`` to the
method until the returned array is in the caller's hands: returned, and one byte of each of
its 4 KiB pages read (``bench_tasks.touch_pages``, every method alike, the peers' drivers
too). A method that hands back memory whose pages are not mapped in yet (a fresh mapping,
faulted in lazily) pays those page faults inside the timing, as a copy into fresh memory pays
them while it copies (before the twelfth round nothing was read, which flattered such
methods: comfy_env lent results through a fresh mapping per reply then):

``memcpy``
    Unit of cost: one in-process ``np.copyto(dst, a)`` into a preallocated, already-touched
    ``dst`` (pure memory bandwidth). "memcpy-equivalents" = method time / this.
``a.copy()``
    One in-process copy into a fresh allocation (page faults included): what any method that
    hands back a *new* array must pay at least once.
``stream reference``
    A hand-written transport: a child ``python -c`` on an ``AF_UNIX`` socketpair; the sender
    pickles with protocol 5 and ``buffer_callback`` (out-of-band buffers), writes a small
    header, the pickle, then each raw buffer with ``sendall``; the receiver ``recv_into``s each
    buffer into a fresh ``bytearray`` and unpickles with ``buffers=``. The child echoes the
    array back the same way. The child reuses its receive buffers across calls (an echo server
    may: the array is gone once it is sent back); the caller receives into a fresh
    ``bytearray`` every time, since the result is the caller's to keep. Default socket buffer
    sizes.
``comfy_env``
    ``worker.call("comfy_env_worker.tasks:echo", a)``, whatever transport comfy_env uses now.
``comfy_env (results kept)``
    The same on a worker of its own (a second pool), every result kept alive until the size is
    done.
peers
    ``ProcessPoolExecutor``, loky and pebble (``submit``/``schedule(echo, a).result()``), and
    comfy-env 0.4.46's ``call_module(..., x=a)``, each in a driver under its own venv that holds
    its own array of the same size and times its own calls.

Fairness
--------
* Interleaved rounds per size (7/5/3/3 rounds for 1/16/64/256 MiB, a few calls per round for
  the small sizes), after one warm-up call per method and size. Median of the per-round mean,
  with min and max.
* No CPU pinning: every method may use both CPUs (a transport that overlaps sender and receiver
  is allowed to).
* Memory: at most two copies of an array are alive per method in the caller (the argument and
  the result, dropped before the next call; ``memcpy`` keeps ``a`` and ``dst``); what a
  transport holds internally while a call is in flight is its own business.
"""

from __future__ import annotations

import functools
import math
import pickle
import random
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from bench_tasks import touch_pages
from benchlib import (
    Context,
    MiB,
    Remote,
    RemoteError,
    Section,
    Series,
    fmt,
    fmt_x,
    ratio,
    target_at_least,
    target_at_most,
    unavailable_row,
)

MEMCPY = "memcpy (np.copyto)"
COPY = "a.copy()"
STREAM = "stream reference"
COMFY_ENV = "comfy_env"
COMFY_KEPT = "comfy_env (results kept)"
PEERS = ("ProcessPoolExecutor", "loky", "pebble", "comfy-env 0.4.46")
ECHO_TARGET = "comfy_env_worker.tasks:echo"

# size MiB -> (rounds, calls per round) for the full run
PLAN = {1: (7, 10), 16: (5, 3), 64: (3, 2), 256: (3, 1)}
QUICK_PLAN = {1: (2, 2)}

TARGET_MEMCPY = 2.0  # comfy_env at the largest size <= 2 memcpy-equivalents (results dropped)
TARGET_KEPT = 3.0  # ... <= 3 when every result is kept alive
TARGET_MID = 3.0  # 16 MiB and 64 MiB round trips <= 3 memcpy-equivalents
TARGET_VS_PEERS = 10.0  # best peer at the largest size >= 10x comfy_env's time

_HEAD = struct.Struct("<QQ")  # pickle length, number of out-of-band buffers
_Q = struct.Struct("<Q")

_STREAM_CHILD = r"""
import pickle, socket, struct, sys
s = socket.socket(fileno=int(sys.argv[1]))
H = struct.Struct("<QQ")
Q = struct.Struct("<Q")
SPARE = []  # receive buffers, reused: the echoed array is dropped once it is sent back
def fill(view):
    while view:
        n = s.recv_into(view)
        if not n:
            sys.exit(0)
        view = view[n:]
def recv_msg():
    head = bytearray(H.size)
    fill(memoryview(head))
    plen, nbuf = H.unpack(head)
    lens = bytearray(Q.size * nbuf)
    fill(memoryview(lens))
    body = bytearray(plen)
    fill(memoryview(body))
    bufs = []
    for i, (n,) in enumerate(Q.iter_unpack(lens)):
        while len(SPARE) <= i:
            SPARE.append(bytearray(0))
        if len(SPARE[i]) < n:
            SPARE[i] = bytearray(n)
        view = memoryview(SPARE[i])[:n]
        fill(view)
        bufs.append(view)
    return pickle.loads(body, buffers=bufs)
def send_msg(obj):
    bufs = []
    body = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    raws = [b.raw() for b in bufs]
    s.sendall(H.pack(len(body), len(raws)) + b"".join(Q.pack(r.nbytes) for r in raws) + body)
    for r in raws:
        s.sendall(r)
while True:
    send_msg(recv_msg())
"""


class StreamChild:
    """Caller side of the pickle-5 out-of-band streaming reference."""

    def __init__(self) -> None:
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _STREAM_CHILD, str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()

    def _fill(self, view: memoryview) -> None:
        while view:
            n = self.sock.recv_into(view)
            if not n:
                raise EOFError("the stream reference child closed the channel")
            view = view[n:]

    def call(self, obj: Any) -> Any:
        bufs: list[pickle.PickleBuffer] = []
        body = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
        raws = [b.raw() for b in bufs]
        head = _HEAD.pack(len(body), len(raws)) + b"".join(_Q.pack(r.nbytes) for r in raws)
        self.sock.sendall(head + body)
        for r in raws:
            self.sock.sendall(r)
        del raws, bufs
        head_in = bytearray(_HEAD.size)
        self._fill(memoryview(head_in))
        plen, nbuf = _HEAD.unpack(head_in)
        lens = bytearray(_Q.size * nbuf)
        self._fill(memoryview(lens))
        body_in = bytearray(plen)
        self._fill(memoryview(body_in))
        received = []
        for (n,) in _Q.iter_unpack(lens):
            buf = bytearray(n)
            self._fill(memoryview(buf))
            received.append(buf)
        return pickle.loads(body_in, buffers=received)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _remote_payload(remote: Remote, n: int) -> float:
    """A peer's mean seconds per round trip over ``n`` calls, timed in its driver."""
    return float(remote.request("payload", n=n, timeout=600)["s"])


def _time_calls(call: Callable[[Any], Any], a: Any, n: int) -> float:
    """Mean seconds per round trip of ``call(a)`` over ``n`` calls (result checked, dropped)."""
    total = 0
    for _ in range(n):
        t0 = time.perf_counter_ns()
        b = call(a)
        touch_pages(b)  # the result in the caller's hands: its pages mapped in
        total += time.perf_counter_ns() - t0
        if b.nbytes != a.nbytes or b.dtype != a.dtype:
            raise RuntimeError("a method returned a different array")
        del b
    return total / n / 1e9


def _time_kept(call: Callable[[Any], Any], a: Any, kept: list[Any], n: int) -> float:
    """Like ``_time_calls``, but every result stays alive (in ``kept``, emptied by the caller
    after the size): each round trip then needs fresh memory for its result, as a program
    that collects results does."""
    total = 0
    for _ in range(n):
        t0 = time.perf_counter_ns()
        b = call(a)
        touch_pages(b)  # the result in the caller's hands: its pages mapped in
        total += time.perf_counter_ns() - t0
        if b.nbytes != a.nbytes or b.dtype != a.dtype:
            raise RuntimeError("a method returned a different array")
        kept.append(b)
    return total / n / 1e9


def run(ctx: Context) -> Section:
    import numpy as np

    import comfy_env

    section = Section("payload", "2. Payload round trip, f(a) = a (float32 numpy arrays)")
    plan = QUICK_PLAN if ctx.quick else PLAN
    rng = random.Random(ctx.seed + 2)
    failed: dict[str, str] = {}
    results: dict[int, dict[str, Series]] = {}
    with ExitStack() as stack:
        stream = StreamChild()
        stack.callback(stream.close)
        pool = comfy_env.Pool(comfy_env.PoolConfig())
        stack.callback(pool.close)
        worker = pool.get_worker(None)
        worker.call(ECHO_TARGET, 0)
        # The kept results get a worker (and a host-side process) of their own: on the shared
        # worker their loans filled the per-worker loan bound (MAX_LOANS, 70 results kept at
        # 1 MiB) and turned the dropped method's replies into copies halfway through the size.
        kept_pool = comfy_env.Pool(comfy_env.PoolConfig())
        stack.callback(kept_pool.close)
        kept_worker = kept_pool.get_worker(None)
        kept_worker.call(ECHO_TARGET, 0)
        remotes = {p: r for p in PEERS if (r := ctx.remote(p)) is not None}
        for mib, (rounds, calls) in plan.items():
            nbytes = mib * MiB
            a = np.full(nbytes // 4, 1.5, dtype=np.float32)
            dst = np.zeros_like(a)
            kept: list[Any] = []  # results of COMFY_KEPT, alive until the size is done

            def memcpy(x: Any, dst: Any = dst) -> Any:
                np.copyto(dst, x)
                return dst

            def comfy(x: Any) -> Any:
                return worker.call(ECHO_TARGET, x)

            def comfy_kept(x: Any) -> Any:
                return kept_worker.call(ECHO_TARGET, x)

            local: dict[str, Callable[[int], float]] = {
                MEMCPY: functools.partial(_time_calls, memcpy, a),
                COPY: functools.partial(_time_calls, np.copy, a),
                STREAM: functools.partial(_time_calls, stream.call, a),
                COMFY_ENV: functools.partial(_time_calls, comfy, a),
                COMFY_KEPT: functools.partial(_time_kept, comfy_kept, a, kept),
            }
            methods: dict[str, Callable[[int], float]] = dict(local)
            for name, remote in list(remotes.items()):
                try:
                    remote.request("alloc", nbytes=nbytes, timeout=120)
                except RemoteError as exc:
                    failed[name] = str(exc)
                    ctx.drop_remote(name, str(exc))
                    del remotes[name]
                    continue
                methods[name] = functools.partial(_remote_payload, remote)
            series = {name: Series() for name in methods}
            try:
                for name in list(methods):  # one warm-up call each
                    try:
                        methods[name](1)
                    except RemoteError as exc:
                        failed[name] = str(exc)
                        ctx.drop_remote(name, str(exc))
                        remotes.pop(name, None)
                        del methods[name]
                for _ in range(rounds):
                    order = list(methods)
                    rng.shuffle(order)
                    for name in order:
                        try:
                            series[name].add(methods[name](calls))
                        except RemoteError as exc:
                            failed[name] = str(exc)
                            ctx.drop_remote(name, str(exc))
                            remotes.pop(name, None)
                            del methods[name]
            finally:
                for remote in remotes.values():
                    try:
                        remote.request("free", timeout=60)
                    except RemoteError:
                        pass
                kept.clear()
                del a, dst, local, methods, kept
            results[mib] = {k: s for k, s in series.items() if s.values}

    unavailable = {p: ctx.reason(p) for p in PEERS if p not in ctx.remotes}
    unavailable.update(failed)
    section.lines.append(
        "Per size: interleaved rounds x calls per round = "
        + ", ".join(f"{m} MiB: {r} x {c}" for m, (r, c) in plan.items())
        + ". Median of the per-round mean ms per round trip; MiB/s = array size / time."
    )
    rows = (MEMCPY, COPY, STREAM, COMFY_ENV, COMFY_KEPT, *PEERS)
    for mib, res in results.items():
        unit = res[MEMCPY].median
        ref = res[STREAM].median if STREAM in res else math.nan
        ce = res[COMFY_ENV].median if COMFY_ENV in res else math.nan
        section.lines += [
            "",
            f"### {mib} MiB",
            "",
            "| method | median ms | min | max | MiB/s | x memcpy | x stream ref | x comfy_env |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in rows:
            if name in res:
                s = res[name]
                section.lines.append(
                    f"| {name} | {fmt(s.median * 1e3)} | {fmt(s.min * 1e3)} "
                    f"| {fmt(s.max * 1e3)} | {fmt(mib / s.median, 0)} "
                    f"| {fmt_x(ratio(s.median, unit))} | {fmt_x(ratio(s.median, ref))} "
                    f"| {fmt_x(ratio(s.median, ce))} |"
                )
            elif name in unavailable:
                section.lines.append(unavailable_row(name, unavailable[name], 8))
        section.data[f"{mib}MiB"] = {k: s.summary() for k, s in res.items()}
    section.data["unavailable"] = unavailable

    if results:
        top = max(results)
        res = results[top]
        ce = res[COMFY_ENV].median
        section.targets.append(
            target_at_most(
                "2",
                f"comfy_env <= {TARGET_MEMCPY:g} memcpy-equivalents at {top} MiB",
                ratio(ce, res[MEMCPY].median),
                TARGET_MEMCPY,
            )
        )
        if COMFY_KEPT in res:
            section.targets.append(
                target_at_most(
                    "2",
                    f"comfy_env with every result kept <= {TARGET_KEPT:g} memcpy-equivalents at "
                    f"{top} MiB",
                    ratio(res[COMFY_KEPT].median, res[MEMCPY].median),
                    TARGET_KEPT,
                )
            )
        for mib in (16, 64):
            if mib in results and COMFY_ENV in results[mib]:
                section.targets.append(
                    target_at_most(
                        "2",
                        f"comfy_env <= {TARGET_MID:g} memcpy-equivalents at {mib} MiB",
                        ratio(results[mib][COMFY_ENV].median, results[mib][MEMCPY].median),
                        TARGET_MID,
                    )
                )
        peer_times = {p: res[p].median for p in PEERS if p in res}
        if peer_times:
            best = min(peer_times, key=peer_times.__getitem__)
            section.targets.append(
                target_at_least(
                    "2",
                    f"comfy_env >= {TARGET_VS_PEERS:g}x faster than the best peer ({best}) "
                    f"at {top} MiB",
                    ratio(peer_times[best], ce),
                    TARGET_VS_PEERS,
                )
            )
        per_size = {m: ratio(r[COMFY_ENV].median, r[STREAM].median) for m, r in results.items()}
        worst = max(per_size.values())
        t = target_at_most("2", "comfy_env never slower than the stream reference", worst, 1.0)
        t.detail = (
            "comfy_env / stream reference: "
            + ", ".join(f"{m} MiB {v:.2f}x" for m, v in per_size.items())
            + f"; worst {worst:.2f}x"
        )
        section.targets.append(t)
    _mesh(ctx, section, rng)
    return section


MESH_CASES = {
    "comfy_env (default)": {},
    "shared_memory=False": {"shared_memory": False},
    "all inline (threshold 1 GiB)": {"shm_threshold_bytes": 1 << 30},
}


def _time_mesh(worker: Any, mesh: tuple[Any, Any], n: int) -> float:
    total = 0
    for _ in range(n):
        t0 = time.perf_counter_ns()
        verts, faces = worker.call(ECHO_TARGET, mesh)
        total += time.perf_counter_ns() - t0
        if verts.nbytes != mesh[0].nbytes or faces.nbytes != mesh[1].nbytes:
            raise RuntimeError("the mesh came back different")
        del verts, faces
    return total / n / 1e9


def _mesh(ctx: Context, section: Section, rng: random.Random) -> None:
    """A mesh: 0.6 MB of float32 vertices and 1.2 MB of int32 faces in one call, under the
    default (per-message) path and both pure paths, interleaved."""
    import numpy as np

    import comfy_env

    verts = np.random.default_rng(ctx.seed).random((50_000, 3)).astype(np.float32)
    faces = np.random.default_rng(ctx.seed).integers(0, 50_000, (100_000, 3)).astype(np.int32)
    mesh = (verts, faces)
    rounds, calls = (2, 5) if ctx.quick else (9, 30)
    series = {name: Series() for name in MESH_CASES}
    with ExitStack() as stack:
        workers = {}
        for name, overrides in MESH_CASES.items():
            pool = comfy_env.Pool(comfy_env.PoolConfig(**overrides))
            stack.callback(pool.close)
            workers[name] = pool.get_worker(None)
            _time_mesh(workers[name], mesh, 5)  # warm-up
        for _ in range(rounds):
            order = list(workers)
            rng.shuffle(order)
            for name in order:
                series[name].add(_time_mesh(workers[name], mesh, calls))
    section.lines += [
        "",
        "### mesh: 0.6 MB vertices + 1.2 MB faces in one call",
        "",
        f"{rounds} interleaved rounds x {calls} calls.",
        "",
        "| path | median ms | min | max |",
        "|---|---:|---:|---:|",
    ]
    for name, ser in series.items():
        section.lines.append(
            f"| {name} | {fmt(ser.median * 1e3)} | {fmt(ser.min * 1e3)} | {fmt(ser.max * 1e3)} |"
        )
    section.data["mesh"] = {k: v.summary() for k, v in series.items()}
    default = series["comfy_env (default)"].median
    pure = min(v.median for k, v in series.items() if k != "comfy_env (default)")
    section.targets.append(
        target_at_most(
            "12",
            "mesh: the default path is not slower than either pure path (5% noise allowance)",
            ratio(default, pure),
            1.05,
        )
    )
