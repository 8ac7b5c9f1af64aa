"""Measurement 1: warm small-call round trip, comfy_env against raw IPC and the peers.

What is measured
----------------
The round trip of ``f(x) = x`` for a small int ``x``, from the caller to a long-lived worker
process and back, after every worker is started and warmed up:

``raw pipe``
    Reference floor. A child ``python -c`` (this interpreter) joined by two ``os.pipe()``; each
    message is an 8-byte length plus a protocol-5 pickle; the child loads and re-dumps it.
``raw socketpair``
    The same over one ``AF_UNIX`` socketpair, both directions.
``raw socketpairs``
    The same over two socketpairs, one per direction: comfy_env's own transport. (On one
    socketpair a side asleep in ``recv`` is woken whenever the peer reads what it sent: about
    one context switch more a call on one CPU.)
``raw socketpair, polling``
    The socketpair with both ends polling for up to 100 us before they block, under the same
    rule as comfy_env's default ``PoolConfig.spin_wait`` (not while both are pinned to one
    CPU). The targets stay against the blocking raw pipe; this row shows what comfy_env's own
    work costs once both wait the same way.
``minimal host, comfy_env worker``
    A hand-written host on a worker of comfy_env's own (a second pool's): it writes the CALL
    frame straight on the worker's channel and reads the REPLY_OK (blocking ``recv``, no
    polling), with none of the pool's work (no gate, lease, deadline, stats, idle-channel
    check, log frames). What any host-side trim can reach with this worker and transport; the
    gap to the raw socketpairs is the worker's own work.
``minimal host, minimal worker``
    The protocol's own floor: the same minimal host on a hand-written worker (``python -c``,
    two socketpairs) that speaks comfy_env's frames and nothing else: it reads a CALL frame
    (the 20-byte header, then the pickled ``(target, args, kwargs)``), looks the target up in
    a dict of resolved functions, calls it and writes a REPLY_OK frame; no lifecycle, no
    shared memory, no log frames, no cancellation, no threads. What comfy_env's wire format
    costs over the raw references when neither end does anything else; the gap from here to
    ``minimal host, comfy_env worker`` is the worker's own work.
``comfy_env``
    ``pool.get_worker(None).call("comfy_env_worker.tasks:echo", x)``: the real protocol, target
    lookup and the pool's bookkeeping.
``comfy_env acall``
    ``await worker.acall(...)`` of comfy_env's worker, awaited one after another in a coroutine
    on an asyncio loop this process keeps (the loop's turns are inside the timed region).
peers
    ``ProcessPoolExecutor(max_workers=1)``, ``multiprocessing.Pool(1).apply``, loky's reusable
    executor, ``pebble.ProcessPool``, ``anyio.to_process.run_sync`` (awaited in anyio's own
    event loop) and comfy-env 0.4.46's ``SubprocessWorker.call_module``. Each runs in a driver
    process under its own venv's interpreter (``driver.py``); the driver is the caller and times
    its own batch, so the suite's control messages are outside the timed region.

Fairness
--------
* Interleaved rounds: each round times one batch per method, in an order shuffled per round
  (seeded); per method the median of the per-round means is reported with min and max.
* Batches are sized per method from a warm-up (about 0.1 s each, at most ``--batch`` calls) so
  slow peers do not dominate the run time; a mean per call does not depend on the batch size.
* Placement: every thread of each caller (this process, or the peer's driver) and of its
  workers is pinned with ``os.sched_setaffinity``: all on one CPU ("same CPU", every hop is a
  context switch), then callers on one CPU and workers on another ("different CPUs", every hop
  a cross-CPU wake-up). A warm-up batch follows each change of placement. Idle drivers of
  other methods are pinned too but sleep in ``read``.
* A new worker every round for the methods whose caller is this process (the raw references,
  the minimal host, comfy_env; ``acall`` uses comfy_env's): a fresh process (started, pinned
  and warmed up untimed before its batch). On this VM the speed of a
  caller-worker pair on one CPU depends on where the two processes' code and data landed
  (address-space randomisation: up to 1.5x for a pair's whole life, HISTORY.md, eleventh
  round), so one pair per method would make a run's ratios one draw of that luck; a new pair
  per round makes the median a median over layouts. The peers' drivers keep their workers.
* A new comfy_env pool (``comfy_env``, the minimal host's) starts its host watcher 50 ms after
  its first worker is ready: a Python interpreter's start-up, run on the caller's CPU. Each
  renewal waits for it to sleep in its read (``benchlib.settle_pool``) before the warm-up and
  the timed batch. Until the seventeenth round it did not, and on one CPU that start-up shared
  the CPU with the first batch after the renewal: comfy_env's wall time per call ran 10-34 us
  over the sum of its caller's and worker's on-CPU times, where every other row's matched.
* The raw references echo the bare object; every other method pays for its own envelope. That
  overhead is exactly what the comparison exposes.

Standalone: ``python benchmarks/bench_small_call.py [--rounds N] [--batch N] [--quick]
[--json PATH]`` (uses the peer venvs if ``run_all.py`` installed them; never installs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from benchlib import (
    Context,
    RawChild,
    RemoteError,
    Section,
    Series,
    fmt,
    fmt_x,
    machine_info,
    pin_process,
    pin_self,
    process_cpu_ns,
    ratio,
    settle_pool,
    target_at_most,
    target_faster_than,
    unavailable_row,
)

RAW_PIPE = "raw pipe"
RAW_SOCKETPAIR = "raw socketpair"
RAW_SOCKETPAIRS = "raw socketpairs"
RAW_SOCKETPAIR_POLLING = "raw socketpair, polling"
MINIMAL_HOST = "minimal host, comfy_env worker"
MINIMAL_BOTH = "minimal host, minimal worker"
COMFY_ENV = "comfy_env"
COMFY_ENV_ACALL = "comfy_env acall"
REFERENCES = (
    RAW_PIPE,
    RAW_SOCKETPAIR,
    RAW_SOCKETPAIRS,
    RAW_SOCKETPAIR_POLLING,
    MINIMAL_BOTH,
    MINIMAL_HOST,
)
PEERS = (
    "ProcessPoolExecutor",
    "multiprocessing.Pool",
    "loky",
    "pebble",
    "anyio.to_process",
    "comfy-env 0.4.46",
)
ECHO_TARGET = "comfy_env_worker.tasks:echo"

TARGET_SAME_CPU = 1.5  # comfy_env <= 1.5x raw pipe, caller and worker on one CPU
TARGET_CROSS_CPU = 1.2  # comfy_env <= 1.2x raw pipe, caller and worker on different CPUs
TARGET_ACALL = 1.5  # comfy_env acall <= 1.5x comfy_env call (issue 12)


@dataclass
class Method:
    name: str
    batch: Callable[[int], float]  # n calls -> mean microseconds per call
    pin: Callable[[set[int], set[int]], None]  # (caller CPUs, worker CPUs)
    n: int = 0  # calls per batch, from the warm-up
    # On-CPU us/call of the caller process and of the worker in the last batch (local
    # methods only: from the kernel's schedstat, see ``benchlib.process_cpu_ns``).
    cpu: tuple[float, float] | None = None
    # Local methods: replace the worker process with a new one, pinned as the old one was
    # (a new address layout each round; see the module docstring, "Fairness").
    renew: Callable[[], None] | None = None


# A local method's worker side, as its ``start`` makes it: the call, the worker's pids, and
# how to stop it.
Started = tuple[Callable[[int], Any], list[int], Callable[[], None]]


def _local(name: str, start: Callable[[], Started], stack: ExitStack) -> Method:
    """A method whose caller is this process: ``start`` makes its worker side (again for
    every round after the first, see ``Method.renew``)."""
    me = os.getpid()
    current: list[Started] = [start()]
    stack.callback(lambda: current[0][2]())
    placement: list[tuple[set[int], set[int]]] = []

    def batch(n: int) -> float:
        call, worker_pids, _ = current[0]
        h0 = process_cpu_ns(me)
        w0 = sum(process_cpu_ns(pid) for pid in worker_pids)
        t0 = time.perf_counter_ns()
        for i in range(n):
            call(i)
        t1 = time.perf_counter_ns()
        host = (process_cpu_ns(me) - h0) / n / 1000.0
        method.cpu = (host, (sum(process_cpu_ns(pid) for pid in worker_pids) - w0) / n / 1000.0)
        return (t1 - t0) / n / 1000.0

    def pin(caller: set[int], workers: set[int]) -> None:
        placement[:] = [(caller, workers)]
        pin_self(caller)
        for pid in current[0][1]:
            pin_process(pid, workers)

    def renew() -> None:
        current[0][2]()
        current[0] = start()
        if placement:
            pin(*placement[0])

    method = Method(name, batch, pin, renew=renew)
    return method


def _raw(mode: str) -> Callable[[], Started]:
    def start() -> Started:
        child = RawChild(mode)
        return child.call, [child.pid], child.close

    return start


def _comfy_env_worker(pool: Any) -> Any:
    """A warm worker of ``pool`` (the current interpreter), checked."""
    worker = pool.get_worker(None)
    if worker.call(ECHO_TARGET, 12345) != 12345:
        raise RuntimeError("comfy_env did not echo its argument")
    if worker.pid is None:
        raise RuntimeError("comfy_env worker has no pid after its first call")
    return worker


def _remote(ctx: Context, name: str) -> Method | None:
    remote = ctx.remote(name)
    if remote is None:
        return None
    driver = remote.pid

    def batch(n: int) -> float:
        return float(remote.request("small", n=n, timeout=120)["us"])

    def pin(caller: set[int], workers: set[int]) -> None:
        pin_process(driver, workers, tree=True)  # its workers and helper processes
        pin_process(driver, caller, tree=False)  # the driver (the caller) and its threads

    return Method(name, batch, pin)


class MinimalHost:
    """The caller side of ``minimal host, comfy_env worker``: CALL frames written straight on
    the channel of a comfy_env worker (``pool``'s, warm), its REPLY_OK read back; nothing
    else. Reaches into the pool for the channel socket: a benchmark's view, not an API."""

    def __init__(self, pool: Any) -> None:
        worker = pool.get_worker(None)
        if worker.call(ECHO_TARGET, 12345) != 12345:
            raise RuntimeError("comfy_env did not echo its argument")
        process = pool._entries[worker.env].slots[0].process
        self._channel(process.sock, process.reply_sock, worker.pid)  # requests, replies

    def _channel(self, requests: socket.socket, replies: socket.socket, pid: int) -> None:
        self.sock = requests
        self.replies = replies
        self.pid: int = pid
        self._call_id = 1 << 40  # far from the pool's own call ids
        self._buf = bytearray(1 << 16)
        self._view = memoryview(self._buf)

    def call(self, x: Any) -> Any:
        from comfy_env_worker.protocol import HEADER, HEADER_SIZE, MAGIC, FrameType

        self._call_id += 1
        body = pickle.dumps((ECHO_TARGET, (x,), {}), 5)
        self.sock.sendall(HEADER.pack(MAGIC, FrameType.CALL, 0, len(body), self._call_id) + body)
        got = 0
        while got < HEADER_SIZE or got < HEADER_SIZE + HEADER.unpack_from(self._buf)[3]:
            try:
                n = self.replies.recv_into(self._view[got:])
            except BlockingIOError:  # (the channel's receive timeout: a stalled machine)
                continue
            if not n:
                raise RuntimeError("the worker closed its channel")
            got += n
        _magic, ftype, _flags, length, call_id = HEADER.unpack_from(self._buf)
        if ftype != FrameType.REPLY_OK or call_id != self._call_id:
            raise RuntimeError(f"unexpected frame {ftype} for call {call_id}")
        return pickle.loads(self._view[HEADER_SIZE : HEADER_SIZE + length])


# The worker side of ``minimal host, minimal worker``. argv: requests fd, replies fd, header
# format, header size, REPLY_OK's frame type. Blocking reads, one frame in flight at a time.
_MINIMAL_WORKER = r"""
import importlib, pickle, socket, struct, sys
requests = socket.socket(fileno=int(sys.argv[1]))
replies = socket.socket(fileno=int(sys.argv[2]))
H, size, reply_ok = struct.Struct(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
functions = {}
buf = bytearray(1 << 16)
mv = memoryview(buf)
while True:
    got = 0
    while got < size or got < size + H.unpack_from(buf)[3]:
        n = requests.recv_into(mv[got:])
        if not n:
            sys.exit(0)
        got += n
    magic, _ftype, _flags, length, call_id = H.unpack_from(buf)
    target, args, kwargs = pickle.loads(mv[size : size + length])
    fn = functions.get(target)
    if fn is None:
        module, _, name = target.partition(":")
        fn = functions[target] = getattr(importlib.import_module(module), name)
    body = pickle.dumps(fn(*args, **kwargs), 5)
    replies.sendall(H.pack(magic, reply_ok, 0, len(body), call_id) + body)
"""


class MinimalWorker(MinimalHost):
    """``minimal host, minimal worker``: the minimal host's frames on ``_MINIMAL_WORKER``, a
    child of this interpreter that can import ``comfy_env_worker`` (for the echo target)."""

    def __init__(self) -> None:
        from comfy_env_worker.protocol import HEADER, HEADER_SIZE, FrameType

        requests, child_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        replies, child_out = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        worker_dir = os.path.dirname(os.path.dirname(_worker_package_file()))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (worker_dir, env.get("PYTHONPATH", "")) if p)
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _MINIMAL_WORKER,
                    str(child_in.fileno()),
                    str(child_out.fileno()),
                    HEADER.format,
                    str(HEADER_SIZE),
                    str(int(FrameType.REPLY_OK)),
                ],
                pass_fds=(child_in.fileno(), child_out.fileno()),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        finally:
            child_in.close()
            child_out.close()
        self._channel(requests, replies, self.proc.pid)
        if self.call(12345) != 12345:
            self.close()
            raise RuntimeError("the minimal worker did not echo its argument")

    def close(self) -> None:
        self.sock.close()
        self.replies.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _worker_package_file() -> str:
    import comfy_env_worker

    return str(comfy_env_worker.__file__)


def start_methods(ctx: Context, stack: ExitStack) -> list[Method]:
    import asyncio

    import comfy_env

    methods = [
        _local(RAW_PIPE, _raw("pipe"), stack),
        _local(RAW_SOCKETPAIR, _raw("sock"), stack),
        _local(RAW_SOCKETPAIRS, _raw("sock2"), stack),
        _local(RAW_SOCKETPAIR_POLLING, _raw("sockpoll"), stack),
    ]

    def minimal_host() -> Started:
        pool = comfy_env.Pool(comfy_env.PoolConfig())
        minimal = MinimalHost(pool)
        settle_pool(pool)
        return minimal.call, [minimal.pid], pool.close

    methods.append(_local(MINIMAL_HOST, minimal_host, stack))

    def minimal_both() -> Started:
        minimal = MinimalWorker()
        return minimal.call, [minimal.pid], minimal.close

    methods.append(_local(MINIMAL_BOTH, minimal_both, stack))

    # ``acall`` runs on comfy_env's current worker, made anew with it each round: the two
    # are compared on one pair (their ratio is issue 12's target), never across layouts.
    ce_worker: list[Any] = []

    def comfy_env_call() -> Started:
        pool = comfy_env.Pool(comfy_env.PoolConfig())
        worker = _comfy_env_worker(pool)
        settle_pool(pool)
        ce_worker[:] = [worker]
        return (lambda x: worker.call(ECHO_TARGET, x)), [worker.pid], pool.close

    ce = _local(COMFY_ENV, comfy_env_call, stack)
    methods.append(ce)

    # The same calls awaited one after another in a coroutine on an asyncio loop this
    # process keeps (its turns are inside the timed region).
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    me = os.getpid()

    def acall_batch(n: int) -> float:
        worker = ce_worker[0]

        async def batch() -> float:
            t0 = time.perf_counter_ns()
            for i in range(n):
                await worker.acall(ECHO_TARGET, i)
            return (time.perf_counter_ns() - t0) / n / 1000.0

        h0, w0 = process_cpu_ns(me), process_cpu_ns(worker.pid)
        us = loop.run_until_complete(batch())
        acall.cpu = (
            (process_cpu_ns(me) - h0) / n / 1000.0,
            (process_cpu_ns(worker.pid) - w0) / n / 1000.0,
        )
        return us

    acall = Method(COMFY_ENV_ACALL, acall_batch, ce.pin)
    methods.append(acall)
    for name in PEERS:
        method = _remote(ctx, name)
        if method is not None:
            methods.append(method)
    return methods


def batch_seconds(ctx: Context) -> float:
    """About how long one method's batch should take."""
    return 0.01 if ctx.quick else 0.1


def calibrate(methods: list[Method], ctx: Context, max_batch: int) -> None:
    """Warm every method and size its batch to about ``batch_seconds`` seconds."""
    target = batch_seconds(ctx)
    for m in methods:
        us = m.batch(10 if ctx.quick else 50)
        m.n = int(min(max_batch, max(5, target * 1e6 / max(us, 1.0))))


def warm_up(m: Method, ctx: Context) -> None:
    """Untimed calls after a change of placement or worker, for long enough that both ends
    have looked at where they may run (``FrameReader.spin_wait``: every ``SPIN_RECHECK``
    seconds at most) and poll, or not, as they will for the rest of the run. Without it a
    pair just pinned to one CPU went on polling for up to 50 ms of its first batch."""
    from comfy_env_worker.protocol import SPIN_RECHECK

    end = time.monotonic() + (0.0 if ctx.quick else 2 * SPIN_RECHECK)
    m.batch(max(5, m.n // 4))
    while time.monotonic() < end:
        m.batch(max(5, m.n // 4))


def run_placement(
    ctx: Context,
    methods: list[Method],
    caller: set[int],
    workers: set[int],
    rounds: int,
    rng: random.Random,
    failed: dict[str, str],
) -> dict[str, Series]:
    for m in methods:
        m.pin(caller, workers)
    results = {m.name: Series() for m in methods}
    host_cpu = {m.name: Series() for m in methods}
    worker_cpu = {m.name: Series() for m in methods}
    live = list(methods)
    for m in list(live):
        try:
            warm_up(m, ctx)  # on the new placement
        except RemoteError as exc:
            failed[m.name] = str(exc)
            ctx.drop_remote(m.name, str(exc))
            live.remove(m)
    for round_ in range(rounds):
        order = list(live)
        rng.shuffle(order)
        for m in order:
            try:
                if round_ and m.renew is not None:
                    m.renew()  # a new worker (and layout) for this round, pinned as before
                    warm_up(m, ctx)
                results[m.name].add(m.batch(m.n))
                if m.cpu is not None:
                    host_cpu[m.name].add(m.cpu[0])
                    worker_cpu[m.name].add(m.cpu[1])
            except RemoteError as exc:
                failed[m.name] = str(exc)
                ctx.drop_remote(m.name, str(exc))
                live.remove(m)
    for name, series in host_cpu.items():
        if series.values:
            results[f"{name} {CPU_HOST}"] = series
            results[f"{name} {CPU_WORKER}"] = worker_cpu[name]
    return {name: s for name, s in results.items() if s.values}


CPU_HOST = "host cpu"
CPU_WORKER = "worker cpu"


def table(results: dict[str, Series], unavailable: dict[str, str]) -> list[str]:
    raw = results[RAW_PIPE].median if RAW_PIPE in results else math.nan
    ce = results[COMFY_ENV].median if COMFY_ENV in results else math.nan
    lines = [
        "| method | median us/call | min | max | x raw pipe | x comfy_env "
        "| caller on-CPU us/call (min-max) | worker on-CPU us/call (min-max) | on-CPU sum |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in (*REFERENCES, COMFY_ENV, COMFY_ENV_ACALL, *PEERS):
        if name in results:
            s = results[name]
            host = results.get(f"{name} {CPU_HOST}")
            worker = results.get(f"{name} {CPU_WORKER}")
            if host is not None and worker is not None:
                cpu = (
                    f"| {fmt(host.median, 1)} ({fmt(host.min, 1)}-{fmt(host.max, 1)}) "
                    f"| {fmt(worker.median, 1)} ({fmt(worker.min, 1)}-{fmt(worker.max, 1)}) "
                    f"| {fmt(host.median + worker.median, 1)} |"
                )
            else:
                cpu = "| - | - | - |"
            lines.append(
                f"| {name} | {fmt(s.median, 1)} | {fmt(s.min, 1)} | {fmt(s.max, 1)} "
                f"| {fmt_x(ratio(s.median, raw))} | {fmt_x(ratio(s.median, ce))} {cpu}"
            )
        elif name in unavailable:
            lines.append(unavailable_row(name, unavailable[name], 9))
    return lines


def run(ctx: Context, rounds: int | None = None, max_batch: int | None = None) -> Section:
    section = Section("small_call", "1. Warm small call, f(x) = x")
    rounds = rounds or (2 if ctx.quick else 9)
    max_batch = max_batch or (50 if ctx.quick else 2000)
    original = os.sched_getaffinity(0)
    usable = sorted(original)
    plans: dict[str, tuple[set[int], set[int]] | None] = {
        "same CPU": ({usable[0]}, {usable[0]}),
        "different CPUs": ({usable[0]}, {usable[1]}) if len(usable) > 1 else None,
    }
    rng = random.Random(ctx.seed)
    failed: dict[str, str] = {}
    placements: dict[str, dict[str, Series]] = {}
    with ExitStack() as stack:
        methods = start_methods(ctx, stack)
        try:
            calibrate(methods, ctx, max_batch)
            for label, plan in plans.items():
                if plan is None:
                    continue
                caller, workers = plan
                placements[label] = run_placement(
                    ctx, methods, caller, workers, rounds, rng, failed
                )
        finally:
            pin_self(original)
            for m in methods:
                m.pin(original, original)
    unavailable = {p: ctx.reason(p) for p in PEERS if p not in ctx.remotes}
    unavailable.update(failed)
    section.lines += [
        f"{rounds} interleaved rounds per placement; per method one batch per round, sized from "
        f"a warm-up to about {batch_seconds(ctx):g} s (at most {max_batch} calls): "
        + ", ".join(f"{m.name} {m.n}" for m in methods)
        + ". Each figure is the median of the per-round mean us/call; min/max are the "
        "fastest and slowest round.",
    ]
    section.data = {"rounds": rounds, "batches": {m.name: m.n for m in methods}}
    limits = {"same CPU": TARGET_SAME_CPU, "different CPUs": TARGET_CROSS_CPU}
    for label, plan in plans.items():
        section.lines += ["", f"### {label}", ""]
        if plan is None:
            section.lines.append("Skipped: only one usable CPU.")
            continue
        caller, workers = plan
        results = placements[label]
        section.lines.append(f"caller CPUs {sorted(caller)}, worker CPUs {sorted(workers)}")
        section.lines += ["", *table(results, unavailable)]
        section.data[label] = {name: s.summary() for name, s in results.items()}
        ce = results[COMFY_ENV].median
        cpu_sums = {
            name: results[f"{name} {CPU_HOST}"].median + results[f"{name} {CPU_WORKER}"].median
            for name in (*REFERENCES, COMFY_ENV, COMFY_ENV_ACALL)
            if f"{name} {CPU_HOST}" in results
        }
        if COMFY_ENV in cpu_sums and RAW_PIPE in cpu_sums:
            section.lines += [
                "",
                f"On-CPU time (caller + worker, medians): comfy_env {fmt(cpu_sums[COMFY_ENV], 1)} "
                f"us/call = {fmt_x(ratio(cpu_sums[COMFY_ENV], cpu_sums[RAW_PIPE]))} the raw "
                f"pipe's {fmt(cpu_sums[RAW_PIPE], 1)} us/call (the caller column counts every "
                "thread of the calling process).",
            ]
        if COMFY_ENV in cpu_sums and COMFY_ENV_ACALL in cpu_sums:
            section.lines += [
                "",
                f"On-CPU time of comfy_env acall: {fmt(cpu_sums[COMFY_ENV_ACALL], 1)} us/call = "
                f"{fmt_x(ratio(cpu_sums[COMFY_ENV_ACALL], cpu_sums[COMFY_ENV]))} the sync "
                "call's (caller + worker, medians).",
            ]
        section.lines += [
            "",
            f"comfy_env vs its own transport (raw socketpairs, one per direction): "
            f"{fmt_x(ratio(ce, results[RAW_SOCKETPAIRS].median))}; raw socketpairs vs raw pipe: "
            f"{fmt_x(ratio(results[RAW_SOCKETPAIRS].median, results[RAW_PIPE].median))}; "
            f"one raw socketpair vs raw pipe: "
            f"{fmt_x(ratio(results[RAW_SOCKETPAIR].median, results[RAW_PIPE].median))}; "
            f"comfy_env vs the polling raw socketpair (both ends poll as comfy_env does): "
            f"{fmt_x(ratio(ce, results[RAW_SOCKETPAIR_POLLING].median))}.",
        ]
        if MINIMAL_HOST in results:
            floor = results[MINIMAL_HOST].median
            line = (
                f"A minimal host on comfy_env's own worker: "
                f"{fmt_x(ratio(floor, results[RAW_PIPE].median))} the raw pipe "
                f"({fmt_x(ratio(floor, results[RAW_SOCKETPAIRS].median))} the raw socketpairs); "
                f"comfy_env is {fmt_x(ratio(ce, floor))} it."
            )
            if label == "same CPU":
                line += (
                    " Here nothing polls, so no host-side work alone can bring comfy_env below "
                    "that: the rest is the worker's own work and the transport."
                )
            else:
                line += " (It blocks in recv where comfy_env polls: not a floor here.)"
            section.lines += ["", line]
        if MINIMAL_BOTH in results:
            frames = results[MINIMAL_BOTH].median
            raw = results[RAW_PIPE].median
            line = (
                f"The frames alone (a minimal host and a minimal worker speaking comfy_env's "
                f"frame format, nothing else at either end): {fmt_x(ratio(frames, raw))} the "
                f"raw pipe; comfy_env is {fmt_x(ratio(ce, frames))} them"
            )
            if MINIMAL_HOST in results:
                line += (
                    f", and comfy_env's worker under the minimal host "
                    f"{fmt_x(ratio(results[MINIMAL_HOST].median, frames))}"
                )
            line += "."
            if label == "same CPU":
                budget = limits[label] * raw - frames
                line += (
                    f" Under the {limits[label]}x target ({fmt(limits[label] * raw, 1)} "
                    f"us/call) that leaves {fmt(budget, 1)} us/call for everything the host "
                    "and the worker do beyond the frames themselves."
                )
            else:
                line += " (Both block in recv where comfy_env polls: not a floor here.)"
            section.lines += ["", line]
        section.targets.append(
            target_at_most(
                "1",
                f"comfy_env <= {limits[label]}x raw pipe ({label})",
                ratio(ce, results[RAW_PIPE].median),
                limits[label],
            )
        )
        if COMFY_ENV_ACALL in results:
            section.targets.append(
                target_at_most(
                    "12",
                    f"comfy_env acall <= {TARGET_ACALL}x comfy_env call ({label})",
                    ratio(results[COMFY_ENV_ACALL].median, ce),
                    TARGET_ACALL,
                )
            )
        section.targets.append(
            target_faster_than(
                "1",
                f"comfy_env faster than every peer ({label})",
                ce,
                {p: results[p].median for p in PEERS if p in results},
                "us",
            )
        )
    section.data["unavailable"] = unavailable
    return section


def main(argv: list[str] | None = None) -> int:
    import peers

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7)")
    ap.add_argument("--batch", type=int, default=None, help="most calls per batch (2000)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffle")
    ap.add_argument("--json", metavar="PATH", help="also write results as JSON to PATH")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="comfy-env-bench-") as workdir:
        pythons, notes = peers.setup(install=False, reinstall=False, cwd=workdir)
        ctx = Context(args.quick, args.seed, workdir, pythons)
        ctx.venv_reasons = {k: notes[k] for k, v in pythons.items() if v is None}
        try:
            section = run(ctx, args.rounds, args.batch)
        finally:
            ctx.close_remotes()
    print(section.markdown())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "small_call": section.data}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
