"""Shared machinery of the benchmark suite: statistics, targets, CPU pinning, process hygiene,
the raw-pipe reference child, and the handle on a peer driver running in another venv.

Nothing here measures anything by itself. The conventions every benchmark follows:

* **Interleaved rounds.** A round times every method once, in an order shuffled per round with
  a seeded ``random.Random``, so drift of the machine lands on every method alike. A figure is
  the median over rounds, with the fastest and slowest round (or the p99) as its spread.
* **Same-run references.** Ratios are always against a reference timed in the same rounds,
  never against a number from another run or another machine.
* **Peers in their own venvs.** Third-party peers (and the stdlib pools) run in a driver
  process (``driver.py``) started with the peer venv's interpreter; the driver times its own
  calls and answers JSON lines. ``Remote`` is the suite's handle on one such driver.
* **No leaks.** Every child is closed in a ``finally``; ``live_descendants`` lists what is
  still alive so the suite can warn (and then kill it).
"""

from __future__ import annotations

import ctypes
import json
import math
import multiprocessing
import os
import pickle
import platform
import selectors
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
DRIVER = os.path.join(BENCH_DIR, "driver.py")
MiB = 1024 * 1024

# --------------------------------------------------------------------------- statistics


@dataclass
class Series:
    """Samples of one figure (one per round, or one per call for latencies)."""

    values: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def min(self) -> float:
        return min(self.values) if self.values else math.nan

    @property
    def max(self) -> float:
        return max(self.values) if self.values else math.nan

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile (``q`` in 0..100)."""
        if not self.values:
            return math.nan
        ordered = sorted(self.values)
        rank = max(1, math.ceil(q / 100.0 * len(ordered)))
        return ordered[rank - 1]

    def summary(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "n": len(self.values),
            "values": list(self.values),
        }


def ratio(a: float, b: float) -> float:
    """``a / b``, NaN when either side is missing or ``b`` is zero."""
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.nan
    return a / b


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.{digits}f}"


def fmt_x(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.2f}x"


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    """One target of the issue, evaluated on this run's numbers (reported, never asserted)."""

    section: str
    label: str
    met: bool | None  # None: could not be evaluated (a method was unavailable)
    detail: str

    def line(self) -> str:
        verdict = {True: "MET", False: "NOT MET", None: "NOT EVALUATED"}[self.met]
        return f"- target {self.label}: {self.detail} -> **{verdict}**"

    def as_dict(self) -> dict[str, Any]:
        return {
            "section": self.section,
            "label": self.label,
            "met": self.met,
            "detail": self.detail,
        }


def target_at_most(
    section: str, label: str, value: float, limit: float, unit: str = "x", digits: int = 2
) -> Target:
    """``value <= limit``; the detail says by how much it is under or over."""
    if not math.isfinite(value):
        return Target(section, label, None, "not measured")
    shown = f"{value:.{digits}f}{unit} (limit {limit:.{digits}f}{unit})"
    if value <= limit:
        headroom = (1.0 - value / limit) * 100.0 if limit else 0.0
        return Target(section, label, True, f"{shown}, {headroom:.0f}% under the limit")
    over = (value / limit - 1.0) * 100.0 if limit else math.inf
    return Target(
        section,
        label,
        False,
        f"{shown}, over by {value - limit:.{digits}f}{unit} ({over:.0f}% over)",
    )


def target_at_least(
    section: str, label: str, value: float, limit: float, unit: str = "x", digits: int = 2
) -> Target:
    """``value >= limit`` (a speed-up); the detail says by how much it is over or under."""
    if not math.isfinite(value):
        return Target(section, label, None, "not measured")
    shown = f"{value:.{digits}f}{unit} (needs {limit:.{digits}f}{unit})"
    if value >= limit:
        return Target(section, label, True, shown)
    short = (1.0 - value / limit) * 100.0 if limit else 0.0
    return Target(section, label, False, f"{shown}, short by {short:.0f}%")


def unavailable_row(name: str, reason: str, columns: int) -> str:
    """A table row for a method that could not be measured (``n/a: ...``: not applicable)."""
    text = reason if reason.startswith("n/a") else f"unavailable: {reason}"
    return f"| {name} | {text} |" + " |" * (columns - 2)


def target_faster_than(
    section: str, label: str, ours: float, peers: dict[str, float], unit: str
) -> Target:
    """``ours`` (a time) is below every peer's time; names the closest peer."""
    finite = {k: v for k, v in peers.items() if math.isfinite(v)}
    if not math.isfinite(ours) or not finite:
        return Target(section, label, None, "no peer measured")
    best_name = min(finite, key=finite.__getitem__)
    best = finite[best_name]
    if ours < best:
        return Target(
            section,
            label,
            True,
            f"fastest peer {best_name} {best:.3g} {unit} is {best / ours:.2f}x comfy_env's "
            f"{ours:.3g} {unit}",
        )
    slower = [k for k, v in finite.items() if v <= ours]
    return Target(
        section,
        label,
        False,
        f"comfy_env {ours:.3g} {unit} is {ours / best:.2f}x the fastest peer {best_name} "
        f"({best:.3g} {unit}); peers at least as fast: {', '.join(sorted(slower))}",
    )


# --------------------------------------------------------------------------- machine


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def mem_total_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": sorted(os.sched_getaffinity(0)),
        "cpu_model": cpu_model(),
        "mem_total_gib": mem_total_gib(),
        "mp_start_method": multiprocessing.get_start_method(),
        "loadavg": os.getloadavg(),
    }


# --------------------------------------------------------------------------- processes


def tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def descendants(pid: int) -> Iterator[int]:
    """``pid``'s child processes, recursively (via /proc/<pid>/task/<tid>/children)."""
    for tid in tids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            yield kid
            yield from descendants(kid)


def proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``Z`` for a zombie), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def live_descendants() -> list[int]:
    """This process's descendants that are alive (zombies excluded)."""
    return sorted(p for p in set(descendants(os.getpid())) if proc_state(p) not in (None, "Z"))


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux ``PR_SET_CHILD_SUBREAPER``),
    so a process a library left behind still shows up in ``live_descendants``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(36, 1, 0, 0, 0)) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_zombies() -> None:
    """Collect exit statuses of re-parented orphans. Only call when no pool is open: it would
    steal the status of a child some library is waiting for."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_leftovers(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.1)
    reap_zombies()


SHM_DIR = "/dev/shm"


def shm_blocks() -> set[str]:
    """comfy_env's shared-memory block names (``ce-<host pid>-...``) now in /dev/shm."""
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("ce-")}
    except OSError:
        return set()


def shm_owner(name: str) -> int | None:
    """The host pid a block name carries."""
    try:
        return int(name.split("-")[1])
    except (IndexError, ValueError):
        return None


def clean_env() -> dict[str, str]:
    """The environment for children in other venvs: without variables that would point their
    interpreter at this one's packages."""
    env = dict(os.environ)
    for var in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__"):
        env.pop(var, None)
    return env


# --------------------------------------------------------------------------- CPU placement


def process_cpu_ns(pid: int) -> int:
    """Nanoseconds ``pid`` (all its threads) has spent on a CPU, from
    ``/proc/<pid>/task/*/schedstat``; 0 for a process that is gone."""
    total = 0
    for tid in tids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread (or the process) that just ended
    return total


# How long ``settle_pool`` waits for a pool's watcher to be launched: the reactor launches it
# right after the first worker's fork (a shell waiting on a pipe; before that, a Python
# interpreter launched 50 ms after the first worker was ready).
_WATCHER_WAIT = 1.0


def settle_pool(pool: Any, timeout: float = 5.0) -> bool:
    """Wait, untimed, until a fresh comfy_env ``pool`` is done with its one-off start-up work
    in the background: its host watcher (``comfy_env._watcher``) has started and sleeps in
    its read. As a Python interpreter (now a shell, about a millisecond) that start-up took
    about 50 ms of CPU here (20 ms since the seventeenth
    round); a batch timed right after a new pool's first call ran beside it, and on
    one CPU shared its CPU with it (measured: up to 9.5 us a call of the watcher's CPU in a
    batch of 1500 calls after 0.1 s of warm-up; in the small-call benchmark comfy_env's wall
    time ran 10-34 us a call over its caller's and worker's on-CPU sum). A warm call of a
    long-lived pool never meets it. Reaches into the pool (``_watcher``): a benchmark's view,
    not an API. True when settled; False when no watcher appeared (a pool that could not
    launch one, an older comfy_env) or it did not go quiet within ``timeout``."""
    from comfy_env._identity import proc_stat  # (here: peer drivers import this module too)

    start = time.monotonic()
    watcher = None
    while watcher is None and time.monotonic() - start < _WATCHER_WAIT:
        watcher = getattr(pool, "_watcher", None)
        if watcher is None:
            time.sleep(0.005)
    if watcher is None:
        return False
    pid = int(watcher.pid)
    last, quiet = -1, 0
    while time.monotonic() - start < timeout:
        used = process_cpu_ns(pid)
        stat = proc_stat(pid)  # None: gone, and nothing of it can run
        # Quiet: asleep and no CPU used over two looks 10 ms apart.
        quiet = quiet + 1 if used == last and (stat is None or stat[0] == "S") else 0
        if quiet >= 2:
            return True
        last = used
        time.sleep(0.01)
    return False


def pin_process(pid: int, cpus: set[int], tree: bool = True) -> None:
    """Pin every thread of ``pid`` (and, with ``tree``, of its descendants) to ``cpus``."""
    pids = [pid, *(descendants(pid) if tree else ())]
    for p in pids:
        for tid in tids(p):
            try:
                os.sched_setaffinity(tid, cpus)
            except (ProcessLookupError, PermissionError, OSError):
                pass  # a thread that just ended, or one we may not touch


def pin_self(cpus: set[int]) -> None:
    """Pin every thread of this process (pool helper threads included)."""
    pin_process(os.getpid(), cpus, tree=False)


# --------------------------------------------------------------------------- raw reference

_LEN = struct.Struct("<Q")

# How long the polling reference ("sockpoll") polls before it blocks: comfy_env's default
# PoolConfig.spin_wait, with the same rule (no polling while both ends share one pinned CPU,
# looked at every 50 ms).
RAW_POLL_SECONDS = 100e-6

# The child side of the raw references. argv: mode ("pipe" | "sock" | "sockpoll"), read fd,
# write fd. ``_POLLING`` (shared by both sides) makes ``recv_into`` poll first.
_POLLING = r"""
import os, select, time
def polling(sock, peer, seconds):
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poll, blocking_recv, state = poller.poll, sock.recv_into, [0.0, False]
    def recv_into(m):
        now = time.monotonic()
        if now >= state[0]:
            mine = os.sched_getaffinity(0)
            state[0] = now + 0.05
            state[1] = len(mine) > 1 or os.sched_getaffinity(peer) != mine
        if state[1]:
            end = now + seconds
            while not poll(0):
                os.sched_yield()
                if time.monotonic() >= end:
                    break
        return blocking_recv(m)
    return recv_into
"""
_RAW_CHILD = (
    _POLLING
    + r"""
import os, pickle, socket, struct, sys
mode, rfd, wfd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
L = struct.Struct("<Q")
buf = bytearray(1 << 16)
mv = memoryview(buf)
if mode in ("sock", "sockpoll"):
    s = socket.socket(fileno=rfd)
    recv_into = s.recv_into
    if mode == "sockpoll":
        recv_into = polling(s, os.getppid(), float(sys.argv[4]))
    send = s.sendall
elif mode == "sock2":
    recv_into = socket.socket(fileno=rfd).recv_into
    send = socket.socket(fileno=wfd).sendall
else:
    def recv_into(m):
        return os.readv(rfd, [m])
    def send(b):
        v = memoryview(b)
        while v:
            v = v[os.write(wfd, v):]
while True:
    got = 0
    need = L.size
    while got < need:
        n = recv_into(mv[got:])
        if not n:
            sys.exit(0)
        got += n
        if got >= L.size:
            need = L.size + L.unpack_from(buf)[0]
            if need > len(buf):
                buf.extend(bytes(need - len(buf)))
                mv = memoryview(buf)
    out = pickle.dumps(pickle.loads(mv[L.size:need]), protocol=5)
    send(L.pack(len(out)) + out)
"""
)


class RawChild:
    """Caller side of the raw length-prefixed pickle ping-pong (over pipes or a socketpair).

    The reference floor: a ``python -c`` child of this interpreter, an 8-byte length plus a
    protocol-5 pickle per message, one ``write`` per message, preallocated receive buffers.
    ``sockpoll``: the socketpair with both ends polling before they block, as comfy_env does
    (``RAW_POLL_SECONDS``): the reference for what comfy_env's own work costs across CPUs.
    ``sock2``: one socketpair per direction, comfy_env's own transport (on one socketpair
    both ways, a side asleep in ``recv`` is woken when the peer reads what it sent)."""

    def __init__(self, mode: str) -> None:
        self._buf = bytearray(1 << 16)
        self._mv = memoryview(self._buf)
        self._sock: socket.socket | None = None
        self._replies: socket.socket | None = None
        self._fds: list[int] = []
        if mode == "sock2":
            self._sock, child_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._replies, child_out = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            fds = (child_in.fileno(), child_out.fileno())
            close_after = [child_in, child_out]
            self._recv_into = self._replies.recv_into
        elif mode in ("sock", "sockpoll"):
            self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            fds = (child.fileno(), child.fileno())
            close_after = [child]
            self._recv_into: Callable[[memoryview], int] = self._sock.recv_into
        else:
            c2p_r, c2p_w = os.pipe()
            p2c_r, p2c_w = os.pipe()
            fds = (p2c_r, c2p_w)
            self._rfd, self._wfd = c2p_r, p2c_w
            self._fds = [c2p_r, p2c_w]
            close_after = []
            self._recv_into = self._read_pipe
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _RAW_CHILD,
                    mode,
                    str(fds[0]),
                    str(fds[1]),
                    str(RAW_POLL_SECONDS),
                ],
                pass_fds=tuple(set(fds)),
                stdin=subprocess.DEVNULL,
            )
        finally:
            for s in close_after:
                s.close()
            if mode not in ("sock", "sockpoll", "sock2"):
                os.close(p2c_r)
                os.close(c2p_w)
        if mode == "sockpoll":
            assert self._sock is not None
            namespace: dict[str, Any] = {}
            exec(_POLLING, namespace)  # the same polling code as the child's
            self._recv_into = namespace["polling"](self._sock, self.proc.pid, RAW_POLL_SECONDS)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_pipe(self, view: memoryview) -> int:
        return os.readv(self._rfd, [view])

    def _send(self, data: bytes) -> None:
        if self._sock is not None:
            self._sock.sendall(data)
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._wfd, view) :]

    def call(self, obj: Any) -> Any:
        payload = pickle.dumps(obj, protocol=5)
        self._send(_LEN.pack(len(payload)) + payload)
        buf, mv, got, need = self._buf, self._mv, 0, _LEN.size
        while got < need:
            n = self._recv_into(mv[got:])
            if not n:
                raise EOFError("raw child closed the channel")
            got += n
            if got >= _LEN.size:
                need = _LEN.size + _LEN.unpack_from(buf)[0]
                if need > len(buf):
                    buf.extend(bytes(need - len(buf)))
                    self._mv = mv = memoryview(buf)
        return pickle.loads(mv[_LEN.size : need])

    def close(self) -> None:
        """EOF makes the child exit; kill it if it does not within a second."""
        for sock in (self._sock, self._replies):
            if sock is not None:
                sock.close()
        self._sock = self._replies = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- peer drivers


class RemoteError(RuntimeError):
    """A peer driver failed: it answered an error, died, or did not answer in time."""


class Remote:
    """One ``driver.py serve METHOD`` process running under a (peer venv's) interpreter.

    Requests and answers are JSON lines on its stdin/stdout; its stderr (and anything the peer
    library prints) goes to a log file whose tail is quoted when it fails. It runs in its own
    session, so ``close`` can stop it and anything it forked with one ``killpg``."""

    def __init__(self, python: str, method: str, cwd: str, log_path: str) -> None:
        self.method = method
        self.log_path = log_path
        self._log = open(log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [python, DRIVER, "serve", method],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                cwd=cwd,
                env=clean_env(),
                start_new_session=True,
            )
        except BaseException:
            self._log.close()
            raise
        assert self.proc.stdout is not None
        self._stdout = self.proc.stdout
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._stdout, selectors.EVENT_READ)
        self._pending = b""
        self.leftovers: list[str] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 8) -> str:
        try:
            with open(self.log_path, "rb") as f:
                text = f.read()[-8192:].decode(errors="replace")
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def _readline(self, deadline: float) -> bytes:
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteError(f"{self.method}: no answer in time; log: {self.log_tail()}")
            if not self._sel.select(left):
                continue
            chunk = os.read(self._stdout.fileno(), 65536)
            if not chunk:
                raise RemoteError(
                    f"{self.method}: driver exited (rc {self.proc.poll()}); log: {self.log_tail()}"
                )
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line

    def request(self, op: str, timeout: float = 120.0, **params: Any) -> dict[str, Any]:
        """Send one request and wait for its answer; raise ``RemoteError`` on any failure."""
        if self.proc.poll() is not None:
            raise RemoteError(f"{self.method}: driver is not running; log: {self.log_tail()}")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **params}).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise RemoteError(f"{self.method}: cannot write to driver: {exc}") from exc
        answer = json.loads(self._readline(time.monotonic() + timeout))
        if "error" in answer:
            raise RemoteError(f"{self.method}: {answer['error']}")
        return dict(answer)

    def close(self, timeout: float = 15.0) -> None:
        """Ask the driver to stop its peer and exit; kill its session if it does not. Anything
        still alive in the session afterwards is recorded in ``leftovers`` and killed."""
        try:
            if self.proc.poll() is None:
                try:
                    self.request("stop", timeout=timeout)
                except (RemoteError, OSError, ValueError):
                    pass
                try:
                    self.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.leftovers.append(f"driver {self.pid} did not exit; killed")
            survivors = session_members(self.pid)
            deadline = time.monotonic() + 2.0  # helpers (resource trackers) exit after a beat
            while survivors and time.monotonic() < deadline:
                time.sleep(0.05)
                survivors = session_members(self.pid)
            if survivors:
                self.leftovers += [f"{p}: {cmdline(p)}" for p in survivors]
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        finally:
            self._sel.close()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    stream.close()
            self._log.close()


def session_members(sid: int) -> list[int]:
    """Live processes in session ``sid`` (a driver's session, after the driver is gone)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) == sid and proc_state(pid) not in (None, "Z"):
                found.append(pid)
        except OSError:
            continue
    return found


def run_driver_once(
    python: str, args: Sequence[str], cwd: str, timeout: float = 120.0
) -> dict[str, Any]:
    """Run ``driver.py ARGS`` to completion and return the JSON object it printed last."""
    proc = subprocess.run(
        [python, DRIVER, *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        timeout=timeout,
        start_new_session=True,
    )
    lines = [ln for ln in proc.stdout.decode(errors="replace").splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-6:])
        raise RemoteError(f"driver {' '.join(args)} failed (rc {proc.returncode}): {tail}")
    answer = json.loads(lines[-1])
    if "error" in answer:
        raise RemoteError(f"driver {' '.join(args)}: {answer['error']}")
    return dict(answer)


# --------------------------------------------------------------------------- fake envs


def make_fake_envs(root: str, count: int) -> list[str]:
    """``count`` env directories whose ``bin/python`` links to this interpreter. The pool keys
    envs by directory, so each one gets its own worker."""
    envs = []
    for i in range(count):
        env = os.path.join(root, f"env{i:03d}")
        python = os.path.join(env, "bin", "python")
        if not os.path.exists(python):
            os.makedirs(os.path.dirname(python), exist_ok=True)
            os.symlink(sys.executable, python)
        envs.append(env)
    return envs


# --------------------------------------------------------------------------- suite plumbing

# Which interpreter hosts each peer: "stdlib" is the suite's own venv, the others are the
# venvs ``peers.py`` installs.
PEER_VENV_OF: dict[str, str] = {
    "ProcessPoolExecutor": "stdlib",
    "multiprocessing.Pool": "stdlib",
    "loky": "peers",
    "pebble": "peers",
    "anyio.to_process": "peers",
    "comfy-env 0.4.46": "old",
}


@dataclass
class Section:
    """One measurement's outcome: markdown body, targets, raw data for the JSON file."""

    key: str
    title: str
    lines: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    leftovers: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        out = [f"## {self.title}", "", *self.lines]
        if self.targets:
            out += ["", *(t.line() for t in self.targets)]
        if self.leftovers:
            out += ["", "**Leftover processes after this section** (killed):", ""]
            out += [f"- `{item}`" for item in self.leftovers]
        out += ["", f"_Section time: {self.seconds:.1f} s_"]
        return "\n".join(out)


@dataclass
class Context:
    """What every benchmark needs: options, where the peers' interpreters are, and the peer
    drivers already started (reused across sections so each starts once)."""

    quick: bool
    seed: int
    workdir: str  # scratch: cwd of every driver, fake envs, driver logs
    pythons: dict[str, str | None]  # venv key -> interpreter, None when unavailable
    venv_reasons: dict[str, str] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # peer -> reason
    versions: dict[str, str] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)  # figures one section gives another
    remotes: dict[str, Remote] = field(default_factory=dict)
    pids: dict[str, list[int]] = field(default_factory=dict)  # worker pids of cached remotes
    leftovers: list[str] = field(default_factory=list)

    def python_for(self, method: str) -> str | None:
        return self.pythons.get(PEER_VENV_OF.get(method, "stdlib"))

    def reason(self, method: str) -> str:
        if method in self.unavailable:
            return self.unavailable[method]
        venv = PEER_VENV_OF.get(method, "stdlib")
        return self.venv_reasons.get(venv, "not started")

    def new_remote(self, method: str) -> tuple[Remote, list[int]]:
        """Start a driver for ``method`` and its peer; the caller closes it. Raises
        ``RemoteError`` (with the reason) when the peer is unavailable."""
        python = self.python_for(method)
        if python is None or method in self.unavailable:
            raise RemoteError(self.reason(method))
        slug = "".join(c if c.isalnum() else "_" for c in method)
        log = os.path.join(self.workdir, f"driver-{slug}.log")
        remote = Remote(python, method, self.workdir, log)
        try:
            info = remote.request("info", timeout=60)
            if info.get("version"):
                self.versions[method] = str(info["version"])
            pids = [int(p) for p in remote.request("start", timeout=120)["pids"]]
        except BaseException:
            remote.close()
            self.leftovers += remote.leftovers
            raise
        return remote, pids

    def remote(self, method: str) -> Remote | None:
        """The shared, started driver for ``method``; None (reason in ``unavailable``) when it
        cannot run."""
        if method in self.remotes:
            return self.remotes[method]
        if method in self.unavailable:
            return None
        try:
            remote, pids = self.new_remote(method)
        except RemoteError as exc:
            self.unavailable[method] = str(exc)
            return None
        self.remotes[method] = remote
        self.pids[method] = pids
        return remote

    def drop_remote(self, method: str, reason: str) -> None:
        """A shared driver failed mid-way: close it and mark the peer unavailable."""
        remote = self.remotes.pop(method, None)
        self.pids.pop(method, None)
        self.unavailable[method] = reason
        if remote is not None:
            remote.close()
            self.leftovers += remote.leftovers

    def close_remotes(self) -> None:
        while self.remotes:
            method, remote = self.remotes.popitem()
            self.pids.pop(method, None)
            try:
                remote.close()
            finally:
                self.leftovers += [f"{method}: {x}" for x in remote.leftovers]

    def expected_pids(self) -> set[int]:
        """Processes that are supposed to be alive: the shared drivers and what they run."""
        pids: set[int] = set()
        for remote in self.remotes.values():
            pids.add(remote.pid)
            pids.update(descendants(remote.pid))
        return pids


def rounds_order(rng: Any, names: Sequence[str]) -> list[str]:
    """A fresh shuffled order for one round."""
    order = list(names)
    rng.shuffle(order)
    return order


class ArmProcess:
    """One arm of an interleaved A/B script (``ab_hotpath``, ``ab_crash``): a long-lived child
    running ``child_code`` that answers one line per command line. ``spec`` is ``tree:PATH``
    or ``atree:PATH`` (that source tree first on ``PYTHONPATH``; ``ab_hotpath``'s asyncio
    arm) or a name the child understands."""

    def __init__(self, spec: str, child_code: str, bench_dir: str) -> None:
        self.spec = spec
        env = dict(os.environ)
        path = [spec.split(":", 1)[1]] if spec.startswith(("tree:", "atree:")) else []
        env["PYTHONPATH"] = os.pathsep.join([*path, bench_dir])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", child_code, spec, bench_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=bench_dir,  # not the checkout: ``-c`` puts the cwd first on sys.path
        )
        self.info = self._ask(None)

    def _ask(self, line: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"arm {self.spec} died")
        return answer.strip()


def compile_bytecode() -> str:
    """Compile comfy_env and comfy_env_worker to byte code, as ``pip install`` does (the
    peers are pip-installed and have theirs). A development checkout run with
    ``PYTHONDONTWRITEBYTECODE=1`` otherwise compiles every module from source in every fresh
    host and in every worker (the runtime dir copies the package with its ``__pycache__``),
    which is not what an installed package costs."""
    import compileall

    import comfy_env
    import comfy_env_worker

    ok = True
    for package in (comfy_env, comfy_env_worker):
        directory = os.path.dirname(os.path.abspath(package.__file__ or ""))
        ok = bool(compileall.compile_dir(directory, quiet=1)) and ok
    note = "comfy_env and comfy_env_worker compiled before the run (as pip install does)"
    return note if ok else note + "; some modules failed to compile"
