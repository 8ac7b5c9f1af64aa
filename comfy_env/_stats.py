"""Frozen snapshots of a pool's state: ``EnvStats`` per env, ``WorkerStats`` per slot.

Returned by ``Pool.stats()`` and ``Worker.stats()``; the status file and the CLI read the same
counters (``CALL_COUNTERS``).
"""

from __future__ import annotations

from ._values import value

TYPE_CHECKING = False  # (``comfy-env status`` loads this module: no typing import at run time)
if TYPE_CHECKING:
    from ._settings import Settings

# How a call ended, and the counters that add up to ``submitted`` (with spawns alongside).
OUTCOMES = ("ok", "raised", "crashed", "timed_out", "cancelled", "failed")
CALL_COUNTERS = ("submitted", *OUTCOMES, "in_flight", "queued", "spawns")


@value
class WorkerStats:
    """One slot's worker as of the snapshot. ``state`` is ``"empty"`` before the first spawn.
    ``idle_since`` is on the pool's clock (monotonic); ``live_refs`` counts RemoteRefs held.
    ``shared_memory`` is ``"on"``, ``"off"`` (configured off) or ``"unavailable"`` (/dev/shm is
    missing or full: large buffers stream inline); None before the first spawn."""

    slot: int
    generation: int
    pid: int | None
    state: str
    retire_reason: str | None
    startup_seconds: float | None
    idle_since: float | None = None
    live_refs: int = 0
    shared_memory: str | None = None
    stuck: bool = False


@value
class EnvStats:
    """Counters of one env. Invariant: ``submitted == ok + raised + crashed + timed_out +
    cancelled + failed + in_flight + queued``.

    ``generation`` is the latest generation spawned for the env (any slot's spawn bumps it);
    ``pid``, ``state`` and ``shared_memory`` are the first slot's (``workers[0]``). With
    ``max_workers_per_env > 1`` each slot's own generation, pid and state are in ``workers``.

    ``raised``: the function raised (or its result did not unpickle). ``crashed``: the worker
    died during the call. ``failed``: the call could not run for another reason (the worker did
    not start, spoke garbage, the pool closed, a by-value function met another Python).
    """

    env: str
    generation: int
    pid: int | None
    state: str
    submitted: int
    ok: int
    raised: int
    crashed: int
    timed_out: int
    cancelled: int
    failed: int
    in_flight: int
    queued: int
    spawns: int
    stale_events_dropped: int
    workers: tuple[WorkerStats, ...]
    reaped: int = 0
    pings: int = 0
    ping_failures: int = 0
    restarts_in_window: int = 0
    live_refs: int = 0
    abandoned: bool = False
    log_lines_dropped: int = 0
    shared_memory: str | None = None  # the first slot's ``WorkerStats.shared_memory``
    # What the env runs with (the pool's settings with the env's own, ``Pool.configure``), and
    # the names of the fields the env set itself.
    settings: Settings | None = None
    own_settings: tuple[str, ...] = ()
