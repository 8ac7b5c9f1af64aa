"""``Settings``: the values a pool runs on, as a plain object (no pydantic on the default path).

Data flow::

    Pool()                    nothing given, no COMFY_ENV_* set -> Settings() (the defaults)
    Pool(), COMFY_ENV_* set   -> PoolConfig() (pydantic reads and checks the environment)
    Pool(config)              -> config as is (defaults only) or PoolConfig(**config) (checked)
                              -> Settings.of(model)
    pool.config               the PoolConfig: the one given or checked above, or, for a pool
                              that took the defaults, one built on first read (pydantic loads
                              then, not before)

``PoolConfig`` (``_config``) is the public, validated model; importing pydantic and building
it costs about 100 ms, most of a fresh host's first call. The pool, the backends and the
process mechanism read their values from a ``Settings``: the same fields, already valid, and
nothing else. The defaults are the model's defaults (a test compares every field, value and
type); the defaults pass the model's validation unchanged (tested too), so a pool that takes
them runs on exactly what ``PoolConfig()`` would hold.

Imports nothing beyond the standard library; loading it at pool creation costs microseconds.
"""

from __future__ import annotations

import os
from typing import Any

ENV_PREFIX = "COMFY_ENV_"

# The longest timeout (seconds, about 11.6 days) any field or call accepts: deadlines go into
# poll(2) in milliseconds and timer heaps; longer waits are spelled None (no deadline).
MAX_SECONDS = 1_000_000.0
# A worker's memory limit, in bytes: below 32 MiB an interpreter cannot start and run its
# handshake; above 2**62 the kernel's counters cannot take it.
MIN_MEMORY_LIMIT = 32 * 1024 * 1024
MAX_MEMORY_LIMIT = 2**62


# PoolConfig's fields, in its order.
FIELDS = (
    "call_timeout",
    "start_timeout",
    "cancel_grace",
    "max_workers_per_env",
    "max_frame_bytes",
    "kill_grace",
    "close_timeout",
    "stderr_tail_lines",
    "sys_path",
    "cwd",
    "env_vars",
    "activate",
    "log_level",
    "idle_timeout",
    "ping_after_idle",
    "ping_timeout",
    "max_restarts",
    "restart_window",
    "abandon_for",
    "reap_with_refs",
    "shared_memory",
    "shm_threshold_bytes",
    "shm_pool_bytes",
    "shm_pinned_ttl",
    "memory_limit",
    "backend",
    "ray_address",
    "spin_wait",
)


# The fields an env may set for itself (``Pool.configure``, a ``Recipe``'s): what its own
# workers and calls run with. The rest (the channel, shared memory, the backend) is the pool's.
ENV_FIELDS = (
    "env_vars",
    "call_timeout",
    "cancel_grace",
    "idle_timeout",
    "memory_limit",
    "max_restarts",
    "restart_window",
    "abandon_for",
)


class Settings:
    """The fields of ``PoolConfig``, valid, read-only. ``Settings()`` holds the defaults;
    ``Settings.of(config)`` the values of a validated ``PoolConfig``."""

    __slots__ = FIELDS

    call_timeout: float | None
    start_timeout: float
    cancel_grace: float
    max_workers_per_env: int
    max_frame_bytes: int
    kill_grace: float
    close_timeout: float
    stderr_tail_lines: int
    sys_path: tuple[str, ...]
    cwd: str | None
    env_vars: dict[str, str]
    activate: bool
    log_level: str
    idle_timeout: float | None
    ping_after_idle: float | None
    ping_timeout: float
    max_restarts: int
    restart_window: float
    abandon_for: float | None
    reap_with_refs: bool
    shared_memory: bool
    shm_threshold_bytes: int
    shm_pool_bytes: int
    shm_pinned_ttl: float
    memory_limit: int | None
    backend: str
    ray_address: str | None
    spin_wait: float

    def __init__(self) -> None:
        # PoolConfig's defaults, field by field (tests/test_envs.py checks they are equal,
        # types included). env_vars is a fresh dict per object, as pydantic's default_factory.
        setattr_ = object.__setattr__
        for name, value in _defaults().items():
            setattr_(self, name, value)

    @classmethod
    def of(cls, config: object) -> Settings:
        """The values of a validated ``PoolConfig`` (shared, not copied: both are read-only)."""
        settings = cls.__new__(cls)
        setattr_ = object.__setattr__
        for name in FIELDS:
            setattr_(settings, name, getattr(config, name))
        return settings

    def values(self) -> dict[str, Any]:
        """Every field and its value."""
        return {name: getattr(self, name) for name in FIELDS}

    def env_values(self) -> dict[str, Any]:
        """The fields an env may set for itself (``ENV_FIELDS``) and their values here."""
        return {name: getattr(self, name) for name in ENV_FIELDS}

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Settings are read-only (tried to set {name!r})")

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in FIELDS)
        return f"Settings({fields})"


def _defaults() -> dict[str, Any]:
    return {
        "call_timeout": None,
        "start_timeout": 60.0,
        "cancel_grace": 5.0,
        "max_workers_per_env": 1,
        "max_frame_bytes": 2 * 1024**3,
        "kill_grace": 1.0,
        "close_timeout": 5.0,
        "stderr_tail_lines": 40,
        "sys_path": (),
        "cwd": None,
        "env_vars": {},
        "activate": True,
        "log_level": "INFO",
        "idle_timeout": 1800.0,
        "ping_after_idle": 60.0,
        "ping_timeout": 5.0,
        "max_restarts": 5,
        "restart_window": 60.0,
        "abandon_for": None,
        "reap_with_refs": False,
        "shared_memory": True,
        "shm_threshold_bytes": 64 * 1024,  # measured: shared memory beats inline from 64 KiB
        "shm_pool_bytes": 1024**3,
        "shm_pinned_ttl": 60.0,
        "memory_limit": None,
        "backend": "local",
        "ray_address": None,
        "spin_wait": 100e-6,
    }


def default_values() -> dict[str, Any]:
    """Every field's default, freshly made (no mutable default is shared between two calls)."""
    return _defaults()


def environment_overrides() -> bool:
    """Whether any ``COMFY_ENV_<FIELD>`` variable is set (then pydantic must read them)."""
    environ = os.environ
    return any(ENV_PREFIX + name.upper() in environ for name in FIELDS)


# ``COMFY_ENV_*`` variables of ours that are not ``PoolConfig`` fields, so never "misspelled":
# set by a host in its workers' environment (a worker that runs a pool of its own sees them),
# read by the ComfyUI integration, by ``dev.py``, the example packs and the test harnesses.
# Add a name here when the project starts reading a new one (tests/test_envs.py checks).
OTHER_VARIABLES = frozenset(
    {
        "COMFY_ENV_HOST_ID",  # a worker's host (_process, _sweep, _descendants)
        "COMFY_ENV_WORKER_ID",  # a worker generation's mark (_process, _descendants)
        "COMFY_ENV_MEMORY_RLIMIT",  # a worker's own memory limit where no cgroup is used
        "COMFY_ENV_COMFYUI_CACHE",  # comfy_env.comfyui's scan cache directory
        "COMFY_ENV_HOME",  # where built envs live (_build.env_root)
        "COMFY_ENV_COMFYUI_SRC",  # dev.py: the ComfyUI source tarball
        "COMFY_ENV_DEV_CACHE",  # dev.py: its cache directory
        "COMFY_ENV_EXAMPLE_NUMPY_ENV",  # examples/comfyui packs' envs
        "COMFY_ENV_EXAMPLE_TORCH_ENV",
        "COMFY_ENV_TEST_COMFYUI_DIR",  # tests_comfyui's harness
        "COMFY_ENV_TEST_COMFYUI_PYTHON",
        "COMFY_ENV_TEST_PACK_ENV_NUMPY",
        "COMFY_ENV_TEST_PACK_ENV_TORCH",
        "COMFY_ENV_TEST_MARK",  # tests/test_sweep.py's and test_host_watcher.py's marked processes
        "COMFY_ENV_FAULT_SIDE",  # tests/tasks/fault.py's fault injection
        "COMFY_ENV_FAULT_WHERE",
        "COMFY_ENV_FAULT_HOW",
        "COMFY_ENV_FAULT_MARKER",
        "COMFY_ENV_FAULT_ONCE",
    }
)

# Unknown variables already warned about in this process (each is said once, not per pool).
_reported: set[str] = set()


def unknown_variables() -> list[tuple[str, str | None]]:
    """The ``COMFY_ENV_*`` variables set that no ``PoolConfig`` field reads and that are not
    ``OTHER_VARIABLES`` (a misspelling such as ``..._CALL_TIMOUT`` would otherwise be silently
    ignored), each with the closest field's variable, or None when none is close."""
    names = [k for k in os.environ if k.startswith(ENV_PREFIX)]  # usually none: no import
    fields = [name.upper() for name in FIELDS]
    unknown = sorted(
        k for k in names if k[len(ENV_PREFIX) :] not in fields and k not in OTHER_VARIABLES
    )
    if not unknown:
        return []
    import difflib

    found = []
    for name in unknown:
        # Compared without the prefix, which every name shares (else all look alike).
        close = difflib.get_close_matches(name[len(ENV_PREFIX) :], fields, n=1)
        found.append((name, ENV_PREFIX + close[0] if close else None))
    return found


def warn_unknown_variables() -> list[tuple[str, str | None]]:
    """Log one warning (logger ``comfy_env``) per unknown ``COMFY_ENV_*`` variable and process,
    naming the closest setting; called wherever the settings are read from the environment.
    Returns every unknown variable, warned now or before."""
    unknown = unknown_variables()
    for name, closest in unknown:
        if name in _reported:
            continue
        _reported.add(name)
        import logging

        hint = f"; did you mean {closest}?" if closest else ""
        logging.getLogger("comfy_env").warning(
            "comfy-env: %s is set but is not a comfy-env setting, so it is ignored%s", name, hint
        )
    return unknown


def check_timeout(
    value: object, what: str = "timeout", none_means: str = "no deadline"
) -> float | None:
    """A per-call timeout: None, or a finite number of seconds in (0, MAX_SECONDS]. Anything
    else is an ``ArgumentError`` naming it (inf, nan and huge values included); the message
    says what None would mean (``none_means``)."""
    from ._errors import ArgumentError

    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentError(f"{what} must be seconds (a number) or None, not {value!r}")
    seconds = float(value)
    if not (0 < seconds <= MAX_SECONDS):  # also false for nan
        raise ArgumentError(
            f"{what} must be positive seconds up to {MAX_SECONDS:g} (or None for "
            f"{none_means}), not {value!r}"
        )
    return seconds
