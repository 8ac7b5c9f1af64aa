"""A worker's descendants and shutdown: a setsid descendant (its own session) is stopped when its
generation dies and at ``close()``, also when its scan is still due at close; a dead generation
holds none of the host's descriptors while a descendant keeps its pipes; and ``close()`` while
many envs start (each with an escaped descendant holding its output pipes) is one bounded
wait, not one per env.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    alive,
    wait_until,
)
from conftest import gone as _gone
from conftest import kill_quietly as _kill_quietly

import comfy_env


def test_a_setsid_descendant_is_stopped_when_its_generation_dies(pool: comfy_env.Pool) -> None:
    worker = pool.get_worker()
    descendant = worker.call("tasks.hostile:spawn_setsid_sleeper", False)
    try:
        assert alive(descendant)
        with pytest.raises(comfy_env.WorkerCrashed):
            worker.call("tasks.hostile:die", 3)
        assert wait_until(lambda: _gone(descendant), 10), "a setsid descendant outlived its worker"
    finally:
        _kill_quietly(descendant)


def test_a_descendant_scan_still_due_at_close_runs_at_close(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scan for a dead generation's setsid descendants runs on a reactor timer after the
    # exit (off the crash report's path). Here the timer is set far out: only close() can run
    # the scan, also for a generation the pool no longer lists (its slot holds generation 2).
    from comfy_env import _exitwatch

    monkeypatch.setattr(_exitwatch, "_MARKED_SCAN_DELAY", 3600.0)
    with comfy_env.Pool(config) as pool:
        worker = pool.get_worker()
        descendant = worker.call("tasks.hostile:spawn_setsid_sleeper", False)
        try:
            with pytest.raises(comfy_env.WorkerCrashed):
                worker.call("tasks.hostile:die", 3)
            assert worker.call("tasks.hostile:add", 1, 2) == 3  # generation 2
            assert alive(descendant)  # its scan is due in an hour
        except BaseException:
            _kill_quietly(descendant)
            raise
    try:
        assert wait_until(lambda: _gone(descendant), 10), "a due scan did not run at close"
    finally:
        _kill_quietly(descendant)


def test_a_setsid_descendant_is_stopped_at_close(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config) as pool:
        descendant = pool.get_worker().call("tasks.hostile:spawn_setsid_sleeper", False)
    try:
        assert wait_until(lambda: _gone(descendant), 10), "a setsid descendant outlived close()"
    finally:
        _kill_quietly(descendant)


def _links(fds: list[int]) -> set[str]:
    out = set()
    for fd in fds:
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def _open_links() -> set[str]:
    return _links([int(fd) for fd in os.listdir("/proc/self/fd")])


def test_a_dead_generation_holds_no_host_descriptors_while_a_descendant_keeps_its_pipes(
    pool: comfy_env.Pool,
) -> None:
    worker = pool.get_worker()
    # It cleared its environment: no mark finds it, and it keeps stdout/stderr open.
    descendant = worker.call("tasks.hostile:spawn_setsid_sleeper", True)
    try:
        process = pool._entries[worker.env].slots[0].process
        assert process is not None and process.popen is not None
        streams = (process.pipes._stdout, process.pipes._stderr, process.pipes._log_pipe)
        # Both ends: the host keeps the write ends open until the reaping (see launch).
        pipes = [p.fileno() for p in streams if p] + list(process.pipes._held_ends)
        assert len(pipes) == 6
        held = _links(pipes)
        assert held and all(link.startswith("pipe:") for link in held)
        with pytest.raises(comfy_env.WorkerCrashed):
            worker.call("tasks.hostile:die", 3)
        assert alive(descendant)
        assert wait_until(lambda: not (held & _open_links()), 10), "the dead generation's pipes"
        assert worker.call("tasks.hostile:add", 1, 2) == 3
    finally:
        _kill_quietly(descendant)


def test_close_while_many_envs_start_is_one_bounded_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from comfy_env._exitwatch import ExitWatch
    from comfy_env._outputpipes import OutputPipes

    real = os.path.realpath(sys.executable)
    pidfile = tmp_path / "escaped.pids"
    envs = []
    for i in range(12):
        env = tmp_path / f"slow{i}"
        (env / "bin").mkdir(parents=True)
        python = env / "bin" / "python"
        # A slow start that ignores SIGTERM, with a descendant that escaped every stop (own
        # session, empty environment) holding the output pipes: close() must escalate for
        # every env, and draining output waits for nothing but a deadline.
        python.write_text(
            "#!/bin/sh\n"
            f"setsid env -i /bin/sleep 60 & echo $! >> {pidfile}\n"
            'trap "" TERM\n'
            "sleep 60\n"
            f'exec {real} "$@"\n'
        )
        python.chmod(0o755)
        envs.append(str(env))
    closer: list[threading.Thread] = []
    deadlines: list[float] = []
    # (``WorkerProcess.wait_exit`` and ``wait_output`` are these parts' bound methods.)
    for part, name in ((ExitWatch, "wait_exit"), (OutputPipes, "wait")):
        original = getattr(part, name)

        def recording(self: Any, timeout: float, _original: Any = original) -> Any:
            if closer and threading.current_thread() is closer[0]:
                deadlines.append(time.monotonic() + timeout)
            return _original(self, timeout)

        monkeypatch.setattr(part, name, recording)
    cfg = comfy_env.PoolConfig(close_timeout=1.0, kill_grace=5.0, start_timeout=120)
    pool = comfy_env.Pool(cfg)
    errors: list[BaseException] = []

    def call(env: str) -> None:
        try:
            pool.get_worker(env).call("tasks.hostile:add", 1, 2)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(env,)) for env in envs]
    try:
        for t in threads:
            t.start()
        assert wait_until(lambda: len(pool._spawner.processes) == len(envs), 60)
        assert wait_until(lambda: len(pidfile.read_text().split()) == len(envs), 30)
        closer.append(threading.current_thread())
        started = time.monotonic()
        pool.close()
        for t in threads:
            t.join(30)
        assert len(errors) == len(envs)
        assert all(isinstance(e, comfy_env.PoolClosedError) for e in errors), errors
        # Every wait close() made ended by one shared deadline per phase: close_timeout, then
        # 2 s for SIGKILL to land, then 0.5 s to drain output (plus slack for a busy machine),
        # never a wait per env (12 envs x 0.5 s of draining alone would pass the bound).
        assert deadlines
        assert max(deadlines) - started <= 1.0 + 2.0 + 0.5 + 2.0
    finally:
        pool.close()
        if pidfile.exists():
            for pid in pidfile.read_text().split():
                _kill_quietly(int(pid))
