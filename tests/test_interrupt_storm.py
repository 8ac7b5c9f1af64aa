"""Bursts of Ctrl-C (SIGINT) against a real host while it calls, starts and loses workers.

A host process runs a loop of calls of one kind (``VARIANTS``) and catches ``KeyboardInterrupt``
around each; this test sends it SIGINT at seeded random intervals of 0.5-10 ms for a bounded
time (Jupyter's repeated "interrupt kernel", a double Ctrl-C in a REPL). Then the host stops
catching and checks that the pool's bookkeeping came through sound: no slot starting without
a start in progress, no slot leased, no call queued or in flight, the counters adding up; one
more call must succeed within a deadline; the pool closes. This test then checks the host
exited 0 and left no worker process and no shared-memory block behind.

``STORM_SEEDS=N`` runs N seeds per variant instead of the suite's few.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_host

from comfy_env._identity import owner_of

VARIANTS = ("small", "crash", "shm", "cold", "queue")
_SEEDS = int(os.environ.get("STORM_SEEDS", "0"))
CASES = (
    [(v, s) for v in VARIANTS for s in range(_SEEDS)]
    if _SEEDS
    else [("small", 1), ("small", 2), ("crash", 1), ("shm", 1), ("cold", 1), ("queue", 1)]
)
STORM_SECONDS = 1.2

HOST = r"""
import faulthandler, json, os, signal, sys, time

import comfy_env
from comfy_env import PoolConfig, WorkerCrashed
from comfy_env._identity import host_id

variant, flag = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job ignores it)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # (a hang: the test asks where)
config = PoolConfig(
    sys_path=(os.environ["PYTHONPATH"],),
    kill_grace=0.5,
    close_timeout=5.0,
    cancel_grace=0.5,
    max_restarts=1000000,
    call_timeout=3.0,  # a stuck slot turns into timeouts here, not into a hung host
)
pool = comfy_env.Pool(config)
spawned = []
pool.subscribe(
    lambda e: spawned.append(e.pid) if type(e).__name__ == "WorkerSpawned" else None
)
worker = pool.get_worker()
counts = {"ok": 0, "interrupted": 0, "errors": 0}
errors = {}

if variant == "shm":
    import numpy as np
    big = np.ones(100_000, dtype="float32")  # 400 kB: out of band both ways


def step(i):
    if variant == "small":
        assert worker.call("tasks.remote:add", i, 1) == i + 1
    elif variant == "crash":
        if i % 4 == 3:
            try:
                worker.call("tasks.remote:kill_self", 9)
            except WorkerCrashed:
                pass
        else:
            assert worker.call("tasks.remote:add", i, 1) == i + 1
    elif variant == "shm":
        if i % 2:
            assert worker.call("tasks.remote:hold_array", big, 0.0) == 100_000.0
        else:
            assert worker.call("tasks.remote:filled", 2.0, 100_000).shape == (100_000,)
    elif variant == "queue":
        assert worker.call("tasks.remote:add", i, 1) == i + 1
    elif variant == "cold":
        if i % 3 == 0:
            pool.retire_idle()
            pool.reset()
        assert worker.call("tasks.remote:add", i, 1) == i + 1


def other_caller():
    # Holds the env's one slot often: the main thread's calls wait in the queue.
    i = 0
    while not os.path.exists(flag):
        i += 1
        try:
            worker.call("tasks.remote:sleep_then", 0.003, i)
        except comfy_env.ComfyEnvError:
            pass  # its worker stopped by a Ctrl-C of the main thread's call


if variant == "queue":
    import threading
    other = threading.Thread(target=other_caller)
    other.start()


def storm():
    i = 0
    while not os.path.exists(flag):
        i += 1
        try:
            step(i)
            counts["ok"] += 1
        except KeyboardInterrupt:
            counts["interrupted"] += 1
        except comfy_env.ComfyEnvError as exc:  # e.g. a call cancelled by Ctrl-C while queued
            counts["errors"] += 1
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1


def guarded(fn):
    # Ctrl-C may land anywhere, also in an except clause: nested catchers take what escapes.
    while True:
        try:
            while True:
                try:
                    while True:
                        try:
                            return fn()
                        except KeyboardInterrupt:
                            counts["interrupted"] += 1
                except KeyboardInterrupt:
                    counts["interrupted"] += 1
        except KeyboardInterrupt:
            counts["interrupted"] += 1


print("ready", flush=True)
late = []


def storm_then_stop_catching():
    storm()  # (returns at once when retried: the flag is there)
    time.sleep(0.2)  # signals still on their way land here
    signal.signal(signal.SIGINT, lambda *a: late.append(1))


guarded(storm_then_stop_catching)
if variant == "queue":
    other.join()

# No more interrupts: is the pool sound?
problems = []
if errors.get("CallTimeout"):
    problems.append(f"{errors['CallTimeout']} calls timed out during the storm")
for key, st in pool.stats().items():
    for w in st.workers:
        if w.state == "starting":
            problems.append(f"slot {w.slot} of {key} starting: {w}")
    if st.in_flight or st.queued:
        problems.append(f"{key}: in_flight={st.in_flight} queued={st.queued}")
    ended = st.ok + st.raised + st.crashed + st.timed_out + st.cancelled + st.failed
    if ended != st.submitted:
        problems.append(f"{key}: submitted={st.submitted} but {ended} ended: {st}")
for key, entry in pool._entries.items():
    for slot in entry.slots:
        if slot.leased:
            problems.append(f"slot {slot.index} of {key} leased: {slot.state}")
    if entry.waiters:
        problems.append(f"{key}: {len(entry.waiters)} waiters")
started = time.monotonic()
try:
    last = worker.run("tasks.remote:add", (1, 1), timeout=20.0)
    if last != 2:
        problems.append(f"the last call returned {last!r}")
except BaseException as exc:
    problems.append(f"the last call failed after {time.monotonic() - started:.1f}s: {exc!r}")
pool.close()
print(json.dumps({
    "problems": problems, "counts": counts, "errors": errors, "late": len(late),
    "spawned": spawned, "host_id": host_id(),
}), flush=True)
sys.exit(1 if problems else 0)
"""


def _shm_of(pid: int) -> set[str]:
    out = set()
    for name in os.listdir("/dev/shm"):
        owner = owner_of(name)
        if owner is not None and owner[0] == pid:
            out.add(name)
    return out


def _storm(pid: int, seed: int, seconds: float) -> int:
    """Bursts of 1-30 SIGINTs 0.5-10 ms apart, with quiet gaps of 0-150 ms between them (in
    which calls and starts get to finish, so the next burst meets them in every state)."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    sent = 0
    while time.monotonic() < end:
        for _ in range(rng.randint(1, 30)):
            time.sleep(rng.uniform(0.0005, 0.010))
            os.kill(pid, signal.SIGINT)
            sent += 1
        time.sleep(rng.uniform(0.0, 0.150))
    return sent


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("variant", "seed"), CASES)
def test_a_ctrl_c_storm_leaves_the_pool_sound(variant: str, seed: int, tmp_path: Path) -> None:
    flag = tmp_path / "stop"
    host = run_host(HOST, variant, str(flag))
    try:
        assert host.stdout is not None
        line = host.stdout.readline()
        assert line.strip() == "ready", line + host.communicate(timeout=30)[1]
        sent = _storm(host.pid, seed * 1000 + VARIANTS.index(variant), STORM_SECONDS)
        flag.touch()
        out, err = host.communicate(timeout=60)
    finally:
        if host.poll() is None:
            os.kill(host.pid, signal.SIGUSR1)  # its threads' stacks, on its stderr
            time.sleep(0.5)
            os.killpg(host.pid, signal.SIGKILL)
            host.communicate()
    lines = out.strip().splitlines()
    assert lines, f"the host said nothing (rc {host.returncode}); stderr:\n{err[-4000:]}"
    report = json.loads(lines[-1])
    print(variant, seed, "sent", sent, report["counts"], report["errors"])
    assert report["problems"] == [], "\n".join(report["problems"]) + "\n" + err[-4000:]
    assert host.returncode == 0, err[-4000:]
    assert report["late"] == 0
    # Nothing outlives the host: no worker, no block of its shared memory.
    deadline = time.monotonic() + 5.0
    while True:
        alive = [p for p in report["spawned"] if psutil.pid_exists(p) and _is_worker(p)]
        blocks = _shm_of(host.pid)
        if (not alive and not blocks) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert alive == [], f"workers outlived the host: {alive}"
    assert blocks == set(), f"shared memory outlived the host: {blocks}"


def _is_worker(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "comfy_env_worker" in " ".join(
            proc.cmdline()
        )
    except psutil.Error:
        return False
