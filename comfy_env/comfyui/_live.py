"""Live ``INPUT_TYPES``: lists of choices that follow the files, as they do in-process.

ComfyUI asks a node class for ``INPUT_TYPES()`` for ``/object_info`` (the UI's node list, read
at every page load and refresh) and when it validates a prompt. In-process, a pack's
``INPUT_TYPES`` lists what is there now (the images in the input directory, the files of a
models folder); a proxy that answered only with its scan (cached on disk across server starts)
would show the files of the scan's day, and a prompt naming a newly uploaded image would fail
validation. So for nodes with a list of choices (a COMBO input) the proxy asks the env::

    ComfyUI -> proxy.INPUT_TYPES()            (the server's loop thread, or the prompt thread)
      -> LiveInputs.get(node name)
           asked less than LIVE_TTL ago: that answer
           else, the pack's worker idle now: one call for all the pack's nodes with choices
                ("comfy_env_worker.comfyui.scan:input_types"), deadline LIVE_TIMEOUT
           else (no live worker, busy, asked by another thread now, failed): None, and the
                proxy answers with its scan; a failure waits LIVE_BACKOFF before asking again

The cost is bounded: at most one worker call per pack per LIVE_TTL (one ``/object_info``
costs one call per pack, not per node), never a worker start (a pack whose worker is not up
shows its scan; ``isolate(..., warm=True)`` keeps it up), never a wait behind a running node
(only an idle worker is asked; one that became busy just then costs at most LIVE_TIMEOUT), and
never more than one caller waiting (a second thread takes the last answer or the scan). V3
nodes keep their scanned schema.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ._scan import server_directories

if TYPE_CHECKING:
    from . import _Pack

log = logging.getLogger("comfy_env.comfyui")

INPUT_TYPES_TARGET = "comfy_env_worker.comfyui.scan:input_types"
LIVE_TTL = 1.0  # seconds an answer serves every node of the pack
LIVE_TIMEOUT = 2.0  # deadline of the worker call
LIVE_BACKOFF = 10.0  # seconds without asking after a failed call


def has_choices(input_types: dict[str, Any]) -> bool:
    """Whether an ``INPUT_TYPES`` value has a COMBO input (its type is a list of choices)."""
    for category in ("required", "optional"):
        entries = input_types.get(category)
        if not isinstance(entries, dict):
            continue
        for spec in entries.values():
            if isinstance(spec, (list, tuple)) and spec and isinstance(spec[0], (list, tuple)):
                return True
    return False


class LiveInputs:
    """The live ``INPUT_TYPES`` of one pack's nodes with choices. Thread-safe."""

    def __init__(self, pack: _Pack) -> None:
        self.pack = pack
        self.names: list[str] = []  # nodes with choices, in scan order
        self._lock = threading.Lock()
        self._answer: dict[str, Any] = {}
        self._asked_at = -LIVE_TTL
        self._failed_at = -LIVE_BACKOFF
        self.calls = 0  # worker calls made (diagnostics, tests)

    def track(self, name: str) -> None:
        self.names.append(name)

    def get(self, name: str) -> dict[str, Any] | None:
        """The node's ``INPUT_TYPES`` as the env's code returns it now, or None (use the scan)."""
        now = time.monotonic()
        if now - self._asked_at < LIVE_TTL:
            return self._answer.get(name)
        if now - self._failed_at < LIVE_BACKOFF or not self._worker_idle():
            return None
        if not self._lock.acquire(blocking=False):
            return self._answer.get(name)  # another thread is asking: its last answer
        try:
            if time.monotonic() - self._asked_at >= LIVE_TTL:
                self._ask()
            return self._answer.get(name)
        finally:
            self._lock.release()

    def _worker_idle(self) -> bool:
        try:
            stats = self.pack.configured_pool().stats().get(self.pack.spec.env.key)
        except Exception:  # noqa: BLE001 - a closed or broken pool: the scan answers
            return False
        return stats is not None and any(w.state == "idle" for w in stats.workers)

    def _ask(self) -> None:
        spec = self.pack.spec
        args = (spec.pack_dir, spec.module, list(self.names), server_directories(spec))
        self.calls += 1
        try:
            answer = self.pack.worker.run(INPUT_TYPES_TARGET, args, timeout=LIVE_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - any failure: the scan answers for a while
            self._failed_at = time.monotonic()
            self._answer = {}
            log.debug(
                "comfy-env: live INPUT_TYPES of %s failed (the scan answers for %gs): %s: %s",
                spec.shown_package,
                LIVE_BACKOFF,
                type(exc).__name__,
                exc,
            )
            return
        self._answer = answer if isinstance(answer, dict) else {}
        self._asked_at = time.monotonic()
