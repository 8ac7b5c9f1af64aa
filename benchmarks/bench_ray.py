"""Measurement 8: the Ray backend beside the local backend (optional: needs ``ray``).

What is measured
----------------
Two pools in one host process, ``PoolConfig(backend="local")`` and ``PoolConfig(backend="ray")``
on a local Ray cluster (``num_cpus=2``, no dashboard, 256 MiB object store; started here unless
Ray is already initialised in this process, and then shut down here). Per backend:

* **first call**: pool creation -> the first ``echo(1)`` returns (Ray: preflight of the env,
  actor creation, handshake and canary; the cluster's own start-up is reported apart);
* **small call**: warm round trip of ``echo(1)``, per-call samples (median and p99);
* **64 MiB round trip**: ``echo`` of a 64 MiB float32 array (local: shared memory; Ray: the
  object store and the actor's socketpair, with a private copy for the caller);
* **crash detection**: a warm worker runs ``sleep(10)``; 0.25 s later the worker's pid gets
  SIGKILL; detection is kill -> the caller holds ``WorkerCrashed``; recovery is kill -> the
  next ``echo(1)`` returns on generation g+1.

Fairness
--------
Interleaved rounds (5; 1 in quick mode), the two backends in a shuffled order each round, both
pools warm. No CPU pinning; Ray's own processes (raylet, GCS, agents) share the 2 cores, which
is part of what the backend costs. The breaker is given a large budget (deliberate kills).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

from benchlib import Context, MiB, Section, Series, fmt, ratio

ECHO = "comfy_env_worker.tasks:echo"
SLEEP = "comfy_env_worker.tasks:sleep"
BACKENDS = ("local", "ray")


def _ray_available() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        # Not comfy-env[ray]: on PyPI that name is another project (the "old" peer here).
        return f"ray is not installed ({exc}); pip install '.[ray]' in the checkout"
    return None


def _crash_sample(worker: Any) -> tuple[float, float]:
    """(detection, recovery) seconds of one SIGKILL mid-call."""
    import comfy_env

    worker.call(ECHO, 1)
    pid = worker.pid
    caught = threading.Event()
    result: dict[str, float] = {}

    def caller() -> None:
        try:
            worker.call(SLEEP, 10)
        except comfy_env.WorkerCrashed:
            result["at"] = time.monotonic()
        finally:
            caught.set()

    thread = threading.Thread(target=caller)
    thread.start()
    time.sleep(0.25)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    caught.wait(60)
    thread.join(60)
    worker.call(ECHO, 1)
    recovered = time.monotonic()
    return result.get("at", float("nan")) - killed, recovered - killed


def run(ctx: Context) -> Section:
    section = Section("ray", "8. Ray backend beside the local backend")
    missing = _ray_available()
    if missing is not None:
        section.lines.append(f"Skipped: {missing}.")
        section.data = {"skipped": missing}
        return section
    import numpy as np
    import ray

    import comfy_env

    rounds = 1 if ctx.quick else 5
    small_n = 20 if ctx.quick else 300
    big = (4 if ctx.quick else 64) * MiB
    rng = random.Random(ctx.seed + 7)
    started_ray = not ray.is_initialized()
    t0 = time.monotonic()
    if started_ray:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=256 * MiB,
            log_to_driver=False,
        )
    cluster_s = time.monotonic() - t0
    first = {b: Series() for b in BACKENDS}
    small = {b: Series() for b in BACKENDS}
    payload = {b: Series() for b in BACKENDS}
    detect = {b: Series() for b in BACKENDS}
    recover = {b: Series() for b in BACKENDS}
    pools: dict[str, Any] = {}
    try:
        for backend in BACKENDS:
            t = time.monotonic()
            cfg = comfy_env.PoolConfig(
                backend=backend, max_restarts=10_000, start_timeout=120.0, close_timeout=10.0
            )
            pools[backend] = comfy_env.Pool(cfg)
            pools[backend].get_worker().call(ECHO, 1)
            first[backend].add(time.monotonic() - t)
        arr = np.ones(big // 4, dtype=np.float32)
        for _ in range(rounds):
            order = list(BACKENDS)
            rng.shuffle(order)
            for backend in order:
                w = pools[backend].get_worker()
                for _ in range(small_n):
                    t = time.perf_counter()
                    w.call(ECHO, 1)
                    small[backend].add(time.perf_counter() - t)
                t = time.perf_counter()
                out = w.call(ECHO, arr)
                payload[backend].add(time.perf_counter() - t)
                assert out.nbytes == arr.nbytes and out.flags.writeable
                del out
                d, r = _crash_sample(w)
                detect[backend].add(d)
                recover[backend].add(r)
    finally:
        for pool in pools.values():
            pool.close()
        if started_ray:
            ray.shutdown()

    def row(
        name: str, series: dict[str, Series], scale: float, unit: str, p99: bool = False
    ) -> str:
        def cell(s: Series) -> str:
            text = f"{fmt(s.median * scale)} ({fmt(s.min * scale)}-{fmt(s.max * scale)})"
            if p99:
                text = f"{fmt(s.median * scale)}, p99 {fmt(s.percentile(99) * scale)}"
            return text

        return (
            f"| {name} ({unit}) | {cell(series['local'])} | {cell(series['ray'])} | "
            f"{fmt(ratio(series['ray'].median, series['local'].median), 1)}x |"
        )

    section.lines += [
        f"{rounds} interleaved round(s); median (min-max) unless said. Ray cluster start-up "
        f"({'started here' if started_ray else 'already running'}): {cluster_s:.2f} s, not "
        "included below.",
        "",
        "| figure | local | ray | ray / local |",
        "|---|---|---|---|",
        row("first call, pool creation included", first, 1e3, "ms"),
        row(f"warm small call, {small_n} per round", small, 1e6, "us", p99=True),
        row(f"{big // MiB} MiB float32 round trip", payload, 1e3, "ms"),
        row("crash detection, SIGKILL -> WorkerCrashed", detect, 1e3, "ms"),
        row("crash recovery, SIGKILL -> next result", recover, 1e3, "ms"),
    ]
    section.data = {
        "cluster_start_s": cluster_s,
        "started_ray": started_ray,
        **{
            f"{fig}_{b}": series[b].summary()
            for fig, series in (
                ("first_call", first),
                ("small_call", small),
                ("payload", payload),
                ("crash_detect", detect),
                ("crash_recover", recover),
            )
            for b in BACKENDS
        },
    }
    return section
