"""Shutdown: one pool's stop of its workers, every pool at interpreter exit, and every pool
made inert in a child created by ``fork``.

Data flow of ``Pool.close`` (the caller's thread; the reactor keeps reaping meanwhile)::

    close_entries      per env, under its lock: queued tickets closed and woken
                       (PoolClosedError); gate(CloseRequested g) for each live slot
                       -> KillWorker(ASK), or TERMINATE where a caller holds the lease
    stop_workers       barrier on the reactor: no fork can start after it, and every
                       process forked so far is tracked
                       TERMINATE the ones still starting (the gate never asked them)
                       one shared deadline (close_timeout) for all exits; KILL stragglers,
                       one more shared 2 s; drain output 0.5 s
                       reactor: force_close every channel; reactor stops
                       dispose of every generation no caller still leases

One shared deadline per phase, never one wait per worker: with many workers stuck (or never
launched) ``close()`` takes ``close_timeout`` plus a bounded constant.

The registry (``live_pools``) exists for the two process-wide hooks, installed when the first
pool is created (never at import): ``atexit`` closes every live pool, and only then removes
the process's private runtime root if it made one (``_rundir.install_exit_hook``: a pool's
close still writes the status file under the root), and
``os.register_at_fork(after_in_child=...)`` makes each inherited pool drop its descriptors
and become closed in the child, which must never send on, read from, kill or clean up the
parent's workers (a worker notices its host's death only when the last copy of the host's
channel end is closed).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from . import _lifecycle as lc
from ._inflight import CALLS_IN_FLIGHT
from ._rundir import install_exit_hook

if TYPE_CHECKING:
    from ._backend import WorkerGeneration
    from ._entry import EnvEntry
    from ._reactor import Reactor
    from ._spawner import Spawner

_log = logging.getLogger("comfy_env")


class LivePool(Protocol):
    """What the process-wide hooks need of a pool."""

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

    def abandon_in_forked_child(self) -> None: ...


class Registration:
    """A pool's entry in ``live_pools``. The registry holds these weakly rather than the pools
    themselves because a compiled pool (``python3 dev.py compile``: a mypyc native class)
    cannot be weakly referenced. The pool keeps its registration and the registration its
    pool, so the entry lives exactly as long as the pool does (freed with it by the cycle
    collector if it was dropped unclosed)."""

    __slots__ = ("__weakref__", "pool")

    def __init__(self, pool: LivePool) -> None:
        self.pool = pool


live_pools: weakref.WeakSet[Registration] = weakref.WeakSet()
_hooks_lock = threading.Lock()
_hooks_installed = False


def install_process_hooks() -> None:
    """Once, when the first pool is created (never at import): close pools at interpreter
    exit, and make every pool inert in a child created by ``fork``."""
    global _hooks_installed
    with _hooks_lock:
        if _hooks_installed:
            return
        import atexit

        # First the private root's removal, then the pools' close: atexit runs the last
        # registered first, so the pools close (their status file is written under the root)
        # before the root goes. Registered once a process, whichever comes first.
        install_exit_hook()
        atexit.register(_close_all_pools)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
        _hooks_installed = True


def register(pool: LivePool) -> Registration:
    """Add ``pool`` to the registry; the pool keeps the returned registration."""
    registration = Registration(pool)
    live_pools.add(registration)
    return registration


def _close_all_pools() -> None:
    for registration in list(live_pools):
        try:
            registration.pool.close()
        except Exception:  # noqa: BLE001 - exit must go on
            _log.exception("comfy-env: closing a pool at exit failed")


def _after_fork_in_child() -> None:
    """Runs in the child right after ``fork``, with only the forking thread alive.

    Every inherited pool is the parent's: the child must never send on, read from, kill or
    clean up the parent's workers, and must not keep the parent's channels open (a worker only
    notices its host's death when the last copy of the host's channel end is closed). So each
    pool drops its descriptors and becomes closed; locks other threads held at the fork are
    replaced."""
    global _hooks_lock
    _hooks_lock = threading.Lock()
    # The calls in flight were the parent's threads' (gone here); a call of the forking thread
    # that ends in the child finds itself gone already (its discard does nothing).
    CALLS_IN_FLIGHT.clear()
    for registration in list(live_pools):
        registration.pool.abandon_in_forked_child()
    live_pools.clear()


def stop_pool(spawner: Spawner, entries: list[EnvEntry], reactor: Reactor | None) -> None:
    """``Pool.close``'s work once the pool is marked closed: fail the queued calls and retire
    every worker through the gate (``close_entries``), stop the reaper's timer, stop the
    workers (``stop_workers``; only if a reactor was ever made: else none was forked), the
    host watcher and the backend, and remove the pool's runtime dir."""
    close_entries(entries)
    if spawner.reaper is not None:
        spawner.reaper.cancel()
    if reactor is not None:
        close_timeout = spawner.pool.settings.close_timeout
        stop_workers(entries, reactor, lambda: list(spawner.processes), spawner.lock, close_timeout)
        if spawner.watcher is not None:  # every worker is stopped: it has nothing to do
            spawner.watcher.close(2.0)
    spawner.pool.backend.close()
    if reactor is not None and spawner.runtime_dir is not None:
        shutil.rmtree(spawner.runtime_dir.path, ignore_errors=True)


def abandon_pool(spawner: Spawner, entries: list[EnvEntry]) -> None:
    """In a forked child (``Pool.abandon_in_forked_child``, the pool already closed there):
    replace the entries' locks (other threads may have held them at the fork), forget the
    queued calls (their threads are the parent's), and make every process, the reactor and
    the host watcher drop their inherited descriptors without signalling anything."""
    processes = set(spawner.processes)
    for entry in entries:
        entry.lock = threading.Lock()
        entry.waiters.clear()
        processes.update(s.process for s in entry.slots if s.process is not None)
    for process in processes:
        process.abandon_in_forked_child()
    if spawner.reactor is not None:
        spawner.reactor.abandon_in_forked_child()
    if spawner.watcher is not None:
        spawner.watcher.forget_in_forked_child()


def close_entries(entries: list[EnvEntry]) -> None:
    """Fail every queued call (``ticket.closed``) and ask every live worker to leave, through
    the gate (``CloseRequested`` of its generation)."""
    for entry in entries:
        with entry.lock:
            waiters = list(entry.waiters)
            entry.waiters.clear()
            for ticket in waiters:
                ticket.closed = True
                ticket.wake()
            live = [
                (s, s.state.generation)
                for s in entry.slots
                if s.state is not None and not isinstance(s.state, lc.Retired)
            ]
        for slot, generation in live:
            entry.apply(slot, lc.CloseRequested(generation))


def stop_workers(
    entries: list[EnvEntry],
    reactor: Reactor,
    tracked: Callable[[], list[WorkerGeneration]],
    lock: threading.Lock,
    close_timeout: float,
) -> None:
    """Stop every worker of a closing pool and release their channels (see the module
    docstring). ``tracked`` lists the processes forked and not yet reaped, under ``lock``
    (the pool's, which guards that set: the spawner adds to it as it forks). A slot's lease
    is read under its entry's lock, which guards everything in the entry: a caller that
    still ends its call keeps its worker's objects until it lets go (it disposes of them)."""
    from ._reactor import ReactorFailed  # (loaded with the reactor: costs nothing here)

    # Barrier: after this, no fork can start (the pool refuses before launching), and every
    # process forked so far is tracked. (A reactor whose thread has ended forks nothing, and
    # from here on this thread does its work: reaping in ``wait_exit``, the release below.)
    if reactor.running:
        try:
            reactor.run_sync(lambda: None)
        except ReactorFailed:
            pass  # it ended just now: as above
    with lock:
        processes = tracked()
    for process in _not_asked(entries, processes):
        process.kill(lc.Stop.TERMINATE)
    deadline = time.monotonic() + close_timeout
    for process in processes:
        process.wait_exit(max(0.0, deadline - time.monotonic()))
    stragglers = [p for p in processes if not p.exited.is_set()]
    for process in stragglers:
        process.kill(lc.Stop.KILL)
    # One shared deadline per phase, never one wait per worker: with many workers stuck
    # (or never launched) close() still takes close_timeout plus a bounded constant.
    killed_by = time.monotonic() + 2.0
    for process in stragglers:
        process.wait_exit(max(0.0, killed_by - time.monotonic()))
    drained_by = time.monotonic() + 0.5
    in_slots = _in_slots(entries)
    for process in in_slots:  # (at once for one never launched: it has no output)
        process.wait_output(max(0.0, drained_by - time.monotonic()))
    all_processes = set(in_slots)
    all_processes.update(processes)

    def release_all() -> None:
        for p in all_processes:
            p.force_close()

    try:
        reactor.run_sync(release_all) if reactor.running else release_all()
    except ReactorFailed:
        release_all()
    reactor.stop()
    for process in all_processes:
        if not _leased(entries, process):
            process.dispose()


def _not_asked(
    entries: list[EnvEntry], processes: list[WorkerGeneration]
) -> list[WorkerGeneration]:
    """The tracked ``processes`` the gate did not ask to stop: those whose slot is not retired
    (``close_entries`` retires every live slot, so these began starting after it looked, and
    their start will fail on the closed pool). A tracked process that left its slot was
    retired before its slot began the next generation: the gate stopped it then."""
    tracked = set(processes)
    not_asked = []
    for entry in entries:
        with entry.lock:
            for slot in entry.slots:
                process = slot.process
                if process in tracked and not isinstance(slot.state, lc.Retired):
                    not_asked.append(process)
    return not_asked


def _in_slots(entries: list[EnvEntry]) -> list[WorkerGeneration]:
    """The process in each slot (the latest generation of each), in slot order."""
    return [s.process for e in entries for s in e.slots if s.process is not None]


def _leased(entries: list[EnvEntry], process: WorkerGeneration) -> bool:
    """Whether a caller still holds the slot of ``process`` (each entry's lock held in turn:
    it guards the slots' leases)."""
    for entry in entries:
        with entry.lock:
            if any(s.leased and s.process is process for s in entry.slots):
                return True
    return False
