"""Declared envs: what building, reusing and sharing an env costs (outside ``run_all.py``).

::

    .venv/bin/python benchmarks/bench_build.py [--rounds N] [--out PATH]

Method. Every figure is taken in this run, on this machine, with uv's cache warm (a first
build of the recipe fills it, untimed): what a second machine-local build costs once the
packages were downloaded once, which is what a server restart or a second pack sees. The
recipe is four tiny pure-Python packages (``six idna packaging iniconfig``, pinned).

- ``cold build``: ``comfy_env.build_env(recipe)`` into a fresh env root (a new key each
  round: the root differs), in a fresh process: find the interpreter, resolve with hashes,
  install, publish, verify.
- ``reference: venv + pip``: ``python -m venv`` then ``pip install`` of the same pins with
  pip's cache warm, the manual way pack authors tell users to follow today.
- ``reused (fresh process)``: ``build_env`` of an already built recipe in a fresh process
  (the build module's first import + key + one stat; the host's own interpreter is not
  launched to probe it), and ``reused (in process)``: the same call again in
  that process (the memo: a stat).
- ``4 processes at once``: four fresh processes ask for one new env together; wall time until
  all have it (one builds, three wait), against one ``cold build``.
- ``disk``: two envs holding the same four packages (plus one more in the second): bytes on
  disk counted once per inode (uv hardlinks from its cache) against the plain sum.

Targets are reported, not asserted: reuse in a fresh process under 100 ms; a cold build
(warm cache) no slower than venv + pip.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PINS = ["six==1.16.0", "idna==3.7", "packaging==24.1", "iniconfig==2.0.0"]

_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import comfy_env
recipe = comfy_env.Recipe(json.loads(sys.argv[1]))
t1 = time.perf_counter()
path = comfy_env.build_env(recipe)
t2 = time.perf_counter()
comfy_env.build_env(recipe)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "first": t2 - t1, "again": t3 - t2, "path": str(path)}))
"""


def child(root: str, pins: list[str]) -> dict[str, float]:
    env = dict(os.environ, COMFY_ENV_HOME=root)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(pins)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def venv_pip(where: str, pins: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", where], check=True, capture_output=True)
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
    return f"{statistics.median(values) * 1000:.0f} ms (min {min(values) * 1000:.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the markdown here")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="bench-build-")
    rows: list[tuple[str, str]] = []
    try:
        child(os.path.join(scratch, "warmup"), PINS)  # fills uv's cache, untimed
        venv_pip(os.path.join(scratch, "warmup-venv"), PINS)  # and pip's
        cold, reused_fresh, reused_memo, pip = [], [], [], []
        for i in range(args.rounds):
            root = os.path.join(scratch, f"r{i}")
            first = child(root, PINS)
            cold.append(first["first"])
            again = child(root, PINS)
            reused_fresh.append(again["first"])
            reused_memo.append(again["again"])
            pip.append(venv_pip(os.path.join(scratch, f"pip{i}"), PINS))
        rows += [
            ("cold build (warm uv cache)", ms(cold)),
            ("reference: python -m venv + pip install (warm pip cache)", ms(pip)),
            (
                "reused, fresh process (first import of the build module + key + stat)",
                ms(reused_fresh),
            ),
            ("reused, in process (memo)", f"{statistics.median(reused_memo) * 1e6:.0f} us"),
        ]
        together = []
        for i in range(args.rounds):
            root = os.path.join(scratch, f"c{i}")
            env = dict(os.environ, COMFY_ENV_HOME=root)
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
        rows.append(("4 processes ask at once (one builds), wall", ms(together)))
        root = os.path.join(scratch, "disk")
        a = child(root, PINS)["path"]
        b = child(root, [*PINS, "pluggy==1.5.0"])["path"]
        once, total = disk([a, b])
        rows.append(
            (
                "disk, two envs sharing 4 packages",
                f"{once / 2**20:.2f} MiB counted once per inode vs {total / 2**20:.2f} MiB summed",
            )
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [
        "| figure | value |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
