"""Finding a worker's descendants after the fact, by a mark in their environment.

A worker runs in its own process group, and the host stops that group. A descendant that
called ``setsid`` (a daemonising library, ``subprocess.Popen(start_new_session=True)``) left
the group, and once the worker is gone it is re-parented to init: neither the group nor the
process tree finds it any more. What it keeps is its environment: every worker is launched
with ``COMFY_ENV_HOST_ID=<host token>`` and ``COMFY_ENV_WORKER_ID=<host token>-w<serial>``
(unique per generation), and children inherit both unless they clear their environment.

``kill_marked(name, value)`` SIGKILLs every process whose environment holds exactly
``name=value``. Each candidate is opened as a pidfd *before* its environment is read, and the
signal goes through that pidfd, so a pid reused in between is never hit. It reads ``/proc``
only; a scan of a few hundred processes takes milliseconds and runs when a generation is
reaped (reactor thread) and in the sweep.

What it cannot see: a descendant that cleared its environment (``env -i``), or one in another
pid namespace. Those keep running; the host still releases every descriptor of the dead
generation (see ``WorkerProcess._finish_now``), so nothing of the host is pinned by them.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator


def pids() -> Iterator[int]:
    """Every pid in ``/proc`` but ours."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    me = os.getpid()
    for name in names:
        if name.isdigit() and int(name) != me:
            yield int(name)


def environ_of(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/environ`` as ``NAME=value`` entries, or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def kill_marked(
    name: str, value: str, also: Callable[[int, list[bytes]], bool] | None = None
) -> list[int]:
    """SIGKILL every process (of any group, in our pid namespace) whose environment holds
    ``name=value``; ``also(pid, environ)`` may veto one (False). Returns the pids signalled."""
    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is None or send is None:  # pragma: no cover - kernels without pidfd
        return []
    mark = f"{name}={value}".encode()
    uid = os.getuid()
    killed = []
    for pid in pids():
        try:
            pidfd = pidfd_open(pid)
        except OSError:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue  # another user's process is never ours to stop
            environ = environ_of(pid)
            if environ is None or mark not in environ:
                continue
            if also is not None and not also(pid, environ):
                continue
            send(pidfd, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            continue
        finally:
            os.close(pidfd)
    return killed


def watch_host(name: str, value: str) -> None:
    """The body of a host watcher process (see ``_watcher``): block on stdin, the read end of
    a pipe whose only writer is the host. ``q`` means the pool closed cleanly (it stopped its
    own workers): exit. End of file without it means the host died: SIGKILL every process
    marked ``name=value`` (the dead host's workers and their descendants, ``setsid`` ones
    included), scanning again while a scan still finds some (a descendant may fork while it
    is being killed)."""
    while True:
        try:
            said = os.read(0, 1)
        except InterruptedError:
            continue
        except OSError:
            said = b""
        break
    if said == b"q":
        return
    for _ in range(5):
        if not kill_marked(name, value):
            return
