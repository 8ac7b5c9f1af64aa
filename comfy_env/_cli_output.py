"""Where the ``comfy-env`` commands that run workers (demo, doctor, call) send the workers'
output: the ``comfy_env.worker.*`` loggers routed, for the command's run, to one handler
that keeps the lines (doctor) or prints them on stderr (call).

A module of its own so that ``comfy-env status`` and ``sweep``, which run no worker, never
import ``logging`` (about a sixth of their start-up; ``sweep`` loads it only to log what it
removed).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator


class CaptureLines(logging.Handler):
    """Keeps worker output lines (doctor shows them only through the errors that carry them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class StderrLines(logging.Handler):
    """Prints each worker output line on stderr as ``[worker <stream>] <line>`` (call)."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = getattr(record, "worker_stream", "output")
        try:
            print(f"[worker {stream}] {record.getMessage()}", file=sys.stderr)
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - as logging.StreamHandler: a closed stderr must not
            # raise into the pool's thread that forwards the worker's output.
            self.handleError(record)


@contextlib.contextmanager
def worker_output(handler: logging.Handler) -> Iterator[None]:
    """Route the ``comfy_env.worker.*`` loggers to ``handler`` only, for the command's run."""
    logger = logging.getLogger("comfy_env.worker")
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
