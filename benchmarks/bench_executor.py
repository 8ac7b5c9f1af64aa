"""``comfy_env.Executor`` against ``ProcessPoolExecutor`` (and loky, pebble where installed).

What is measured
----------------
``map``
    ``list(ex.map(f, range(N), chunksize=c))`` with ``f(x) = x``
    (``comfy_env_worker.tasks:echo``, importable in the host and in every worker, so every
    method sends it by reference), for ``c`` in 1 and 100, on the current interpreter, with the
    same ``max_workers`` for every method. Figures: wall time per item, and on-CPU time per
    item of the host and all its worker processes (from ``/proc/<pid>/task/*/schedstat``:
    what the machine spent, not only what the caller waited).
``comfy_env.Executor spin_wait=100us``
    The same executor with the pool's default ``PoolConfig.spin_wait`` (an ``Executor`` sets
    it to 0 unless told): why it does.
``submit latency``
    ``ex.submit(f, x).result()`` one at a time: the round trip of one future, per call
    (median and p99 over the calls of all rounds).

Fairness
--------
* Every executor is created once and warmed (a full ``map`` at each chunk size) before the
  rounds, so worker start-up is outside the timed region for every method.
* Interleaved rounds: each round times every method once, in an order shuffled per round with
  a seeded ``random.Random``; a figure is the median over rounds, with min and max.
* Ratios are against ``ProcessPoolExecutor`` timed in the same rounds.
* ``ProcessPoolExecutor`` uses the platform's default start method (fork on Linux before 3.14);
  start-up is excluded anyway.

Usage::

    python benchmarks/bench_executor.py [--items 10000] [--rounds 7] [--workers 2] [--quick]

Writes ``benchmarks/out/bench_executor.md`` (and ``.json``) unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sections
from benchlib import (
    BENCH_DIR,
    Series,
    fmt,
    fmt_x,
    live_descendants,
    machine_info,
    process_cpu_ns,
    ratio,
    target_faster_than,
)

import comfy_env
from comfy_env_worker.tasks import echo

SECTION = "Executor"
CHUNKSIZES = (1, 100)


def tree_cpu_ns() -> int:
    """On-CPU nanoseconds of this process and every process below it."""
    return process_cpu_ns(os.getpid()) + sum(process_cpu_ns(pid) for pid in live_descendants())


def make_executors(workers: int) -> tuple[dict[str, Any], dict[str, str]]:
    """The executors to compare, by name, and why the missing ones are missing."""
    made: dict[str, Any] = {
        "comfy_env.Executor": comfy_env.Executor(None, max_workers=workers),
        # The pool's own default polling, which the Executor turns off (see _executor).
        "comfy_env.Executor spin_wait=100us": comfy_env.Executor(
            None, max_workers=workers, config=comfy_env.PoolConfig(spin_wait=100e-6)
        ),
        "ProcessPoolExecutor": concurrent.futures.ProcessPoolExecutor(max_workers=workers),
    }
    missing: dict[str, str] = {}
    try:
        import loky

        made["loky"] = loky.ProcessPoolExecutor(max_workers=workers)
    except ImportError:
        missing["loky"] = "not installed in this interpreter"
    try:
        import pebble

        made["pebble"] = pebble.ProcessPool(max_workers=workers)
    except ImportError:
        missing["pebble"] = "not installed in this interpreter"
    return made, missing


def mapper(name: str, ex: Any, items: int, chunksize: int) -> Callable[[], list[Any]]:
    if name == "pebble":  # pebble's map returns a future whose result is the iterator
        return lambda: list(ex.map(echo, range(items), chunksize=chunksize).result())
    return lambda: list(ex.map(echo, range(items), chunksize=chunksize))


def submitter(name: str, ex: Any) -> Callable[[int], Any]:
    if name == "pebble":
        return lambda x: ex.schedule(echo, (x,)).result()
    return lambda x: ex.submit(echo, x).result()


def close_all(made: dict[str, Any]) -> None:
    for name, ex in made.items():
        if name == "pebble":
            ex.close()
            ex.join()
        else:
            ex.shutdown(wait=True)


def run(items: int, rounds: int, workers: int, latency_calls: int, seed: int) -> dict[str, Any]:
    made, missing = make_executors(workers)
    rng = random.Random(seed)
    wall: dict[tuple[str, int], Series] = {}
    cpu: dict[tuple[str, int], Series] = {}
    latency: dict[str, Series] = {name: Series() for name in made}
    try:
        for name, ex in made.items():  # warm: workers started, imports done, caches filled
            for chunksize in CHUNKSIZES:
                assert mapper(name, ex, items, chunksize)() == list(range(items))
            submitter(name, ex)(0)
        methods = [(name, c) for name in made for c in CHUNKSIZES]
        for _ in range(rounds):
            order = methods + [(name, 0) for name in made]  # chunksize 0: the latency batch
            rng.shuffle(order)
            for name, chunksize in order:
                ex = made[name]
                if chunksize == 0:
                    submit = submitter(name, ex)
                    for x in range(latency_calls):
                        t0 = time.perf_counter()
                        submit(x)
                        latency[name].add((time.perf_counter() - t0) * 1e6)
                    continue
                go = mapper(name, ex, items, chunksize)
                c0 = tree_cpu_ns()
                t0 = time.perf_counter()
                result = go()
                elapsed = time.perf_counter() - t0
                spent = tree_cpu_ns() - c0
                assert len(result) == items
                wall.setdefault((name, chunksize), Series()).add(elapsed / items * 1e6)
                cpu.setdefault((name, chunksize), Series()).add(spent / items / 1e3)
    finally:
        close_all(made)
    return {
        "items": items,
        "rounds": rounds,
        "workers": workers,
        "latency_calls": latency_calls,
        "seed": seed,
        "missing": missing,
        "map_wall_us_per_item": {f"{n} c={c}": s.summary() for (n, c), s in wall.items()},
        "map_cpu_us_per_item": {f"{n} c={c}": s.summary() for (n, c), s in cpu.items()},
        "submit_latency_us": {
            n: {**s.summary(), "p99": s.percentile(99), "values": []} for n, s in latency.items()
        },
        "_series": (wall, cpu, latency),
    }


def report(result: dict[str, Any]) -> Iterator[str]:
    wall, cpu, latency = result["_series"]
    names = sorted({n for n, _ in wall}, key=lambda n: (n != "comfy_env.Executor", n))
    yield f"## {SECTION}: map over {result['items']} small items, submit latency"
    yield ""
    yield (
        f"max_workers={result['workers']}, {result['rounds']} interleaved rounds, "
        f"f(x)=x by reference; per item: median (min-max) over rounds."
    )
    yield ""
    yield "| method | chunksize | wall us/item | CPU us/item | wall vs ProcessPoolExecutor |"
    yield "|---|---|---|---|---|"
    for c in CHUNKSIZES:
        base = wall[("ProcessPoolExecutor", c)].median
        for n in names:
            w, u = wall[(n, c)], cpu[(n, c)]
            yield (
                f"| {n} | {c} | {fmt(w.median)} ({fmt(w.min)}-{fmt(w.max)}) | "
                f"{fmt(u.median)} ({fmt(u.min)}-{fmt(u.max)}) | {fmt_x(ratio(w.median, base))} |"
            )
    for n, why in result["missing"].items():
        yield f"| {n} | - | unavailable: {why} | | |"
    yield ""
    yield "| method | submit+result latency us: median | p99 | min | max |"
    yield "|---|---|---|---|---|"
    for n in names:
        s = latency[n]
        yield f"| {n} | {fmt(s.median)} | {fmt(s.percentile(99))} | {fmt(s.min)} | {fmt(s.max)} |"
    yield ""
    for c in CHUNKSIZES:
        ours = wall[("comfy_env.Executor", c)].median
        # The target: faster than ProcessPoolExecutor on the current interpreter.
        ppe = {"ProcessPoolExecutor": wall[("ProcessPoolExecutor", c)].median}
        label = f"Executor.map faster than ProcessPoolExecutor (chunksize {c})"
        yield target_faster_than(SECTION, label, ours, ppe, "us/item").line()
        peers = {n: wall[(n, c)].median for n in names if not n.startswith("comfy_env")}
        if len(peers) > 1:  # (informational: every peer installed)
            label = f"(for information) faster than every peer (chunksize {c})"
            yield target_faster_than(SECTION, label, ours, peers, "us/item").line()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--latency-calls", type=int, default=300)
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--out", default=os.path.join(BENCH_DIR, "out", "bench_executor.md"))
    parser.add_argument("--write", action="store_true", help="write section 11 of RESULTS.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.rounds, args.latency_calls = 200, 2, 20
    result = run(args.items, args.rounds, args.workers, args.latency_calls, args.seed)
    lines = list(report(result))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    if args.write and not args.quick:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        body = text.replace(f"## {SECTION}:", f"## 11. {SECTION}:", 1).rstrip("\n")
        head, _, rest = body.partition("\n\n")
        block = (
            f"{sections.EXECUTOR.begin}\n{head}\n\n`.venv/bin/python benchmarks/bench_executor.py"
            f" --write`, {when}; load average at the end: {load} (a shared 2-core machine). "
            f"{rest}\n{sections.EXECUTOR.end}"
        )
        sections.EXECUTOR.write(Path(BENCH_DIR) / "RESULTS.md", block)
    result.pop("_series")
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"machine": machine_info(), **result}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
