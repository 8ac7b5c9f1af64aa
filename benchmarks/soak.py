"""A time-bounded soak of one Pool: many threads, several envs, random payloads, random crashes.

Not run in CI. Run it by hand::

    .venv/bin/python benchmarks/soak.py --seconds 60 --threads 8 --envs 4 --crash-rate 0.01

``--threads`` caller threads pick one of ``--envs`` envs at random for every call (each env is a
directory whose ``bin/python`` is a symlink to this interpreter; the pool keys envs by
directory). A call is ``comfy_env_worker.tasks:echo`` with a random payload (small ints, short
strings and, if numpy is importable, 2 MiB arrays that travel through shared memory), or, with
probability ``--crash-rate``, ``comfy_env_worker.tasks:crash`` (a real SIGSEGV).

Every call must resolve: an echo returns a value equal to its argument, a crash raises a typed
``comfy_env`` error. A call that neither returns nor raises within ``--hang-after`` seconds
counts as hung (lost). At the end the pool is closed and the host is checked for leaks: child
processes, ``/dev/shm`` blocks ``ce-<pid>-*``, runtime directories ``host-<pid>-*`` and open
descriptors, each against a snapshot taken before the pool started.

Prints a summary and exits 1 if any call was lost, hung or wrong, or anything leaked.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

import comfy_env
from comfy_env._process import runtime_root

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is optional
    np = None  # type: ignore[assignment]

ARRAY_BYTES = 2 * 1024 * 1024


@dataclass
class Tally:
    """Counters shared by the caller threads (updated under ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    submitted: int = 0
    resolved: int = 0
    ok: int = 0
    arrays: int = 0
    crashes: int = 0
    wrong: list[str] = field(default_factory=list)
    in_progress: dict[int, tuple[float, str]] = field(default_factory=dict)
    hung: set[tuple[int, float]] = field(default_factory=set)


def _fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


def _children() -> set[tuple[int, float]]:
    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            out.add((child.pid, child.create_time()))
        except psutil.NoSuchProcess:
            pass
    return out


def _shm() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(f"ce-{os.getpid()}-")}
    except FileNotFoundError:
        return set()


def _runtime_dirs() -> set[str]:
    prefix = f"host-{os.getpid()}-"
    return {d for d in os.listdir(runtime_root()) if d.startswith(prefix)}


PROBES: dict[str, Callable[[], set[Any]]] = {
    "child processes": _children,
    "/dev/shm blocks": _shm,
    "runtime dirs": _runtime_dirs,
    "descriptors": _fds,
}


def make_envs(root: Path, count: int) -> list[Path]:
    envs = []
    for i in range(count):
        bindir = root / f"env{i}" / "bin"
        bindir.mkdir(parents=True)
        (bindir / "python").symlink_to(sys.executable)
        envs.append(root / f"env{i}")
    return envs


def payload(rng: random.Random) -> Any:
    roll = rng.random()
    if np is not None and roll < 0.1:
        return np.frombuffer(rng.randbytes(ARRAY_BYTES), dtype=np.uint8).copy()
    if roll < 0.2:
        return "".join(rng.choice("abcdef") for _ in range(rng.randrange(32)))
    return rng.randrange(-1000, 1000)


def same(a: Any, b: Any) -> bool:
    if np is not None and isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def caller(
    seed: int,
    workers: list[comfy_env.Worker],
    stop_at: float,
    crash_rate: float,
    tally: Tally,
) -> None:
    rng = random.Random(seed)
    me = threading.get_ident()
    while time.monotonic() < stop_at:
        w = rng.choice(workers)
        crash = rng.random() < crash_rate
        value = None if crash else payload(rng)
        what = f"crash on {w.env}" if crash else f"echo({type(value).__name__}) on {w.env}"
        with tally.lock:
            tally.submitted += 1
            tally.in_progress[me] = (time.monotonic(), what)
        error: str | None = None
        is_array = False
        try:
            if crash:
                w.call("comfy_env_worker.tasks:crash")
                error = f"{what}: returned instead of raising"
            else:
                result = w.call("comfy_env_worker.tasks:echo", value)
                is_array = np is not None and isinstance(value, np.ndarray)
                if not same(result, value):
                    error = f"{what}: result differs from the argument"
        except comfy_env.ComfyEnvError as exc:
            if not crash:
                error = f"{what}: {type(exc).__name__}: {exc}"
        except BaseException as exc:  # noqa: BLE001 - every failure is reported
            error = f"{what}: untyped {type(exc).__name__}: {exc}"
        with tally.lock:
            del tally.in_progress[me]
            tally.resolved += 1
            if error is not None:
                tally.wrong.append(error)
            elif crash:
                tally.crashes += 1
            else:
                tally.ok += 1
                tally.arrays += is_array


def watch_for_hangs(tally: Tally, hang_after: float, done: threading.Event) -> None:
    while not done.wait(0.5):
        now = time.monotonic()
        with tally.lock:
            for ident, (started, _what) in tally.in_progress.items():
                if now - started > hang_after:
                    tally.hung.add((ident, started))


def leaks(before: dict[str, set[Any]], timeout: float = 5.0) -> dict[str, set[Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for name, probe in PROBES.items():
            extra = probe() - before[name]
            if extra:
                found[name] = extra
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--crash-rate", type=float, default=0.01)
    parser.add_argument("--hang-after", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="show the workers' output")
    args = parser.parse_args(argv)
    if not args.verbose:  # crash reports (faulthandler stacks) would flood the terminal
        logging.getLogger("comfy_env.worker").setLevel(logging.ERROR)

    with tempfile.TemporaryDirectory(prefix="comfy-env-soak-") as tmp:
        envs = make_envs(Path(tmp), args.envs)
        before = {name: probe() for name, probe in PROBES.items()}
        tally = Tally()
        pool = comfy_env.Pool(comfy_env.PoolConfig(max_restarts=10**6))
        workers = [pool.get_worker(env) for env in envs]
        started = time.monotonic()
        stop_at = started + args.seconds
        done = threading.Event()
        watcher = threading.Thread(target=watch_for_hangs, args=(tally, args.hang_after, done))
        watcher.start()
        threads = [
            threading.Thread(
                target=caller,
                args=(args.seed * 1000 + i, workers, stop_at, args.crash_rate, tally),
                daemon=True,
            )
            for i in range(args.threads)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, stop_at - time.monotonic()) + args.hang_after)
        elapsed = time.monotonic() - started
        done.set()
        watcher.join()
        stuck = [t for t in threads if t.is_alive()]
        with tally.lock:
            for ident, (t0, _what) in tally.in_progress.items():
                tally.hung.add((ident, t0))
            submitted, resolved = tally.submitted, tally.resolved
            hung, wrong = len(tally.hung), list(tally.wrong)
            pending = dict(tally.in_progress)
        pool.close()
        for t in stuck:
            t.join(10)
        stats = pool.stats()
        found = leaks(before)

    lost = submitted - resolved
    print(
        f"soak: {args.seconds:g} s, {args.threads} threads, {args.envs} envs, "
        f"crash rate {args.crash_rate:g}, numpy {'yes' if np is not None else 'no'}"
    )
    print(f"calls completed:   {resolved} of {submitted} submitted ({resolved / elapsed:.0f}/s)")
    print(f"  echo ok:         {tally.ok} ({tally.arrays} of them 2 MiB arrays)")
    print(f"  crashes:         {tally.crashes} (each a typed comfy_env error)")
    print(f"  spawns:          {sum(s.spawns for s in stats.values())}")
    print(f"  wrong outcomes:  {len(wrong)}")
    for line in wrong[:20]:
        print(f"    {line}")
    print(f"  lost:            {lost}; hung (> {args.hang_after:g} s): {hung}")
    for _ident, (_t0, what) in pending.items():
        print(f"    still waiting: {what}")
    every = lost == 0 and hung == 0 and not wrong
    print(f"every call resolved: {'yes' if every else 'NO'}")
    if found:
        for name, extra in found.items():
            print(f"LEAK: {name}: {sorted(map(str, extra))[:10]}")
    else:
        print("leaks found: none")
    return 0 if every and not found else 1


if __name__ == "__main__":
    sys.exit(main())
