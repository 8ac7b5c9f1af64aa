"""Instructions per warm small call, each side, counted by callgrind: a figure the noise of a
shared VM cannot move.

Not part of ``run_all.py`` (it needs valgrind and takes a few minutes). Wall and on-CPU times
on this VM move by 1.5-2x between hours (HISTORY.md); the user-space instructions a call
executes do not: callgrind counts them, repeatably for the same interpreter, code and inputs,
whatever else the machine does. They leave out the kernel (system calls, context switches)
and the cost of cache misses, so they are no wall time; they tell where a side's own work is
and whether a change removed any.

Method. For each method a driver process (this interpreter, ``PYTHONHASHSEED=0``) makes a
warm-up of 50 calls and then ``N`` calls of ``f(x) = x``, and exits; it runs under
``valgrind --tool=callgrind --trace-children=yes``, once with ``N = --base`` and once with
``N = --base + --calls``. Per process (the caller; its worker) the difference of the two
totals, divided by ``--calls``, is the count per call: start-up, imports and shutdown cancel
out. The caller's count is its calling thread's alone: a pool's reactor thread does no work
per plain call, but it does timed work (the status file, at most twice a second) that a run
under valgrind, about 50 times slower, would spread over fewer calls. The worker's count is
all its threads'. comfy_env runs with ``spin_wait=0`` (a poll before sleeping would count its
spins); its pool's watcher is left out.

``await worker.acall(...)`` is not counted: it waits on the spot for a reply for at most
200 us (``_acall._REPLY_SPIN``) and then through the event loop, and under valgrind no reply
comes within 200 us, so what it would count is the loop's path, not the one a quick call takes.

Methods (the rows of ``bench_small_call.py``):

``raw pipe`` / ``raw socketpairs``
    ``benchlib.RawChild``: a length-prefixed pickle echo over two pipes / two socketpairs.
``minimal host, minimal worker``
    comfy_env's frames alone at both ends (``bench_small_call.MinimalWorker``).
``minimal host, comfy_env worker``
    The same host on a worker of comfy_env's own (``bench_small_call.MinimalHost``).
``comfy_env``
    ``worker.call(...)`` of a pool with one warm worker.

``python benchmarks/count_instructions.py [--tree PATH ...] [--calls 1000] [--base 200]
[--only NAMES] [--json PATH]``: ``--tree`` counts the comfy_env methods again with
``comfy_env`` imported from ``PATH`` (a copy of the repository, e.g. one built with ``dev.py
compile``), as ``ab_hotpath.py``'s ``tree:`` arms do.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from bench_small_call import (  # noqa: E402 - the rows' names, as that benchmark has them
    COMFY_ENV,
    MINIMAL_BOTH,
    MINIMAL_HOST,
    RAW_PIPE,
    RAW_SOCKETPAIRS,
)

METHODS = (RAW_PIPE, RAW_SOCKETPAIRS, MINIMAL_BOTH, MINIMAL_HOST, COMFY_ENV)
TREE_METHODS = (MINIMAL_HOST, COMFY_ENV)

# Marks the driver's own command line (how its callgrind file is told from its children's).
_MARK = "count_instructions_driver"

# argv: mark, bench dir, method, warm-up calls, calls.
_DRIVER = r"""
import sys
bench_dir, method = sys.argv[2], sys.argv[3]
warm, n = int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, bench_dir)
ECHO = "comfy_env_worker.tasks:echo"
close = []
if method in ("raw pipe", "raw socketpairs"):
    import benchlib
    raw = benchlib.RawChild("pipe" if method == "raw pipe" else "sock2")
    call = raw.call
    close.append(raw.close)
elif method == "minimal host, minimal worker":
    from bench_small_call import MinimalWorker
    minimal = MinimalWorker()
    call = minimal.call
    close.append(minimal.close)
else:
    import benchlib
    import comfy_env
    import comfy_env._pool
    print("module", comfy_env._pool.__file__, flush=True)  # which tree, compiled or not
    pool = comfy_env.Pool(comfy_env.PoolConfig(spin_wait=0, start_timeout=300))
    close.append(pool.close)
    worker = pool.get_worker(None)
    worker.call(ECHO, 0)
    benchlib.settle_pool(pool, timeout=60)  # its watcher's start-up, before the counted calls
    if method == "minimal host, comfy_env worker":
        from bench_small_call import MinimalHost
        call = MinimalHost(pool).call
    else:
        def call(x):
            return worker.call(ECHO, x)
def batch(k):
    for i in range(k):
        if call(i) != i:
            raise SystemExit(method + " did not echo")
batch(warm)
batch(n)
for fn in close:
    fn()
"""


def _count(method: str, n: int, tree: str | None, out_dir: str) -> tuple[int, int, str]:
    """(caller, worker) instructions of one driver run of ``n`` calls, and the file
    ``comfy_env._pool`` came from ("" for the methods without comfy_env's host)."""
    for old in glob.glob(os.path.join(out_dir, "*.out*")):
        os.unlink(old)
    env = dict(os.environ, PYTHONHASHSEED="0")
    if tree is not None:
        paths = [tree, os.path.join(tree, "workers")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--trace-children=yes",
        "--separate-threads=yes",
        f"--callgrind-out-file={os.path.join(out_dir, '%p.out')}",
        sys.executable,
        "-c",
        _DRIVER,
        _MARK,
        BENCH_DIR,
        method,
        "50",
        str(n),
    ]
    # (cwd: ``-c`` puts it first on sys.path, ahead of PYTHONPATH: never a checkout.)
    done = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{method}: the driver failed:\n{done.stderr[-3000:]}")
    caller = worker = 0
    for path in glob.glob(os.path.join(out_dir, "*.out-*")):  # one file per thread
        command, total = "", 0
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("cmd:"):
                    command = line
                elif line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
                    break
        if _MARK in command:
            if path.endswith("-01"):  # the calling thread (the process's first)
                caller = total
        elif "watch_host" in command:
            continue  # the pool's watcher: asleep in a read, not part of a call
        elif command:
            worker += total
    if not caller or not worker:
        raise RuntimeError(f"{method}: no callgrind totals for the caller or the worker")
    module = "".join(ln[7:] for ln in done.stdout.splitlines() if ln.startswith("module "))
    return caller, worker, module


def count(method: str, calls: int, base: int, tree: str | None) -> dict[str, Any]:
    out_dir = tempfile.mkdtemp(prefix="comfy-env-callgrind-")
    try:
        c0, w0, _ = _count(method, base, tree, out_dir)
        c1, w1, module = _count(method, base + calls, tree, out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {"caller": (c1 - c0) / calls, "worker": (w1 - w0) / calls, "module": module}


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    ref = rows.get(RAW_PIPE)
    ref_sum = ref["caller"] + ref["worker"] if ref else None
    lines = [
        "| method | caller instructions/call | worker instructions/call | sum | x raw pipe (sum) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        total = r["caller"] + r["worker"]
        x = f"{total / ref_sum:.2f}x" if ref_sum else "-"
        lines.append(f"| {name} | {r['caller']:,.0f} | {r['worker']:,.0f} | {total:,.0f} | {x} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls counted (the difference)")
    parser.add_argument("--base", type=int, default=200, help="calls of the shorter run")
    parser.add_argument("--tree", action="append", default=[], help="another repository copy")
    parser.add_argument("--only", default="", help="comma-separated method names")
    parser.add_argument("--json", help="write the counts as JSON to this path")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("count_instructions: valgrind is not installed", file=sys.stderr)
        return 2
    only = {m.strip() for m in args.only.split(",") if m.strip()}
    unknown = only - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    rows: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        if only and method not in only:
            continue
        rows[method] = count(method, args.calls, args.base, None)
        print(f"{method}: {rows[method]}", file=sys.stderr, flush=True)
        for tree in args.tree:
            if method in TREE_METHODS:
                name = f"{method} ({tree})"
                rows[name] = count(method, args.calls, args.base, os.path.abspath(tree))
                print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    print("\n".join(table(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
