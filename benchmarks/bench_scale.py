"""Measurement 6: scale with the number of envs (one worker each).

What is measured
----------------
For N = 1, 4, 16, 64 envs (1 and 4 in quick mode; fake envs: directories whose ``bin/python``
links to this interpreter, so each is its own env to the pool), with a fresh pool each time:

* **spawn all**: N threads, released together, each make the first call of its own env; time
  from the release until the last one has its answer (N interpreters start concurrently on
  this machine's CPUs).
* **load**: 8 threads call ``echo`` for a fixed time (2 s; 0.3 s in quick mode); thread ``i``
  sends its ``k``-th call to env ``(i + 8k) mod N``, so with N = 1 all threads queue on one
  worker and with N >= 8 the calls spread over every env. Throughput is completed calls per
  second of the window; latency is per call (queueing included), p50 and p99 over all calls.
* host threads and fds with the N workers idle, and the time ``close()`` takes.

Fairness
--------
Interleaved rounds (3; 1 in quick mode): each round runs every N once, in a shuffled order,
each with a fresh pool that is closed before the next. Figures are medians over rounds (min-max
in the table). All in this process, no CPU pinning; the 8 load threads share the GIL of this
host, which is part of what a real multi-threaded host pays.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

from benchlib import Context, Section, Series, fmt, fmt_x, make_fake_envs, ratio

ECHO_TARGET = "comfy_env_worker.tasks:echo"
LOAD_THREADS = 8


def _spawn_all(workers: list[Any]) -> float:
    """Release N threads at once, each making its env's first call; seconds until all done."""
    go = threading.Event()
    errors: list[BaseException] = []
    done: list[float] = []

    def first(worker: Any) -> None:
        go.wait()
        try:
            worker.call(ECHO_TARGET, 0)
            done.append(time.perf_counter())
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=first, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return max(done) - t0


def _load(workers: list[Any], duration: float) -> tuple[float, list[float]]:
    """8 threads of back-to-back calls for ``duration`` s: (calls/s, latencies in us)."""
    n = len(workers)
    go = threading.Event()
    per_thread: list[list[float]] = [[] for _ in range(LOAD_THREADS)]
    errors: list[BaseException] = []
    end = [0.0]

    def loop(i: int) -> None:
        lat = per_thread[i]
        k = 0
        go.wait()
        stop = end[0]
        clock = time.perf_counter_ns
        try:
            while True:
                t0 = clock()
                if t0 >= stop:
                    break
                workers[(i + LOAD_THREADS * k) % n].call(ECHO_TARGET, k)
                lat.append((clock() - t0) / 1000.0)
                k += 1
        except Exception as exc:  # noqa: BLE001 - re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(LOAD_THREADS)]
    for t in threads:
        t.start()
    t_start = time.perf_counter_ns()
    end[0] = t_start + int(duration * 1e9)
    go.set()
    for t in threads:
        t.join()
    elapsed = (time.perf_counter_ns() - t_start) / 1e9
    if errors:
        raise errors[0]
    latencies = [x for lat in per_thread for x in lat]
    return len(latencies) / elapsed, latencies


def run(ctx: Context) -> Section:
    import comfy_env

    section = Section("scale", "6. Scale: 1 to 64 envs")
    counts = [1, 4] if ctx.quick else [1, 4, 16, 64]
    rounds = 1 if ctx.quick else 3
    duration = 0.3 if ctx.quick else 2.0
    rng = random.Random(ctx.seed + 6)
    envs = make_fake_envs(os.path.join(ctx.workdir, "scale-envs"), max(counts))
    spawn = {n: Series() for n in counts}
    throughput = {n: Series() for n in counts}
    p50 = {n: Series() for n in counts}
    p99 = {n: Series() for n in counts}
    close_s = {n: Series() for n in counts}
    host: dict[int, tuple[int, int]] = {}
    for _ in range(rounds):
        order = list(counts)
        rng.shuffle(order)
        for n in order:
            pool = comfy_env.Pool(comfy_env.PoolConfig())
            try:
                workers = [pool.get_worker(env) for env in envs[:n]]
                spawn[n].add(_spawn_all(workers))
                time.sleep(0.1)
                host[n] = (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")))
                rate, latencies = _load(workers, duration)
                lat = Series(latencies)
                throughput[n].add(rate)
                p50[n].add(lat.percentile(50))
                p99[n].add(lat.percentile(99))
            finally:
                t0 = time.perf_counter()
                pool.close()
                close_s[n].add(time.perf_counter() - t0)

    base_rate = throughput[counts[0]].median
    base_p99 = p99[counts[0]].median
    section.lines += [
        f"{rounds} interleaved rounds; load window {duration} s with {LOAD_THREADS} threads. "
        "Spawn-all and close in ms; throughput in calls/s; latencies in us (queueing "
        "included). Ratios are against N = 1. Host threads/fds: this process (which also "
        "holds the suite's own state) with the N workers idle.",
        "",
        "| envs N | spawn all ms (min-max) | per env ms | calls/s (min-max) | x N=1 calls/s "
        "| p50 us | p99 us | x N=1 p99 | host threads | host fds | close ms |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in counts:
        s, r = spawn[n], throughput[n]
        threads, fds = host.get(n, (0, 0))
        section.lines.append(
            f"| {n} | {fmt(s.median * 1e3, 1)} ({fmt(s.min * 1e3, 1)}-{fmt(s.max * 1e3, 1)}) "
            f"| {fmt(s.median * 1e3 / n, 1)} | {fmt(r.median, 0)} ({fmt(r.min, 0)}-"
            f"{fmt(r.max, 0)}) | {fmt_x(ratio(r.median, base_rate))} | {fmt(p50[n].median, 0)} "
            f"| {fmt(p99[n].median, 0)} | {fmt_x(ratio(p99[n].median, base_p99))} "
            f"| {threads} | {fds} | {fmt(close_s[n].median * 1e3, 1)} |"
        )
    section.data = {
        "rounds": rounds,
        "duration_s": duration,
        "spawn_all_s": {n: spawn[n].summary() for n in counts},
        "calls_per_s": {n: throughput[n].summary() for n in counts},
        "p50_us": {n: p50[n].summary() for n in counts},
        "p99_us": {n: p99[n].summary() for n in counts},
        "close_s": {n: close_s[n].summary() for n in counts},
        "host_threads_fds": {n: list(v) for n, v in host.items()},
    }
    return section
