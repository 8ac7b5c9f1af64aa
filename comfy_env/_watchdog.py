"""A worker's named threads, seen from the host: the first sign of a worker's death.

Why: a killed worker closes its channel (the host's EOF) only at the very end of the kernel's
teardown. The last of its threads to exit frees the whole address space, and only then are
its descriptors closed: about 1 ms for a bare interpreter here, 15-18 ms for a worker holding
256 MiB, 27-56 ms for 1 GiB. Its other threads end long before that, about 0.1-0.3 ms after a
SIGKILL. Every worker names two threads (``comfy_env_worker.protocol``): its watchdog, and a
sentinel that only waits, so that one of the two is not the last to exit (with the main
thread and the watchdog alone, the watchdog often is). A pidfd of a *thread* (Linux 6.9+,
``PIDFD_THREAD``) becomes readable when that thread has exited. Two watch the same pidfds
(one per thread, closed with the channel):

* the reactor (``_exitwatch.ThreadWatch._on_thread_exit``): when one fires while the
  worker's main thread is exiting (its ``PF_EXITING`` flag, with the exit status stored), it
  shuts the host's end of the channel down, so a caller blocked reading it sees EOF at once;
* the caller itself, once its wait for a reply has lasted ``_ALARM_AFTER`` (the channel's
  reader, ``FrameReader.set_alarms``): the same check, and its read ends as at EOF. On a
  2-CPU machine the reactor was often queued behind the dying worker's teardown, on the very
  CPU that teardown ran on, while the caller's own CPU was free.

Either way the crash report carries the status the kernel will report at the reaping.

Data flow::

    handshake done (caller)   reactor.call_later(lookup delay, _watch_threads)
    reactor                   named_threads(pid) -> tids, thread_pidfd(pid, tid) -> fds,
                              looked up again while the threads have not named themselves;
                              the same fds handed to the channel's reader (``set_alarms``)
    a named thread ends       reactor: fd readable -> exiting_status(pid) known? -> channel
                              shut down; a caller in a long wait: alarm -> the same check
    caller                    EOF -> crash_error -> status_at_eof (the same status) as before

Races it must not lose:

* **A reused thread id.** The tid is found in ``/proc/<pid>/task`` of our own unreaped child,
  opened as a pidfd, then checked again (still a task of that process, still so named): a
  thread that ended in between, its id given to another process's thread, is never watched.
* **A named thread ending without the process.** An ``exec`` in the worker ends every other
  thread, and an exception could end the watchdog alone. Neither sets the main thread's
  ``PF_EXITING``, so nothing is done: the worker's exit or EOF is reported as before.
* **A core dump.** The dumping thread stops the others first, but it is not exiting yet:
  nothing is done, and the dump is never cut short; its EOF comes when it has finished.

Kernels without thread pidfds answer ``EINVAL``: then no worker is watched this way (decided
once per host process), and a crash is seen at its EOF as before.
"""

from __future__ import annotations

import errno
import os

from comfy_env_worker.protocol import SENTINEL_THREAD_NAME, WATCHDOG_THREAD_NAME

# ``pidfd_open`` flag for a pidfd of one thread (not the thread group): Linux 6.9+, O_EXCL.
PIDFD_THREAD = os.O_EXCL
NAMES = frozenset(n.encode() for n in (WATCHDOG_THREAD_NAME, SENTINEL_THREAD_NAME))
# None: not tried yet; False: this kernel (or Python) has no thread pidfds.
_supported: bool | None = None


def supported() -> bool:
    """Whether thread pidfds may work here (False once the kernel refused one)."""
    return _supported is not False and hasattr(os, "pidfd_open")


def _named(pid: int, tid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
            return f.read().rstrip(b"\n") in NAMES
    except OSError:
        return False


def named_threads(pid: int) -> list[int]:
    """The thread ids of the worker ``pid``'s named threads (those that have named themselves
    so far)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    return [int(t) for t in tids if t.isdigit() and int(t) != pid and _named(pid, int(t))]


def thread_pidfd(pid: int, tid: int) -> int | None:
    """A pidfd of thread ``tid`` of our child ``pid``, checked after it was opened to be one of
    the named threads (so a thread id reused meanwhile is never watched); None if that cannot
    be had."""
    global _supported
    if not supported():
        return None
    try:
        fd = os.pidfd_open(tid, PIDFD_THREAD)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # no PIDFD_THREAD before Linux 6.9
            _supported = False
        return None  # ESRCH: it ended meanwhile
    _supported = True
    if not _named(pid, tid):
        os.close(fd)
        return None
    return fd
