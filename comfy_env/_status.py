"""Host status files: what each live comfy-env host on this machine is running, for ``status``.

Data flow::

    host process (one file per host)                      ``comfy-env status`` (any process)
    --------------------------------                      ----------------------------------
    Pool state changes -> publisher.publish_soon()        read_status():
      (throttled; the write runs on the pool's reactor)     list <status dir>/*.json
    publisher.publish():                                    host dead (pid gone, or reused by
      snapshots() -> [snapshot, ...] (_pool)                  a process with another start
      -> JSON document -> <status dir>/.<id>.json.tmp         time)? remove its file, skip it
      -> os.replace() onto <status dir>/<id>.json           parse -> HostStatus/EnvStatus/
      (no live pool left: the file is removed instead)        WorkerStatus (frozen)
    Pool.close() / interpreter exit -> publish()/remove()   RSS of each worker pid, measured
                                                              live with psutil

The status directory is ``<runtime_root()>/status`` (per user, mode 0700); files are mode 0600
and named after the host: ``<pid>-t<start ticks>-n<pid namespace>.json``, the same ``host_id()``
that names the host's shared-memory blocks and runtime directories, so a reused pid never passes
for a dead host, and a host in another pid namespace is never taken for dead. A host writes
only its own file, always whole (temporary file + ``os.replace``), so a reader never sees a
partial document. Readers and the CLI never need the host's cooperation: everything the file
does not say (RSS, whether the host is still alive) is measured at read time.

Times in the file are wall-clock seconds (``time.time()``): ``updated_at`` (when the file was
written), and per worker ``idle_since`` (idle workers) or ``busy_since`` (a worker in a call),
converted from the pool's monotonic clock when the snapshot is taken. An idle worker's file is
not rewritten while it idles; ``now - idle_since`` is its idle time as of any later read.

One publisher serves a whole host process (``host_publisher(snapshots)``): its snapshot
callable, passed in by the pool module (this module never imports it), lists every open pool
of the process, so several pools share one file. A forked child gets its own
publisher and file; it never writes or removes the parent's.
"""

from __future__ import annotations

import _thread
import contextlib
import math
import os
import re
import stat
import sys
import time

from ._errors import RuntimeRootError
from ._identity import host_id, owner_dead, pid_namespace
from ._leftovers import STATUS_DIR_NAME as STATUS_DIR_NAME  # (its public home was here)
from ._leftovers import STATUS_FILE, remove_status_files
from ._rundir import private_subdir, runtime_root
from ._say import package_logger
from ._stats import CALL_COUNTERS, CallCounts
from ._values import replace, value

SCHEMA = 1
_COUNTERS = CALL_COUNTERS
# Seconds a status write waits at least after the change that asked for it (publish_soon).
PUBLISH_SETTLE_DELAY = 0.01

# Not ``typing.TYPE_CHECKING``: ``comfy-env status`` loads this module, and typing (like
# threading, whose locks are ``_thread``'s) is a large import it does not need at run time.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    Snapshot = dict[str, Any]
else:
    Snapshot = dict  # (the pool module imports the name)


def status_dir() -> str:
    """``<runtime_root()>/status``, created with mode 0700 if missing and checked to be ours
    (``RuntimeRootError`` if it is a symlink, another user's, or not a directory)."""
    return private_subdir(runtime_root(), STATUS_DIR_NAME)


# The kernel's "no audit session" ((u32)-1 in ``/proc/<pid>/sessionid``).
NO_LOGIN_SESSION = 4294967295


def login_session(pid: int | str = "self") -> int | None:
    """The login session of ``pid``: the kernel's audit session id, which ``pam_loginuid``
    gives each login (ssh, console, a desktop session) and every process started from it
    inherits, through ``setsid``, ``nohup`` and a tmux or screen started there. None where
    there is none (no audit support, a process no login started: a container, a service) or
    it cannot be read. ``comfy-env status`` shows the hosts of its own login
    session, so that people sharing one account see their own hosts by default."""
    try:
        with open(f"/proc/{pid}/sessionid") as f:
            value = int(f.read())
    except (OSError, ValueError):
        return None
    return None if value == NO_LOGIN_SESSION else value


# ---- the publisher (host side) ------------------------------------------------------------


class StatusPublisher:
    """Keeps this host's status file current.

    ``snapshots`` returns the current pool snapshots (``_pool.snapshot_pool`` results).
    ``publish()`` writes the file now (or removes it when there is no pool to describe);
    ``publish_soon`` schedules a throttled ``publish()`` through a timer function such as a
    reactor's ``call_later``; ``remove()`` deletes the file and stops all further writes.

    Only the process that created the publisher writes: in a forked child every method is a
    no-op, so the child can never overwrite or delete its parent's file."""

    def __init__(
        self,
        snapshots: Callable[[], Iterable[Snapshot]],
        *,
        directory: str | None = None,
        min_interval: float = 0.5,
    ) -> None:
        self._snapshots = snapshots
        self._directory = directory
        self.min_interval = min_interval
        self.host_id = host_id()
        self._owner_pid = os.getpid()
        # Two locks, so that asking for a write (publish_soon, from a caller's thread) never
        # waits for a write in progress, which takes the pool's locks for its snapshot.
        self._write_lock = _thread.allocate_lock()  # one write (or remove) at a time
        self._flag_lock = _thread.allocate_lock()  # guards _pending
        self._pending = False
        self._last = float("-inf")  # monotonic time of the last write
        self._removed = False
        self._warned: set[str] = set()  # paths publish_or_warn has warned about

    @property
    def path(self) -> str:
        return os.path.join(self._dir(), f"{self.host_id}.json")

    def _dir(self) -> str:
        return self._directory if self._directory is not None else status_dir()

    def _mine(self) -> bool:
        return os.getpid() == self._owner_pid

    def publish(self) -> str | None:
        """Write the current state (atomically, mode 0600). Returns the file's path, or None if
        nothing was written (no open pool: the file is removed; after ``remove()``; in a forked
        child)."""
        if not self._mine():
            return None
        with self._write_lock:
            if self._removed:
                return None
            self._last = time.monotonic()
            pools = list(self._snapshots())
            if not pools:
                self._unlink()
                return None
            return self._write(pools)

    def publish_soon(self, call_later: Callable[[float, Callable[[], None]], object]) -> None:
        """Ask for a ``publish()`` within ``min_interval`` of the last one. Cheap when a write is
        already pending (a flag test); ``call_later(delay, fn)`` runs the write off the caller's
        path (on the pool's reactor thread)."""
        if self._pending or self._removed or not self._mine():
            return
        with self._flag_lock:
            if self._pending:
                return
            self._pending = True
            # Never at once: the change was made by a caller still on its way out of a call
            # (a crash report, say), and the write (Python work between system calls) would
            # take the GIL from it at each of its own calls (measured: 0.2 ms added to a
            # crash's detection).
            delay = max(PUBLISH_SETTLE_DELAY, self._last + self.min_interval - time.monotonic())
        try:
            call_later(delay, self._flush)
        except Exception:  # noqa: BLE001 - a stopped reactor: the next change asks again
            self._pending = False

    def _flush(self) -> None:
        self._pending = False  # changes from here on schedule another write
        try:
            self.publish()
        except Exception:  # noqa: BLE001 - status is best effort; never break the reactor
            package_logger().debug("comfy-env: status publish failed", exc_info=True)

    def publish_or_warn(self) -> None:
        """``publish()`` for a pool's close, which must finish whatever the status directory
        is like: a directory that is not safely ours (``RuntimeRootError``: a file or a
        symlink planted at ``<root>/status``) or a write that fails (``OSError``) is a
        warning naming the path (once a path), never raised."""
        try:
            self.publish()
        except (OSError, RuntimeRootError) as exc:
            path = str(getattr(exc, "path", None) or getattr(exc, "filename", None) or exc)
            if path not in self._warned:
                self._warned.add(path)
                # A RuntimeRootError's advice was given where it was first met (the calls'
                # own error, a warning): here its path and reason only.
                if isinstance(exc, RuntimeRootError):
                    said = f"{exc.path} is not usable: {exc.reason}"
                else:
                    said = str(exc)
                package_logger().warning(
                    "comfy-env: cannot write this host's status file, so comfy-env status may "
                    "show this host out of date: %s",
                    said,
                )

    def remove(self) -> None:
        """Delete this host's file; later ``publish()`` calls do nothing."""
        if not self._mine():
            return
        with self._write_lock:
            self._removed = True
            self._unlink()

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _write(self, pools: list[Snapshot]) -> str:
        pid = self.host_id.split("-", 1)[0]
        document = {
            "schema": SCHEMA,
            "host_id": self.host_id,
            "pid": int(pid),
            "start_ms": _start_ms(),
            "updated_at": round(time.time(), 3),
            "argv": [str(a)[:200] for a in sys.argv[:16]],
            "executable": sys.executable,
            "version": _version(),
            # (For readers in another pid namespace: the audit session id is not namespaced.)
            "login_session": login_session(),
            "pools": pools,
        }
        import json  # here, not at import: publishing runs on the reactor, off the first call

        data = json.dumps(document, separators=(",", ":"), default=str).encode()
        directory = self._dir()
        final = os.path.join(directory, f"{self.host_id}.json")
        tmp = os.path.join(directory, f".{self.host_id}.json.tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a write this process never finished
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return final


_START_MS: tuple[int, int] | None = None  # (pid, start ms), computed once per process


class StatusThrottle:
    """Keeps this host's status file (``comfy-env status``) current, throttled, written on the
    reactor thread (``changed``; the pool calls it on every change it makes, each call's end
    among them). A change inside the throttle window (``window`` seconds) is written when the
    window ends, so the file is never more than about a second behind the last change.

    Every decision (open a window, mark a change for its end, close it) is made under
    ``_lock``. A busy call path costs one flag test and no lock: once a change is marked
    (``_dirty``), the changes after it need nothing more, because the window's end
    (``_written``) clears the mark under the lock *before* it asks for the write, and the
    write takes its snapshot after that; so a caller that still saw the mark made its change
    before the snapshot. Only the first change of each window takes the lock."""

    __slots__ = ("_dirty", "_lock", "_pending", "_snapshots", "_timer", "window")

    def __init__(
        self,
        snapshots: Callable[[], Iterable[Snapshot]],
        timer: Callable[[], Callable[[float, Callable[[], None]], object] | None],
        window: float = 0.5,
    ) -> None:
        """``snapshots``: every open pool's (``host_publisher``); ``timer``: the reactor's
        ``call_later`` while the pool is open and has one, else None (nothing to write)."""
        self._snapshots = snapshots
        self._timer = timer
        self.window = window
        self._lock = _thread.allocate_lock()
        self._pending = False  # a window is open: its end (``_written``) is queued
        self._dirty = False  # changed inside the open window: written at its end

    def changed(self) -> None:
        if self._dirty:
            return  # marked already; the window's end writes it (see the class docstring)
        # Asked before the lock: a pool inherited by fork is closed (no timer), and a lock
        # another thread of the parent held at the fork is never taken.
        call_later = self._timer()
        if call_later is None:
            return
        with self._lock:
            if self._pending:
                self._dirty = True
                return
            try:
                publisher = host_publisher(self._snapshots)
            except (OSError, RuntimeRootError):
                # The first publisher names this host (``host_id``), which reads /proc: a host
                # out of descriptors. No window opens: the next change tries again; the call
                # that got here keeps its own outcome.
                return
            self._pending = True
        publisher.publish_soon(call_later)
        call_later(self.window, self._written)

    def _written(self) -> None:
        """Reactor thread: the throttle window ended; publish what changed inside it."""
        with self._lock:
            self._pending = False
            if not self._dirty:
                return
            self._dirty = False
        self.changed()


def _start_ms() -> int:
    """This host's start in wall-clock ms, for display only (liveness uses the host id).

    Computed once per process, from ``/proc`` where it can be (boot time plus the start ticks
    of the host id): the first status write runs on the reactor while the first call starts
    its worker, and importing psutil there (about 10 ms) took CPU from that call."""
    global _START_MS
    pid = os.getpid()
    if _START_MS is not None and _START_MS[0] == pid:
        return _START_MS[1]
    start = None
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration):
        if host_id().endswith("-n0"):
            raise ValueError("no usable /proc: the id's ticks are psutil's milliseconds")
        ticks = int(host_id().split("-")[1][1:])
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        start = int((btime + ticks / os.sysconf("SC_CLK_TCK")) * 1000)
    if start is None:
        import psutil

        start = int(psutil.Process().create_time() * 1000)
    _START_MS = (pid, start)
    return start


def _version() -> str:
    from . import __version__

    return __version__


_host_publisher: StatusPublisher | None = None
_host_publisher_lock = _thread.allocate_lock()


def host_publisher(snapshots: Callable[[], Iterable[Snapshot]]) -> StatusPublisher:
    """This process's publisher (a forked child gets a new one). ``snapshots`` lists every
    open pool of the process (the pool module passes it in, so that this module never needs
    the pool's names); the first call's ``snapshots`` is the one kept."""
    global _host_publisher, _host_publisher_lock
    publisher = _host_publisher
    if publisher is not None and publisher._owner_pid == os.getpid():
        return publisher
    if publisher is not None:  # inherited by fork: the parent's lock may be held
        _host_publisher_lock = _thread.allocate_lock()
    with _host_publisher_lock:
        if _host_publisher is None or _host_publisher._owner_pid != os.getpid():
            _host_publisher = StatusPublisher(snapshots)
        return _host_publisher


# ---- reading (any process) ----------------------------------------------------------------


@value
class WorkerStatus:
    """One worker slot as its host last published it; ``rss_bytes`` is measured at read time
    (None when the pid is not a live worker of that host)."""

    slot: int
    pid: int | None
    generation: int
    state: str
    retire_reason: str | None
    startup_seconds: float | None
    idle_since: float | None
    busy_since: float | None
    rss_bytes: int | None
    stuck: bool = False  # starting with no start in progress (``WorkerStats.stuck``)

    def idle_seconds(self, now: float | None = None) -> float | None:
        """Seconds idle as of ``now`` (wall time), for an idle worker."""
        if self.state != "idle" or self.idle_since is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.idle_since)

    def busy_seconds(self, now: float | None = None) -> float | None:
        """Seconds in the current call as of ``now`` (wall time), for a busy worker."""
        if self.state != "in_call" or self.busy_since is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.busy_since)


@value
class EnvStatus(CallCounts):
    """One env of one pool of a host: its call counters (``CallCounts``), then the rest."""

    pool: str
    env: str
    interpreter: str | None
    generation: int
    workers: tuple[WorkerStatus, ...]
    # The env's own settings (``Pool.configure``), effective values; ``env_vars`` by name.
    own_settings: tuple[tuple[str, Any], ...] = ()


@value
class HostStatus:
    """A live host process using comfy-env, as of its status file (``path``).

    ``other_pid_namespace``: the host runs in another pid namespace than the reader (a
    container sharing the runtime directory, ``unshare --pid``), or one that cannot be told
    (its token's namespace is 0: it had no ``/proc``). Its ``pid`` and its workers' pids are
    numbers in that namespace, not processes here, and it is "live" only because its death
    cannot be proven from here: a host killed there stays listed until its file is removed.

    ``login_session``: the host's login session (``login_session``), read from ``/proc`` for
    a host in the reader's pid namespace, else as its file says; None: none, or not known."""

    host_id: str
    pid: int
    start_ms: int
    updated_at: float
    argv: tuple[str, ...]
    executable: str | None
    version: str | None
    envs: tuple[EnvStatus, ...]
    path: str
    other_pid_namespace: bool = False
    login_session: int | None = None


def read_status(
    *, measure: bool = True, remove_stale: bool = True, notes: list[str] | None = None
) -> list[HostStatus]:
    """Every live host's status, sorted by pid. Files of dead hosts (and their leftover
    temporary files) are skipped and, with ``remove_stale``, deleted. Unreadable or malformed
    files of live hosts (not a regular file, over ``MAX_STATUS_BYTES``, deeply nested or
    non-finite JSON, wrong shapes) are skipped, each with a line appended to ``notes``: reading
    never blocks and never raises for a file's content. ``measure``: fill ``rss_bytes`` from
    the live processes."""
    notes = [] if notes is None else notes
    directory = status_dir()
    hosts: list[HostStatus] = []
    for name in sorted(os.listdir(directory)):
        match = STATUS_FILE.match(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        if not _owner_alive(match):
            if remove_stale:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            continue
        if name.startswith("."):
            continue  # a live host's write in progress
        host = _load(path, notes)
        if host is None:
            continue
        # A host in another pid namespace (a container sharing this directory) has pids that
        # mean other processes here, and its death cannot be proven from here: it is listed,
        # marked as such (by the namespace its file is named with, as the sweep judges it),
        # and nothing is measured for it.
        if int(match.group(3)) != pid_namespace():
            host = replace(host, other_pid_namespace=True)
            hosts.append(host)
            continue
        # Read live where it can be (a file written by an older comfy-env does not say it).
        host = replace(host, login_session=login_session(host.pid))
        if measure:
            try:
                host = _measured(host)
            except (ValueError, OverflowError, TypeError) as exc:
                notes.append(f"skipped {path}: implausible values ({exc})")
                continue
        hosts.append(host)
    hosts.sort(key=lambda h: (h.pid, h.start_ms))
    return hosts


def remove_stale_status(*, dry_run: bool = False) -> list[str]:
    """Delete status files (and temporary files) of dead hosts; returns their names
    (``dry_run``: deletes nothing). Decided as the sweep decides (``_leftovers``): a regular
    file of ours, named for a host proven dead."""
    return remove_status_files(status_dir(), dry_run=dry_run)


def _owner_alive(match: re.Match[str]) -> bool:
    """Alive unless proven dead (so "alive" includes "cannot tell"), as the sweep judges."""
    return not owner_dead(int(match.group(1)), int(match.group(2)), int(match.group(3)))


MAX_STATUS_BYTES = 4 * 1024 * 1024  # a real status file is a few KiB


def _load(path: str, notes: list[str]) -> HostStatus | None:
    """One status file, or None (with a note) if it cannot be trusted. Opened non-blocking (a
    FIFO planted under a status name must not hang the reader), checked to be a regular file
    of ours, read up to ``MAX_STATUS_BYTES``, parsed with non-finite numbers refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        notes.append(f"skipped {path}: cannot open it ({exc.strerror or exc})")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            notes.append(f"skipped {path}: not a regular file")
            return None
        if st.st_uid != os.getuid():
            notes.append(f"skipped {path}: owned by uid {st.st_uid}, not by this user")
            return None
        chunks = []
        size = 0
        while size <= MAX_STATUS_BYTES:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_STATUS_BYTES:
            notes.append(f"skipped {path}: larger than {MAX_STATUS_BYTES} bytes")
            return None
    except OSError as exc:
        notes.append(f"skipped {path}: cannot read it ({exc.strerror or exc})")
        return None
    finally:
        os.close(fd)
    try:
        import json

        doc = json.loads(b"".join(chunks), parse_constant=_no_constant, parse_float=_finite_float)
        return _parse(doc, path)
    except (
        ValueError,  # JSONDecodeError, UnicodeDecodeError, non-finite numbers, huge ints
        TypeError,
        KeyError,
        AttributeError,
        OverflowError,
        RecursionError,  # nested deeper than the parser's stack
    ) as exc:
        notes.append(f"skipped {path}: malformed ({type(exc).__name__}: {str(exc)[:200]})")
        return None


def _no_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} in a status file")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"non-finite number {text[:40]} in a status file")
    return value


def _opt_int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _opt_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _frozen(value: Any) -> Any:
    """A JSON value as a hashable one (lists as tuples), for a frozen status value."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _parse(doc: Any, path: str) -> HostStatus:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    envs: list[EnvStatus] = []
    for pool in doc.get("pools") or ():
        for env in pool.get("envs") or ():
            workers = tuple(
                WorkerStatus(
                    slot=int(w.get("slot", 0)),
                    pid=_opt_int(w.get("pid")),
                    generation=int(w.get("generation", 0)),
                    state=str(w.get("state", "?")),
                    retire_reason=_opt_str(w.get("retire_reason")),
                    startup_seconds=_opt_float(w.get("startup_seconds")),
                    idle_since=_opt_float(w.get("idle_since")),
                    busy_since=_opt_float(w.get("busy_since")),
                    rss_bytes=None,
                    stuck=w.get("stuck") is True,
                )
                for w in env.get("workers") or ()
            )
            counters = {name: int(env.get(name, 0)) for name in _COUNTERS}
            envs.append(
                EnvStatus(
                    pool=str(pool.get("pool", "")),
                    env=str(env["env"]),
                    interpreter=_opt_str(env.get("interpreter")),
                    generation=int(env.get("generation", 0)),
                    workers=workers,
                    own_settings=tuple(
                        (str(k), _frozen(v)) for k, v in (env.get("settings") or {}).items()
                    ),
                    **counters,
                )
            )
    return HostStatus(
        host_id=str(doc["host_id"]),
        pid=int(doc["pid"]),
        start_ms=int(doc["start_ms"]),
        updated_at=float(doc.get("updated_at", 0.0)),
        argv=tuple(str(a) for a in doc.get("argv") or ()),
        executable=_opt_str(doc.get("executable")),
        version=_opt_str(doc.get("version")),
        envs=tuple(envs),
        path=path,
        login_session=_opt_int(doc.get("login_session")),
    )


def _measured(host: HostStatus) -> HostStatus:

    envs = tuple(
        replace(env, workers=tuple(replace(w, rss_bytes=worker_rss(host, w)) for w in env.workers))
        for env in host.envs
    )
    return replace(host, envs=envs)


def worker_rss(host: HostStatus, worker: WorkerStatus) -> int | None:
    """The resident set size of ``worker``'s process, if that pid is still a worker of
    ``host`` (its command line names a runtime directory of the host), else None."""
    if worker.pid is None:
        return None
    import psutil

    from ._process import BOOT

    try:
        proc = psutil.Process(worker.pid)
        cmdline = proc.cmdline()
        if BOOT not in cmdline:
            return None
        runtime_dir = cmdline[cmdline.index(BOOT) + 1]
        if not os.path.basename(runtime_dir).startswith(f"host-{host.host_id}-"):
            return None
        return int(proc.memory_info().rss)
    except (psutil.Error, OSError, ValueError, IndexError):
        return None
