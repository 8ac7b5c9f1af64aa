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
    ``Pool()`` -> ``get_worker(None).call("comfy_env_worker.tasks:echo", 1)`` (spawn,
    handshake, the start-up canary and the call). ``Pool()`` takes the defaults without
    pydantic; a program that builds a ``PoolConfig`` pays pydantic's import on top.
peers
    ``ProcessPoolExecutor`` with the ``fork`` and the ``spawn`` start method, loky's reusable
    executor, ``pebble.ProcessPool`` (default context: ``fork``) and comfy-env 0.4.46
    (``SubprocessWorker`` + first ``call_module``).

Fairness
--------
* Interleaved rounds (20), one fresh host per method per round in a shuffled order, after
  one untimed warm-up host per method (page cache). Median over rounds with min and max; the
  target is the ratio of the medians. Beside it, comfy_env's ratio to the minimal worker
  within each round (median and range).
* All references, comfy_env and the stdlib pools use this venv's interpreter; peers use their
  venv's interpreter (the same CPython binary).
* ``fork``-based peers do not start an interpreter at all: they copy the host. That is fast,
  but cannot run another env's Python, so the table marks how each method starts a worker and
  the targets are given both against every peer and against those that start an interpreter.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import tempfile
import time

from benchlib import (
    Context,
    RemoteError,
    Section,
    Series,
    clean_env,
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
TARGET_IMPORT_MS = 50.0  # import comfy_env in a fresh interpreter
TARGET_WITH_IMPORT = 3.0  # fresh host, import included, vs the minimal host and worker
TARGET_STATUS_MS = 120.0  # comfy-env status with nothing running
STATUS = "comfy-env status"
BARE_EXIT = "python -c pass"


def _wall(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from spawning ``argv`` to its exit (it must succeed)."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, timeout=60)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RemoteError(f"{argv[1:]} failed: {proc.stderr.decode(errors='replace')[-300:]}")
    return elapsed


def run(ctx: Context) -> Section:
    section = Section("first_call", "3. First call: pool creation to first result")
    # 20: one host's interpreter start varies by 25-50 ms here, and with 10 rounds the median
    # ratio to the minimal worker read 0.92-1.35x over six runs of one tree.
    rounds = 2 if ctx.quick else 20
    rng = random.Random(ctx.seed + 3)
    unavailable: dict[str, str] = {}
    pythons: dict[str, str] = {}
    for method, (venv, _) in METHODS.items():
        python = ctx.pythons.get(venv)
        if python is None:
            unavailable[method] = ctx.venv_reasons.get(venv, "venv unavailable")
        else:
            pythons[method] = python

    def sample(method: str) -> tuple[float, float, float] | None:
        try:
            out = run_driver_once(pythons[method], ["first-call", method], ctx.workdir)
        except (RemoteError, OSError, ValueError) as exc:
            unavailable[method] = str(exc)
            del pythons[method]
            return None
        return float(out["s"]), float(out["import_s"]), float(out.get("load_s", 0.0))

    if not ctx.quick:
        for method in list(pythons):
            sample(method)  # warm-up host
    times = {m: Series() for m in METHODS}
    imports = {m: Series() for m in METHODS}
    loads = {m: Series() for m in METHODS}  # comfy_env: Pool loaded lazily
    totals = {m: Series() for m in METHODS}  # import + load + first call, per fresh host
    # ``comfy-env status`` with nothing running (an empty private runtime root), beside a bare
    # interpreter that exits at once; both are whole processes timed from spawn to exit.
    cli = {STATUS: Series(), BARE_EXIT: Series()}
    python = pythons.get(COMFY_ENV)
    status_root = tempfile.mkdtemp(prefix="comfy-env-bench-status-")
    os.chmod(status_root, 0o700)
    status_env = {**clean_env(), "XDG_RUNTIME_DIR": status_root}
    script = os.path.join(os.path.dirname(python), "comfy-env") if python else ""
    via_module = [python or "", "-m", "comfy_env", "status"]
    cli_argv = {
        STATUS: [script, "status"] if os.path.exists(script) else via_module,
        BARE_EXIT: [python or "", "-c", "pass"],
    }
    for _ in range(rounds):
        order = [*pythons, *(cli if python else ())]
        rng.shuffle(order)
        for method in order:
            if method in cli:
                cli[method].add(_wall(cli_argv[method], status_env))
                continue
            if method not in pythons:
                continue
            got = sample(method)
            if got is not None:
                times[method].add(got[0])
                imports[method].add(got[1])
                loads[method].add(got[2])
                totals[method].add(got[0] + got[1] + got[2])
    import shutil

    shutil.rmtree(status_root, ignore_errors=True)

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
    ce_values, min_values = times[COMFY_ENV].values, times[MINIMAL].values
    paired = []
    if len(ce_values) == len(min_values):  # a round either host failed: no pairing
        paired = sorted(c / m for c, m in zip(ce_values, min_values, strict=True) if m > 0)
    if paired:
        section.lines += [
            "",
            f"comfy_env / minimal worker within each round (the two hosts a few hundred ms "
            f"apart): median {fmt_x(statistics.median(paired))}, range "
            f"{fmt_x(paired[0])}-{fmt_x(paired[-1])}.",
        ]
    total_ce = totals[COMFY_ENV].median
    total_min = totals[MINIMAL].median
    section.lines += [
        "",
        "Fresh host, import included (import + loading `Pool` + `Pool()` "
        "+ first call, summed per host):",
        "",
        "| method | median ms | min | max | x minimal host and worker |",
        "|---|---:|---:|---:|---:|",
    ]
    for method in (MINIMAL, COMFY_ENV):
        t = totals[method]
        if t.values:
            section.lines.append(
                f"| {method} | {fmt(t.median * 1e3, 1)} | {fmt(t.min * 1e3, 1)} "
                f"| {fmt(t.max * 1e3, 1)} | {fmt_x(ratio(t.median, total_min))} |"
            )
    imp = imports[COMFY_ENV]
    if imp.values:
        section.lines += [
            "",
            f"`import comfy_env` in a fresh interpreter (timed inside the host): median "
            f"{fmt(imp.median * 1e3, 1)} ms (min {fmt(imp.min * 1e3, 1)}, max "
            f"{fmt(imp.max * 1e3, 1)}). The public names load on first use: touching "
            f"`comfy_env.Pool` (the pool's machinery; `Pool()` needs no pydantic) "
            f"took a median {fmt(loads[COMFY_ENV].median * 1e3, 1)} ms more, timed apart "
            "from the first call above and included in the import-included figure.",
        ]
    if cli[STATUS].values:
        st, bare = cli[STATUS], cli[BARE_EXIT]
        section.lines += [
            "",
            "| command (spawn to exit, nothing running) | median ms | min | max |",
            "|---|---:|---:|---:|",
            f"| `{' '.join(os.path.basename(a) for a in cli_argv[STATUS])}` "
            f"| {fmt(st.median * 1e3, 1)} | {fmt(st.min * 1e3, 1)} | {fmt(st.max * 1e3, 1)} |",
            f"| `python -c pass` (reference) | {fmt(bare.median * 1e3, 1)} "
            f"| {fmt(bare.min * 1e3, 1)} | {fmt(bare.max * 1e3, 1)} |",
        ]
    section.data = {
        "with_import_seconds": {m: s.summary() for m, s in totals.items() if s.values},
        "cli_seconds": {m: s.summary() for m, s in cli.items() if s.values},
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
    section.targets.append(
        target_at_most(
            "3",
            f"import comfy_env in a fresh interpreter <= {TARGET_IMPORT_MS:g} ms",
            imp.median * 1e3 if imp.values else math.nan,
            TARGET_IMPORT_MS,
            " ms",
            1,
        )
    )
    section.targets.append(
        target_at_most(
            "3",
            f"comfy_env first call from a fresh host, import included <= {TARGET_WITH_IMPORT:g}x "
            "the minimal host and worker",
            ratio(total_ce, total_min),
            TARGET_WITH_IMPORT,
        )
    )
    section.targets.append(
        target_at_most(
            "3",
            f"comfy-env status with nothing running <= {TARGET_STATUS_MS:g} ms",
            cli[STATUS].median * 1e3 if cli[STATUS].values else math.nan,
            TARGET_STATUS_MS,
            " ms",
            1,
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
