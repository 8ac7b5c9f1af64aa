"""Workers wait passively in OpenMP unless told otherwise.

OpenMP's threads (torch, BLAS, OpenCV) spin after each parallel region by default; in a worker
that spin takes a core from the worker's own thread and from the host while they exchange the
reply, so a node of small tensor ops ran several times slower isolated than in-process
(``benchmarks/bench_comfyui.py``). Workers get ``OMP_WAIT_POLICY=PASSIVE`` unless the host's
environment or ``PoolConfig.env_vars`` says otherwise.
"""

from __future__ import annotations

import sys

import pytest

import comfy_env


def _policy(pool: comfy_env.Pool) -> str | None:
    value: str | None = pool.get_worker(sys.prefix).call("os:getenv", "OMP_WAIT_POLICY")
    return value


def test_workers_wait_passively_in_openmp_by_default(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with comfy_env.Pool(config) as pool:
        assert _policy(pool) == "PASSIVE"


def test_the_hosts_openmp_wait_policy_is_kept(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with comfy_env.Pool(config) as pool:
        assert _policy(pool) == "ACTIVE"


def test_env_vars_set_the_openmp_wait_policy(
    config: comfy_env.PoolConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    update = {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}
    with comfy_env.Pool(config.model_copy(update=update)) as pool:
        assert _policy(pool) == "ACTIVE"
