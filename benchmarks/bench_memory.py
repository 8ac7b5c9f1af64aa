"""Measurement 5: idle worker memory, and what each worker costs the host.

What is measured
----------------
**Idle worker.** USS (memory only this process has) and RSS of one idle worker that has
served one small call and imported nothing for the user, read with psutil's
``memory_full_info()`` after a short settle:

``bare python``
    Reference: ``python -c "import time; time.sleep(60)"`` (this interpreter).
``raw pipe worker``
    Reference: the hand-written pipe worker of measurement 1, after one call.
``comfy_env``
    The worker of ``Pool(PoolConfig()).get_worker(None)`` after one ``echo``.
peers
    The worker process of each peer (fresh driver per sample, one warm call).

**Host overhead.** A fresh host process (``driver.py host-probe``) counts its threads
(``/proc/self/task``), file descriptors (``/proc/self/fd``) and RSS after importing comfy_env,
after creating a pool, with 1, 4 and 16 idle workers (one per fake env: a directory whose
``bin/python`` links to this interpreter; the pool keys envs by directory), and after
``close()``.

Fairness
--------
* Fresh workers per sample, interleaved rounds (3; 1 in quick mode), median with min/max.
* ``fork``-started workers (ProcessPoolExecutor, multiprocessing.Pool, pebble) share their
  pages copy-on-write with their driver, so their USS is small by construction while their RSS
  counts the shared pages; spawned and exec'd workers (comfy_env, loky, anyio, comfy-env
  0.4.46) own everything they touched. Compare USS with that in mind.
* The drivers import no peer library beyond the peer itself (numpy is imported lazily, only by
  the payload benchmark), so forked workers do not inherit it.
"""

from __future__ import annotations

import functools
import random
import subprocess
import sys
import time
from collections.abc import Callable

from benchlib import (
    Context,
    MiB,
    RawChild,
    RemoteError,
    Section,
    Series,
    fmt,
    fmt_x,
    ratio,
    run_driver_once,
    target_at_most,
    unavailable_row,
)

BARE = "bare python (sleep)"
RAW = "raw pipe worker"
COMFY_ENV = "comfy_env"
PEERS = (
    "ProcessPoolExecutor",
    "multiprocessing.Pool",
    "loky",
    "pebble",
    "anyio.to_process",
    "comfy-env 0.4.46",
)
START_KIND = {
    BARE: "new interpreter",
    RAW: "new interpreter",
    COMFY_ENV: "new interpreter",
    "ProcessPoolExecutor": "fork",
    "multiprocessing.Pool": "fork",
    "loky": "fork+exec",
    "pebble": "fork",
    "anyio.to_process": "new interpreter",
    "comfy-env 0.4.46": "new interpreter",
}
ECHO_TARGET = "comfy_env_worker.tasks:echo"
TARGET_USS_MIB = 9.0


def memory_of(pids: list[int]) -> tuple[float, float]:
    """Summed USS and RSS in MiB."""
    import psutil

    uss = rss = 0.0
    for pid in pids:
        info = psutil.Process(pid).memory_full_info()
        uss += info.uss / MiB
        rss += info.rss / MiB
    return uss, rss


def _idle_workers(ctx: Context, section: Section) -> None:
    import comfy_env

    rounds = 1 if ctx.quick else 3
    settle = 0.2 if ctx.quick else 0.5
    rng = random.Random(ctx.seed + 5)
    uss = {m: Series() for m in (BARE, RAW, COMFY_ENV, *PEERS)}
    rss = {m: Series() for m in (BARE, RAW, COMFY_ENV, *PEERS)}
    unavailable: dict[str, str] = {}

    def bare() -> tuple[float, float]:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.DEVNULL
        )
        try:
            time.sleep(settle)
            return memory_of([proc.pid])
        finally:
            proc.kill()
            proc.wait()

    def raw() -> tuple[float, float]:
        child = RawChild("pipe")
        try:
            child.call(1)
            time.sleep(settle)
            return memory_of([child.pid])
        finally:
            child.close()

    def ours() -> tuple[float, float]:
        with comfy_env.Pool(comfy_env.PoolConfig()) as pool:
            worker = pool.get_worker(None)
            worker.call(ECHO_TARGET, 0)
            time.sleep(settle)
            assert worker.pid is not None
            return memory_of([worker.pid])

    def peer(name: str) -> tuple[float, float]:
        remote, pids = ctx.new_remote(name)
        try:
            time.sleep(settle)
            return memory_of(pids)
        finally:
            remote.close()
            ctx.leftovers += [f"{name}: {x}" for x in remote.leftovers]

    samplers: dict[str, Callable[[], tuple[float, float]]] = {
        BARE: bare,
        RAW: raw,
        COMFY_ENV: ours,
    }
    for name in PEERS:
        if ctx.python_for(name) is None:
            unavailable[name] = ctx.reason(name)
        else:
            samplers[name] = functools.partial(peer, name)
    for _ in range(rounds):
        order = list(samplers)
        rng.shuffle(order)
        for name in order:
            try:
                got_uss, got_rss = samplers[name]()
            except RemoteError as exc:
                unavailable[name] = str(exc)
                del samplers[name]
                continue
            uss[name].add(got_uss)
            rss[name].add(got_rss)

    base = uss[BARE].median
    ce = uss[COMFY_ENV].median
    section.lines += [
        "### Idle worker",
        "",
        f"{rounds} interleaved rounds, a fresh worker per sample, measured {settle} s after "
        "its one call.",
        "",
        "| method | start | USS median MiB | min | max | RSS median MiB | USS x bare python "
        "| USS x comfy_env |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in (BARE, RAW, COMFY_ENV, *PEERS):
        u = uss[name]
        if u.values:
            section.lines.append(
                f"| {name} | {START_KIND[name]} | {fmt(u.median)} | {fmt(u.min)} "
                f"| {fmt(u.max)} | {fmt(rss[name].median)} | {fmt_x(ratio(u.median, base))} "
                f"| {fmt_x(ratio(u.median, ce))} |"
            )
        else:
            section.lines.append(unavailable_row(name, unavailable.get(name, "?"), 8))
    section.data["idle_uss_mib"] = {m: s.summary() for m, s in uss.items() if s.values}
    section.data["idle_rss_mib"] = {m: s.summary() for m, s in rss.items() if s.values}
    section.data["unavailable"] = unavailable
    section.targets.append(
        target_at_most(
            "5",
            f"comfy_env idle worker USS <= {TARGET_USS_MIB:g} MiB",
            ce,
            TARGET_USS_MIB,
            unit=" MiB",
        )
    )


def _host_overhead(ctx: Context, section: Section) -> None:
    counts = [1, 4] if ctx.quick else [1, 4, 16]
    root = f"{ctx.workdir}/host-probe-envs"
    python = ctx.pythons["stdlib"]
    assert python is not None
    section.lines += ["", "### Host overhead per worker", ""]
    try:
        rows = run_driver_once(
            python, ["host-probe", root, ",".join(map(str, counts))], ctx.workdir, 300
        )["rows"]
    except (RemoteError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
        section.lines.append(f"Host probe failed: {exc}")
        section.targets.append(target_at_most("5", "constant host thread count", float("nan"), 0.0))
        return
    section.lines += [
        "A fresh host process; counts from /proc/self after each stage.",
        "",
        "| stage | workers | threads | fds | RSS MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        section.lines.append(
            f"| {row['stage']} | {row['workers']} | {row['threads']} | {row['fds']} "
            f"| {fmt(row['rss_mib'], 1)} |"
        )
    idle = [r for r in rows if r["stage"] == "idle workers"]
    first, last = idle[0], idle[-1]
    span = last["workers"] - first["workers"]
    if span:
        section.lines += [
            "",
            f"Per extra worker: {(last['fds'] - first['fds']) / span:.2f} fds, "
            f"{(last['threads'] - first['threads']) / span:.2f} threads, "
            f"{(last['rss_mib'] - first['rss_mib']) / span:.2f} MiB host RSS.",
        ]
    created = next(r for r in rows if r["stage"] == "pool created")
    closed = rows[-1]
    section.lines += [
        f"Host Python threads with {last['workers']} workers: {', '.join(last['python_threads'])}.",
        f"After close: {closed['threads']} threads, {closed['fds']} fds (pool created: "
        f"{created['threads']} threads, {created['fds']} fds).",
    ]
    section.data["host"] = rows
    threads = [r["threads"] for r in idle]
    growth = float(max(threads) - min(threads))
    t = target_at_most(
        "5",
        "constant host thread count regardless of the number of workers",
        growth,
        0.0,
        unit=" threads",
        digits=0,
    )
    t.detail = (
        "threads with "
        + ", ".join(f"{r['workers']} workers: {r['threads']}" for r in idle)
        + f" (spread {growth:.0f})"
    )
    section.targets.append(t)


def run(ctx: Context) -> Section:
    section = Section("memory", "5. Idle worker memory and host overhead")
    _idle_workers(ctx, section)
    _host_overhead(ctx, section)
    return section
