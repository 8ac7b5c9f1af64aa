"""Warm starts: the first call after ``Worker.start(preload=...)`` against a cold first call.

What is measured (section 10 of ``benchmarks/RESULTS.md``)
--------------------------------------------------------
A program whose env imports a heavy module on its first call pays the worker's start and that
import on the call. ``start(preload=...)`` does both in the background. Each round makes a fresh
``Pool`` in this process (one untimed warm-up round first, for the page cache) and measures, in
a shuffled order:

``cold``
    ``get_worker().call(MODULE_FUNCTION)``: spawn, handshake, canary, the import, the call.
``after start``
    ``get_worker().start(preload=(MODULE,))``, waited for (its time reported: "start, waited"),
    then the first call, timed alone.
``warm``
    In the same pool as "after start", the call once more: what any warm call costs.

Each timed call of "after start" and "warm" comes after the same pause (``PAUSE``, 10 ms), so
both find the worker asleep: a call made right after a reply finds the worker still polling
for the next request and would be the faster for that alone, not for being warm.

The target (from the issue): the first call after the start has finished costs no more than a
warm call. Beside wall time, the worker's on-CPU time of each timed call
(``/proc/<pid>/schedstat`` of all its threads) shows whether the call did the import's work.
Figures: median with min and max over the rounds; targets are reported, never asserted.

The heavy module is numpy when this interpreter has it (``numpy:ones`` is the call), else
``asyncio`` (``asyncio:iscoroutinefunction`` on ``len``). ``--write`` puts section 10 into
``benchmarks/RESULTS.md`` (``sections.START``), which ``run_all.py`` keeps.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import sections  # noqa: E402
from benchlib import Series, fmt, fmt_x, process_cpu_ns, ratio  # noqa: E402

import comfy_env  # noqa: E402

PAUSE = 0.010  # seconds before each timed call of a started worker
TARGET_RATIO = 1.0  # first call after start, at most a warm call's time (ratio of medians)


def heavy_call() -> tuple[str, str, tuple[Any, ...]]:
    """The module to preload, the call that needs it, and its arguments."""
    if importlib.util.find_spec("numpy") is not None:
        return "numpy", "numpy:ones", (4,)
    return "asyncio", "asyncio:iscoroutinefunction", (len,)


def timed_call(
    worker: comfy_env.Worker, target: str, args: tuple[Any, ...]
) -> tuple[float, float, float]:
    """Wall ms of one call, the calling thread's on-CPU ms and the worker's (0 when its pid is
    unknown) during it."""
    pid = worker.pid
    before = process_cpu_ns(pid) if pid else 0
    host_before = time.thread_time_ns()
    began = time.perf_counter()
    worker.call(target, *args)
    wall = (time.perf_counter() - began) * 1e3
    host = (time.thread_time_ns() - host_before) / 1e6
    pid = worker.pid
    cpu = (process_cpu_ns(pid) - before) / 1e6 if pid else 0.0
    return wall, host, cpu


def measure_round(
    module: str, target: str, args: tuple[Any, ...], rng: random.Random
) -> dict[str, float]:
    figures: dict[str, float] = {}

    def cold() -> None:
        with comfy_env.Pool() as pool:
            began = time.perf_counter()
            pool.get_worker().call(target, *args)
            figures["cold"] = (time.perf_counter() - began) * 1e3

    def started() -> None:
        with comfy_env.Pool() as pool:
            worker = pool.get_worker()
            began = time.perf_counter()
            worker.start(preload=(module,)).result(timeout=120)
            figures["start"] = (time.perf_counter() - began) * 1e3
            time.sleep(PAUSE)
            figures["after"], figures["after_host"], figures["after_cpu"] = timed_call(
                worker, target, args
            )
            time.sleep(PAUSE)
            figures["warm"], figures["warm_host"], figures["warm_cpu"] = timed_call(
                worker, target, args
            )

    arms: list[Callable[[], None]] = [cold, started]
    rng.shuffle(arms)
    for arm in arms:
        arm()
    return figures


def run(rounds: int, seed: int) -> str:
    module, target, args = heavy_call()
    rng = random.Random(seed)
    measure_round(module, target, args, rng)  # warm-up, untimed
    series: dict[str, Series] = {
        k: Series()
        for k in (
            "cold",
            "start",
            "after",
            "after_host",
            "after_cpu",
            "warm",
            "warm_host",
            "warm_cpu",
        )
    }
    ratios = Series()
    for _ in range(rounds):
        figures = measure_round(module, target, args, rng)
        for key, value in figures.items():
            series[key].add(value)
        ratios.add(ratio(figures["after"], figures["warm"]))
    return report(series, ratios, module, target, rounds, seed)


def _row(label: str, s: Series, digits: int = 2) -> str:
    low, high = fmt(s.min, digits), fmt(s.max, digits)
    return f"| {label} | {fmt(s.median, digits)} ms (min {low}, max {high}) |"


def report(
    series: dict[str, Series], ratios: Series, module: str, target: str, rounds: int, seed: int
) -> str:
    after, warm = series["after"].median, series["warm"].median
    overall = ratio(after, warm)
    met = "MET" if overall <= TARGET_RATIO else "NOT MET"
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    python = ".".join(map(str, sys.version_info[:3]))
    lines = [
        sections.START.begin,
        "## 10. Warm starts: the first call after `start(preload=...)`",
        "",
        f"`.venv/bin/python benchmarks/bench_start.py`, {when}, Python {python}, {rounds} "
        f"interleaved rounds (seed {seed}), a fresh pool per measurement, the heavy module "
        f"`{module}` (the call: `{target}`). Load average at the end: {load}. Method: the "
        "module's docstring.",
        "",
        "| figure | median (min, max) |",
        "|---|---|",
        _row("cold first call (spawn, verify, import, call)", series["cold"], 1),
        _row("`start(preload=...)`, waited for (spawn, verify, import)", series["start"], 1),
        _row("first call after the start", series["after"], 3),
        _row("the next call (warm), after the same pause", series["warm"], 3),
        _row("caller on-CPU, first call after the start", series["after_host"], 3),
        _row("caller on-CPU, warm call", series["warm_host"], 3),
        _row("worker on-CPU, first call after the start", series["after_cpu"], 3),
        _row("worker on-CPU, warm call", series["warm_cpu"], 3),
        f"| first call after the start / warm call, per round | {fmt_x(ratios.median)} "
        f"(min {fmt_x(ratios.min)}, max {fmt_x(ratios.max)}) |",
        "",
        f"- First call after the start at most a warm call's time: {met} "
        f"({fmt_x(overall)}, ratio of the medians; {fmt(after, 3)} against {fmt(warm, 3)} ms).",
        "- The start takes the cold call's cost off the first call: "
        f"{fmt(series['cold'].median, 1)} ms cold against {fmt(after, 3)} ms after the start.",
        sections.START.end,
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="write section 10 of RESULTS.md")
    parser.add_argument("--out", default=str(BENCH_DIR / "out" / "bench_start.md"))
    options = parser.parse_args()
    text = run(options.rounds, options.seed)
    print(text)
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    if options.write:
        sections.START.write(BENCH_DIR / "RESULTS.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
