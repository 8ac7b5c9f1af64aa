"""Warm small-call round trip: comfy_env against raw IPC and the stdlib process pools.

What is measured
----------------
The round trip of ``f(x) = x`` for a small int ``x``, from the caller to a long-lived worker
process and back, after every worker is started and warmed up. Methods, all run in one process
and one run so they see the same machine:

``raw pipe``
    Reference floor. A child ``python -c`` (this interpreter) joined by two ``os.pipe()``; each
    message is an 8-byte little-endian length followed by a pickle (protocol 5). The child
    ``pickle.loads`` the payload and ``pickle.dumps`` it back. Both sides read into a
    preallocated buffer and send each message with one ``write``.
``raw socketpair``
    The same, over one ``AF_UNIX`` stream socketpair (the transport comfy_env itself uses).
``comfy_env``
    ``worker.call("comfy_env_worker.tasks:echo", x)`` on a ``Pool(PoolConfig())`` worker for the
    current interpreter. This carries the real protocol: a 20-byte frame header, the pickled
    ``(target, args, kwargs)`` request, target lookup and the pool's bookkeeping.
``ProcessPoolExecutor``
    ``concurrent.futures.ProcessPoolExecutor(max_workers=1)``, ``ex.submit(echo, x).result()``.
``multiprocessing.Pool``
    ``multiprocessing.Pool(1).apply(echo, (x,))``.

Both stdlib pools use the platform's default start method (``fork`` on Linux up to Python
3.13, ``forkserver`` from 3.14); the start method only affects start-up, which is not timed,
and it is reported in the output. ``echo`` is a module-level function so it pickles by name.

Fairness
--------
* Interleaved rounds: each round times every method for one fixed batch of calls, in an order
  shuffled per round (seeded), so drift of the machine (frequency, noisy neighbours) lands on
  every method alike. Per method the median of the per-round means is reported, with the
  minimum and maximum as the spread.
* Warm: each method gets a warm-up batch after its workers start and again after every change
  of CPU placement; no start-up cost is timed.
* Placement: every thread of the caller and of each worker process is pinned with
  ``os.sched_setaffinity``: all on one CPU ("same CPU", every hop is a context switch), then
  the caller on one CPU and the workers on another ("different CPUs", every hop is a cross-CPU
  wake-up). Affinity of the caller is restored at the end. With one usable CPU the second
  placement is skipped. The comfy_env worker runs in its own process group; that does not
  affect pinning, which is by thread id.
* The raw references echo the bare object; every other method also pays for its own request
  envelope. That overhead is exactly what the comparison is meant to expose.

Usage: ``python benchmarks/bench_small_call.py [--rounds N] [--batch N] [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import multiprocessing.pool
import os
import pickle
import platform
import random
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

RAW_PIPE = "raw pipe"
RAW_SOCKETPAIR = "raw socketpair"
COMFY_ENV = "comfy_env"
PPE = "ProcessPoolExecutor"
MP_POOL = "multiprocessing.Pool"
METHOD_ORDER = (RAW_PIPE, RAW_SOCKETPAIR, COMFY_ENV, PPE, MP_POOL)

# Targets from the issue: reported, never asserted.
TARGET_VS_RAW = 1.5  # comfy_env median <= 1.5x the raw pipe median
TARGET_VS_PPE = 3.0  # ProcessPoolExecutor median >= 3x the comfy_env median

ECHO_TARGET = "comfy_env_worker.tasks:echo"


def echo(value: Any) -> Any:
    """The stdlib pools' target (module level, so it pickles by reference)."""
    return value


# --------------------------------------------------------------------------- raw reference

_LEN = struct.Struct("<Q")

# The child side of the raw references. argv: mode ("pipe" | "sock"), read fd, write fd.
_RAW_CHILD = r"""
import os, pickle, socket, struct, sys
mode, rfd, wfd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
L = struct.Struct("<Q")
buf = bytearray(1 << 16)
mv = memoryview(buf)
if mode == "sock":
    s = socket.socket(fileno=rfd)
    recv_into = s.recv_into
    send = s.sendall
else:
    def recv_into(m):
        return os.readv(rfd, [m])
    def send(b):
        v = memoryview(b)
        while v:
            v = v[os.write(wfd, v):]
while True:
    got = 0
    need = L.size
    while got < need:
        n = recv_into(mv[got:])
        if not n:
            sys.exit(0)
        got += n
        if got >= L.size:
            need = L.size + L.unpack_from(buf)[0]
            if need > len(buf):
                buf.extend(bytes(need - len(buf)))
                mv = memoryview(buf)
    out = pickle.dumps(pickle.loads(mv[L.size:need]), protocol=5)
    send(L.pack(len(out)) + out)
"""


class RawChild:
    """Caller side of the raw length-prefixed pickle ping-pong (over pipes or a socketpair)."""

    def __init__(self, mode: str) -> None:
        self._buf = bytearray(1 << 16)
        self._mv = memoryview(self._buf)
        self._sock: socket.socket | None = None
        if mode == "sock":
            self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            fds = (child.fileno(), child.fileno())
            self._close_after_spawn = [child]
            self._recv_into: Callable[[memoryview], int] = self._sock.recv_into
            self._fds: list[int] = []
        else:
            c2p_r, c2p_w = os.pipe()
            p2c_r, p2c_w = os.pipe()
            fds = (p2c_r, c2p_w)
            self._rfd, self._wfd = c2p_r, p2c_w
            self._fds = [c2p_r, p2c_w]
            self._close_after_spawn = []
            self._recv_into = self._read_pipe
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _RAW_CHILD, mode, str(fds[0]), str(fds[1])],
            pass_fds=tuple(set(fds)),
            stdin=subprocess.DEVNULL,
        )
        for s in self._close_after_spawn:
            s.close()
        if mode != "sock":
            os.close(p2c_r)
            os.close(c2p_w)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_pipe(self, view: memoryview) -> int:
        return os.readv(self._rfd, [view])

    def _send(self, data: bytes) -> None:
        if self._sock is not None:
            self._sock.sendall(data)
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._wfd, view) :]

    def call(self, obj: Any) -> Any:
        payload = pickle.dumps(obj, protocol=5)
        self._send(_LEN.pack(len(payload)) + payload)
        buf, mv, got, need = self._buf, self._mv, 0, _LEN.size
        while got < need:
            n = self._recv_into(mv[got:])
            if not n:
                raise EOFError("raw child closed the channel")
            got += n
            if got >= _LEN.size:
                need = _LEN.size + _LEN.unpack_from(buf)[0]
                if need > len(buf):
                    buf.extend(bytes(need - len(buf)))
                    self._mv = mv = memoryview(buf)
        return pickle.loads(mv[_LEN.size : need])

    def close(self) -> None:
        """EOF makes the child exit; kill it if it does not within a second."""
        if self._sock is not None:
            self._sock.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- CPU placement


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _descendants(pid: int) -> Iterator[int]:
    """``pid``'s child processes, recursively (via /proc/<pid>/task/<tid>/children)."""
    for tid in _tids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            yield kid
            yield from _descendants(kid)


def pin_process(pid: int, cpus: set[int], tree: bool = True) -> None:
    """Pin every thread of ``pid`` (and, with ``tree``, of its descendants) to ``cpus``."""
    pids = [pid, *(_descendants(pid) if tree else ())]
    for p in pids:
        for tid in _tids(p):
            try:
                os.sched_setaffinity(tid, cpus)
            except (ProcessLookupError, PermissionError):
                pass  # a thread that just ended, or one we may not touch


def pin_self(cpus: set[int]) -> None:
    """Pin every thread of this process (pool helper threads included)."""
    pin_process(os.getpid(), cpus, tree=False)


# --------------------------------------------------------------------------- methods


@dataclass
class Method:
    name: str
    call: Callable[[int], Any]
    pids: list[int]


@dataclass
class Result:
    name: str
    per_call_us: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.per_call_us)


def start_methods(stack: ExitStack) -> list[Method]:
    """Start every method's worker, warm it with one call and learn the worker pids.

    The stdlib pools start first: with the ``fork`` start method they are forked before the
    comfy_env pool's reactor thread exists.
    """
    methods: list[Method] = []

    ex = concurrent.futures.ProcessPoolExecutor(max_workers=1)
    stack.callback(ex.shutdown, wait=True, cancel_futures=True)
    ex_pid: int = ex.submit(os.getpid).result()

    def ppe_call(x: int) -> Any:
        return ex.submit(echo, x).result()

    mp_pool = multiprocessing.Pool(1)

    def close_mp_pool() -> None:
        mp_pool.close()
        mp_pool.join()

    stack.callback(close_mp_pool)
    mp_pid: int = mp_pool.apply(os.getpid)

    import comfy_env  # after the forks above (see docstring)

    pool = comfy_env.Pool(comfy_env.PoolConfig())
    stack.callback(pool.close)
    worker = pool.get_worker(None)
    assert worker.call(ECHO_TARGET, 0) == 0
    ce_pid = worker.pid
    if ce_pid is None:
        raise RuntimeError("comfy_env worker has no pid after its first call")

    def ce_call(x: int) -> Any:
        return worker.call(ECHO_TARGET, x)

    raw_pipe = RawChild("pipe")
    stack.callback(raw_pipe.close)
    raw_sock = RawChild("sock")
    stack.callback(raw_sock.close)

    methods.append(Method(RAW_PIPE, raw_pipe.call, [raw_pipe.pid]))
    methods.append(Method(RAW_SOCKETPAIR, raw_sock.call, [raw_sock.pid]))
    methods.append(Method(COMFY_ENV, ce_call, [ce_pid]))
    methods.append(Method(PPE, ppe_call, [ex_pid]))
    methods.append(Method(MP_POOL, lambda x: mp_pool.apply(echo, (x,)), [mp_pid]))
    for m in methods:
        if m.call(12345) != 12345:
            raise RuntimeError(f"{m.name} did not echo its argument")
    return methods


def time_batch(call: Callable[[int], Any], batch: int) -> float:
    """Mean microseconds per call over ``batch`` sequential calls."""
    t0 = time.perf_counter_ns()
    for i in range(batch):
        call(i)
    return (time.perf_counter_ns() - t0) / batch / 1000.0


def run_placement(
    methods: list[Method],
    caller_cpus: set[int],
    worker_cpus: set[int],
    rounds: int,
    batch: int,
    rng: random.Random,
) -> dict[str, Result]:
    pin_self(caller_cpus)
    for m in methods:
        for pid in m.pids:
            pin_process(pid, worker_cpus)
    warm = max(10, min(batch, 500))
    for m in methods:
        time_batch(m.call, warm)
    results = {m.name: Result(m.name) for m in methods}
    for _ in range(rounds):
        order = list(methods)
        rng.shuffle(order)
        for m in order:
            results[m.name].per_call_us.append(time_batch(m.call, batch))
    return results


# --------------------------------------------------------------------------- reporting


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict[str, Any]:
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": sorted(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "mp_start_method": multiprocessing.get_start_method(),
    }


def summarize(results: dict[str, Result]) -> dict[str, dict[str, Any]]:
    raw = results[RAW_PIPE].median
    ce = results[COMFY_ENV].median
    out: dict[str, dict[str, Any]] = {}
    for name in METHOD_ORDER:
        r = results[name]
        out[name] = {
            "median_us": r.median,
            "min_us": min(r.per_call_us),
            "max_us": max(r.per_call_us),
            "x_raw_pipe": r.median / raw,
            "x_comfy_env": r.median / ce,
            "per_round_us": r.per_call_us,
        }
    return out


def targets(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ce_vs_raw = summary[COMFY_ENV]["x_raw_pipe"]
    ppe_vs_ce = summary[PPE]["x_comfy_env"]
    return {
        "comfy_env_x_raw_pipe": ce_vs_raw,
        "comfy_env_within_1_5x_raw_pipe": ce_vs_raw <= TARGET_VS_RAW,
        "ppe_x_comfy_env": ppe_vs_ce,
        "comfy_env_3x_faster_than_ppe": ppe_vs_ce >= TARGET_VS_PPE,
    }


def render(
    info: dict[str, Any], config: dict[str, Any], placements: dict[str, dict[str, Any]]
) -> str:
    lines = [
        "# Warm small-call round trip, f(x) = x",
        "",
        f"- python: {info['python']} (`{sys.executable}`)",
        f"- platform: {info['platform']}",
        f"- CPU: {info['cpu_model'] or 'unknown'}; cpu_count {info['cpu_count']}, "
        f"usable {info['usable_cpus']}",
        f"- stdlib pools start method: {info['mp_start_method']}",
        f"- {config['rounds']} interleaved rounds x {config['batch']} calls per method, "
        f"shuffled order (seed {config['seed']})",
    ]
    for label, p in placements.items():
        lines += ["", f"## {label}", ""]
        if p.get("skipped"):
            lines.append(f"Skipped: {p['skipped']}")
            continue
        lines.append(f"caller CPUs {p['caller_cpus']}, worker CPUs {p['worker_cpus']}")
        lines += [
            "",
            "| method | median us/call | min | max | x raw pipe | x comfy_env |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, s in p["methods"].items():
            lines.append(
                f"| {name} | {s['median_us']:.1f} | {s['min_us']:.1f} | {s['max_us']:.1f} "
                f"| {s['x_raw_pipe']:.2f} | {s['x_comfy_env']:.2f} |"
            )
        t = p["targets"]
        lines += [
            "",
            f"- target comfy_env <= {TARGET_VS_RAW}x raw pipe: "
            f"{t['comfy_env_x_raw_pipe']:.2f}x -> "
            f"{'MET' if t['comfy_env_within_1_5x_raw_pipe'] else 'NOT MET'}",
            f"- target comfy_env >= {TARGET_VS_PPE}x faster than ProcessPoolExecutor: "
            f"{t['ppe_x_comfy_env']:.2f}x -> "
            f"{'MET' if t['comfy_env_3x_faster_than_ppe'] else 'NOT MET'}",
        ]
    return "\n".join(lines)


def leftover_children() -> list[int]:
    return sorted(set(_descendants(os.getpid())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--batch", type=int, default=2000, help="calls per method per round")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffle")
    ap.add_argument("--json", metavar="PATH", help="also write results as JSON to PATH")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.batch = 2, 50
    if args.rounds < 1 or args.batch < 1:
        ap.error("--rounds and --batch must be >= 1")

    info = machine_info()
    config = {"rounds": args.rounds, "batch": args.batch, "seed": args.seed}
    original = os.sched_getaffinity(0)
    usable = sorted(original)
    plans: dict[str, tuple[set[int], set[int]] | None] = {
        "same CPU": ({usable[0]}, {usable[0]}),
        "different CPUs": ({usable[0]}, {usable[1]}) if len(usable) > 1 else None,
    }
    rng = random.Random(args.seed)
    placements: dict[str, dict[str, Any]] = {}
    try:
        with ExitStack() as stack:
            methods = start_methods(stack)
            for label, plan in plans.items():
                if plan is None:
                    placements[label] = {"skipped": "only one usable CPU"}
                    continue
                caller, workers = plan
                res = run_placement(methods, caller, workers, args.rounds, args.batch, rng)
                summary = summarize(res)
                placements[label] = {
                    "caller_cpus": sorted(caller),
                    "worker_cpus": sorted(workers),
                    "methods": summary,
                    "targets": targets(summary),
                }
            pin_self(original)  # workers get the full set too, so shutdown is not squeezed
            for m in methods:
                for pid in m.pids:
                    pin_process(pid, original)
    finally:
        pin_self(original)

    print(render(info, config, placements))
    left = leftover_children()
    if left:
        # A multiprocessing forkserver / resource tracker (non-fork start methods) may remain
        # until exit; anything else is a leak.
        print(f"\nWARNING: child processes still alive after cleanup: {left}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "config": config, "placements": placements}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
