"""The backend seam: what starts, talks to and stops one worker generation.

The pool's core (env entries, slots, FIFO leasing, the lifecycle gate, stats, events) and its
policies (idle reaper, health ping, crash-loop breaker) know nothing about how a worker runs.
They hold a ``WorkerGeneration`` per slot and reach it only through the members below. A
``Backend`` makes one generation at a time::

    Spawner._begin --new_generation(Birth)--> WorkerGeneration (not started; ``_generation``)
                 launch(before, after, activation) -> the pid launched (None: an actor)
                                            start it (a process, an actor) with the env's
                                            activation variables (``_activation``)
                 handshake(deadline)        verified: hello + canary, or WorkerStartError
                 send_request / reader.read / read_frame / open_reply / finish_request
                                            one call at a time, by the lease holder
                 send_cancel(call_id)       cooperative cancellation (any thread)
                 release_refs_now(ids)      dropped refs, to an idle worker nobody leases
                                            (the reactor, under the entry's lock)
                 kill(stop) / dispose()     the gate's effects
    on_exit(gen)      -> the gate's Exited (it died or was stopped)
    on_finished(gen)  -> exit code and last output are final (WorkerRetired, the breaker)

Backends:

- ``local`` (``LocalBackend``): a subprocess of the env's interpreter, a framed socketpair,
  shared memory for large buffers (``_process.WorkerProcess``). The default.
- ``ray`` (``comfy_env._ray``, the ``ray`` extra: ``pip install '.[ray]'``): one Ray actor per
  generation under the env's interpreter. Imported only when a pool selects it.

A backend declares ``capabilities`` (``"exit codes"``, ``"signal grace"``, ``"shared memory"``,
``"fork"``, ``"fd channel"``): the contract suite skips by them, and the asyncio path runs a
call on the event loop only over an ``"fd channel"``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from comfy_env_worker.protocol import Payload
    from comfy_env_worker.shm import Block

    from ._activation import Activation
    from ._channel import Channel
    from ._generation import Birth
    from ._lifecycle import Stop
    from ._logs import WorkerLog
    from ._memlimit import WorkerMemory
    from ._settings import Settings

LOCAL_CAPABILITIES = frozenset(
    {"exit codes", "signal grace", "shared memory", "fork", "fd channel", "descendants"}
)


class FrameSource(Protocol):
    """The reply side of a generation's channel, read by the lease holder only."""

    def read(self, deadline: float | None) -> tuple[int, int, int, Payload]: ...

    @property
    def buffered(self) -> int: ...


class WorkerGeneration(Protocol):
    """One generation of one slot's worker, as the pool sees it (see the module docstring)."""

    generation: int
    pid: int | None
    startup_seconds: float
    log: WorkerLog
    exited: threading.Event  # set once it is known dead (reaped, or the actor is gone)
    death_detail: str | None  # how it died, where no exit code says it (Ray)
    memory: WorkerMemory | None  # its memory limit and OOM evidence (None: Ray's actors)

    @property
    def returncode(self) -> int | None: ...

    @property
    def shm_state(self) -> str: ...

    @property
    def reader(self) -> FrameSource | None: ...

    @property
    def channel(self) -> Channel | None:
        """The host end of a local worker's channel (``_channel``); None for an actor."""
        ...

    @property
    def python_version(self) -> tuple[int, ...]: ...

    def launch(
        self,
        before_launch: Callable[[], None] | None = None,
        after_launch: Callable[[Any], None] | None = None,
        activation: Activation | None = None,
    ) -> int | None:
        """Start it. Returns the pid of the process launched for it (``WorkerSpawned`` tells
        it at once), or None where no process of ours was launched (an actor: its pid comes
        with its hello, and ``WorkerSpawned`` tells it once it is ready)."""
        ...

    def handshake(self, deadline: float) -> None: ...

    def send_request(
        self, call_id: int, body: bytes, buffers: list[memoryview], deadline: float | None
    ) -> Block | None: ...

    def read_frame(
        self,
        deadline: float | None,
        pending: tuple[int, int, Payload] | None = None,
        on_event: Callable[[int, Payload], None] | None = None,
    ) -> tuple[int, int, int, Payload]: ...

    def open_reply(
        self, call_id: int, flags: int, payload: Payload
    ) -> tuple[Payload | memoryview, list[Any] | None, list[str]]: ...

    def finish_request(self, block: Block | None, retained: list[str]) -> None: ...

    def idle_channel_state(self) -> str: ...

    def ping(self, timeout: float) -> bool: ...

    def send_cancel(self, call_id: int) -> bool: ...

    def release_refs(self, ref_ids: list[int]) -> None: ...

    def release_refs_now(self, ref_ids: list[int]) -> bool:
        """The background release to an idle worker, under the entry's lock: never blocks.
        False: not now (the next call releases them); see ``_policies.release_idle``."""
        ...

    def kill(self, stop: Stop) -> None: ...

    def status_at_eof(self) -> int | None: ...

    def request_unread(self) -> bool: ...

    def collect_exit(self) -> None: ...

    def wait_exit(self, timeout: float) -> int | None: ...

    def wait_output(self, timeout: float) -> None: ...

    def dispose(self) -> None: ...

    def abandon_in_forked_child(self) -> None: ...

    def force_close(self) -> None: ...


class Backend(Protocol):
    """Makes worker generations for a pool (one backend object per pool)."""

    name: str
    capabilities: frozenset[str]

    def new_generation(self, birth: Birth) -> WorkerGeneration: ...

    def close(self) -> None:
        """The pool closed: release what the backend itself holds (not the generations)."""


class LocalBackend:
    """Workers as subprocesses of the env's interpreter (``_process.WorkerProcess``)."""

    name = "local"
    capabilities = LOCAL_CAPABILITIES

    def new_generation(self, birth: Birth) -> WorkerGeneration:
        from ._process import WorkerProcess

        return WorkerProcess(birth)

    def close(self) -> None:
        pass


def backend_for(config: Settings) -> Backend:
    """The backend ``config.backend`` names; Ray is imported only when selected."""
    if config.backend == "ray":
        from ._ray import RayBackend  # type: ignore[import-not-found,unused-ignore]

        backend: Backend = RayBackend(config)
        return backend
    return LocalBackend()
