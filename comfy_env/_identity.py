"""Host identity: a name for this host process that a sweep can check against the live system.

Everything a host creates in shared places (shared-memory blocks, runtime directories, status
files) carries its ``host_token()``::

    <pid>-t<start ticks>-n<pid namespace>      e.g. 41234-t8812345-n4026531836

- ``pid`` as this process sees it (``os.getpid()``);
- ``start ticks``: field 22 of ``/proc/self/stat``, the start time in clock ticks since boot.
  It never moves with the wall clock (an NTP step or a VM resume shifted psutil's
  ``create_time`` and made every live host look dead);
- ``pid namespace``: the inode of ``/proc/self/ns/pid``. A pid means something only inside its
  namespace: a host in another one (a container sharing /dev/shm or /tmp, ``unshare --pid``)
  has pids we cannot look up.

``owner_dead`` is the only question a sweep asks, and it answers True only with proof: the
owner is in *our* pid namespace, our ``/proc`` shows that namespace (a ``/proc`` mounted for
another one would show other processes under the same numbers), and the pid is gone, a zombie,
or a process that started at another tick (a reused pid). Anything else (another namespace, an
unreadable ``/proc``, a name in an older format) counts as alive: the sweep leaves it alone.
"""

from __future__ import annotations

import errno
import os

# The variable that carries the host's ``host_token()`` to every process it launches (set by
# ``_process`` for each worker, inherited by their descendants): the sweep's proof that a stray
# process was launched for a host that is now dead.
HOST_ID_VAR = "COMFY_ENV_HOST_ID"

# (Not ``typing.TYPE_CHECKING``: importing typing would cost the watcher more than ``re``.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import re

# ``ce-<pid>-t<ticks>-n<ns>-...`` (blocks) and ``host-<pid>-t<ticks>-n<ns>-...`` (runtime
# dirs). The letters matter: earlier versions named things ``<pid>-<start ms>-`` and judged
# anything matching ``(\d+)-(\d+)-`` by wall-clock start time; they must not read our names.
_OWNER_PATTERN = r"^(?:ce-|host-)(\d+)-t(\d+)-n(\d+)-"
# Compiled at the first ``owner_of``: the host watcher imports this module at its start and
# needs no pattern until its host died (``re`` is a fifth of that start).
_owner: re.Pattern[str] | None = None


def pid_namespace() -> int | None:
    """The inode of this process's pid namespace, or None where there is no ``/proc``."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def proc_stat(pid: int | str) -> tuple[str, int] | None:
    """(state letter, start ticks) of ``/proc/<pid>/stat``; None if there is no such entry.
    Raises ``OSError`` for anything but absence (unreadable ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = data.rpartition(b")")[2].split()
    return fields[0].decode(), int(fields[19])


def proc_is_ours() -> bool:
    """Does ``/proc`` show our pid namespace? (Its ``self`` entry then has our pid.) False in a
    child pid namespace that kept its parent's ``/proc`` (``unshare --pid`` without
    ``--mount-proc``): a pid listed there is not the pid ``kill`` or ``pidfd_open`` take here."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def host_token() -> str:
    """``<pid>-t<start ticks>-n<pid namespace>`` of this process (see the module docstring).
    Where ``/proc`` is missing the namespace is 0, which no sweep ever treats as dead."""
    ns = pid_namespace()
    try:
        stat = proc_stat("self") if ns is not None else None
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            # Out of descriptors for a moment: raised (the caller's error says so), never the
            # fallback below, whose other token would name this host differently from then on.
            raise
        stat = None
    if ns is None or stat is None:
        import psutil

        return f"{os.getpid()}-t{int(psutil.Process().create_time() * 1000)}-n0"
    return f"{os.getpid()}-t{stat[1]}-n{ns}"


def owner_dead(pid: int, ticks: int, namespace: int) -> bool:
    """Is the host ``<pid>-t<ticks>-n<namespace>`` provably gone? False whenever it cannot be
    proven (another namespace, no usable ``/proc``): leftovers are then left alone."""
    if namespace == 0 or namespace != pid_namespace() or not proc_is_ours():
        return False
    try:
        stat = proc_stat(pid)
    except (OSError, ValueError, IndexError):
        return False
    if stat is None:
        return True
    state, started = stat
    return started != ticks or state in ("Z", "X")


def owner_of(name: str) -> tuple[int, int, int] | None:
    """(pid, ticks, namespace) of a block or runtime dir name; None if not ours."""
    global _owner
    if _owner is None:
        import re

        _owner = re.compile(_OWNER_PATTERN)
    match = _owner.match(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


_HOST_TOKEN: tuple[int, str] | None = None


def host_id() -> str:
    """This process's ``host_token()`` (``<pid>-t<start ticks>-n<pid namespace>``), cached per
    pid (a forked child computes its own)."""
    global _HOST_TOKEN
    pid = os.getpid()
    if _HOST_TOKEN is None or _HOST_TOKEN[0] != pid:
        _HOST_TOKEN = (pid, host_token())
    return _HOST_TOKEN[1]
