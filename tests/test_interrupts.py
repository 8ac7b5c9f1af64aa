"""Ctrl-C held back across the pool's bookkeeping (``_interrupts.Deferred``), and a slot stuck
starting made visible and recoverable (``WorkerStats.stuck``, ``comfy-env status``,
``Pool.reset``). The storm against a real host is in test_interrupt_storm.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

import comfy_env
from comfy_env import _exchange, _lease
from comfy_env import _lifecycle as lc
from comfy_env._cli import main
from comfy_env._interrupts import Deferred
from comfy_env._pool import snapshot_pool
from comfy_env._status import StatusPublisher


def _interrupt_self() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs on the main thread's next bytecodes


def test_a_ctrl_c_inside_a_held_section_is_delivered_after_it(ctrl_c: None) -> None:
    done = []
    with pytest.raises(KeyboardInterrupt):
        with Deferred():
            _interrupt_self()
            _interrupt_self()  # two: delivered once
            done.append("the section ran whole")
    assert done == ["the section ran whole"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_held_section_takes_one_ctrl_c_in_its_wait_and_finishes_its_clean_up(
    ctrl_c: None,
) -> None:
    cleaned = []
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            with Deferred() as held:
                try:
                    with held.allowing():
                        time.sleep(10)
                finally:
                    _interrupt_self()  # a second Ctrl-C during the clean-up: recorded
                    cleaned.append(True)
    finally:
        timer.join()
    assert cleaned == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_recorded_before_a_wait_raises_at_once(ctrl_c: None) -> None:
    with pytest.raises(KeyboardInterrupt):
        with Deferred() as held:
            _interrupt_self()
            started = time.monotonic()
            with held.allowing():
                time.sleep(10)
    assert time.monotonic() - started < 5


def test_a_wait_opened_inside_nested_sections_is_interrupted(ctrl_c: None) -> None:
    """A start's handshake inside a call held since a recent Ctrl-C: the inner section's wait
    takes the interrupt itself (the outer section, closed, would only record it)."""
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            with Deferred(), Deferred() as inner, inner.allowing():
                time.sleep(10)
    finally:
        timer.join()
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_held_section_keeps_a_users_own_handler(ctrl_c: None) -> None:
    seen: list[int] = []

    def mine(signum: int, frame: object) -> None:
        seen.append(signum)

    signal.signal(signal.SIGINT, mine)
    with Deferred():
        _interrupt_self()
        assert seen == []
    assert seen == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is mine


def test_a_held_section_off_the_main_thread_changes_nothing() -> None:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            with Deferred() as held, held.allowing():
                pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert errors == []


def _make_stuck(pool: comfy_env.Pool, worker: comfy_env.Worker) -> None:
    """Leave the worker's slot as an interrupted start did before the fix: ``SpawnBegan``
    applied through the gate, then the start gone (its caller interrupted) with the lease
    given back."""
    assert pool.retire_idle(None) == 1
    entry = worker._entry
    slot = entry.slots[0]
    with entry.lock:
        entry.generation += 1
        assert entry.apply_locked(slot, lc.SpawnBegan(entry.generation)) is not None


def test_a_slot_stuck_starting_is_shown_and_reset_recovers_it(
    pool: comfy_env.Pool, capsys: pytest.CaptureFixture[str]
) -> None:
    worker = pool.get_worker()
    assert worker.call("tasks.remote:add", 1, 1) == 2
    _make_stuck(pool, worker)

    (ws,) = worker.stats().workers
    assert (ws.state, ws.pid, ws.stuck) == ("starting", None, True)
    (env,) = snapshot_pool(pool)["envs"]
    assert env["workers"][0]["stuck"] is True
    publisher = StatusPublisher(lambda: [snapshot_pool(pool)])
    try:
        publisher.publish()
        assert main(["status"]) == 0
        out = capsys.readouterr().out
        assert "starting, STUCK: no start in progress (Pool.reset(env)" in out
        assert main(["status", "--json"]) == 0
        hosts = json.loads(capsys.readouterr().out)["hosts"]
        (host,) = [h for h in hosts if h["pid"] == os.getpid()]
        (env_doc,) = [e for e in host["envs"] if e["env"] == worker.env]
        assert env_doc["workers"][0]["stuck"] is True
    finally:
        publisher.remove()

    pool.reset()
    (ws,) = worker.stats().workers
    assert (ws.state, ws.stuck) == ("retired", False)
    assert worker.run("tasks.remote:add", (2, 2), timeout=30) == 4
    assert worker.stats().workers[0].state == "idle"


def test_the_reaper_recovers_a_slot_stuck_starting(config: comfy_env.PoolConfig) -> None:
    with comfy_env.Pool(config.model_copy(update={"idle_timeout": 60.0})) as pool:
        worker = pool.get_worker()
        assert worker.call("tasks.remote:add", 1, 1) == 2
        _make_stuck(pool, worker)
        pool._spawner.reap_tick()
        assert worker.stats().workers[0].stuck is False
        assert worker.run("tasks.remote:add", (2, 2), timeout=30) == 4


@pytest.mark.skipif(
    not str(_exchange.__file__).endswith(".py"),
    reason="the per-call modules are compiled (dev.py compile): the settling cannot be patched",
)
@pytest.mark.parametrize("how", ["call", "run_with_timeout"])
def test_a_ctrl_c_after_the_whole_reply_leaves_the_worker_idle(
    pool: comfy_env.Pool, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # A Ctrl-C between the reply read whole and the call's own settling (here: as the settling
    # starts, before it takes the env's lock) leaves the settling to the call's safety net. The
    # worker replied and is idle: it is not stopped, and the next call runs on it.
    worker = pool.get_worker()
    assert worker.call("tasks.remote:add", 1, 2) == 3
    pid, generation = worker.pid, worker.generation
    real = _lease.settle_ok
    hits: list[int] = []

    def interrupted(*args: object) -> None:
        if not hits:
            hits.append(1)
            raise KeyboardInterrupt
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_lease, "settle_ok", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if how == "call":
            worker.call("tasks.remote:add", 1, 2)
        else:
            worker.run("tasks.remote:add", (1, 2), timeout=30)
    assert hits
    stats = worker.stats()
    assert (stats.cancelled, stats.in_flight, stats.crashed) == (1, 0, 0)
    assert worker.call("tasks.remote:add", 2, 2) == 4
    assert (worker.pid, worker.generation) == (pid, generation)
