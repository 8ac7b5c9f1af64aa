"""Writes into a pipe that a child reads, immune to SIGPIPE.

Many command-line programs set SIGPIPE back to its default action (``signal(SIGPIPE,
SIG_DFL)``): a write into a pipe whose reader is gone then kills the whole host (exit -13)
instead of failing with ``EPIPE``. A worker dies whenever it likes, so every write the host
makes to a worker must be immune. Socket sends pass ``MSG_NOSIGNAL``
(``comfy_env_worker.protocol.MSG_NOSIGNAL``, free: the same syscall). A pipe takes no such
flag, so ``write`` blocks SIGPIPE for the calling thread around the write, and if the write met
a closed pipe, takes the signal it raised (pending, directed at this thread) off the queue
before the old mask comes back: the write fails with ``BrokenPipeError``, nothing else
happens. Three more syscalls per write: for rare writes only (the cancel pipe, the watcher's
quit byte), never the call's hot path.
"""

from __future__ import annotations

import errno
import os
import signal

_SIGPIPE = {signal.SIGPIPE}
# Linux has both; a platform without them (macOS lacks sigtimedwait) writes plainly, as before.
_SUPPORTED = hasattr(signal, "pthread_sigmask") and hasattr(signal, "sigtimedwait")


def write(fd: int, data: bytes) -> int:
    """``os.write(fd, data)`` that raises ``BrokenPipeError`` where the reader is gone, whatever
    the process's SIGPIPE disposition. Any thread."""
    if not _SUPPORTED:
        return os.write(fd, data)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGPIPE)
    try:
        return os.write(fd, data)
    except OSError as exc:
        if exc.errno == errno.EPIPE and signal.SIGPIPE not in old:
            # The kernel queued SIGPIPE for this thread (unless it is ignored): drop it, so
            # that restoring the mask does not deliver it. (It was blocked before we came:
            # then it stays the caller's business, as it was.)
            signal.sigtimedwait(_SIGPIPE, 0)
        raise
    finally:
        if signal.SIGPIPE not in old:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
