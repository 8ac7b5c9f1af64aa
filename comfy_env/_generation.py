"""What one worker generation is born with (``Birth``), the facts every backend's generation
carries (``GenerationFacts``), and the core's own record of how it ended (``GenerationEnd``).

Data flow::

    Spawner._begin    gate(SpawnBegan g) -> Birth(spec, g, the env's settings, reactor,
                      runtime dir, on_exit, on_finished)
    Backend.new_generation(birth)
                      -> WorkerProcess(birth)    (local: _process)
                      -> RayWorker(backend, birth) (ray: _ray)
                      both start from GenerationFacts: the data members of
                      ``_backend.WorkerGeneration`` that do not depend on how a worker runs

    Spawner._begin    -> GenerationEnd(g), in the slot beside its process (``slot.ending``)

Who writes the facts: the backend (``pid``, ``hello`` from the worker's hello;
``death_detail``). The lifecycle facts are the core's, not the mechanism's, so they live on
``GenerationEnd``, never on the backend's object: the gate writes ``retire_reason`` and
``cancel_kill`` (under the entry's lock, as it retires the generation) and the spawner
``death_reported`` (under the entry's lock, so a death is reported once whether the caller or
the reactor sees it first). One writer each (``tests/test_structure.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import WorkerStartError
from ._values import value

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._envs import EnvSpec
    from ._lifecycle import CancelKill, RetireReason
    from ._reactor import Reactor
    from ._runtime_store import RuntimeDir
    from ._settings import Settings


@value
class Birth:
    """Everything a backend needs to make generation ``generation``'s process object."""

    spec: EnvSpec
    generation: int
    config: Settings  # the env's effective settings (the pool's, or its own: Pool.configure)
    reactor: Reactor
    runtime_dir: RuntimeDir
    on_exit: Callable[[Any], None]  # it is known dead (the gate's Exited), on the reactor
    on_finished: Callable[[Any], None]  # its exit code and last output are final


class GenerationFacts:
    """The facts about one generation that every backend keeps alike (see the module
    docstring for who writes which)."""

    def __init__(self, birth: Birth) -> None:
        self.spec = birth.spec
        self.generation = birth.generation
        self.config = birth.config
        self.reactor = birth.reactor
        self.runtime_dir = birth.runtime_dir
        self.pid: int | None = None  # the interpreter's own pid, from its hello
        self.hello: dict[str, Any] = {}
        self.death_detail: str | None = None  # how it died, where no exit code says it

    def start_error(self, text: str, tail: str = "", unsupported: bool = False) -> WorkerStartError:
        """A ``WorkerStartError`` naming this generation's env, number and pid (None before
        its hello), with ``tail``, its last output lines (``_handshake.start_error``)."""
        return WorkerStartError(
            text,
            env=self.spec.key,
            pid=self.pid,
            generation=self.generation,
            stderr_tail=tail,
            unsupported=unsupported,
        )

    def stopped_before_launch(self) -> WorkerStartError:
        """The start's error when the generation was stopped (a close, a reset) before it
        was launched: nothing was started, so there is nothing to stop."""
        return self.start_error("the worker was stopped before it was launched")


class GenerationEnd:
    """The core's record of how generation ``generation`` of a slot ended (see the module
    docstring for who writes which). It outlives the slot's state: a death is reported (the
    reactor's ``on_finished``) after the slot may have begun the next generation."""

    __slots__ = ("cancel_kill", "death_reported", "generation", "retire_reason")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.retire_reason: RetireReason | None = None  # set by the pool's gate
        self.cancel_kill: CancelKill | None = None  # how a cancel killed it: the gate, with it
        self.death_reported = False  # by the spawner (breaker, WorkerRetired), once
