"""``Worker.arun_ref`` (``call_ref`` for asyncio) and ``RemoteRef.alive``, which the ComfyUI
node proxies build on: a kept object made from an event loop, cancellable like ``arun``."""

from __future__ import annotations

import asyncio

import pytest
from tasks import remote as remote_tasks

import comfy_env
from comfy_env import CallTimeout, StaleGenerationError


def test_arun_ref_keeps_the_result_in_the_worker_and_alive_follows_its_generation(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()

    async def main() -> comfy_env.RemoteRef:
        return await w.arun_ref(remote_tasks.make_counter, (5,))

    ref = asyncio.run(main())
    assert ref.alive and ref.generation == w.generation
    assert w.call(remote_tasks.counter_value, ref) == 5
    with pytest.raises(comfy_env.WorkerCrashed):
        w.call(remote_tasks.kill_self, 9)
    assert not ref.alive
    with pytest.raises(StaleGenerationError):
        w.call(remote_tasks.counter_value, ref)
    other = w.call_ref(remote_tasks.make_counter, 1)
    other.release()
    assert not other.alive  # released


@pytest.mark.parametrize("cancels", [1, 2])
def test_cancelling_arun_ref_stops_the_call_and_keeps_nothing(
    config: comfy_env.PoolConfig, cancels: int
) -> None:
    with comfy_env.Pool(config.model_copy(update={"cancel_grace": 0.6})) as pool:
        w = pool.get_worker()
        w.call(remote_tasks.add, 1)
        first = w.generation

        async def main() -> None:
            task = asyncio.ensure_future(w.arun_ref(remote_tasks.chatty_sleep, (30.0, 0.05)))
            while w.stats().in_flight == 0:
                await asyncio.sleep(0.01)
            for _ in range(cancels):
                task.cancel()
                await asyncio.sleep(0.05)
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        assert w.call(remote_tasks.kept_objects) == 0
        assert w.stats().cancelled == 1
        # once: the worker stopped the call itself and lives on; twice: it was killed
        assert w.generation == (first if cancels == 1 else first + 1)


def test_arun_ref_has_a_total_deadline(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()

    async def main() -> None:
        await w.arun_ref(remote_tasks.chatty_sleep, (30.0, 0.05), timeout=0.5)

    with pytest.raises(CallTimeout):
        asyncio.run(main())
