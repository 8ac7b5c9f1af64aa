"""Declared envs: what building, reusing, listing and sharing an env costs (outside ``run_all.py``).

::

    .venv/bin/python benchmarks/bench_build.py [--rounds N] [--seed N] [--out PATH] [--no-write]

Writes its section, section 9 of ``benchmarks/RESULTS.md``, between the markers
``<!-- bench_build:begin -->`` and ``<!-- bench_build:end -->`` (``--no-write``: print only;
``--out``: another results file); ``run_all.py`` keeps that block when it rewrites the file
(``sections.py``). About 2 minutes on 2 cores; it needs the package index only if uv's or
pip's cache lacks the pins.

Method. Every figure is taken in this run, on this machine, with uv's cache warm (a first
build of each recipe fills it, untimed): what a build costs once the packages were downloaded
once, which is what a server restart or a second pack sees. The small recipe is four tiny
pure-Python packages (``six idna packaging iniconfig``, pinned); the shared-pages recipes hold
numpy (a large native package) and one small package each.

- Cold build, interleaved rounds (order shuffled per round, seeded), each method in a fresh
  process and a fresh root, timed from after the process's start and imports (``comfy_env``
  and its build module, whose first import is a row of its own) to the env's completion;
  comfy_env is compiled to byte code first, as ``pip install`` does:

  - ``build_env``: ``comfy_env.build_env(recipe)`` (find the interpreter, resolve with hashes,
    install, publish, verify); the host's own base interpreter, as ``python=None`` picks;
  - ``by hand``: the same uv commands typed by hand with the same interpreter and the flags
    ``_build.py`` passes: ``uv venv --relocatable --no-project --python PY DIR``, ``uv pip
    compile --quiet --generate-hashes --no-header`` of the same pins into ``env.lock``, ``uv pip
    sync --require-hashes env.lock`` (uv's own link mode: hardlinks, as build_env asks for
    when uv's cache and the root share a volume, which they do here);
  - ``python -m venv`` + ``pip install`` of the same pins with pip's cache warm, the manual way
    pack authors tell users to follow today.

  The ratio build_env / by hand is taken per round (median and range). Target: at most 1.15x.
- Reuse: ``build_env`` of an already built recipe in a fresh process (the build module's first
  import + key + one stat) and again in that process (the memo).
- First call of an already built env, interleaved rounds, a fresh ``Pool`` each time:
  ``pool.get_worker(recipe)`` + ``call("math:sqrt", 2.0)`` against ``pool.get_worker(path)`` +
  the same call on a plain ``python -m venv`` holding the same pins (the last venv + pip
  round's). Target: at most 5 ms more.
- ``comfy-env env list --json`` over 100 envs: one env is built for real, then laid out 100
  times under a fresh ``COMFY_ENV_HOME`` as the builder lays out its envs (``envs/<key>/`` as a
  hardlinked copy of the built env with its record rewritten to the new key, ``env.lock``,
  ``logs/<key>.log``, ``locks/<key>.lock``, ``used/<key>``; 100 real builds would take about
  a minute more). The command is timed as a whole process, and ``list_envs()`` in process.
  Target: at most 0.5 s.
- Four fresh processes ask for one new env at once: wall time until all have it (one builds,
  three wait).
- Shared pages: two envs with the same numpy but a different second package, built once with
  uv's hardlinks (the default here) and once with ``UV_LINK_MODE=copy``; a worker in each env
  imports numpy; the second worker's PSS (``psutil``'s ``memory_full_info().pss``: its
  private pages plus its share of the pages it maps with others) linked against copied, in
  interleaved rounds, only one pair alive at a time. With hardlinks both workers map the same
  files, so the page cache holds numpy's code once and each worker is charged half of it. The
  disk the two envs take, each inode counted once, is given beside it.

Targets are reported (MET / NOT MET), never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sections
from benchlib import compile_bytecode

HERE = Path(__file__).resolve().parent
PINS = ["six==1.16.0", "idna==3.7", "packaging==24.1", "iniconfig==2.0.0"]
NUMPY = "numpy==2.0.2"  # a large native package uv's cache holds for this Python
SHARED = ([NUMPY, "six==1.16.0"], [NUMPY, "idna==3.7"])
ENVS_LISTED = 100

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import comfy_env
recipe = comfy_env.Recipe(json.loads(sys.argv[1]))
t1 = time.perf_counter()
from comfy_env import build_env
t2 = time.perf_counter()
path = build_env(recipe)
t3 = time.perf_counter()
build_env(recipe)
t4 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "import_build": t2 - t1, "first": t3 - t2,
                  "again": t4 - t3, "path": str(path)}))
"""

# The same uv commands typed by hand (the flags comfy_env/_build.py passes), timed in a fresh
# process as the build_env child is, from after its start to the env's completion.
_BY_HAND = """
import json, os, subprocess, sys, time
uv, python, where, pins = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
t0 = time.perf_counter()
def run(*args):
    subprocess.run([uv, *args], check=True, capture_output=True, cwd=where)
os.makedirs(where)
run("venv", "--relocatable", "--no-project", "--python", python, "env")
with open(os.path.join(where, "requirements.in"), "w") as fh:
    fh.write("\\n".join(pins) + "\\n")
target = os.path.join(where, "env", "bin", "python")
run("pip", "compile", "--quiet", "--generate-hashes", "--no-header", "--python", target,
    "requirements.in", "-o", "env.lock")
run("pip", "sync", "--python", target, "--require-hashes", "env.lock")
print(time.perf_counter() - t0)
"""


def child(root: str, pins: list[str], **environ: str) -> dict[str, Any]:
    """``_CHILD`` in a fresh process with ``COMFY_ENV_HOME=root``: its timings and env path."""
    env = dict(os.environ, COMFY_ENV_HOME=root, **environ)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(pins)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def by_hand(uv: str, python: str, where: str, pins: list[str]) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _BY_HAND, uv, python, where, json.dumps(pins)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def venv_pip(python: str, where: str, pins: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([python, "-m", "venv", where], check=True, capture_output=True)
    subprocess.run(
        [os.path.join(where, "bin", "python"), "-m", "pip", "install", "-q", *pins],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def disk(paths: list[str]) -> tuple[int, int]:
    """(bytes counting each inode once, plain sum over the paths)."""
    seen: set[tuple[int, int]] = set()
    once = total = 0
    for path in paths:
        for folder, _dirs, files in os.walk(path):
            for name in files:
                st = os.lstat(os.path.join(folder, name))
                size = st.st_blocks * 512
                total += size
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    once += size
    return once, total


def ms(values: list[float]) -> str:
    """Median (min / max) in ms."""
    return (
        f"{statistics.median(values) * 1e3:.1f} ms "
        f"(min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f})"
    )


def verdict(ok: bool) -> str:
    return "MET" if ok else "**NOT MET**"


def interleaved(
    methods: dict[str, Callable[[int], float]], rounds: int, rng: random.Random
) -> dict[str, list[float]]:
    """Each method once a round, in an order shuffled per round: name -> per-round values."""
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(rounds):
        order = list(methods)
        rng.shuffle(order)
        for name in order:
            samples[name].append(methods[name](i))
    return samples


# ---- the measurements ----------------------------------------------------------------------


def bench_cold(scratch: str, rounds: int, rng: random.Random) -> tuple[list[str], str]:
    """Cold build against by hand and venv + pip; reuse. Rows, and the plain venv of the last
    venv + pip round (for the first-call comparison)."""
    from uv import find_uv_bin

    from comfy_env._build import find_python

    uv = str(find_uv_bin())
    python = find_python(None)[0]
    child(os.path.join(scratch, "warmup"), PINS)  # fills uv's cache, untimed
    by_hand(uv, python, os.path.join(scratch, "warmup-hand"), PINS)
    venv_pip(python, os.path.join(scratch, "warmup-venv"), PINS)  # and pip's
    roots: list[str] = []

    def build(i: int) -> float:
        roots.append(os.path.join(scratch, f"cold{i}"))
        return float(child(roots[-1], PINS)["first"])

    samples = interleaved(
        {
            "build_env": build,
            "by hand": lambda i: by_hand(uv, python, os.path.join(scratch, f"hand{i}"), PINS),
            "venv + pip": lambda i: venv_pip(python, os.path.join(scratch, f"pip{i}"), PINS),
        },
        rounds,
        rng,
    )
    fresh, memo, imports = [], [], []
    for root in roots:
        again = child(root, PINS)
        fresh.append(again["import_build"] + again["first"])
        memo.append(again["again"])
        imports.append(again["import_build"])
    ratios = [b / h for b, h in zip(samples["build_env"], samples["by hand"], strict=True)]
    pip_ratios = [b / p for b, p in zip(samples["build_env"], samples["venv + pip"], strict=True)]
    rows = [
        f"| cold build, `build_env` (warm uv cache) | {ms(samples['build_env'])} |",
        f"| the same uv commands by hand (venv, compile --generate-hashes, sync) | "
        f"{ms(samples['by hand'])} |",
        f"| `python -m venv` + `pip install` (warm pip cache) | {ms(samples['venv + pip'])} |",
        f"| ratio build_env / by hand, per round | {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}) |",
        f"| ratio build_env / venv + pip, per round | {statistics.median(pip_ratios):.2f}x "
        f"(min {min(pip_ratios):.2f}, max {max(pip_ratios):.2f}) |",
        f"| reused, fresh process (first import of the build module + key + stat) | {ms(fresh)} |",
        f"| of which the build module's first import (not in the cold-build rows) | "
        f"{ms(imports)} |",
        f"| reused, in process (memo) | {statistics.median(memo) * 1e6:.0f} us |",
    ]
    targets = [
        f"- Cold build at most 1.15x the same uv commands by hand: "
        f"{verdict(statistics.median(ratios) <= 1.15)} ({statistics.median(ratios):.2f}x, "
        "median of the per-round ratios).",
        f"- Cold build no slower than `python -m venv` + pip: "
        f"{verdict(statistics.median(pip_ratios) <= 1.0)} "
        f"({statistics.median(pip_ratios):.2f}x).",
        f"- Reuse in a fresh process under 100 ms: "
        f"{verdict(statistics.median(fresh) < 0.1)} ({statistics.median(fresh) * 1e3:.1f} ms).",
    ]
    return [*rows, "", *targets], os.path.join(scratch, f"pip{rounds - 1}")


def bench_first_call(root: str, plain: str, rounds: int, rng: random.Random) -> list[str]:
    """``get_worker`` + first call: a built recipe env against a plain venv path."""
    import comfy_env

    recipe = comfy_env.Recipe(PINS)
    saved = os.environ.get("COMFY_ENV_HOME")
    os.environ["COMFY_ENV_HOME"] = root  # where the recipe was built (the warm-up's root)

    def first_call(env: object) -> float:
        pool = comfy_env.Pool(comfy_env.PoolConfig(log_level="WARNING"))
        try:
            started = time.perf_counter()
            assert pool.get_worker(env).call("math:sqrt", 2.0) > 1.4  # type: ignore[arg-type]
            return time.perf_counter() - started
        finally:
            pool.close()

    try:
        methods = {"recipe": lambda i: first_call(recipe), "plain": lambda i: first_call(plain)}
        interleaved(methods, 1, rng)  # warm-up: the first pool of this process, untimed
        samples = interleaved(methods, rounds, rng)
    finally:
        if saved is None:
            os.environ.pop("COMFY_ENV_HOME", None)
        else:
            os.environ["COMFY_ENV_HOME"] = saved
    added = statistics.median(samples["recipe"]) - statistics.median(samples["plain"])
    diffs = [r - p for r, p in zip(samples["recipe"], samples["plain"], strict=True)]
    return [
        f"| `get_worker(recipe)` + first call, already built env | {ms(samples['recipe'])} |",
        f"| `get_worker(path)` + first call, plain `python -m venv` env, same pins | "
        f"{ms(samples['plain'])} |",
        f"| added (difference of the medians; per-round differences) | {added * 1e3:.1f} ms "
        f"({min(diffs) * 1e3:+.1f} to {max(diffs) * 1e3:+.1f}) |",
        "",
        f"- First call of a built env at most 5 ms more than a plain env path: "
        f"{verdict(added <= 0.005)} ({added * 1e3:+.1f} ms, {rounds} rounds, a fresh pool "
        "each).",
    ]


def lay_out(built: Path, root: Path, count: int) -> None:
    """``count`` envs under ``root`` as the builder lays them out, from the built env
    ``built`` (its root is ``built.parent.parent``): hardlinked copies with distinct keys,
    each record rewritten to its key."""
    import hashlib

    from comfy_env._build import RECORD_NAME

    source_root = built.parent.parent
    record = json.loads((built / RECORD_NAME).read_text())
    for sub in ("envs", "logs", "locks", "used"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        key = hashlib.sha256(f"{built.name}-{i}".encode()).hexdigest()[:20]
        target = root / "envs" / key
        shutil.copytree(built, target, symlinks=True, copy_function=os.link)
        (target / RECORD_NAME).unlink()  # (a link to the source's: written anew, not through)
        (target / RECORD_NAME).write_text(
            json.dumps(dict(record, key=key, created=time.time()), indent=1)
        )
        os.link(source_root / "logs" / f"{built.name}.log", root / "logs" / f"{key}.log")
        (root / "locks" / f"{key}.lock").write_text("")
        (root / "used" / key).touch()


def bench_list(built: Path, scratch: str, runs: int) -> list[str]:
    """``comfy-env env list --json`` (a process) and ``list_envs()`` over ``ENVS_LISTED``."""
    from comfy_env._envstore import list_envs

    root = Path(scratch) / "listed"
    started = time.perf_counter()
    lay_out(built, root, ENVS_LISTED)
    laid = time.perf_counter() - started
    script = Path(sys.executable).with_name("comfy-env")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "comfy_env"]
    env = dict(os.environ, COMFY_ENV_HOME=str(root))
    command_times, in_process = [], []
    for _ in range(runs):
        started = time.perf_counter()
        out = subprocess.run(
            [*command, "env", "list", "--json"], capture_output=True, env=env, check=True
        )
        command_times.append(time.perf_counter() - started)
        listed = json.loads(out.stdout)
        count = len(listed) if isinstance(listed, list) else len(listed.get("envs", ()))
        assert count == ENVS_LISTED, count
        started = time.perf_counter()
        assert len(list_envs(root)) == ENVS_LISTED
        in_process.append(time.perf_counter() - started)
    median = statistics.median(command_times)
    return [
        f"| `comfy-env env list --json` over {ENVS_LISTED} envs, whole process | "
        f"{ms(command_times)} |",
        f"| `list_envs()` over {ENVS_LISTED} envs, in process | {ms(in_process)} |",
        "",
        f"- `comfy-env env list` over {ENVS_LISTED} envs at most 0.5 s: "
        f"{verdict(median <= 0.5)} ({median * 1e3:.0f} ms, median of {runs} runs). The "
        f"{ENVS_LISTED} envs are hardlinked copies of one real build, laid out as the builder "
        f"lays out its envs, each record rewritten to its own key (laid out in {laid:.1f} s), "
        "not 100 real builds.",
    ]


def bench_together(scratch: str, rounds: int) -> list[str]:
    """Four fresh processes ask for one new env at once."""
    together = []
    for i in range(rounds):
        env = dict(os.environ, COMFY_ENV_HOME=os.path.join(scratch, f"together{i}"))
        started = time.perf_counter()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps(PINS)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for _ in range(4)
        ]
        paths = {json.loads(p.communicate()[0].strip().splitlines()[-1])["path"] for p in procs}
        together.append(time.perf_counter() - started)
        assert len(paths) == 1, paths
    return [
        f"| 4 fresh processes ask for one new env at once (one builds), wall | {ms(together)} |"
    ]


def bench_shared(scratch: str, rounds: int, rng: random.Random) -> list[str]:
    """The second of two workers (two envs, the same numpy) in PSS: linked against copied."""
    import psutil

    import comfy_env

    pairs: dict[str, tuple[str, str]] = {}
    for mode, environ in (("linked", {}), ("copied", {"UV_LINK_MODE": "copy"})):
        root = os.path.join(scratch, f"shared-{mode}")
        a, b = (str(child(root, pins, **environ)["path"]) for pins in SHARED)
        pairs[mode] = (a, b)

    def so_inode(env: str) -> tuple[int, int] | None:
        for folder, _dirs, files in os.walk(env):
            for name in files:
                if name.startswith("_multiarray_umath") and name.endswith(".so"):
                    st = os.stat(os.path.join(folder, name))
                    return st.st_dev, st.st_ino
        return None

    rss: dict[str, list[float]] = {mode: [] for mode in pairs}

    def second_pss(mode: str) -> float:
        pool = comfy_env.Pool(comfy_env.PoolConfig(log_level="WARNING"))
        try:
            workers = [pool.get_worker(env) for env in pairs[mode]]
            for worker in workers:
                assert worker.call("numpy:__version__.__str__") == NUMPY.split("==")[1]
            pid = workers[1].pid
            assert pid is not None
            info = psutil.Process(pid).memory_full_info()
            rss[mode].append(info.rss)
            return float(info.pss)
        finally:
            pool.close()

    samples = interleaved(
        {"linked": lambda i: second_pss("linked"), "copied": lambda i: second_pss("copied")},
        rounds,
        rng,
    )

    def mib(values: list[float]) -> str:
        return f"{statistics.median(values) / 2**20:.1f} MiB"

    linked, copied = (statistics.median(samples[m]) for m in ("linked", "copied"))
    inode = so_inode(pairs["linked"][0])
    shared = inode is not None and inode == so_inode(pairs["linked"][1])
    rows = [
        f"| second worker's PSS, numpy imported, envs hardlinked from uv's cache | "
        f"{mib(samples['linked'])} (RSS {mib(rss['linked'])}) |",
        f"| second worker's PSS, numpy imported, envs copied (`UV_LINK_MODE=copy`) | "
        f"{mib(samples['copied'])} (RSS {mib(rss['copied'])}) |",
        f"| PSS saved by the links | {(copied - linked) / 2**20:.1f} MiB |",
    ]
    for mode, (a, b) in pairs.items():
        once, total = disk([a, b])
        rows.append(
            f"| disk, the two envs, {mode} | {once / 2**20:.1f} MiB counted once per inode "
            f"({total / 2**20:.1f} MiB summed) |"
        )
    return [
        *rows,
        "",
        f"Shared pages: two envs with `{NUMPY}` (and `{SHARED[0][1]}`, `{SHARED[1][1]}`), a "
        "worker in each that imported numpy, only one pair alive at a time, "
        f"{rounds} interleaved rounds (median). Linked envs share numpy's extension module "
        f"file: {'yes' if shared else 'NO'} (same inode). No target: the figure shows what "
        "hardlinks save per extra worker.",
    ]


# ---- the section ---------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="cold-build rounds (5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the per-round shuffles")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"), help="results file")
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    bytecode = compile_bytecode()
    scratch = tempfile.mkdtemp(prefix="bench-build-")
    started = time.perf_counter()
    try:
        cold, plain = bench_cold(scratch, args.rounds, rng)
        built = Path(child(os.path.join(scratch, "warmup"), PINS)["path"])
        first = bench_first_call(os.path.join(scratch, "warmup"), plain, 3 * args.rounds, rng)
        listing = bench_list(built, scratch, args.rounds)
        together = bench_together(scratch, max(2, args.rounds // 2))
        shared = bench_shared(scratch, 3, rng)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    from importlib.metadata import version

    table = ["| figure | median (min, max) |", "|---|---|"]
    lines = [
        sections.BUILD.begin,
        "## 9. Declared envs: build, first call, list, shared pages",
        "",
        f"`.venv/bin/python benchmarks/bench_build.py`, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, Python "
        f"{sys.version.split()[0]}, uv {version('uv')}, {args.rounds} interleaved cold-build "
        f"rounds (shuffled, seed {args.seed}), each build in a fresh process and a fresh root, "
        f"uv's and pip's caches warm; {bytecode}; "
        f"{time.perf_counter() - started:.0f} s in all. Load "
        "average at the end: " + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + " (a "
        "shared 2-core machine: the spreads are wide). Method: the module's docstring.",
        "",
        *table,
        *cold,
        "",
        *table,
        *first,
        "",
        *table,
        *listing,
        "",
        *table,
        *together,
        "",
        *table,
        *shared,
        sections.BUILD.end,
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        sections.BUILD.write(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
