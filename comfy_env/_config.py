"""``PoolConfig``: every knob of a pool, validated once, overridable by environment variables.

Precedence: a value passed to ``PoolConfig(...)`` wins over ``COMFY_ENV_<FIELD>`` in the
environment, which wins over the default. Environment values are strings: numbers parse as
numbers, ``none`` (or an empty string) means None for optional fields, ``sys_path`` is an
``os.pathsep``-separated list and ``env_vars`` a JSON object. A bad value raises
``ConfigError`` (a ``ComfyEnvError`` and a ``ValueError``) naming the field, the variable (for
environment values) and the bad value as given. A ``COMFY_ENV_*`` variable that is no field
(and not one of ``_settings.OTHER_VARIABLES``) is ignored with one warning per process naming
the closest field's variable (a misspelled ``..._CALL_TIMOUT`` is not a setting).

A pool does not need this module (nor pydantic) when it takes the defaults: it runs on a
``_settings.Settings`` and builds a ``PoolConfig`` only when one is given, a ``COMFY_ENV_*``
variable is set, or ``pool.config`` is read (see ``_settings``).
"""

from __future__ import annotations

import difflib
import json
import os
import threading
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ._errors import ArgumentError, ConfigError
from ._lifecycle import Breaker
from ._settings import (  # re-exported: their home was this module
    ENV_FIELDS,
    ENV_PREFIX,
    MAX_MEMORY_LIMIT,
    MAX_SECONDS,
    MIN_MEMORY_LIMIT,
    Settings,
    check_timeout,
    default_values,
    environment_overrides,
    warn_unknown_variables,
)

__all__ = [
    "ENV_PREFIX",
    "MAX_SECONDS",
    "PoolConfig",
    "check_timeout",
    "config_of_defaults",
    "holds_defaults",
]

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class PoolConfig(BaseModel):
    """Settings of a ``Pool``. Immutable; every field also reads ``COMFY_ENV_<FIELD>``."""

    # inf and nan are refused for every float (they overflowed deadlines, killed workers and
    # made close() leak); "no deadline" is spelled None where a field allows it.
    # defer_build: the validator is built on the first validation, not when the class is
    # created, so the default config (below) never builds it (about 50-100 ms with pydantic's
    # plugin discovery, on a fresh host's first call).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)

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
        le=MAX_SECONDS,  # its grace timer goes on the reactor, whose wait the OS bounds
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
    activate: bool = Field(
        True,
        description="Give workers of a venv, conda or pixi env the variables activating it "
        "would set: VIRTUAL_ENV or CONDA_PREFIX, the env's bin first on PATH, conda-meta/state's "
        "env_vars and what its etc/conda/activate.d/*.sh scripts export (run once per env and "
        "host process, bounded by start_timeout). env_vars win over them. False: the host's "
        "environment only.",
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
        "failures included) within restart_window abandon the env until Pool.reset(env) "
        "(or for abandon_for seconds).",
    )
    restart_window: float = Field(
        60.0, le=MAX_SECONDS, gt=0, description="The breaker's window in seconds."
    )
    abandon_for: float | None = Field(
        None,
        le=MAX_SECONDS,
        gt=0,
        description="Seconds an abandoned env stays cut off before the block lifts by itself "
        "(the next call then starts a fresh worker). None: until Pool.reset(env).",
    )
    reap_with_refs: bool = Field(
        False, description="Let the idle reaper retire a worker that holds live RemoteRefs."
    )
    shared_memory: bool = Field(
        True,
        description="Send large buffers through shared memory (else inline in the frame).",
    )
    shm_threshold_bytes: int = Field(
        64 * 1024,  # measured: shared memory beats inline from 64 KiB up (benchmarks/)
        ge=4096,
        description="Decided per call: when the buffers of at least 64 KiB (numpy arrays, "
        "bytes, tensors) of a request or reply add up to this size, they all travel through "
        "shared memory; below it they are sent inline in the frame, still without a pickle "
        "copy. A mix of sizes is never split between the two paths.",
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
        "ack before it gives them up (the host lost the ack or keeps a result long). Only time "
        "the host is seen running counts: a stopped host (SIGSTOP, Ctrl-Z, a debugger) keeps "
        "its replies.",
    )
    memory_limit: int | None = Field(
        None,
        ge=MIN_MEMORY_LIMIT,
        le=MAX_MEMORY_LIMIT,
        description="Bytes of memory each worker may use (None: no limit). Past it the call "
        "fails with WorkerOutOfMemory and the worker is replaced. Counted by the kernel in a "
        "memory cgroup per worker where the host may make one, else an RLIMIT_DATA the worker "
        "sets on itself.",
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="Where workers run: 'local' (subprocesses of the env's interpreter) or "
        "'ray' (one Ray actor per worker generation; needs ray in the host: pip install "
        "'ray>=2.60', the ray extra).",
    )
    ray_address: str | None = Field(
        None,
        description="With backend='ray': the cluster to join (ray.init(address=...)); None "
        "joins the cluster this process already initialised, else starts a local one.",
    )
    spin_wait: float = Field(
        100e-6,
        ge=0,
        le=0.01,
        description="Seconds a caller waiting for a reply, and a worker waiting for its next "
        "call, keep polling the channel (yielding the CPU between polls) before they sleep. "
        "Across CPUs this saves the wake-up of a sleeping process, about half of a small "
        "call's round trip, for at most this much CPU per wait. Skipped while both ends are "
        "pinned to the same single CPU. 0 never polls.",
    )

    if not TYPE_CHECKING:  # type checkers keep pydantic's typed signature

        def __init__(self, **data: Any) -> None:
            warn_unknown_variables()  # a misspelled COMFY_ENV_* is otherwise ignored unseen
            if not data and not environment_overrides():
                # Nothing given, nothing in the environment: every field takes its default,
                # and the defaults are valid (tested: they pass the full validation unchanged).
                # pydantic would not validate them either (``validate_default`` is off).
                self.__setstate__(_default_state())
                return
            try:
                super().__init__(**data)
            except ValidationError as exc:
                raise _config_error(exc, data) from None

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
            merged[name] = _parse_env_value(var, raw, field.annotation, name)
        return merged

    @field_validator("*", mode="before")
    @classmethod
    def _refuse_booleans(cls, value: Any, info: ValidationInfo) -> Any:
        """``True`` is an ``int`` to Python and pydantic would take it as 1 for a numeric field
        (``call_timeout=True`` a one-second deadline): refused, as per-call timeouts refuse it
        (``check_timeout``). Environment values arrive as strings and never meet this."""
        if isinstance(value, bool) and info.field_name in _NUMERIC_FIELDS:
            raise ValueError(f"must be a number, not the boolean {value!r}")
        return value

    @field_validator("log_level")
    @classmethod
    def _check_log_level(cls, value: str) -> str:
        if value.upper() not in _LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(_LOG_LEVELS)}")
        return value

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
        # Relative entries are relative to the host's working directory now, as ``cwd``: the
        # worker runs in ``cwd`` and would read them from there, a surprise either way.
        return tuple(os.path.abspath(entry) for entry in value)

    @field_validator("cwd")
    @classmethod
    def _check_cwd(cls, value: str | None) -> str | None:
        if value is not None and ("\0" in value or not value):
            raise ValueError(f"cwd {value!r} must be a non-empty path without NUL characters")
        # Absolute against the host's working directory now: the worker is launched in cwd
        # (Popen) and then changes to it again from its CONFIG, so a relative one would be
        # looked for inside itself (FileNotFoundError, or a same-named nested directory).
        return None if value is None else os.path.abspath(value)


# The fields that hold a number (int or float, or one of them or None), read from the model.
_NUMERIC_FIELDS = frozenset(
    name
    for name, field in PoolConfig.model_fields.items()
    if field.annotation in (int, float, int | None, float | None)
)


def holds_defaults(config: PoolConfig) -> bool:
    """True if ``config`` is a ``PoolConfig`` whose every field holds its default value: such a
    config is valid as it is (``Pool`` takes it without building pydantic's validator)."""
    if type(config) is not PoolConfig:
        return False
    values = config.__dict__
    defaults = default_values()
    if values.keys() - defaults.keys():
        return False  # ``model_copy(update=...)`` with a name that is no field: validated, refused
    # Types too: ``model_copy(update=...)`` may hold True where the default is 1.
    return all(
        type(values.get(name)) is type(default) and values.get(name) == default
        for name, default in defaults.items()
    )


def settings_for(config: PoolConfig | None) -> tuple[Settings, PoolConfig | None]:
    """What a pool runs on, and the validated ``PoolConfig`` if one exists already.

    ``None`` with no ``COMFY_ENV_*`` variable set gives the defaults without pydantic (the
    model is built when someone reads ``pool.config``). A variable set, or a config given, goes
    through pydantic: ``model_copy(update=...)`` skips its checks, and a value the OS or the
    clock cannot take must fail here (``ConfigError``), not inside a worker or a timer.
    """
    if config is None:
        if not environment_overrides():
            return Settings(), None
        config = PoolConfig()
    elif not isinstance(config, PoolConfig):
        what = "the PoolConfig class itself" if config is PoolConfig else type(config).__name__
        raise ArgumentError(
            f"Pool(config) takes a comfy_env.PoolConfig or None, not {what} "
            "(e.g. Pool(PoolConfig(call_timeout=60)); from a dict: PoolConfig(**values))"
        )
    elif not holds_defaults(config):
        config = PoolConfig(**dict(config))
    return Settings.of(config), config


def config_of_defaults() -> PoolConfig:
    """A ``PoolConfig`` holding every default, whatever the environment says now: what a pool
    that took the defaults (``Settings()``) shows as ``pool.config``."""
    config = PoolConfig.__new__(PoolConfig)
    config.__setstate__(_default_state())
    return config


def _default_state() -> dict[str, Any]:
    """What ``PoolConfig.model_construct()`` holds: every default, freshly made (no field is
    shared between two configs), with nothing counted as set; no validator is built."""
    return {
        "__dict__": default_values(),
        "__pydantic_fields_set__": set(),
        "__pydantic_extra__": None,
        "__pydantic_private__": None,
    }


class _EnvValueError(ValueError):
    """A ``COMFY_ENV_*`` value that does not parse; pydantic wraps it, ``_config_error``
    unwraps it."""

    def __init__(self, field: str, var: str, raw: str, detail: str) -> None:
        super().__init__(f"{var}={raw!r}: {detail}")
        self.field, self.var, self.raw, self.detail = field, var, raw, detail


def _config_error(exc: ValidationError, data: dict[str, Any]) -> ConfigError:
    """One clear error for what pydantic found: field, variable and value as given."""
    lines = []
    facts: list[tuple[str | None, str | None, Any]] = []
    for error in exc.errors():
        cause = (error.get("ctx") or {}).get("error")
        loc = error.get("loc") or ()
        field: str | None = str(loc[0]) if loc else None
        var: str | None = None
        value: Any = None
        if isinstance(cause, _EnvValueError):
            field, var, value, detail = cause.field, cause.var, cause.raw, cause.detail
        elif error.get("type") == "extra_forbidden" and field is not None:
            close = difflib.get_close_matches(field, list(PoolConfig.model_fields), n=1)
            detail = "no such field" + (f"; did you mean {close[0]}?" if close else "")
            value = data.get(field)
        else:
            detail = str(error.get("msg", "invalid")).removeprefix("Value error, ")
            if field is not None:
                candidate = ENV_PREFIX + field.upper()
                if field not in data and candidate in os.environ:
                    var, value = candidate, os.environ[candidate]
                else:
                    value = data.get(field)
        if field is None:
            lines.append(f"invalid PoolConfig: {detail}")
        elif var is not None:
            lines.append(f"{var}={value!r} is not a valid PoolConfig.{field}: {detail}")
        else:
            lines.append(f"PoolConfig({field}={value!r}) is invalid: {detail}")
        facts.append((field, var, value))
    field, var, value = facts[0] if facts else (None, None, None)
    return ConfigError("; ".join(lines), field=field, variable=var, value=value)


def _parse_env_value(var: str, raw: str, annotation: Any, field: str) -> Any:
    text = raw.strip()
    if annotation == dict[str, str]:
        try:
            value = json.loads(text) if text else {}
        except json.JSONDecodeError as exc:
            raise _EnvValueError(field, var, raw, f"not a JSON object: {exc}") from None
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
        raise _EnvValueError(field, var, raw, detail) from None


def settings_for_env(base: Settings, changes: dict[str, Any]) -> Settings:
    """``base`` (the pool's settings) with an env's own ``changes`` (``ENV_FIELDS`` only;
    ``env_vars`` are added to the pool's, the env's winning), checked by ``PoolConfig`` as a
    pool's values are: a bad value is a ``ConfigError`` naming the field."""
    unknown = sorted(set(changes) - set(ENV_FIELDS))
    if unknown:
        raise ArgumentError(
            f"an env cannot set {', '.join(unknown)} for itself; its own settings are "
            f"{', '.join(ENV_FIELDS)}"
        )
    values = base.values()
    for name, value in changes.items():
        if name == "env_vars" and isinstance(value, dict):
            value = {**base.env_vars, **value}
        values[name] = value
    return Settings.of(PoolConfig(**values))


BREAKER_FIELDS = ("max_restarts", "restart_window", "abandon_for")


class EnvSettings(Protocol):
    """What ``configure_env`` writes of an env entry (``_entry.EnvEntry``; not imported: the
    entry's imports reach this module)."""

    lock: threading.Lock
    own_settings: dict[str, Any]
    settings: Settings
    breaker: Breaker | None


def configure_env(entry: EnvSettings, base: Settings, changes: dict[str, Any]) -> None:
    """``Pool.configure``'s checks and writes: the env's own settings grow by ``changes`` and
    its effective settings (and breaker, if it set one of ``BREAKER_FIELDS``) are replaced, all
    under its lock; a bad value raises (``settings_for_env``) before anything changes."""
    own = {**entry.own_settings, **changes}
    effective = settings_for_env(base, own)
    breaker = None
    if any(name in own for name in BREAKER_FIELDS):
        breaker = Breaker(effective.max_restarts, effective.restart_window, effective.abandon_for)
    with entry.lock:
        entry.own_settings = own
        entry.settings = effective
        if breaker is not None:
            entry.breaker = breaker
