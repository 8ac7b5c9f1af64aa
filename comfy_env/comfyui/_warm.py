"""Warm packs: a pack's worker started and its node module imported before the first prompt.

Without it, the first prompt after a server start (a cached scan spawns no worker) and the first
one after every crash pay the worker's start and the pack's imports: seconds for a pack that
imports torch or a native library. ``isolate(..., warm=True)`` moves that cost off the prompt::

    isolate(..., warm=True)                      (ComfyUI's import of the pack: returns at once)
      -> Warmer.start() -> thread "comfy-env-warm":
           pack.worker.run("comfy_env_worker.comfyui.scan:warm", ...)
           (spawns the worker if none is live, imports the node module as a node call would)
    pool event WorkerRetired(env, generation, reason)        (the pool's event thread)
      -> a death (crashed, timeout, cancelled, ping_failed, protocol_error): Warmer.start()
         again, so the next prompt finds a fresh worker with the module imported

A prompt that arrives while a warm-up runs waits for it in the env's queue (a worker serves one
call at a time), so it never pays the start twice. Only deaths re-warm: an idle reap or a close
means the memory was wanted back, and a failed start means the env itself is in trouble. A
warm-up that fails (the module no longer imports, the env is abandoned, the pool closed) is
logged and stops the re-warming until a call to the env succeeds again (its ``ok`` count grows),
so a pack whose import crashes cannot loop by itself: its next prompt gets the error, as without
``warm``. One warm-up at a time
per pack: a request while one runs is covered by it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from .._errors import ComfyEnvError
from .._events import Event, WorkerRetired
from ._scan import server_directories

if TYPE_CHECKING:
    from .._pool import Pool
    from . import _Pack

log = logging.getLogger("comfy_env.comfyui")

WARM_TARGET = "comfy_env_worker.comfyui.scan:warm"
# WorkerRetired reasons after which a fresh worker is warmed at once.
REWARM_REASONS = frozenset({"crashed", "timeout", "cancelled", "ping_failed", "protocol_error"})


class Warmer:
    """Keeps one pack's worker warm. Thread-safe: ``start`` runs on ComfyUI's import thread and
    on the pool's event thread."""

    def __init__(self, pack: _Pack, timeout: float) -> None:
        self.pack = pack
        self.timeout = timeout
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._subscribed: Pool | None = None
        self._unsubscribe: Any = None
        self.healthy = True  # False after a failed warm-up: no re-warming until a call succeeds
        self._ok_at_failure = 0  # the env's ``ok`` count when the last warm-up failed
        self.warmups = 0  # warm-ups that completed (diagnostics, tests)

    def start(self) -> None:
        """Warm the pack's worker in the background (no-op while a warm-up runs)."""
        pool = self.pack.configured_pool()
        with self._lock:
            if self._subscribed is not pool:
                # The default pool may have been closed and recreated: follow the live one.
                if self._unsubscribe is not None:
                    self._unsubscribe()
                self._unsubscribe = pool.subscribe(self._on_event)
                self._subscribed = pool
            if self._thread is not None and self._thread.is_alive():
                return
            thread = threading.Thread(target=self._run, name="comfy-env-warm", daemon=True)
            self._thread = thread
        thread.start()

    def follow_deaths(self) -> None:
        """Re-warm after deaths only (the worker is warm already: it just ran the scan)."""
        pool = self.pack.configured_pool()
        with self._lock:
            if self._subscribed is not pool:
                self._unsubscribe = pool.subscribe(self._on_event)
                self._subscribed = pool

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the running warm-up, if any; True when none runs any more."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _run(self) -> None:
        spec = self.pack.spec
        kind = self.pack.scan.get("kind", "v1")
        try:
            self.pack.worker.run(
                WARM_TARGET,
                (spec.pack_dir, spec.module, kind, server_directories(spec)),
                timeout=self.timeout,
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the pack's import: logged
            self.healthy = False
            self._ok_at_failure = self._ok_calls()
            log.warning(
                "comfy-env: could not warm node pack %s in env %s (its next prompt will try "
                "again): %s: %s",
                spec.shown_package,
                spec.env.key,
                type(exc).__name__,
                exc,
            )
            return
        self.healthy = True
        self.warmups += 1
        log.debug("comfy-env: node pack %s is warm in env %s", spec.shown_package, spec.env.key)

    def _ok_calls(self) -> int:
        try:
            stats = self.pack.configured_pool().stats().get(self.pack.spec.env.key)
        except ComfyEnvError:  # a closed pool
            return self._ok_at_failure
        return stats.ok if stats is not None else 0

    def _on_event(self, event: Event) -> None:
        if not (
            isinstance(event, WorkerRetired)
            and event.env == self.pack.spec.env.key
            and event.reason in REWARM_REASONS
        ):
            return
        if not self.healthy and self._ok_calls() > self._ok_at_failure:
            self.healthy = True  # a call succeeded since the failed warm-up
        if self.healthy:
            try:
                self.start()
            except ComfyEnvError as exc:  # a closed pool: nothing to warm
                log.debug("comfy-env: no re-warm of %s: %s", self.pack.spec.shown_package, exc)
