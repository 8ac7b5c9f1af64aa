"""The ``comfy-env`` command line.

Commands:
  demo [--env ENV]    walk through the lifecycle on a real worker: lazy spawn, a call, a
                      native segfault turned into WorkerCrashed, the replacement generation,
                      a timeout, and the stats.

Exit codes: 0 success; 1 the demo saw something other than what it demonstrates; 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import __version__
from ._config import PoolConfig
from ._errors import CallTimeout, ComfyEnvError, WorkerCrashed
from ._pool import Pool


def _timed(label: str, fn: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        ms = (time.perf_counter() - started) * 1000
        print(f"  {label:<44} {ms:8.1f} ms  -> {type(exc).__name__}")
        raise
    ms = (time.perf_counter() - started) * 1000
    print(f"  {label:<44} {ms:8.1f} ms  -> {result!r}")
    return result


def demo(env: str | None) -> int:
    """Run the lifecycle walk-through; returns the exit code."""
    print(f"comfy-env {__version__} demo on env: {env or 'the current interpreter'}\n")
    ok = True
    with Pool(PoolConfig()) as pool:
        worker = pool.get_worker(env)
        print(f"1. get_worker() spawns nothing: generation={worker.generation} pid={worker.pid}")
        print("2. the first call spawns, handshakes and canaries a worker, then runs:")
        _timed(
            "call tasks:info (cold)", lambda: worker.call("comfy_env_worker.tasks:info")["python"]
        )
        print(f"   worker is generation {worker.generation}, pid {worker.pid}")
        _timed("call tasks:echo (warm)", lambda: worker.call("comfy_env_worker.tasks:echo", 42))
        started = time.perf_counter()
        n = 2000
        for i in range(n):
            worker.call("comfy_env_worker.tasks:echo", i)
        per_call = (time.perf_counter() - started) / n * 1e6
        print(f"  {n} warm calls: {per_call:.1f} us per round trip")

        print("3. a native library segfaults (ctypes null read) inside a call:")
        first_pid = worker.pid
        try:
            _timed("call tasks:crash", lambda: worker.call("comfy_env_worker.tasks:crash"))
            ok = False
            print("   !! the crash did not surface")
        except WorkerCrashed as exc:
            print(
                f"   WorkerCrashed: signal={exc.signal} exitcode={exc.exitcode} "
                f"pid={exc.pid} generation={exc.generation} call_id={exc.call_id}"
            )
            frames = [ln for ln in exc.stderr_tail.splitlines() if "File" in ln][:2]
            for line in frames:
                print(f"   worker stack: {line.strip()}")
        print("4. the next call transparently gets a fresh worker:")
        _timed("call tasks:getpid", lambda: worker.call("comfy_env_worker.tasks:getpid"))
        print(f"   generation {worker.generation}, pid {worker.pid} (was {first_pid})")
        if worker.generation != 2:
            ok = False

        print("5. a call that overruns its deadline is stopped and its worker replaced:")
        try:
            _timed(
                "run tasks:sleep(10) with timeout=0.5",
                lambda: worker.run("comfy_env_worker.tasks:sleep", (10,), timeout=0.5),
            )
            ok = False
        except CallTimeout as exc:
            print(f"   CallTimeout: {exc}")
        _timed(
            "call tasks:echo after the timeout",
            lambda: worker.call("comfy_env_worker.tasks:echo", "alive"),
        )
        print(f"   generation {worker.generation}")

        print("6. stats:")
        stats = worker.stats()
        for field in (
            "submitted",
            "ok",
            "raised",
            "crashed",
            "timed_out",
            "cancelled",
            "failed",
            "in_flight",
            "queued",
            "spawns",
            "stale_events_dropped",
        ):
            print(f"   {field:<22} {getattr(stats, field)}")
    print("\npool closed: no worker process, socket or runtime dir is left behind.")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comfy-env",
        description="Run functions in crash-isolated worker processes, one per Python env.",
    )
    parser.add_argument("--version", action="version", version=f"comfy-env {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="walk through spawn, call, crash, replace, timeout")
    p_demo.add_argument(
        "--env",
        default=None,
        help="env directory or interpreter (default: the current interpreter)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return demo(args.env)
    except ComfyEnvError as exc:
        print(f"comfy-env: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
