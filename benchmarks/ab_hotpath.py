"""A/B of the warm small call between source trees (and the raw references), interleaved.

Not part of ``run_all.py``: a tool for comparing two builds of the host package in the same
minutes on a noisy machine (issue 16, third round: a mypyc-compiled hot path against the pure
modules, a pipe channel against the socketpair).

Each *arm* is a long-lived child process that answers ``pin``/``run`` lines on stdin:

``tree:PATH``
    ``comfy_env`` imported from ``PATH`` (put first on ``PYTHONPATH``, ahead of the editable
    install), a warm ``Pool`` with one worker; ``run N`` times ``N`` calls of
    ``comfy_env_worker.tasks:echo``.
``atree:PATH``
    The same, ``run N`` awaiting ``N`` ``acall``s one after another in one coroutine.
``raw:pipe`` / ``raw:sock`` / ``raw:sock2``
    The raw length-prefixed pickle ping-pong of ``benchlib.RawChild``.

Per round every arm runs one batch, in an order shuffled per round (seeded). A batch reports
wall us/call and the on-CPU us/call of the caller process (all threads) and of its worker,
from ``/proc/<pid>/task/*/schedstat``. Placements: caller and worker on CPU 0 ("same"), caller
on 0 and worker on 1 ("across"), both free to run on every CPU of this process ("free", where
the scheduler puts them). Medians over rounds with min-max. Each arm is one process for the
whole run unless ``--fresh``: on this VM a pair of processes sometimes runs 1.5x slower for its
whole life (its address layout; see HISTORY.md, eleventh round), so compare arms over several
runs (seeds), or with ``--fresh``, which starts every arm anew each round.

``python benchmarks/ab_hotpath.py --arm tree:/tmp/pure --arm tree:/tmp/mypyc --arm raw:pipe
--rounds 9 --calls 3000 [--placements same,across,free] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import benchlib  # noqa: E402

_CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
import benchlib
from comfy_env_worker.protocol import SPIN_RECHECK
arm = sys.argv[1]
me = os.getpid()
if arm.startswith(("tree:", "atree:")):
    import comfy_env
    pool = comfy_env.Pool()
    worker = pool.get_worker(None)
    call = worker.call
    call("comfy_env_worker.tasks:echo", 0)
    # The pool's watcher starts 50 ms after its first worker is ready: let its start-up
    # end before anything is timed (benchlib.settle_pool), and leave it out of the worker's
    # CPU time (it sleeps in a read for the rest of the run).
    benchlib.settle_pool(pool)
    import comfy_env._pool as _p
    origin = os.path.dirname(_p.__file__)
    compiled = [n for n in os.listdir(origin) if n.endswith(".so")]
    wpids = [worker.pid]
    def batch(n):
        for i in range(n):
            call("comfy_env_worker.tasks:echo", i)
    if arm.startswith("atree:"):
        import asyncio
        loop = asyncio.new_event_loop()
        async def calls(n):
            for i in range(n):
                await worker.acall("comfy_env_worker.tasks:echo", i)
        def batch(n):
            loop.run_until_complete(calls(n))
    info = f"{origin} compiled={sorted(compiled)}"
else:
    raw = benchlib.RawChild(arm.split(":", 1)[1])
    raw.call(0)
    wpids = [raw.pid]
    def batch(n):
        for i in range(n):
            raw.call(i)
    info = arm
print("ready " + info, flush=True)
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "pin":
        caller = {int(c) for c in cmd[1].split(",")}
        workers = {int(c) for c in cmd[2].split(",")}
        benchlib.pin_self(caller)
        for p in wpids:
            benchlib.pin_process(p, workers)
        # Past the readers' look at where both ends may run (every SPIN_RECHECK at most): a
        # pair just pinned to one CPU polls until then (as bench_small_call.warm_up).
        end = time.monotonic() + 2 * SPIN_RECHECK
        while time.monotonic() < end:
            batch(200)
        print("ok", flush=True)
    elif cmd[0] == "run":
        n = int(cmd[1])
        h0 = benchlib.process_cpu_ns(me)
        w0 = sum(benchlib.process_cpu_ns(p) for p in wpids)
        t0 = time.perf_counter_ns()
        batch(n)
        t1 = time.perf_counter_ns()
        h1 = benchlib.process_cpu_ns(me)
        w1 = sum(benchlib.process_cpu_ns(p) for p in wpids)
        print(f"{(t1 - t0) / n / 1e3} {(h1 - h0) / n / 1e3} {(w1 - w0) / n / 1e3}", flush=True)
    elif cmd[0] == "quit":
        break
if arm.startswith(("tree:", "atree:")):
    pool.close()
else:
    raw.close()
"""


class Arm(benchlib.ArmProcess):
    def __init__(self, spec: str) -> None:
        super().__init__(spec, _CHILD, BENCH_DIR)

    def pin(self, caller: str, workers: str) -> None:
        self._ask(f"pin {caller} {workers}")

    def run(self, n: int) -> tuple[float, float, float]:
        wall, host, worker = (float(x) for x in self._ask(f"run {n}").split())
        return wall, host, worker

    def close(self) -> None:
        try:
            self._ask("quit")
        except (RuntimeError, BrokenPipeError):
            pass
        self.proc.wait(10)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--placements", default="same,across", help="same, across and/or free")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="new arm processes (caller and worker) every round: each round then samples a new "
        "address layout, which on one CPU moves a pair's speed by up to 1.5x for its whole life",
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    arms = [Arm(spec) for spec in args.arm]
    out: dict[str, Any] = {"load_start": os.getloadavg()}
    try:
        for arm in arms:
            print(f"# {arm.spec}: {arm.info}")
        for placement in args.placements.split(","):
            # "free": caller and worker may both run on every CPU, where the scheduler puts them.
            caller = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
            caller, workers = {"same": ("0", "0"), "across": ("0", "1")}.get(
                placement, (caller, caller)
            )
            for arm in arms:
                arm.pin(caller, workers)
            samples: dict[str, list[tuple[float, float, float]]] = {a.spec: [] for a in arms}
            for round_ in range(args.rounds):
                if args.fresh and round_:
                    for i, arm in enumerate(arms):
                        arm.close()
                        arms[i] = Arm(arm.spec)
                        arms[i].pin(caller, workers)
                order = list(arms)
                rng.shuffle(order)
                for arm in order:
                    samples[arm.spec].append(arm.run(args.calls))
            print(f"## {placement} CPU ({args.rounds} rounds x {args.calls} calls)")
            print(f"{'arm':40s} {'wall us/call':>22s} {'host on-CPU':>22s} {'worker on-CPU':>22s}")
            for spec, rows in samples.items():
                cols = [summary([r[i] for r in rows]) for i in range(3)]
                print(f"{spec:40s} {cols[0]:>22s} {cols[1]:>22s} {cols[2]:>22s}")
            out[placement] = samples
    finally:
        for arm in arms:
            arm.close()
    out["load_end"] = os.getloadavg()
    print(f"# load average start {out['load_start']} end {out['load_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    time.sleep(0)
    sys.exit(main())
