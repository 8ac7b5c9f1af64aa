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
reaped (reactor thread), in the host watcher when its host died (``watch_host``) and in the
sweep.

Pids mean something only in a namespace. ``/proc`` lists pids in the namespace it was mounted
for, ``pidfd_open`` and ``kill`` take pids in the caller's. In a child pid namespace that kept
its parent's ``/proc`` (``unshare --pid`` without ``--mount-proc``, some container set-ups) the
two numberings differ: ``/proc/1234`` is one process, ``pidfd_open(1234)`` another, and
opening the pidfd first proves nothing. A scan there once SIGKILLed an unrelated process whose
in-namespace pid equalled a marked descendant's ``/proc`` pid. So ``kill_marked`` signals
nothing unless ``/proc`` shows our namespace (``_identity.proc_is_ours``; one warning per
process says so), and where the kernel tells (``Pid:`` in ``/proc/self/fdinfo/<pidfd>``,
Linux 5.4+) each pidfd must name the very process ``/proc`` listed under that pid
(``pidfd_is``).

What it cannot see: a descendant that cleared its environment (``env -i``), one in another
pid namespace, and any descendant at all where ``/proc`` is not our namespace's (only the
worker's process group is stopped there). Those keep running; the host still releases every
descriptor of the dead generation (see ``WorkerProcess._finish_now``), so nothing of the host
is pinned by them.
"""

from __future__ import annotations

import os

from ._identity import proc_is_ours

# The host watcher (``_watcher``) imports this module at its start and then sleeps until its
# host ends: what it needs only after that (``signal``, which imports ``enum``; ``logging``) is
# imported where it is used, and the annotations' names are the type checker's alone (not
# ``typing.TYPE_CHECKING``: typing itself is a large import).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


# Whether this process has said that /proc is not its namespace's (said once, not per scan).
_said_foreign_proc = False


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


def held_pids(pidfd_open: Callable[[int], int]) -> Iterator[tuple[int, int]]:
    """Every pid of ``pids()`` with a pidfd held on it (``pidfd_open``, i.e. ``os.pidfd_open``)
    while the loop's body looks at it, so the process signalled through that pidfd cannot be
    a reused pid; the pidfd is closed when the loop moves on or leaves. A process gone before
    its pidfd opened is skipped."""
    for pid in pids():
        try:
            pidfd = pidfd_open(pid)
        except OSError:
            continue
        try:
            yield pid, pidfd
        finally:
            os.close(pidfd)


def environ_of(pid: int) -> list[bytes] | None:
    """``/proc/<pid>/environ`` as ``NAME=value`` entries, or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def pidfd_is(pidfd: int, pid: int) -> bool:
    """Does ``pidfd`` refer to the process ``/proc`` lists as ``pid``? The kernel writes the
    pidfd's process, numbered in the namespace of ``/proc``, as ``Pid:`` in its fdinfo (-1
    once it has exited). Kernels without that line (before 5.4) cannot tell: True, and the
    caller relies on ``proc_is_ours`` alone."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as f:
            info = f.read()
    except OSError:
        return False
    for line in info.splitlines():
        if line.startswith(b"Pid:"):
            try:
                return int(line[4:]) == pid
            except ValueError:
                return False
    return True


def proc_usable_for_signals() -> bool:
    """``proc_is_ours()``, and where it is not, one warning per process: descendants that
    left a worker's process group cannot be found and stay running."""
    global _said_foreign_proc
    if proc_is_ours():
        return True
    if not _said_foreign_proc:
        _said_foreign_proc = True
        import logging  # (here: see TYPE_CHECKING above)

        logging.getLogger("comfy_env").warning(
            "comfy-env: /proc does not show this process's pid namespace (a pid namespace "
            "without its own /proc, e.g. unshare --pid without --mount-proc): descendants of "
            "workers that left their process group (setsid) cannot be found, and are not "
            "stopped when their worker or host dies. Mount a /proc for this namespace "
            "(unshare --mount-proc) to have them stopped"
        )
    return False


def kill_marked(
    name: str, value: str, also: Callable[[int, list[bytes]], bool] | None = None
) -> list[int]:
    """SIGKILL every process (of any group, in our pid namespace) whose environment holds
    ``name=value``; ``also(pid, environ)`` may veto one (False). Returns the pids signalled:
    none where ``/proc`` does not show our pid namespace (see the module docstring)."""
    import signal

    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is None or send is None:  # pragma: no cover - kernels without pidfd
        return []
    # /proc's pids and pidfd_open's would name different processes: signal nothing.
    if not proc_usable_for_signals():
        return []
    mark = f"{name}={value}".encode()
    uid = os.getuid()
    killed = []
    for pid, pidfd in held_pids(pidfd_open):
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue  # another user's process is never ours to stop
            environ = environ_of(pid)
            if environ is None or mark not in environ:
                continue
            if also is not None and not also(pid, environ):
                continue
            # The environment read was /proc/<pid>'s: signal only if the pidfd is that process.
            if not pidfd_is(pidfd, pid):
                continue
            send(pidfd, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            continue
    return killed


def watch_host(
    name: str, value: str, root: str = "", shm_dir: str = "", block_prefix: str = ""
) -> None:
    """The body of a host watcher process (see ``_watcher``): block on stdin, the read end of
    a pipe whose only writer is the host. ``q`` means the pool closed cleanly (it stopped its
    own workers): exit. End of file without it means the host died: SIGKILL every process
    marked ``name=value`` (the dead host's workers and their descendants, ``setsid`` ones
    included), scanning again while a scan still finds some (a descendant may fork while it
    is being killed). Then, given ``shm_dir`` (``value`` is the host's token), remove what the
    host left behind (``_leftovers.remove_dead_host``: its blocks in ``shm_dir`` named
    ``<block_prefix><token>-...``, its runtime dirs and status file under ``root``, or
    ``root`` itself if it was the host's private one), once the host is proven dead: the end
    of file alone is no proof (a host that exec'd closed the pipe and lives on)."""
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
            break
    if shm_dir:
        # Here, not at the top: only a watcher whose host died pays for it (shutil), and the
        # watcher's start stays as small as it was.
        from ._leftovers import remove_dead_host

        remove_dead_host(value, root=root, shm_dir=shm_dir, block_prefix=block_prefix)
