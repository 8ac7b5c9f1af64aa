"""The orphan sweep: what dead hosts left behind, found by name and removed.

A host that is killed outright (SIGKILL, OOM) cannot clean up, and when its workers die with it
(parent-death signal) they cannot either. Everything either side creates is therefore named
after the host that owns it, as ``<pid>-<start time in ms>``:

- shared-memory blocks ``/dev/shm/ce-<pid>-<start>-...`` (the host's and its workers');
- runtime directories ``<runtime root>/host-<pid>-<start>-...``;
- worker processes, whose command line carries their runtime directory;
- status files ``<runtime root>/status/<pid>-<start>.json`` (``comfy-env status``).

A host counts as alive when a process with that pid exists *and* started at that time, so a
reused pid never protects a dead host's leftovers, and a live host's resources are never
touched. ``sweep()`` runs when a pool first starts workers, and on demand.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
from dataclasses import dataclass

import psutil

from comfy_env_worker import shm

from ._process import BOOT
from ._rundir import runtime_root

_log = logging.getLogger("comfy_env")

_OWNER = re.compile(r"^(?:ce-|host-)(\d+)-(\d+)-")


@dataclass(frozen=True)
class SweepReport:
    """What a sweep removed."""

    blocks: tuple[str, ...]
    runtime_dirs: tuple[str, ...]
    processes: tuple[int, ...]
    status_files: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.blocks or self.runtime_dirs or self.processes or self.status_files)


def host_alive(pid: int, start_ms: int) -> bool:
    """Is the host ``<pid>-<start_ms>`` still running (and not a later process reusing pid)?"""
    try:
        started = int(psutil.Process(pid).create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return abs(started - start_ms) <= 10  # create_time is derived from clock ticks


def _dead_owner(name: str) -> bool:
    match = _OWNER.match(name)
    if match is None:
        return False  # not ours, or not named after a host: never touched
    return not host_alive(int(match.group(1)), int(match.group(2)))


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
    """Worker processes (ours: launched with ``BOOT``) whose host is dead."""
    killed = []
    me = os.getuid()
    for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            cmdline = proc.info["cmdline"] or []
            uids = proc.info["uids"]
            if uids is None or uids.real != me or len(cmdline) < 4 or BOOT not in cmdline:
                continue
            runtime_dir = cmdline[cmdline.index(BOOT) + 1]
            if not _dead_owner(os.path.basename(runtime_dir)):
                continue
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)  # its group: a launcher wrapper included
            else:
                proc.kill()
            killed.append(proc.pid)
        except (psutil.Error, OSError, ValueError, IndexError):
            continue
    return killed
