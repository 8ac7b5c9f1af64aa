"""The orphan sweep: what dead hosts left behind, found by name and removed.

A host that is killed outright (SIGKILL, OOM) cannot clean up, and when its workers die with it
(parent-death signal) they cannot either. Everything either side creates is therefore named
after the host that owns it, with its ``host_token()`` (``<pid>-<start ticks>-<pid
namespace>``, see ``_identity``):

- shared-memory blocks ``/dev/shm/ce-<token>-...`` (the host's and its workers');
- runtime directories ``<runtime root>/host-<token>-...``;
- worker processes, whose command line carries their runtime directory and host pid;
- status files ``<runtime root>/status/<token>.json`` (``comfy-env status``);
- a private fallback root ``<temp dir>/comfy-env-<uid>-private-<token>-<random>``, made where
  the shared runtime root was not safe to use (``_rundir``), with all of the above inside.

A sweep acts only on what it can prove belongs to a dead host of this user in this pid
namespace (``_identity.owner_dead``): a host in another namespace sharing /dev/shm or /tmp, a
wall-clock step, or a name in an older format never make a live host's resources look dead.
A name is no proof of ownership in ``/dev/shm``, where any user can create any name: a block,
runtime dir or status file is removed only if ``lstat`` shows a regular file (a real
directory) owned by our uid (``ours_to_remove``), so root never deletes another user's files,
and the dry run, deciding by the same test, lists exactly what the real sweep removes. Those
tests live in ``_leftovers``, shared with the host watcher (``_watcher``), which removes one
dead host's files the moment it dies: the sweep finds what is left when the watcher was
killed too.
Before a process is signalled it is proven to have been launched for that dead host (its
environment carries the host's token; see ``_orphan_of_dead_host``): a worker, or one of its
descendants, also those that left the worker's process group. It is signalled through a pidfd
opened *before* that proof, so a pid reused in between cannot be hit. ``sweep()`` runs when a
pool first starts workers, and on demand.
"""

from __future__ import annotations

import os
import shutil
import signal

from comfy_env_worker import shm

from ._descendants import environ_of, held_pids, pidfd_is
from ._errors import RuntimeRootError
from ._identity import HOST_ID_VAR, owner_dead, owner_of, pid_namespace, proc_stat
from ._leftovers import private_root_removable, remove_blocks, remove_runtime_dirs
from ._rundir import private_root_parent, runtime_root
from ._say import package_logger
from ._values import value


@value
class SweepReport:
    """What a sweep removed."""

    blocks: tuple[str, ...]
    runtime_dirs: tuple[str, ...]
    processes: tuple[int, ...]
    status_files: tuple[str, ...] = ()
    private_roots: tuple[str, ...] = ()  # paths: private fallback roots of killed hosts

    def __bool__(self) -> bool:
        return bool(
            self.blocks
            or self.runtime_dirs
            or self.processes
            or self.status_files
            or self.private_roots
        )


def sweep(*, dry_run: bool = False) -> SweepReport:
    """Remove shared-memory blocks, runtime directories, status files, private fallback roots
    and worker processes of dead hosts.

    Safe to call at any time from any process of the same user; returns what was removed
    (``dry_run``: what would be removed, and nothing is changed). Only what this user owns is
    touched (``_leftovers.ours_to_remove``), root included."""
    processes = _kill_stray_workers(dry_run)
    blocks = remove_blocks(shm.SHM_DIR, shm.NAME_PREFIX, dry_run=dry_run)
    dirs = remove_runtime_dirs(runtime_root(), dry_run=dry_run)
    from ._status import remove_stale_status  # (it imports this module)

    try:
        status_files = remove_stale_status(dry_run=dry_run)
    except (OSError, RuntimeRootError) as exc:
        # A status directory that is not safely ours (a file or a symlink planted at
        # <root>/status) or cannot be listed: the rest of the sweep stands; said, not raised
        # (the start-up sweep runs on the reactor, which would log a traceback).
        package_logger().warning("comfy-env: the sweep skipped dead hosts' status files: %s", exc)
        status_files = []
    private_roots = _sweep_private_roots(dry_run)
    report = SweepReport(
        tuple(sorted(blocks)),
        tuple(sorted(dirs)),
        tuple(sorted(processes)),
        tuple(status_files),
        tuple(sorted(private_roots)),
    )
    if report and not dry_run:
        package_logger().info(
            "comfy-env: swept leftovers of dead hosts: %d shared-memory blocks, %d runtime "
            "dirs, %d worker processes, %d status files, %d private roots",
            len(report.blocks),
            len(report.runtime_dirs),
            len(report.processes),
            len(report.status_files),
            len(report.private_roots),
        )
    return report


def _sweep_private_roots(dry_run: bool) -> list[str]:
    """Private fallback roots (``<temp dir>/comfy-env-<uid>-private-<token>-<random>``, see
    ``_rundir.runtime_root``) of hosts proven dead: a host killed before its ``atexit`` ran
    leaves its whole root (its runtime dirs, the worker package) behind. Checked like the
    root itself: a real directory (never a symlink) of our uid, closed to group and other
    writes; the temp dir is shared, so a look-alike of anyone else's is left alone."""
    try:
        parent = private_root_parent()
        names = os.listdir(parent)
    except (OSError, RuntimeRootError):  # (no safe temp dir: no private root was made there)
        return []
    removed = []
    for name in names:
        path = os.path.join(parent, name)
        if not private_root_removable(path):
            continue
        if not dry_run:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _kill_stray_workers(dry_run: bool = False) -> list[int]:
    """Processes of this user whose environment names a host proven dead: its workers, and
    their descendants, including those that left the worker's process group (setsid).
    ``dry_run``: only list them."""
    pidfd_open = getattr(os, "pidfd_open", None)
    send = getattr(signal, "pidfd_send_signal", None)
    if pidfd_open is None or send is None:  # pragma: no cover - kernels without pidfd
        return []
    killed = []
    for pid, pidfd in held_pids(pidfd_open):
        try:
            if _orphan_of_dead_host(pid) and pidfd_is(pidfd, pid):
                if dry_run:
                    killed.append(pid)
                    continue
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)  # a worker's group: a wrapper's children
                send(pidfd, signal.SIGKILL)
                killed.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    return killed


def _orphan_of_dead_host(pid: int) -> bool:
    """Is ``pid`` (already held as a pidfd by the caller, so it cannot be a reused pid by
    the time it is signalled) provably a process launched for a dead host?

    - it belongs to this user and runs in our pid namespace;
    - its environment carries ``COMFY_ENV_HOST_ID=<host token>`` (set when the host launches
      a worker, inherited by the worker's descendants; a look-alike command line has none);
    - that host is proven dead (``owner_dead``), and the process started after it did."""
    if os.stat(f"/proc/{pid}").st_uid != os.getuid():
        return False
    environ = environ_of(pid)
    if not environ:
        return False
    mark = f"{HOST_ID_VAR}=".encode()
    token = next((e[len(mark) :] for e in environ if e.startswith(mark)), None)
    if token is None:
        return False
    owner = owner_of(f"host-{token.decode('ascii', 'replace')}-")
    if owner is None or not owner_dead(*owner):
        return False
    if os.stat(f"/proc/{pid}/ns/pid").st_ino != pid_namespace():
        return False
    stat = proc_stat(pid)
    return stat is not None and stat[1] >= owner[1]
