"""The spawner: one generation's birth, and the report of its end.

Data flow of a start (``Spawner.spawn``, on the caller that leased the slot)::

    services        the reactor, the reaper's timer and the runtime dir, on the first spawn
                    (under the pool's lock: a close cannot miss them)
    begin           gate(SpawnBegan) under the entry's lock; generation g+1 numbered, its
                    process object made by the backend and put in the slot
    activate        the env's activation scripts (cached), before the start-up deadline
    launch          fork on the reactor (``track``: known before anything can stop us; the
                    host watcher and the start-up sweep are queued there)
    handshake       HELLO -> CONFIG -> READY and the canary, on the caller
    ready           gate(HandshakeOk), ``WorkerSpawned``/``WorkerReady``, status file

Data flow of an end (on the reactor, or first on the caller a crash failed)::

    pidfd readable -> on_exit: gate(Exited), the process forgotten
    output drained -> on_finished -> report_death: ``WorkerRetired`` once, then the
                      crash-loop breaker counts it (``_policies.record_death``)

Writes of ``slot.process`` (with ``slot.ending``, the core's record of that generation's end),
``entry.generation`` and ``GenerationEnd.death_reported`` happen here and nowhere else
(``tests/test_structure.py``). Ctrl-C is held back from ``SpawnBegan`` to the start's outcome
(``_interrupts``): it interrupts only the waits for the activation and the handshake, and the
clean-up that records ``StartFailed`` runs whole, so no interrupt leaves a slot starting with
no start in progress. Close during a spawn: ``launch`` refuses to fork once the pool is
closing, and ``close`` first runs a barrier on the reactor, so every forked process is known.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from . import _lifecycle as lc
from . import _policies
from ._errors import PoolClosedError, WorkerStartError, describe_exit, signal_name
from ._events import ShmSwept, WorkerReady, WorkerRetired, WorkerSpawned
from ._failures import abandoned_error
from ._generation import Birth, GenerationEnd
from ._identity import HOST_ID_VAR, host_id
from ._interrupts import Deferred
from ._process import RuntimeDir, base_environment
from ._reactor import Reactor, TimerHandle
from ._watcher import HostWatcher

if TYPE_CHECKING:
    from ._activation import Activation
    from ._backend import Backend, WorkerGeneration
    from ._entry import EnvEntry, Slot
    from ._events import Dispatcher
    from ._settings import Settings
    from ._sweep import SweepReport

_log = logging.getLogger("comfy_env")
# Seconds from a pool's first fork to its start-up sweep (see ``track``): past the moment the
# launching caller blocks on the worker's hello, well before the hello can arrive.
_SWEEP_DELAY = 0.005
# Seconds from a worker's retirement to the release of its sockets and shared memory (see
# ``dispose_later``).
_DISPOSE_DELAY = 0.005


class SpawnSite(Protocol):
    """What the spawner reads of its pool (``_pool.Pool``), which it never imports."""

    settings: Settings
    clock: Callable[[], float]
    events: Dispatcher
    backend: Backend

    @property
    def closed(self) -> bool: ...

    def closed_error(self) -> Exception: ...

    def status_changed(self) -> None: ...

    def entries(self) -> list[EnvEntry]: ...

    def reap_idle(self, now: float | None = None) -> int: ...


class Spawner:
    """Starts a pool's generations and reports their ends; holds what starting needs (the
    reactor, the runtime dir, the host watcher) and the processes forked and not yet reaped.

    ``lock`` is the pool's: the pool's ``closed`` flag and what is made here on the first
    spawn change under it together, so a close never misses a reactor or a fork."""

    def __init__(self, pool: SpawnSite, lock: threading.Lock, entries: dict[str, EnvEntry]) -> None:
        self.pool, self.lock = pool, lock
        self._entries = entries  # the pool's, by env key (read lock-free: ``_release_dropped``)
        self.reactor: Reactor | None = None
        self.runtime_dir: RuntimeDir | None = None
        self.watcher: HostWatcher | None = None  # stops setsid descendants if we die
        self.processes: set[WorkerGeneration] = set()  # forked and not yet reaped
        self.last_sweep: SweepReport | None = None  # what the start-up sweep removed
        self.reaper: TimerHandle | None = None
        self._sweep_queued = False
        self._release_due = False  # a background release of dropped refs is queued

    # ---- birth ----

    def spawn(self, entry: EnvEntry, slot: Slot) -> WorkerGeneration:
        """Start generation g+1 on the leased ``slot`` and return it verified
        (``HandshakeOk``); Ctrl-C held back as the module docstring says."""
        with Deferred() as held:
            reactor, runtime_dir = self._services(entry)
            process, generation = self._begin(entry, slot, reactor, runtime_dir)
            activation = self._activate(entry, slot, generation, held)
            started = time.monotonic()
            launched = self._launch(entry, slot, process, activation)
            try:
                with held.allowing():  # (a slow import: the user may give up)
                    process.handshake(started + self.pool.settings.start_timeout)
            except BaseException as exc:
                entry.apply(slot, lc.StartFailed(generation))
                if isinstance(exc, WorkerStartError) and exc.unsupported:
                    with entry.lock:
                        entry.unsupported = exc
                if self.pool.closed and isinstance(exc, WorkerStartError):
                    raise PoolClosedError("the pool was closed while the worker started") from exc
                raise
            self._ready(entry, slot, process, launched)
            return process

    def _services(self, entry: EnvEntry) -> tuple[Reactor, RuntimeDir]:
        """The reactor (and the reaper on it) and the runtime dir, made on the first spawn
        under the pool's lock, refused once the pool is closed."""
        with self.lock:
            if self.pool.closed:
                raise self.pool.closed_error()
            try:
                if self.reactor is None:
                    self.reactor = Reactor()
                    self.reactor.start()
                    # On the reactor, where the ticks run, outside this lock (the schedule
                    # reads every env's idle timeout, and the entries are behind this lock).
                    self.reactor.call_later(0, self.reschedule_reaper)
                if self.runtime_dir is None:
                    # Named here; the first spawn makes and fills it while its worker starts.
                    self.runtime_dir = RuntimeDir()
            except OSError as exc:  # out of descriptors or disk in the host: typed, nothing kept
                raise WorkerStartError(
                    f"cannot prepare to start a worker for env {entry.spec.key}: {exc} (is the "
                    "host out of file descriptors or disk space?)",
                    env=entry.spec.key,
                ) from exc
            return self.reactor, self.runtime_dir

    def _begin(
        self, entry: EnvEntry, slot: Slot, reactor: Reactor, runtime_dir: RuntimeDir
    ) -> tuple[WorkerGeneration, int]:
        """``SpawnBegan`` under the entry's lock (refused for an abandoned env or a Python
        found unsupported): the generation numbered and its process object in the slot."""
        pool = self.pool
        with entry.lock:
            if isinstance(entry.env_state, lc.EnvAbandoned) and (
                abandoned := entry.abandoned_locked(pool.clock())
            ):
                raise abandoned_error(entry.spec.key, abandoned, entry.breaker is not None)
            if entry.unsupported is not None:  # said once; never started again
                raise WorkerStartError(str(entry.unsupported), env=entry.spec.key, unsupported=True)
            generation = entry.generation + 1
            effects = entry.apply_locked(slot, lc.SpawnBegan(generation))
            if effects is None:  # pragma: no cover - the lease makes this impossible
                raise AssertionError(f"slot {slot.index} of {entry.spec.key} is not free")
            entry.generation = generation
            entry.spawns += 1
            old = slot.process
            if old is not None:
                entry.log_lines_dropped += old.log.dropped
            ending = GenerationEnd(generation)  # the core's record of this generation's end
            birth = Birth(
                entry.spec,
                generation,
                entry.settings,  # the pool's, or the env's own (``Pool.configure``)
                reactor,
                runtime_dir,
                lambda p: self.on_exit(entry, slot, p),
                lambda p: self.on_finished(entry, p, ending),
            )
            process: WorkerGeneration = pool.backend.new_generation(birth)
            slot.process, slot.ending = process, ending
        if old is not None:
            old.dispose()
        return process, generation

    def _activate(
        self, entry: EnvEntry, slot: Slot, generation: int, held: Deferred
    ) -> Activation | None:
        """The env's activation (its scripts run on the first spawn of the env in this host,
        bounded by start_timeout; later spawns take the cached result), on the spawning
        caller's thread and before the start-up deadline begins: never on the reactor, never
        on a warm call, and a slow script does not eat the worker's own deadline."""
        settings = self.pool.settings
        if not settings.activate or entry.spec.is_current:
            return None
        from ._activation import activation_for  # not loaded for the current interpreter

        try:
            with held.allowing():  # (its scripts may take seconds)
                return activation_for(entry.spec, base_environment(), settings.start_timeout)
        except BaseException:
            entry.apply(slot, lc.StartFailed(generation))
            raise

    def _launch(
        self,
        entry: EnvEntry,
        slot: Slot,
        process: WorkerGeneration,
        activation: Activation | None,
    ) -> int | None:
        """Fork the worker (on the reactor); a start that fails is recorded (``StartFailed``)
        and, since no exit will be reported for it, counted as a death now. Returns the pid
        launched (``WorkerSpawned`` tells it now), None where no process was (an actor)."""
        generation = process.generation
        try:
            # Not interruptible: the fork runs on the reactor, and a caller that left its
            # wait would leave the forked process's descriptors to nobody.
            launched = process.launch(
                before_launch=self.refuse_if_closed, after_launch=self.track, activation=activation
            )
        except BaseException as exc:
            entry.apply(slot, lc.StartFailed(generation))
            closed = self.pool.closed
            if isinstance(exc, WorkerStartError) and not closed:
                # Nothing was forked, so no exit will be reported: count the death now (told
                # first, then counted: see ``report_death``).
                self.pool.events.emit(
                    WorkerRetired(entry.spec.key, generation, None, "start_failed", None, None)
                )
                self._record_death(entry, generation, lc.RetireReason.START_FAILED, None, "")
            if closed and isinstance(exc, WorkerStartError):
                # close() stopped it before or while it was launched ("stopped before it was
                # launched", a reactor already stopped): the pool's closing, not the env's.
                raise PoolClosedError("the pool was closed while the worker started") from exc
            raise
        if launched is not None:
            self.pool.events.emit(WorkerSpawned(entry.spec.key, generation, launched))
        return launched

    def _ready(
        self, entry: EnvEntry, slot: Slot, process: WorkerGeneration, launched: int | None
    ) -> None:
        """``HandshakeOk`` through the gate, then the events and the status file."""
        pool, generation = self.pool, process.generation
        if not entry.apply(slot, lc.HandshakeOk(generation, process.pid or 0, pool.clock())):
            # Retired while starting (the pool is closing, or it died right after the canary).
            if pool.closed:
                raise PoolClosedError("the pool was closed while the worker started")
            rc = process.wait_exit(1.0)
            raise WorkerStartError(
                f"worker for env {entry.spec.key} (generation {generation}) {describe_exit(rc)} "
                "right after its start-up",
                env=entry.spec.key,
                pid=process.pid,
                generation=generation,
                stderr_tail=process.log.tail(),
            )
        python, entry.python = entry.python, process.python_version
        if python and python[:2] != entry.python[:2]:
            # The same interpreter path now runs another Python: the env was rebuilt in place
            # (its workers of before kept the old one until they ended). Not refused: the
            # path is what was asked for; by-value calls are checked per worker anyway.
            _log.warning(
                "comfy-env: env %s now runs Python %s; its earlier workers ran Python %s "
                "(the env was rebuilt in place?)",
                entry.spec.key,
                ".".join(map(str, entry.python[:3])),
                ".".join(map(str, python[:3])),
            )
        _log.debug(
            "comfy-env: env %s generation %d ready (pid %s, %.1f ms)",
            entry.spec.key,
            generation,
            process.pid,
            process.startup_seconds * 1000,
        )
        if launched is None and process.pid is not None:
            # No process of ours was launched (an actor): its pid is known from its hello.
            pool.events.emit(WorkerSpawned(entry.spec.key, generation, process.pid))
        pool.events.emit(
            WorkerReady(entry.spec.key, generation, process.pid or 0, process.startup_seconds)
        )
        pool.status_changed()

    def refuse_if_closed(self) -> None:
        if self.pool.closed:
            raise self.pool.closed_error()

    def track(self, process: WorkerGeneration) -> None:
        """Reactor thread, right after a fork: know the process before anything can stop us."""
        with self.lock:
            self.processes.add(process)
            first = self.last_sweep is None and not self._sweep_queued
            self._sweep_queued = True
        if self.watcher is None and self.reactor is not None:
            self._start_watcher()
        if first and self.reactor is not None:
            # The pool starts: clear what dead hosts left behind, off every caller's path: on
            # the reactor thread, a moment after this fork, when the caller that launched the
            # worker waits for its hello (tens of ms). Run at once, the sweep (1-8 ms of
            # Python) held the GIL while that caller wanted to go on with the handshake.
            self.reactor.call_later(_SWEEP_DELAY, self._sweep)

    def _start_watcher(self) -> None:
        """Reactor thread, right after the first worker's fork (``track``): launch the host
        watcher once (see ``_watcher``), before the caller makes the runtime dir that worker
        waits for, so that no leftover of this host exists without a watcher to remove it. A
        shell waiting on a pipe: about a millisecond of the first call, no interpreter start.
        ``close`` reads ``watcher`` after the reactor stopped, so no start races a close."""
        with self.lock:
            if self.watcher is not None or self.pool.closed:
                return
            # The root this pool's runtime dir is in: where the host's status file is too, and
            # what the watcher cleans up (the whole root, if it is this host's private one).
            root = "" if self.runtime_dir is None else os.path.dirname(self.runtime_dir.path)
            try:
                self.watcher = HostWatcher.start(HOST_ID_VAR, host_id(), runtime_root=root)
            except OSError as exc:  # the sweep remains the backstop
                _log.warning(
                    "comfy-env: cannot start the host watcher (%s); setsid descendants of "
                    "workers outlive a killed host until the next sweep",
                    exc,
                )

    def _sweep(self) -> None:
        from ._sweep import sweep

        try:
            self.last_sweep = report = sweep()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise
            # A host short of descriptors or memory right now: the sweep is a backstop (the
            # next pool start, or ``comfy-env sweep``, runs it), not worth a traceback.
            _log.warning("comfy-env: the start-up sweep was skipped: %s", exc)
            return
        if report:
            self.pool.events.emit(ShmSwept(report))

    # ---- the reaper's timer ----

    def schedule_reaper(self) -> None:
        """One periodic timer on the reactor serves every env (no thread per worker), as often
        as the shortest idle timeout of the pool's and the envs' own asks."""
        timeouts = [e.settings.idle_timeout for e in self.pool.entries()]
        known = [t for t in [*timeouts, self.pool.settings.idle_timeout] if t is not None]
        if not known or self.reactor is None:
            self.reaper = None  # (``Pool.configure`` reschedules when an env gets a timeout)
            return
        interval = min(max(min(known) / 4, 0.02), 5.0)
        self.reaper = self.reactor.call_later(interval, self.reap_tick)

    def reschedule_reaper(self) -> None:
        """Reactor thread (where the ticks run: one timer chain, never two): schedule again
        after an env's idle timeout changed."""
        if self.reaper is not None:
            self.reaper.cancel()
        if not self.pool.closed:
            self.schedule_reaper()

    def reap_tick(self) -> None:
        pool = self.pool
        if pool.closed:
            return
        for entry in pool.entries():  # (none stuck in a sound pool: a check per slot)
            if entry.recover_stuck():
                _log.warning(
                    "comfy-env: env %s had a slot starting with no start in progress; "
                    "retired (the next call starts a fresh worker)",
                    entry.spec.key,
                )
        pool.reap_idle()
        self.schedule_reaper()

    # ---- the end ----

    def on_exit(self, entry: EnvEntry, slot: Slot, process: WorkerGeneration) -> None:
        """Reactor thread: the process was reaped."""
        with self.lock:
            self.processes.discard(process)
        entry.apply(slot, lc.Exited(process.generation, process.returncode))
        self.pool.status_changed()

    def on_finished(self, entry: EnvEntry, process: WorkerGeneration, end: GenerationEnd) -> None:
        """Reactor thread: reaped and output drained; exit code and last lines are final."""
        self.report_death(entry, process, end, process.returncode, process.log.tail())

    def report_death(
        self,
        entry: EnvEntry,
        process: WorkerGeneration,
        ending: GenerationEnd,
        returncode: int | None,
        tail: str,
    ) -> None:
        """Report a generation's end once: subscribers get ``WorkerRetired``, then the
        crash-loop breaker counts it (deaths only, and nothing while the pool closes;
        ``EnvAbandoned`` if it trips, after the retirement that caused it). The caller whose
        call the death failed reports before it raises (``Exchange.crashed``), so a caller that
        calls again at once meets the breaker's verdict and events keep their order; else the
        reactor does when the exit is reported."""
        with entry.lock:
            if ending.death_reported:
                return
            ending.death_reported = True
            reason = ending.retire_reason or lc.RetireReason.CRASHED
        events = self.pool.events
        # Causal order for subscribers: the retirement first, then the breaker's verdict on
        # it (``record_death`` emits ``EnvAbandoned`` when this death trips the breaker).
        if events.subscribed:  # no event object on a crash path nobody watches
            events.emit(
                WorkerRetired(
                    entry.spec.key,
                    process.generation,
                    process.pid,
                    reason.value,
                    returncode,
                    signal_name(returncode),
                )
            )
        if reason in lc.DEATHS and not self.pool.closed:
            self._record_death(entry, process.generation, reason, returncode, tail)

    def _record_death(
        self, entry: EnvEntry, generation: int, reason: lc.RetireReason, rc: int | None, tail: str
    ) -> None:
        pool = self.pool
        death = _policies.death_of(generation, reason, rc, tail, pool.clock())
        _policies.record_death(entry, death, pool.settings, pool.events)

    # ---- dropped refs ----

    def refs_dropped(self) -> None:
        """A RemoteRef was dropped (``__del__``, ``discard``), or a slot was freed with dropped
        refs still queued: the reactor releases them soon (``_release_dropped``). Every
        entry's ``refs_dropped``.

        Runs inside finalisers: in any thread, under any lock (the pool's and its entries'
        too), at interpreter exit. So it takes no lock, blocks on nothing and raises nothing:
        one flag and, once per burst, a callback queued with a wake-up byte
        (``Reactor.notify``). The flag is cleared by the callback *before* it looks at the
        queues, so a ref appended after that look finds the flag clear and queues another."""
        reactor = self.reactor
        if reactor is None or self._release_due:  # (None: no worker ran, no ref exists)
            return
        self._release_due = True
        reactor.notify(self._release_dropped)

    def _release_dropped(self) -> None:
        """On the reactor: release the dropped refs of every env's idle workers
        (``_policies.release_idle``); refs of a worker in a call wait for its end."""
        self._release_due = False
        if self.pool.closed:
            return  # the workers are being stopped, and their objects with them
        # (A copy made in one C call, no lock: a new entry holds no dropped ref yet.)
        for entry in tuple(self._entries.values()):
            if entry.dropped_refs:
                _policies.release_idle(entry)

    def status_timer(self) -> Callable[[float, Callable[[], None]], object] | None:
        """The status throttle's timer (``_status``): the reactor's, while the pool is open."""
        reactor = self.reactor
        return None if reactor is None or self.pool.closed else reactor.call_later

    def dispose_later(self, process: WorkerGeneration) -> None:
        """Release a retired worker's sockets and shared memory on the reactor thread, off the
        caller's path (a crash report should not wait for unlinking blocks), and a moment
        later: at once, the reactor's work (Python between system calls) took the GIL from
        the caller still raising its crash report at each of its calls (measured: 0.1-0.37 ms
        added to a quarter of the crashes). The retired worker stays in its slot until then:
        a new generation taking the slot (``spawn``) or the pool closing releases it at once
        instead (``dispose`` is idempotent)."""
        reactor = self.reactor
        if reactor is not None and reactor.running:
            reactor.call_later(_DISPOSE_DELAY, process.dispose)
        else:
            process.dispose()
