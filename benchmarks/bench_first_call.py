"""Measurement 3: first call, from pool creation to the first result, in a fresh host.

What is measured
----------------
Every sample is a new host process (``driver.py first-call METHOD`` under the method's venv).
The host imports what it needs (timed separately, reported but not part of the figure), then
times from creating the pool/executor to holding the first result of ``echo(1)``:

``bare interpreter``
    Reference: ``Popen([python, "-c", "os.write(fd, b'x')"])`` -> that byte read from an
    inherited pipe. The cost of starting this interpreter at all.
``minimal worker``
    Reference: a hand-written worker: socketpair + ``python -c`` that reads one length-prefixed
    pickled request and replies with a pickle; the host sends ``("echo", (1,))``.
``comfy_env``
    ``Pool(PoolConfig())`` -> ``get_worker(None).call("comfy_env_worker.tasks:echo", 1)``
    (spawn, handshake, the start-up canary and the call).
peers
    ``ProcessPoolExecutor`` with the ``fork`` and the ``spawn`` start method, loky's reusable
    executor, ``pebble.ProcessPool`` (default context: ``fork``) and comfy-env 0.4.46
    (``SubprocessWorker`` + first ``call_module``).

Fairness
--------
* Interleaved rounds, one fresh host per method per round in a shuffled order, after one
  untimed warm-up host per method (page cache). Median over rounds with min and max.
* All references, comfy_env and the stdlib pools use this venv's interpreter; peers use their
  venv's interpreter (the same CPython binary).
* ``fork``-based peers do not start an interpreter at all: they copy the host. That is fast,
  but cannot run another env's Python, so the table marks how each method starts a worker and
  the targets are given both against every peer and against those that start an interpreter.
"""

from __future__ import annotations

import math
import random

from benchlib import (
    Context,
    RemoteError,
    Section,
    Series,
    fmt,
    fmt_x,
    ratio,
    run_driver_once,
    target_at_most,
    target_faster_than,
    unavailable_row,
)

BARE = "bare interpreter"
MINIMAL = "minimal worker"
COMFY_ENV = "comfy_env"
# method -> (venv key, how it starts a worker)
METHODS: dict[str, tuple[str, str]] = {
    BARE: ("stdlib", "new interpreter"),
    MINIMAL: ("stdlib", "new interpreter"),
    COMFY_ENV: ("stdlib", "new interpreter"),
    "ProcessPoolExecutor (fork)": ("stdlib", "fork of the host"),
    "ProcessPoolExecutor (spawn)": ("stdlib", "new interpreter"),
    "loky": ("peers", "new interpreter (fork+exec)"),
    "pebble": ("peers", "fork of the host"),
    "comfy-env 0.4.46": ("old", "new interpreter"),
}
PEERS = tuple(m for m in METHODS if m not in (BARE, MINIMAL, COMFY_ENV))

TARGET_VS_MINIMAL = 1.2


def run(ctx: Context) -> Section:
    section = Section("first_call", "3. First call: pool creation to first result")
    rounds = 2 if ctx.quick else 10
    rng = random.Random(ctx.seed + 3)
    unavailable: dict[str, str] = {}
    pythons: dict[str, str] = {}
    for method, (venv, _) in METHODS.items():
        python = ctx.pythons.get(venv)
        if python is None:
            unavailable[method] = ctx.venv_reasons.get(venv, "venv unavailable")
        else:
            pythons[method] = python

    def sample(method: str) -> tuple[float, float] | None:
        try:
            out = run_driver_once(pythons[method], ["first-call", method], ctx.workdir)
        except (RemoteError, OSError, ValueError) as exc:
            unavailable[method] = str(exc)
            del pythons[method]
            return None
        return float(out["s"]), float(out["import_s"])

    if not ctx.quick:
        for method in list(pythons):
            sample(method)  # warm-up host
    times = {m: Series() for m in METHODS}
    imports = {m: Series() for m in METHODS}
    for _ in range(rounds):
        order = list(pythons)
        rng.shuffle(order)
        for method in order:
            if method not in pythons:
                continue
            got = sample(method)
            if got is not None:
                times[method].add(got[0])
                imports[method].add(got[1])

    minimal = times[MINIMAL].median
    ce = times[COMFY_ENV].median
    section.lines += [
        f"{rounds} interleaved rounds, one fresh host process per method per round. ms from "
        "creating the pool to holding the first result; import ms (median) is the host's "
        "import of the library, not included.",
        "",
        "| method | starts a worker by | median ms | min | max | x minimal worker "
        "| x comfy_env | import ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, (_, how) in METHODS.items():
        s = times[method]
        if s.values:
            section.lines.append(
                f"| {method} | {how} | {fmt(s.median * 1e3, 1)} | {fmt(s.min * 1e3, 1)} "
                f"| {fmt(s.max * 1e3, 1)} | {fmt_x(ratio(s.median, minimal))} "
                f"| {fmt_x(ratio(s.median, ce))} | {fmt(imports[method].median * 1e3, 1)} |"
            )
        else:
            section.lines.append(unavailable_row(method, unavailable.get(method, "no sample"), 8))
    section.data = {
        "rounds": rounds,
        "seconds": {m: s.summary() for m, s in times.items() if s.values},
        "import_seconds": {m: s.summary() for m, s in imports.items() if s.values},
        "unavailable": unavailable,
    }
    if math.isfinite(ce):
        ctx.shared["first_call_comfy_env_s"] = ce
    section.targets.append(
        target_at_most(
            "3",
            f"comfy_env <= {TARGET_VS_MINIMAL}x the minimal worker",
            ratio(ce, minimal),
            TARGET_VS_MINIMAL,
        )
    )
    peer_ms = {p: times[p].median * 1e3 for p in PEERS if times[p].values}
    section.targets.append(
        target_faster_than("3", "comfy_env faster than every peer", ce * 1e3, peer_ms, "ms")
    )
    fresh = {p: v for p, v in peer_ms.items() if METHODS[p][1].startswith("new interpreter")}
    section.targets.append(
        target_faster_than(
            "3",
            "comfy_env faster than every peer that starts a new interpreter (not a fork)",
            ce * 1e3,
            fresh,
            "ms",
        )
    )
    return section
