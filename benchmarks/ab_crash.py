"""A/B of crash detection between source trees (and the raw socketpair child), interleaved.

Not part of ``run_all.py``: a tool for comparing two builds of the host package in the same
minutes on a noisy machine (issue 16, fourth round: the caller collecting a crashed worker's
exit itself against the hand-off to the reactor thread).

Each *arm* is a long-lived child process that answers ``kill`` lines on stdin:

``tree:PATH``
    ``comfy_env`` imported from ``PATH`` (put first on ``PYTHONPATH``, ahead of the editable
    install), a warm ``Pool`` with one worker; a sample is ``driver.measure_crash`` of a
    ``sleep(10)`` call (SIGKILL of the worker mid-call, as ``bench_crash.py`` does).
``raw``
    ``bench_crash.RawSleeper``, the reference floor (EOF of a killed ``python -c`` child).

Per round every arm takes one sample, in an order shuffled per round (seeded). A sample
reports detection (kill -> the caller holds the exception) and recovery (kill -> the next
call returned) in ms, and the arm process's on-CPU ms (all its threads, ended ones included:
``time.process_time_ns``) between the kill and the exception. No CPU pinning (as
``bench_crash.py``). Medians over rounds with min-max.

``python benchmarks/ab_crash.py --arm tree:/tmp/old --arm tree:/tmp/new --arm raw
--rounds 25 [--hold-mib N] [--json PATH]``

``--hold-mib N``: the killed process holds N MiB (touched), as a worker with a model loaded
does; the kernel frees it before it closes the process's descriptors (the raw child's EOF).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import benchlib  # noqa: E402

_CHILD = r"""
import os, sys, threading, time
sys.path.insert(0, sys.argv[2])
import driver
arm = sys.argv[1]
me = os.getpid()
cpu = {}
_measure = driver.measure_crash
hold = int(os.environ.get("AB_CRASH_HOLD_MIB", "0"))


def hold_and_sleep(mib, seconds):
    import time
    global held
    held = b"\x01" * (mib << 20)
    time.sleep(seconds)


if arm.startswith("tree:"):
    import comfy_env
    pool = comfy_env.Pool(comfy_env.PoolConfig(max_restarts=100000))
    worker = pool.get_worker(None)
    worker.call("comfy_env_worker.tasks:echo", 0)
    import comfy_env._pool as _p
    info = os.path.dirname(_p.__file__)

    def blocking():
        try:
            if hold:
                worker.call(hold_and_sleep, hold, 10.0)
            else:
                worker.call("comfy_env_worker.tasks:sleep", 10.0)
        finally:
            cpu["end"] = time.process_time_ns()

    def sample():
        return _measure(worker.pid, blocking, lambda: worker.call("comfy_env_worker.tasks:echo", 1))
else:
    from bench_crash import RawSleeper
    raw = [RawSleeper(hold)]
    info = arm

    def blocking():
        try:
            raw[0].call()
        finally:
            cpu["end"] = time.process_time_ns()

    def recover():
        raw[0].close()
        raw[0] = RawSleeper(hold)

    def sample():
        return _measure(raw[0].proc.pid, blocking, recover)

_kill = os.kill

def kill(pid, sig):
    cpu["start"] = time.process_time_ns()
    _kill(pid, sig)

driver.os.kill = kill  # the on-CPU count starts at the kill
print("ready " + info, flush=True)
for line in sys.stdin:
    if line.split()[0] == "kill":
        out = sample()
        print(f"{out['detect_ms']} {out['recover_ms']} {(cpu['end'] - cpu['start']) / 1e6}"
              f" {out['raised']}", flush=True)
    else:
        break
if arm.startswith("tree:"):
    pool.close()
else:
    raw[0].close()
"""


class Arm(benchlib.ArmProcess):
    def __init__(self, spec: str) -> None:
        super().__init__(spec, _CHILD, BENCH_DIR)

    def kill(self) -> tuple[float, float, float, str]:
        detect, recover, cpu, raised = self._ask("kill").split()
        return float(detect), float(recover), float(cpu), raised

    def close(self) -> None:
        try:
            self._ask("quit")
        except (RuntimeError, BrokenPipeError):
            pass
        self.proc.wait(30)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument(
        "--hold-mib",
        type=int,
        default=0,
        help="MiB the killed process holds (the tree arms' call touches them, the raw child"
        " at its start): its teardown, which the raw child's EOF waits for, grows with it",
    )
    args = ap.parse_args(argv)
    os.environ["AB_CRASH_HOLD_MIB"] = str(args.hold_mib)
    rng = random.Random(args.seed)
    arms = [Arm(spec) for spec in args.arm]
    out: dict[str, Any] = {"load_start": os.getloadavg()}
    samples: dict[str, list[tuple[float, float, float, str]]] = {a.spec: [] for a in arms}
    try:
        for arm in arms:
            print(f"# {arm.spec}: {arm.info}")
        for _ in range(args.rounds):
            order = list(arms)
            rng.shuffle(order)
            for arm in order:
                samples[arm.spec].append(arm.kill())
    finally:
        for arm in arms:
            arm.close()
    print(f"## {args.rounds} rounds, one kill per arm per round")
    print(f"{'arm':32s} {'detect ms':>22s} {'on-CPU ms to detect':>22s} {'recover ms':>22s}")
    for spec, rows in samples.items():
        cols = [summary([r[i] for r in rows]) for i in (0, 2, 1)]
        raised = sorted({r[3] for r in rows})
        print(f"{spec:32s} {cols[0]:>22s} {cols[1]:>22s} {cols[2]:>22s} {raised}")
    out["samples"] = samples
    out["load_end"] = os.getloadavg()
    print(f"# load average start {out['load_start']} end {out['load_end']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
