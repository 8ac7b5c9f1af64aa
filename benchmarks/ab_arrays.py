"""A/B of array calls between source trees, interleaved: the warm small-array call and the
256 MiB array round trip (the version-neutral array pickle against numpy's own).

Not part of ``run_all.py``: a tool for comparing two builds of the host package in the same
minutes on a noisy machine. Each arm is a long-lived child process with ``comfy_env`` and
``comfy_env_worker`` imported from its tree (``PATH`` and ``PATH/workers`` first on
``PYTHONPATH``; run it from outside the checkout, so that the editable install is not found
first) and a warm pool on the current interpreter (or ``--env``). Per round each arm runs one
batch, in an order that alternates; medians over rounds with min-max.

``python benchmarks/ab_arrays.py --arm /tmp/old --arm /work/checkout --rounds 7``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

_CHILD = r"""
import json, sys, time
import numpy as np
import comfy_env

env = sys.argv[1] or None
with comfy_env.Pool() as pool:
    w = pool.get_worker(env)
    small = np.arange(16, dtype="float32")
    big = np.ones(256 << 20, dtype="uint8")
    w.call("comfy_env_worker.tasks:echo", small)
    w.call("comfy_env_worker.tasks:echo", big)
    print(json.dumps({"tree": comfy_env.__file__}), flush=True)
    for line in sys.stdin:
        what, n = line.split()
        n = int(n)
        times = []
        if what == "small":
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(n):
                    w.call("comfy_env_worker.tasks:echo", small)
                times.append((time.perf_counter() - t) / n * 1e6)
        else:
            for _ in range(n):
                t = time.perf_counter()
                out = w.call("comfy_env_worker.tasks:echo", big)
                times.append((time.perf_counter() - t) * 1e3)
                del out
        print(json.dumps(min(times)), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arm", action="append", required=True, help="a source tree")
    parser.add_argument("--env", default="", help="the env (default: this interpreter)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--big", type=int, default=3)
    args = parser.parse_args()
    arms: list[subprocess.Popen[str]] = []
    for tree in args.arm:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join((tree, os.path.join(tree, "workers"))))
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, args.env],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
        )
        assert child.stdout is not None
        print(f"arm {tree}: {json.loads(child.stdout.readline())['tree']}", file=sys.stderr)
        arms.append(child)
    results: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(range(len(arms))) if r % 2 == 0 else list(reversed(range(len(arms))))
        for what, n in (("small", args.calls), ("big", args.big)):
            for i in order:
                child = arms[i]
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(f"{what} {n}\n")
                child.stdin.flush()
                results.setdefault((i, what), []).append(json.loads(child.stdout.readline()))
    for child in arms:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    out: dict[str, Any] = {}
    for (i, what), values in sorted(results.items()):
        unit = "us/call" if what == "small" else "ms"
        med = statistics.median(values)
        print(
            f"{args.arm[i]:<30} {what:<6} {med:9.2f} {unit} (min {min(values):.2f}, "
            f"max {max(values):.2f}, {len(values)} rounds)"
        )
        out[f"{i}:{what}"] = values
    print(json.dumps(out))


if __name__ == "__main__":
    main()
