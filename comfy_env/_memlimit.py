"""Memory limits per worker, counted by the kernel: one memory cgroup leaf per worker.

A runaway native call (a 2.6 M-vertex decimation, a leak in a loop) can take the machine's
memory, and the kernel's OOM killer then picks a victim, maybe the host. With a limit, the
kernel kills the worker alone once *its* memory (anonymous pages, page cache it caused, kernel
memory of its sockets: what the cgroup counts) passes the limit, and this module tells that
death apart from any other SIGKILL.

Data flow (mechanism only: the spawner asks, the crash path reads facts)::

    launch:  leaf = Leaf.make(limit, name)   before the fork: a directory under this
                                             process's own memory cgroup, the limit written
             leaf.adopt(pid)                 after the fork, before the worker's go byte: the
                                             worker runs nothing of the env's outside the leaf
    death:   leaf.facts() -> MemoryFacts     oom kills in the leaf, peak usage, the limit
    reaped:  leaf.remove()                   rmdir once the worker's processes are gone

Where the leaf lives: cgroup v2 when this process's own cgroup delegates the memory controller
to its children (``memory`` in ``cgroup.subtree_control``, or writable there), else cgroup v1's
memory hierarchy (no such rule there), else nowhere: ``Leaf.make`` returns None and the caller
falls back (``hierarchy()`` says why). Only root, or a user a hierarchy was delegated to, can
make leaves; a container without a writable cgroup mount cannot.

Races it prevents: the worker is moved before it is told to go on (the BOOT script waits for
one byte), so no env code allocates outside the leaf; the leaf's directory name carries the
host's pid and a sequence number, so two hosts (or two pools of one host) never share one; a
leaf left by a host that died is removed by the next host that makes one in the same cgroup
(``rmdir`` succeeds only on an empty leaf, so a live worker's leaf is never taken).

Without a cgroup, the kernel's own OOM killer may still end a worker (no limit set, or the
machine ran out first): ``system_oom_kills()`` reads the machine's OOM kill count, which the
crash path compares with the count at the worker's start.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
import threading
from dataclasses import dataclass

_PREFIX = "comfy-env-"
_sequence = itertools.count(1)
_found: tuple[str, str, str] | None = None  # (version, path, why), once looked up
_found_lock = threading.Lock()


@dataclass(frozen=True)
class MemoryFacts:
    """What the kernel counted for one worker's leaf: ``limit`` and ``peak`` in bytes (peak
    None where the kernel does not keep it), ``oom_kills`` in the leaf, ``how`` (``"cgroup v2"``
    or ``"cgroup v1"``)."""

    limit: int
    peak: int | None
    oom_kills: int
    how: str


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount point, root inside the hierarchy, fs type, super options) of cgroup mounts."""
    text = _read("/proc/self/mountinfo") or ""
    found = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        if tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[4], fields[3], tail[0], set(tail[2].split(","))))
    return found


def _own(controller: str) -> str | None:
    """This process's path in the hierarchy: ``""`` names the v2 line (``0::/path``)."""
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        _, names, path = line.split(":", 2)
        if (controller == "" and names == "" and line.startswith("0:")) or (
            controller and controller in names.split(",")
        ):
            return path
    return None


def _under(mount: str, root: str, own: str) -> str | None:
    if root != "/" and not (own == root or own.startswith(root.rstrip("/") + "/")):
        return None  # our cgroup is outside what this mount shows
    rest = own[len(root) :] if root != "/" else own
    return os.path.join(mount, rest.lstrip("/"))


def _v2(mounts: list[tuple[str, str, str, set[str]]]) -> tuple[str | None, str]:
    own = _own("")
    for mount, root, kind, _ in mounts:
        if kind != "cgroup2" or own is None:
            continue
        path = _under(mount, root, own)
        if path is None:
            continue
        if "memory" not in (_read(os.path.join(path, "cgroup.controllers")) or "").split():
            return None, "cgroup v2 has no memory controller here"
        control = os.path.join(path, "cgroup.subtree_control")
        if "memory" in (_read(control) or "").split():
            return path, ""
        try:
            _write(control, "+memory")
        except OSError as exc:  # EBUSY: our own cgroup holds processes (the v2 rule)
            return None, f"cgroup v2 does not delegate memory to this process ({exc.strerror})"
        return path, ""
    return None, "no cgroup v2 mount"


def _v1(mounts: list[tuple[str, str, str, set[str]]]) -> tuple[str | None, str]:
    own = _own("memory")
    for mount, root, kind, options in mounts:
        if kind == "cgroup" and "memory" in options and own is not None:
            path = _under(mount, root, own)
            if path is not None and os.access(path, os.W_OK):
                return path, ""
            return None, "the cgroup v1 memory hierarchy is not writable by this user"
    return None, "no cgroup v1 memory hierarchy"


def hierarchy() -> tuple[str, str, str]:
    """``(version, path, why)``: where this process may make memory leaves (``"v2"`` or
    ``"v1"`` and the parent directory), or ``("", "", reason)`` where it may not. Looked up
    once per process."""
    global _found
    with _found_lock:
        if _found is not None:
            return _found
        mounts = _mounts()
        path, why2 = _v2(mounts)
        if path is not None:
            _found = ("v2", path, "")
        else:
            path, why1 = _v1(mounts)
            _found = ("v1", path, "") if path is not None else ("", "", f"{why2}; {why1}")
        return _found


def _sweep_dead_leaves(parent: str) -> None:
    """Remove empty leaves of hosts that are gone (rmdir refuses a leaf with processes)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX) :].partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass


class Leaf:
    """One worker's memory cgroup. Not thread-safe: one owner (the worker's generation)."""

    __slots__ = ("limit", "path", "version")

    def __init__(self, version: str, path: str, limit: int) -> None:
        self.version = version
        self.path = path
        self.limit = limit

    @classmethod
    def make(cls, limit: int) -> Leaf | None:
        """A fresh leaf limited to ``limit`` bytes, or None where no hierarchy may be used
        (``hierarchy()`` says why). An ``OSError`` making a leaf where the hierarchy is usable
        (out of memory, a full cgroup tree) is raised: the caller's start fails typed."""
        version, parent, _ = hierarchy()
        if not version:
            return None
        if next(_sequence) == 1:
            _sweep_dead_leaves(parent)
        path = os.path.join(parent, f"{_PREFIX}{os.getpid()}-{next(_sequence)}")
        os.mkdir(path)
        leaf = cls(version, path, limit)
        try:
            leaf._limit()
        except BaseException:
            leaf.remove()
            raise
        return leaf

    def _limit(self) -> None:
        if self.version == "v2":
            _write(os.path.join(self.path, "memory.max"), str(self.limit))
            try:  # no swapping past the limit: the limit is the memory the worker may use
                _write(os.path.join(self.path, "memory.swap.max"), "0")
            except OSError:
                pass  # no swap accounting on this kernel
            return
        _write(os.path.join(self.path, "memory.limit_in_bytes"), str(self.limit))
        for name, value in (
            ("memory.memsw.limit_in_bytes", str(self.limit)),  # memory and swap together
            ("memory.move_charge_at_immigrate", "3"),  # the interpreter's start-up pages too
        ):
            try:
                _write(os.path.join(self.path, name), value)
            except OSError:
                pass  # no swap accounting / charge moving on this kernel

    def adopt(self, pid: int) -> None:
        """Move ``pid`` (the worker, before it runs env code) into the leaf."""
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def facts(self) -> MemoryFacts:
        """The leaf's counters now (read them before ``remove``)."""
        if self.version == "v2":
            events = _counters(_read(os.path.join(self.path, "memory.events")))
            peak_text = _read(os.path.join(self.path, "memory.peak"))
            peak = int(peak_text) if peak_text and peak_text.strip().isdigit() else None
            return MemoryFacts(self.limit, peak, events.get("oom_kill", 0), "cgroup v2")
        control = _counters(_read(os.path.join(self.path, "memory.oom_control")))
        peak_text = _read(os.path.join(self.path, "memory.max_usage_in_bytes"))
        peak = int(peak_text) if peak_text and peak_text.strip().isdigit() else None
        kills = control.get("oom_kill")
        if kills is None:  # kernels before 4.13 do not count: a hit limit and a full leaf tell
            failed = _counters(
                "failcnt " + (_read(os.path.join(self.path, "memory.failcnt")) or "0")
            )
            kills = 1 if failed.get("failcnt", 0) and peak is not None and peak >= self.limit else 0
        return MemoryFacts(self.limit, peak, kills, "cgroup v1")

    def remove(self) -> bool:
        """Remove the leaf; False while it still holds a process (the kernel lets a killed
        process go a moment after its exit: try again later). A leaf never removed is removed
        by the next host's ``make`` in this cgroup once its host is gone."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            return True
        except OSError as exc:
            return exc.errno not in (errno.EBUSY, errno.EAGAIN)
        return True


def _counters(text: str | None) -> dict[str, int]:
    found: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            found[key] = int(value)
    return found


def system_oom_kills() -> int | None:
    """The machine's count of OOM kills so far (``/proc/vmstat``), None where not shown."""
    return _counters(_read("/proc/vmstat")).get("oom_kill")


# The line a worker writes on fd 2 before it leaves at its RLIMIT_DATA limit
# (``comfy_env_worker.main._exit_out_of_memory``), and its exit code there.
_RLIMIT_LINE = re.compile(
    r"comfy-env: memory limit reached: limit=(\d+) peak=(\d+) \(RLIMIT_DATA\)"
)
EXIT_OUT_OF_MEMORY = 72


class WorkerMemory:
    """One worker generation's memory guard: its leaf (None without a cgroup or a limit), the
    machine's OOM kill count when it started, and the limit it was given."""

    __slots__ = ("facts", "leaf", "limit", "oom_kills_at_start")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.leaf = Leaf.make(limit) if limit else None
        self.oom_kills_at_start = system_oom_kills()
        self.facts: MemoryFacts | None = None  # the leaf's, read once the worker was reaped

    def seal(self) -> None:
        """Keep the leaf's facts of now (the worker was reaped): the leaf may go after."""
        if self.leaf is not None and self.facts is None:
            self.facts = self.leaf.facts()

    def worker_variables(self) -> dict[str, str]:
        """Variables for the worker's environment: its own RLIMIT_DATA where a limit was asked
        for and no leaf could be made."""
        if self.limit and self.leaf is None:
            return {"COMFY_ENV_MEMORY_RLIMIT": str(self.limit)}
        return {}

    def verdict(self, exitcode: int | None, tail: str) -> MemoryVerdict | None:
        """Whether the worker that ended with ``exitcode`` (and wrote ``tail`` last) ran out of
        memory, and how; None when nothing says so."""
        if self.leaf is not None:
            facts = self.facts or self.leaf.facts()
            if facts.oom_kills:
                return MemoryVerdict(facts.limit, facts.peak, facts.how)
        if exitcode == EXIT_OUT_OF_MEMORY:
            found = _RLIMIT_LINE.findall(tail)
            if found:
                limit, peak = found[-1]
                return MemoryVerdict(int(limit), int(peak) or None, "RLIMIT_DATA")
        if exitcode == -9 and self.oom_kills_at_start is not None:
            now = system_oom_kills()
            if now is not None and now > self.oom_kills_at_start:
                return MemoryVerdict(None, None, "OOM killer")
        return None

    def release(self) -> bool:
        """Remove the leaf once the worker's processes are gone; False: not yet (try again)."""
        self.seal()
        return self.leaf is None or self.leaf.remove()


@dataclass(frozen=True)
class MemoryVerdict:
    """A worker ran out of memory: the limit it had and its peak, in bytes (None: unknown),
    and who ended it (``WorkerOutOfMemory.how``)."""

    limit: int | None
    peak: int | None
    how: str
