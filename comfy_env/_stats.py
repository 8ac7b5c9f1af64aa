"""Frozen snapshots of a pool's state: ``EnvStats`` per env, ``WorkerStats`` per slot.

Returned by ``Pool.stats()`` and ``Worker.stats()``. The call counters are declared once
(``CallCounts``): ``EnvStats`` starts with them, the status file's ``_status.EnvStatus`` too,
and the pool's status snapshot and the CLI go through their names (``CALL_COUNTERS``).
"""

from __future__ import annotations

from ._values import fields, value

TYPE_CHECKING = False  # (``comfy-env status`` loads this module: no typing import at run time)
if TYPE_CHECKING:
    from ._settings import Settings


@value
class CallCounts:
    """How one env's calls stand. Invariant: ``submitted == ok + raised + crashed +
    timed_out + cancelled + failed + in_flight + queued``: every call submitted is queued, in
    flight, or ended in one way (``ok`` to ``failed``); ``spawns`` (workers started) alongside.

    ``raised``: the function raised (or its result did not unpickle). ``crashed``: the worker
    died during the call. ``failed``: the call could not run for another reason (the worker did
    not start, spoke garbage, the pool closed, a by-value function met another Python).
    """

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


# The counters' names, in order (the status file's keys, the CLI's rows).
CALL_COUNTERS = fields(CallCounts)


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
class EnvStats(CallCounts):
    """One env: its call counters (``CallCounts``, with their invariant), then the rest.

    ``generation`` is the latest generation spawned for the env (any slot's spawn bumps it);
    ``pid``, ``state`` and ``shared_memory`` are the first slot's (``workers[0]``). With
    ``max_workers_per_env > 1`` each slot's own generation, pid and state are in ``workers``.
    """

    env: str
    generation: int
    pid: int | None
    state: str
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
