"""Run the whole benchmark suite and write ``benchmarks/RESULTS.md``.

::

    python3 dev.py bench                    # full run, a few minutes on 2 cores
    python3 dev.py bench --quick            # smoke test, tiny sizes, into benchmarks/out/quick.md

(``dev.py bench`` creates ``.venv`` if needed and runs this script in it with the given
arguments; ``.venv/bin/python benchmarks/run_all.py ...`` is the same once ``.venv`` exists.)
``--quick`` takes about 50 s with the peer venvs in place, about 80 s on a fresh clone (their
install adds about 30 s; ``--no-install`` skips them); its figures are for smoke testing only,
and it writes ``benchmarks/out/quick.md`` (git-ignored) unless ``--out`` says otherwise; a
run of some sections (``--only``) writes ``benchmarks/out/only.md`` likewise.

Steps: install (or reuse) the peer venvs under ``benchmarks/.peers`` (``peers.py``), then run
the seven measurements in order, each on its own references measured in the same run:

1. warm small call (``bench_small_call``)     4. crash recovery (``bench_crash``)
2. payload round trip (``bench_payload``)     5. idle memory, host overhead (``bench_memory``)
3. first call (``bench_first_call``)          6. scale to 64 envs (``bench_scale``)
8. the Ray backend beside the local one (``bench_ray``; skipped, and said so, without ray)

Section 7 (a ComfyUI node on a 512x512 IMAGE, ``bench_comfyui``) is not measured here: it needs
ComfyUI's venv and comes from ``python3 dev.py bench-comfyui``, which writes it between markers
into ``benchmarks/RESULTS.md``; neither is section 9 (declared envs: build, first call, list, shared
pages), which ``bench_build.py`` writes. When this script rewrites its results file it keeps
those blocks already in it, each in its place (``write_results``, ``sections.keep_sections``),
so a full run never loses them.

A measurement that fails is reported with its error and the suite goes on; a peer that cannot
be installed or does not work is reported as "unavailable: reason". Targets are printed as
MET / NOT MET, never asserted: the exit status is 0 unless the suite itself broke.

Hygiene: this process becomes a child subreaper, so any process a peer or comfy_env leaves
behind re-parents here; after every section and at the end the live descendants are listed in
the results (and killed). The scratch directory (driver logs, fake envs) is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import bench_crash
import bench_first_call
import bench_memory
import bench_payload
import bench_ray
import bench_scale
import bench_small_call
import peers
import sections
from benchlib import (
    BENCH_DIR,
    SHM_DIR,
    Context,
    Section,
    become_subreaper,
    cmdline,
    compile_bytecode,
    kill_leftovers,
    live_descendants,
    machine_info,
    proc_state,
    reap_zombies,
    shm_blocks,
    shm_owner,
)

SECTIONS: dict[str, Callable[[Context], Section]] = {
    "small_call": bench_small_call.run,
    "payload": bench_payload.run,
    "first_call": bench_first_call.run,
    "crash": bench_crash.run,
    "memory": bench_memory.run,
    "scale": bench_scale.run,
    "ray": bench_ray.run,
}
TITLES = {
    "small_call": "1. Warm small call, f(x) = x",
    "payload": "2. Payload round trip",
    "first_call": "3. First call",
    "crash": "4. Crash recovery",
    "memory": "5. Idle worker memory and host overhead",
    "scale": "6. Scale",
    "ray": "8. Ray backend beside the local backend",
}
# Where results go: a full run updates the tracked file, a quick look never touches it.
RESULTS = os.path.join(BENCH_DIR, "RESULTS.md")
QUICK_RESULTS = os.path.join(BENCH_DIR, "out", "quick.md")
ONLY_RESULTS = os.path.join(BENCH_DIR, "out", "only.md")


def run_section(key: str, ctx: Context) -> Section:
    t0 = time.monotonic()
    try:
        section = SECTIONS[key](ctx)
    except Exception as exc:  # noqa: BLE001 - a failed measurement is reported, the suite goes on
        section = Section(key, TITLES[key])
        tb = traceback.format_exc().strip().splitlines()
        section.lines += [
            f"**This measurement failed**: `{type(exc).__name__}: {exc}`",
            "",
            "```",
            *tb[-15:],
            "```",
        ]
        section.data = {"error": f"{type(exc).__name__}: {exc}"}
    section.seconds = time.monotonic() - t0
    expected = ctx.expected_pids()
    stray = [p for p in live_descendants() if p not in expected]
    if stray:  # give processes that are already exiting a moment before calling them strays
        time.sleep(0.5)
        stray = [p for p in live_descendants() if p not in expected]
    if stray:
        section.leftovers += [f"{p}: {cmdline(p)}" for p in stray]
        kill_leftovers(stray)
    section.leftovers += ctx.leftovers
    ctx.leftovers.clear()
    print(
        f"[{section.seconds:6.1f} s] {section.title}: "
        + ", ".join(
            f"{'MET' if t.met else 'NOT MET' if t.met is False else 'n/e'}" for t in section.targets
        ),
        flush=True,
    )
    return section


def stale_shm(before: set[str]) -> list[str]:
    """comfy_env shared-memory blocks that appeared during the run and outlived their owner
    (or belong to this process, whose pools are all closed). This process's are removed; other
    hosts' are only reported (another run may be using this machine)."""
    time.sleep(0.2)
    found = []
    for name in sorted(shm_blocks() - before):
        owner = shm_owner(name)
        mine = owner == os.getpid()
        if mine or owner is None or proc_state(owner) in (None, "Z"):
            found.append(f"/dev/shm/{name} (owner pid {owner}{', this process' if mine else ''})")
            if mine:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
    return found


def render(
    info: dict[str, Any],
    args: argparse.Namespace,
    ctx: Context,
    venv_notes: dict[str, str],
    sections: list[Section],
    total_s: float,
    final_leftovers: list[str],
) -> str:
    command = (
        "python benchmarks/run_all.py"
        + (" --quick" if args.quick else "")
        + (f" --only {args.only}" if args.only else "")
    )
    lines = [
        "# comfy-env benchmark results",
        "",
        f"Produced by `{command}` in {total_s:.0f} s"
        + (" (**quick mode: tiny sizes, smoke test only**)" if args.quick else "")
        + f", seed {args.seed}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}.",
        "All ratios are against references measured in the same run; targets are reported, "
        "never asserted. See `benchmarks/README.md` for the method.",
        "",
        "## Machine",
        "",
        f"- python: {info['python']} (`{info['executable']}`)",
        f"- platform: {info['platform']}",
        f"- CPU: {info['cpu_model'] or 'unknown'}; cpu_count {info['cpu_count']}, usable "
        f"{info['usable_cpus']}",
        f"- memory: {info['mem_total_gib']:.1f} GiB"
        if info["mem_total_gib"]
        else "- memory: unknown",
        f"- stdlib pools' default start method: {info['mp_start_method']}",
        "- load average (1/5/15 min) at the start: "
        + " / ".join(f"{x:.2f}" for x in info["loadavg"])
        + "; at the end: "
        + " / ".join(f"{x:.2f}" for x in os.getloadavg())
        + " (anything else running on the machine adds noise, cross-CPU figures most)",
        f"- byte code: {info.get('bytecode', 'as found')}",
        "",
        "## Peers",
        "",
        "| venv | status |",
        "|---|---|",
    ]
    for key, note in venv_notes.items():
        lines.append(f"| {key} | {note} |")
    if ctx.versions:
        lines += [
            "",
            "Peer versions: "
            + ", ".join(f"{m.split()[0]} {v}" for m, v in sorted(ctx.versions.items()))
            + ".",
        ]
    if ctx.unavailable:
        lines += ["", "Unavailable or partly unavailable peers:", ""]
        lines += [f"- {m}: {why}" for m, why in sorted(ctx.unavailable.items())]
    lines += ["", "## Targets", "", "| # | target | verdict | detail |", "|---|---|---|---|"]
    for section in sections:
        for t in section.targets:
            verdict = {True: "MET", False: "**NOT MET**", None: "not evaluated"}[t.met]
            lines.append(f"| {t.section} | {t.label} | {verdict} | {t.detail} |")
    for section in sections:
        lines += ["", section.markdown()]
    lines += ["", "## Process hygiene", ""]
    if final_leftovers:
        lines.append(
            "Left behind when the suite ended (processes were killed; this process's "
            "shared-memory blocks removed):"
        )
        lines += [f"- `{x}`" for x in final_leftovers]
    else:
        lines.append(
            "No child process and no comfy_env shared-memory block was left behind at the end "
            "of the run."
        )
    return "\n".join(lines) + "\n"


def write_results(path: str, text: str) -> None:
    """Write the results ``text`` to ``path``, keeping the blocks of the file already there
    that other scripts wrote (``sections.KEPT``: section 7, ComfyUI, from ``python3 dev.py
    bench-comfyui``, between sections 6 and 8; section 9, declared envs, from
    ``bench_build.py``, before the hygiene check), each in its place."""
    try:
        with open(path) as f:
            previous = f.read()
    except FileNotFoundError:
        previous = ""
    text = sections.keep_sections(previous, text)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--out`` resolved: ``benchmarks/RESULTS.md`` for a full run,
    ``benchmarks/out/quick.md`` (git-ignored) for ``--quick``, ``benchmarks/out/only.md``
    (git-ignored) for ``--only``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, a smoke test (about 50 s; about 80 s when the peer venvs are "
        "installed first)",
    )
    ap.add_argument(
        "--out",
        help="results file (default benchmarks/RESULTS.md; with --quick benchmarks/out/quick.md, "
        "with --only benchmarks/out/only.md)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffles")
    ap.add_argument(
        "--only",
        metavar="NAMES",
        help="comma-separated subset of: " + ", ".join(SECTIONS),
    )
    ap.add_argument("--no-install", action="store_true", help="never create the peer venvs")
    ap.add_argument("--reinstall", action="store_true", help="rebuild the peer venvs")
    args = ap.parse_args(argv)
    args.keys = list(SECTIONS) if not args.only else [k.strip() for k in args.only.split(",")]
    if args.out is None:
        # Only a full run of every section writes the tracked results file: a quick run or a
        # subset would replace it with a partial one (the other sections gone).
        if args.quick:
            args.out = QUICK_RESULTS
        elif args.only:
            args.out = ONLY_RESULTS
        else:
            args.out = RESULTS
    unknown = [k for k in args.keys if k not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s): {', '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keys: list[str] = args.keys

    t_start = time.monotonic()
    subreaper = become_subreaper()
    shm_before = shm_blocks()
    info = machine_info()
    info["bytecode"] = compile_bytecode()
    workdir = tempfile.mkdtemp(prefix="comfy-env-bench-")
    sections: list[Section] = []
    final_leftovers: list[str] = []
    venv_notes: dict[str, str] = {}
    ctx: Context | None = None
    try:
        print("peers: preparing venvs under benchmarks/.peers ...", flush=True)
        pythons, venv_notes = peers.setup(not args.no_install, args.reinstall, workdir)
        for key, note in venv_notes.items():
            print(f"  {key}: {note}", flush=True)
        ctx = Context(args.quick, args.seed, workdir, pythons)
        ctx.venv_reasons = {k: venv_notes[k] for k, v in pythons.items() if v is None}
        for key in keys:
            sections.append(run_section(key, ctx))
            if key == "crash":
                ctx.close_remotes()  # later sections start fresh peers of their own
    finally:
        if ctx is not None:
            ctx.close_remotes()
            if ctx.leftovers and sections:
                sections[-1].leftovers += ctx.leftovers
        time.sleep(0.2)
        stray = live_descendants()
        if stray:
            final_leftovers = [f"{p}: {cmdline(p)}" for p in stray]
            print("WARNING: processes left alive, killing them:", file=sys.stderr)
            for item in final_leftovers:
                print(f"  {item}", file=sys.stderr)
            kill_leftovers(stray)
        reap_zombies()
        shutil.rmtree(workdir, ignore_errors=True)
        shm_left = stale_shm(shm_before)
        for item in shm_left:
            print(f"WARNING: shared-memory block left behind: {item}", file=sys.stderr)
        final_leftovers += shm_left
    assert ctx is not None
    total = time.monotonic() - t_start
    text = render(info, args, ctx, venv_notes, sections, total, final_leftovers)
    if not subreaper:
        text += "\n(Could not become a child subreaper: orphaned processes may go unnoticed.)\n"
    write_results(args.out, text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": info,
                    "quick": args.quick,
                    "seconds": total,
                    "peers": venv_notes,
                    "versions": ctx.versions,
                    "sections": {s.key: s.data for s in sections},
                    "targets": [t.as_dict() for s in sections for t in s.targets],
                    "leftovers": final_leftovers,
                },
                f,
                indent=2,
                default=str,
            )
    print(f"\nwrote {args.out} ({total:.0f} s)")
    for section in sections:
        for t in section.targets:
            print(t.line().replace("**", ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
