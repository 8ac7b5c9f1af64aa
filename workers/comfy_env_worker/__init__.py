"""The worker runtime of comfy-env: the code that runs inside each env's interpreter.

This package is stdlib-only and never imports ``comfy_env`` or a third-party package at
module scope: the host copies it into a private runtime directory and puts only that
directory on the worker's ``sys.path``, so it must run in any env (Python 3.8 and newer).

Modules:
- ``protocol``: the frame format and message types both sides agree on (imported by the host).
- ``main``: the worker's serve loop (handshake, calls, exit on channel EOF).
- ``tasks``: small built-in functions (echo for the canary, sleep, crash) usable by any env.
- ``shm``: out-of-band buffers in shared memory; ``refs``: kept objects and release hooks.
- ``control``: the running call's cancellation, progress and events. Env code uses them as
  ``comfy_env_worker.cancelled()``, ``raise_if_cancelled()``, ``progress(done, total)`` and
  ``emit(kind, data)``; all are harmless no-ops outside a worker call.
"""

from .control import Cancelled, cancelled, emit, progress, raise_if_cancelled

__version__ = "0.1.0"

__all__ = [
    "Cancelled",
    "cancelled",
    "emit",
    "on_release",
    "progress",
    "raise_if_cancelled",
]


def on_release(hook):  # type: ignore[no-untyped-def]
    """Register ``hook`` to run before this worker is retired for being idle or the pool closes
    (drop models and caches cleanly). Call it from the env's own code, inside a worker."""
    from .refs import on_release as register

    return register(hook)
