"""``PoolConfig``: every knob of a pool, validated once, overridable by environment variables.

Precedence: a value passed to ``PoolConfig(...)`` wins over ``COMFY_ENV_<FIELD>`` in the
environment, which wins over the default. Environment values are strings: numbers parse as
numbers, ``none`` (or an empty string) means None for optional fields, ``sys_path`` is an
``os.pathsep``-separated list and ``env_vars`` a JSON object. A bad value raises pydantic's
``ValidationError`` naming the field and, for environment values, the variable.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

ENV_PREFIX = "COMFY_ENV_"

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# The longest timeout (seconds, about 11.6 days) any field or call accepts: deadlines go into
# poll(2) in milliseconds and timer heaps; longer waits are spelled None (no deadline).
MAX_SECONDS = 1_000_000.0


class PoolConfig(BaseModel):
    """Settings of a ``Pool``. Immutable; every field also reads ``COMFY_ENV_<FIELD>``."""

    # inf and nan are refused for every float (they overflowed deadlines, killed workers and
    # made close() leak); "no deadline" is spelled None where a field allows it.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    call_timeout: float | None = Field(
        None,
        le=MAX_SECONDS,
        gt=0,
        description="Default total deadline of a call in seconds (queue wait included); "
        "None waits forever. Per call: Worker.run(timeout=...).",
    )
    start_timeout: float = Field(
        60.0,
        le=MAX_SECONDS,
        gt=0,
        description="Deadline for a worker to start, handshake and pass the canary. Generous: "
        "an env that imports torch with CUDA takes seconds.",
    )
    cancel_grace: float = Field(
        5.0,
        ge=0,
        description="Seconds a cancelled call gets to end by itself (the worker is asked first: "
        "comfy_env_worker.cancelled() turns true, and after half the grace pure-Python code is "
        "interrupted with comfy_env_worker.Cancelled) before its worker is killed. A call that "
        "ends in time leaves the worker alive, same generation, caches intact. 0 kills at once.",
    )
    max_workers_per_env: int = Field(
        1, ge=1, le=256, description="Workers an env may run in parallel; callers queue FIFO."
    )
    max_frame_bytes: int = Field(
        2 * 1024**3,
        ge=1024 * 1024,
        le=2**62,
        description="Largest frame (pickled call or reply) accepted in either direction.",
    )
    kill_grace: float = Field(
        1.0,
        le=MAX_SECONDS,
        ge=0,
        description="Seconds between SIGTERM and SIGKILL when a worker's process group is "
        "stopped on timeout or close.",
    )
    close_timeout: float = Field(
        5.0,
        le=MAX_SECONDS,
        ge=0,
        description="One bounded wait for all workers to exit in Pool.close().",
    )
    stderr_tail_lines: int = Field(
        40, ge=0, le=10000, description="Lines of worker output kept for crash reports."
    )
    sys_path: tuple[str, ...] = Field(
        (), description="Extra sys.path entries for every worker (after its runtime dir)."
    )
    cwd: str | None = Field(None, description="Working directory of workers (default: host's).")
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables for workers."
    )
    log_level: str = Field("INFO", description="Level of the worker's root logger.")
    idle_timeout: float | None = Field(
        1800.0,
        le=MAX_SECONDS,
        gt=0,
        description="Seconds a worker may sit idle before the reaper retires it (its release "
        "hooks run first); the next call spawns a fresh one. None disables reaping.",
    )
    ping_after_idle: float | None = Field(
        60.0,
        le=MAX_SECONDS,
        gt=0,
        description="A worker idle this long is pinged before it gets a call; one that does "
        "not answer is replaced and the call runs on the fresh worker. None disables.",
    )
    ping_timeout: float = Field(
        5.0, le=MAX_SECONDS, gt=0, description="Deadline of that health ping."
    )
    max_restarts: int = Field(
        5,
        ge=0,
        description="Crash-loop breaker: more than this many worker deaths (start-up "
        "failures included) within restart_window abandon the env until Pool.reset(env).",
    )
    restart_window: float = Field(
        60.0, le=MAX_SECONDS, gt=0, description="The breaker's window in seconds."
    )
    reap_with_refs: bool = Field(
        False, description="Let the idle reaper retire a worker that holds live RemoteRefs."
    )
    shared_memory: bool = Field(
        True,
        description="Send large buffers through shared memory (else inline in the frame).",
    )
    shm_threshold_bytes: int = Field(
        1024 * 1024,
        ge=4096,
        description="Buffers of at least this size travel out of band (shared memory).",
    )
    shm_pool_bytes: int = Field(
        1024**3,
        ge=0,
        description="Idle shared-memory bytes each side of a worker keeps for reuse.",
    )
    shm_pinned_ttl: float = Field(
        60.0,
        le=MAX_SECONDS,
        gt=0,
        description="Seconds a worker keeps a reply's blocks pinned waiting for the host's "
        "ack before it gives them up (the host died or hung).",
    )

    @model_validator(mode="before")
    @classmethod
    def _read_environment(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, field in cls.model_fields.items():
            if name in merged:
                continue
            var = ENV_PREFIX + name.upper()
            raw = os.environ.get(var)
            if raw is None:
                continue
            merged[name] = _parse_env_value(var, raw, field.annotation)
        return merged

    @model_validator(mode="after")
    def _check_log_level(self) -> PoolConfig:
        if self.log_level.upper() not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(_LOG_LEVELS)}")
        return self

    @field_validator("env_vars")
    @classmethod
    def _check_env_vars(cls, value: dict[str, str]) -> dict[str, str]:
        """What ``execve`` cannot take is refused here, naming the variable, not at spawn."""
        for name, text in value.items():
            if not name or "=" in name or "\0" in name:
                raise ValueError(
                    f"env_vars: variable name {name!r} must be non-empty and contain no '=' "
                    "and no NUL character"
                )
            if "\0" in text:
                raise ValueError(f"env_vars: the value of {name!r} contains a NUL character")
        return value

    @field_validator("sys_path")
    @classmethod
    def _check_sys_path(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            if "\0" in entry:
                raise ValueError(f"sys_path: entry {entry!r} contains a NUL character")
        return value

    @field_validator("cwd")
    @classmethod
    def _check_cwd(cls, value: str | None) -> str | None:
        if value is not None and ("\0" in value or not value):
            raise ValueError(f"cwd {value!r} must be a non-empty path without NUL characters")
        return value


def check_timeout(value: object, what: str = "timeout") -> float | None:
    """A per-call timeout: None, or a finite number of seconds in (0, MAX_SECONDS]. Anything
    else is an ``ArgumentError`` naming it (inf, nan and huge values included)."""
    from ._errors import ArgumentError

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{what} must be seconds (a number) or None, not {value!r}")
    seconds = float(value)
    if not (0 < seconds <= MAX_SECONDS):  # also false for nan
        raise ArgumentError(
            f"{what} must be positive seconds up to {MAX_SECONDS:g} (or None for no "
            f"deadline), not {value!r}"
        )
    return seconds


def _parse_env_value(var: str, raw: str, annotation: Any) -> Any:
    text = raw.strip()
    if annotation == dict[str, str]:
        try:
            value = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{var}={raw!r} is not a JSON object: {exc}") from None
        return value
    if annotation == tuple[str, ...]:
        return tuple(p for p in text.split(os.pathsep) if p)
    optional = "None" in repr(annotation)
    if optional and text.lower() in ("", "none", "null"):
        return None
    try:
        return TypeAdapter(annotation).validate_python(text)
    except ValidationError as exc:
        detail = exc.errors()[0].get("msg", str(exc))
        raise ValueError(f"{var}={raw!r}: {detail}") from None
