"""The orphan sweep: what dead hosts left behind, found by name and removed.

A host that is killed outright (SIGKILL, OOM) cannot clean up, and when its workers die with it
(parent-death signal) they cannot either. Everything either side creates is therefore named
after the host that owns it, with its ``host_token()`` (``<pid>-<start ticks>-<pid
namespace>``, see ``_identity``):

- shared-memory blocks ``/dev/shm/ce-<token>-...`` (the host's and its workers');
- runtime directories ``<runtime root>/host-<token>-...``;
- worker processes, whose command line carries their runtime directory and host pid;
- status files ``<runtime root>/status/<token>.json`` (``comfy-env status``).

A sweep acts only on what it can prove belongs to a dead host of this user in this pid
namespace (``_identity.owner_dead``): a host in another namespace sharing /dev/shm or /tmp, a
wall-clock step, or a name in an older format never make a live host's resources look dead.
Before a process is signalled it is proven to be a worker of that dead host (see
``_kill_stray_workers``), and it is signalled through a pidfd opened *before* that proof, so a
pid reused in between cannot be hit. ``sweep()`` runs when a pool first starts workers, and on
demand.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
from dataclasses import dataclass

import psutil

from comfy_env_worker import shm

from ._identity import name_of_dead_owner, owner_dead, owner_of, pid_namespace, proc_stat
from ._process import BOOT, HOST_ID_VAR
from ._rundir import runtime_root

_log = logging.getLogger("comfy_env")


@dataclass(frozen=True)
class SweepReport:
    """What a sweep removed."""

    blocks: tuple[str, ...]
    runtime_dirs: tuple[str, ...]
    processes: tuple[int, ...]
    status_files: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.blocks or self.runtime_dirs or self.processes or self.status_files)


def host_alive(pid: int, ticks: int, namespace: int) -> bool:
    """Might the host ``<pid>-t<ticks>-n<namespace>`` still be running? True unless it is proven
    dead (so "alive" includes "cannot tell")."""
    return not owner_dead(pid, ticks, namespace)


def _dead_owner(name: str) -> bool:
    return name_of_dead_owner(name)


def sweep() -> SweepReport:
    """Remove shared-memory blocks, runtime directories and worker processes of dead hosts.

    Safe to call at any time from any process of the same user; returns what was removed."""
    processes = _kill_stray_workers()
    blocks = []
    for name in shm.owned_blocks(shm.NAME_PREFIX):
        if _dead_owner(name):
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
                blocks.append(name)
            except OSError:
                pass
    dirs = []
    root = runtime_root()
    for name in os.listdir(root):
        if name.startswith("host-") and _dead_owner(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            dirs.append(name)
    from ._status import remove_stale_status  # (it imports this module)

    status_files = remove_stale_status()
    report = SweepReport(
        tuple(sorted(blocks)),
        tuple(sorted(dirs)),
        tuple(sorted(processes)),
        tuple(status_files),
    )
    if report:
        _log.info(
            "comfy-env: swept leftovers of dead hosts: %d shared-memory blocks, %d runtime "
            "dirs, %d worker processes, %d status files",
            len(report.blocks),
            len(report.runtime_dirs),
            len(report.processes),
            len(report.status_files),
        )
    return report


def _kill_stray_workers() -> list[int]:
    """Worker processes whose host is proven dead, each proven to be that host's worker."""
    killed = []
    me = os.getuid()
    for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            cmdline = proc.info["cmdline"] or []
            uids = proc.info["uids"]
            if uids is None or uids.real != me or BOOT not in cmdline:
                continue
            if _kill_if_orphan(proc.pid, cmdline):
                killed.append(proc.pid)
        except (psutil.Error, OSError, ValueError, IndexError):
            continue
    return killed


def _kill_if_orphan(pid: int, cmdline: list[str]) -> bool:
    """SIGKILL ``pid`` (and its group) if it is provably a worker of a dead host:

    - its command line is our launch line: ``-c BOOT <runtime dir> <fd> <host pid> ...``, the
      runtime dir named after the host and the host pid argument equal to the owner's pid;
    - the owner is proven dead (``owner_dead``);
    - the process runs in our pid namespace and started after its host did (a look-alike
      started earlier, or one whose pid was reused, is not that host's worker);
    - its environment names the host (``COMFY_ENV_HOST_ID``, set at launch);
    - the pidfd the signal goes through was opened before these checks, so the process that
      passed them is the one signalled."""
    index = cmdline.index(BOOT)
    if index < 1 or cmdline[index - 1] != "-c" or len(cmdline) < index + 4:
        return False
    owner = owner_of(os.path.basename(cmdline[index + 1]))
    if owner is None or cmdline[index + 3] != str(owner[0]):
        return False
    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is None or send is None:  # pragma: no cover - kernels without pidfd
        return False
    try:
        pidfd = pidfd_open(pid)
    except OSError:
        return False
    try:
        if not owner_dead(*owner):
            return False
        if os.stat(f"/proc/{pid}/ns/pid").st_ino != pid_namespace():
            return False
        stat = proc_stat(pid)
        if stat is None or stat[1] < owner[1]:
            return False
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        token = f"{owner[0]}-t{owner[1]}-n{owner[2]}"
        if f"{HOST_ID_VAR}={token}".encode() not in environ:
            return False
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)  # its group: a launcher wrapper's children included
        send(pidfd, signal.SIGKILL)
        return True
    except (ProcessLookupError, OSError, ValueError, IndexError):
        return False
    finally:
        os.close(pidfd)
