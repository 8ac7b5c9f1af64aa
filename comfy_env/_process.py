"""Mechanism: launch a worker process, talk frames with it, watch it, stop it.

Nothing here decides policy. ``WorkerProcess`` does what the pool's gate tells it (kill,
dispose) and reports what it sees (exit, EOF, bad frames) back as facts.

Launch (``launch``)::

    runtime dir (per pool)          comfy_env_worker + cloudpickle, hard links into a runtime
                                    store shared by this user's hosts (``RuntimeDir``); the
                                    ONLY path the host adds to the child's sys.path
    two socketpairs                 requests (host writes) and replies (host reads): host
                                    ends stay here; child ends inherited as fds N and M
    Popen(interpreter -c BOOT ...)  own session (own process group, no terminal Ctrl-C),
                                    stdin=/dev/null, stdout/stderr pipes, cleaned environment
    GO (one byte on the channel)    once the runtime dir is filled (the first spawn fills it
                                    while the interpreter starts); BOOT waits for it before it
                                    imports anything from the dir

``Popen`` runs on the reactor thread (see ``_reactor``) so the worker's parent-death signal is
tied to a thread that lives as long as the pool. Immediately after, the host closes its copies
of the child's ends: from then on the worker dying is an EOF on the host's reply end, which is
how a worker that exits during start-up is reported at once rather than after a timeout.
The channel is one socketpair per direction, so that nobody asleep reading one is woken when
the peer reads what it wrote on the other (see ``launch``).

Watching: the reactor watches a pidfd (exit, reaped at once so no zombie lingers) and the
stdout, stderr and log pipes (kept as a tail of recent lines for crash reports and forwarded
to ``logging``). The host holds the pipes' write ends until the reaping, so a dying worker
wakes the reactor once (its pidfd), not three times more at the moment its EOF wakes the
caller; the output ends at the reaping (``_end_output``), whatever a descendant holds.
The reactor also watches the worker's two named threads (``_watchdog``: thread pidfds, Linux
6.9+). A killed worker's descriptors close, and its channel reaches EOF, only after the
kernel has freed its memory; its other threads end first. When a named thread has ended and
the main thread is exiting, the reactor shuts the channel down (``_on_thread_exit``), so the
caller's read ends at once; the status it read goes to the crash report (``noticed_status``).
A caller whose wait for a reply has lasted ``_ALARM_AFTER`` watches the same pidfds itself
(``_reader_alarm``): it need not wait for the reactor to be scheduled. They are closed with
the channel (``dispose``); the reactor only stops watching them.
Once the death is known the reactor goes quiet until the caller is done (``_quiet``).
After any EOF on the replies, our request still unread on the worker's side of the requests
socketpair (or the reset its exit left there) tells that the call never ran
(``request_unread``).
A caller whose call the exit failed reads the exit status and the last words itself
(``status_at_eof``: the kernel has the status before the worker can be reaped; nothing is
reaped there), or reaps and drains when the exit is there (``collect_exit``), or waits for
the reactor's report. The reactor reports an exit a moment after reaping it, so the caller,
not the reactor, goes first. The slower scan for the generation's setsid descendants runs on
a timer just after, so it never holds the GIL while that caller wakes.

Handshake: the canary is encoded (and its shared-memory block filled) before the worker's
HELLO arrives, while its interpreter starts; then CONFIG and the canary go out together.

Stopping: ``kill`` signals the whole process group (a launcher wrapper such as ``pixi run`` and
its interpreter alike), SIGTERM then SIGKILL after the grace period, or SIGKILL at once; it also
shuts the channel down so a thread blocked reading it wakes with EOF. Closing the channel's
sockets is ``dispose``, which the pool calls only when no caller holds them, so a descriptor
number is never closed under a thread that still reads it.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import pickle
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from comfy_env_worker import shm
from comfy_env_worker.protocol import (
    CANARY_TARGET,
    FLAG_GONE,
    FLAG_OOB,
    HEADER_SIZE,
    MSG_NOSIGNAL,
    PROTOCOL_VERSION,
    ChannelClosed,
    FrameError,
    FrameReader,
    FrameType,
    PartialSend,
    Payload,
    encode_header,
    send_frame,
    send_parts,
)

from . import _sigpipe
from ._codec import decode_reply, encode_call, oob_threshold, use_shm, worker_config
from ._descendants import kill_marked
from ._envs import EnvSpec
from ._errors import HostResourceError, SerializationError, WorkerStartError, describe_exit
from ._identity import HOST_ID_VAR, host_id
from ._interrupts import Deferred
from ._lifecycle import CancelKill, RetireReason, Stop
from ._logs import WorkerLog
from ._reactor import Reactor, ReactorFailed
from ._rundir import runtime_root as runtime_root  # (re-exported: tests import it from here)
from ._runtime_store import RuntimeDir as RuntimeDir  # (re-exported for the pool and backends)
from ._settings import Settings
from ._watchdog import named_threads, thread_pidfd
from ._watchdog import supported as thread_watch_supported

if TYPE_CHECKING:
    from ._activation import Activation

_log = logging.getLogger("comfy_env")

# The first line parses under any Python (2.7 included) and refuses one older than 3.8 with a
# recognisable exit code, before the runtime (which needs 3.8) is imported. Then the worker
# waits for GO, the one byte the host writes on the channel once the runtime dir is complete
# (``RuntimeDir``): the first worker's interpreter starts while the host fills the dir. No GO
# (the host closed the channel first) is a quiet exit. The runtime dir takes the place of the
# ``''`` entry ``-c`` puts first in ``sys.path`` (the worker's cwd must not shadow the runtime),
# or goes before the rest where there is none (``PYTHONSAFEPATH``, ``-P``): overwriting the
# first entry then would drop a stdlib entry (the zip).
TOO_OLD_EXIT = 87
GO = b"\x01"
BOOT = (
    "import sys,os\n"
    "if sys.version_info[:2]<(3,8):"
    "sys.stderr.write('comfy-env: unsupported Python %d.%d\\n'%sys.version_info[:2]);sys.exit(87)\n"
    "if os.read(int(sys.argv[2]),1)!=b'\\x01':os._exit(0)\n"
    "if sys.path[:1]==['']:sys.path[0]=sys.argv[1]\n"
    "else:sys.path.insert(0,sys.argv[1])\n"
    "from comfy_env_worker.main import main;main(sys.argv[2:])"
)

# Variables that would make the env's interpreter import the host's packages or run host code.
_STRIPPED_ENV = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONEXECUTABLE",
    "PYTHONSAFEPATH",
    "__PYVENV_LAUNCHER__",
    "PYTHONUSERBASE",
)

WORKER_ID_VAR = "COMFY_ENV_WORKER_ID"
_HANDSHAKE_FRAME_BYTES = 1 << 20
# Reply mappings one worker process may have lent out at a time (see ``open_reply``).
MAX_LOANS = 64
# Replies with less shared memory than this are copied out. Lending wins from here up, results
# dropped or kept: a copy faults in fresh private pages. Measured with a fresh mapping per loan
# (echo round trip, interleaved): 3 MiB 1.04 ms lent vs 2.27 ms copied (2.56 vs 1.13 with 16
# results kept), 1 MiB 0.71 vs 0.79, 256 KiB 0.31 vs 0.34. With loan roots (no mapping per
# loan) 64-512 KiB showed no difference either way within this machine's noise, so small
# replies still go back at once instead of pinning a 1 MiB block each. (A ComfyUI 512x512
# IMAGE is 3 MiB.)
LOAN_MIN = 256 << 10
# What failing to open a reply's blocks means the *host* ran out of (``open_reply``: the worker
# is kept); any other error opening them is a block the worker named that is none.
_HOST_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
# Seconds a caller whose read saw the worker's EOF waits for the exit itself (collect_exit)
# before it leaves the rest to the reactor; a closed channel means the exit is moments away.
_COLLECT_WAIT = 0.1
# Seconds from a worker's exit (its pidfd) to the reactor's reaping and report (see _on_pidfd).
_EXIT_REPORT_DELAY = 0.002
# Seconds a caller waits for a reply in one blocking read before it watches the worker's
# named threads itself (``FrameReader.set_read_timeout``, ``set_alarms``; at least two clock
# ticks: the socket's receive timeout counts in ticks). A call that ends sooner pays nothing.
_ALARM_AFTER = 0.05
# States of our argument blocks lent to a result (see ``_lend_own``).
_LENT, _FINISHED, _RETURNED = 1, 2, 3
# Seconds from a worker's exit to the scan for its marked descendants (see _reaped), and the
# processes whose scan is still due (any pool's; run at the latest by force_close at close).
_MARKED_SCAN_DELAY = 0.005
_due_scans: set[WorkerProcess] = set()
_due_scans_lock = threading.Lock()


def canary_value(oob_bytes: int) -> Any:
    """Exercises the codec: nested containers, int keys, bytes, floats, a 4 KiB in-band
    buffer, and one buffer of ``oob_bytes`` that travels out of band (shared memory)."""
    return (
        {1: (b"\x00bytes\xff", [1.5, -0.0, None, True]), 2: {"nested": (1, 2, {3: "x"})}},
        [(), [], {}, "\u00e9\u4e2d", 2**70],
        bytes(range(256)) * 16,  # 4 KiB: under the out-of-band size, pickled in band
        bytearray(os.urandom(64)) * (oob_bytes // 64 + 1),
    )


_warned: set[str] = set()


def _warn_once(message: str, key: str | None = None) -> None:
    """Shared memory trouble is said loudly, but once per process (per ``key``, by default
    the message), not once per call."""
    key = message if key is None else key
    if key not in _warned:
        _warned.add(key)
        _log.warning("comfy-env: %s", message)


def shm_failure_hint(err: int | None) -> str:
    """What a failure to create a block with errno ``err`` probably means (None: the worker
    failed, and its errno did not travel)."""
    if err == errno.EEXIST:
        return (
            f"a block name was taken by someone else: another user may be creating files "
            f"named like comfy-env's in {shm.SHM_DIR}"
        )
    if err in (errno.ENOSPC, errno.ENOMEM, None):
        return f"is {shm.SHM_DIR} full or too small?"
    if err in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT):
        return f"is {shm.SHM_DIR} missing or not writable?"
    return "the error above says why"


_serials = itertools.count(1)


def _peek_exit(popen: subprocess.Popen[bytes]) -> int | None:
    """The exit status of ``popen`` if it was reaped or is a zombie (left unreaped), else
    None."""
    if popen.returncode is not None:
        return popen.returncode
    try:
        info = os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile (the reactor)
        return popen.returncode
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status  # killed, or dumped core


# ``/proc/<pid>/stat``: the per-process flag set once exit has begun (field 9).
_PF_EXITING = 0x4


def exiting_status(pid: int, stat_fd: int | None = None) -> int | None:
    """The exit status of our child ``pid`` once the kernel has begun to tear it down
    (``subprocess`` convention: the exit code, or minus the signal), before it can be reaped;
    None while it runs, if the status is not final yet, or without ``/proc``.

    Field 9 of ``/proc/<pid>/stat`` holds ``PF_EXITING``; field 52 (Linux 3.5+) the exit
    status in ``wait`` form, set before the process closes its descriptors. A zero status
    is trusted only from a zombie: an exit that has only just begun may not have stored its
    status yet. The pid is ours and unreaped, so it names no other process.

    ``stat_fd``: that file, opened beforehand (``WorkerProcess._stat_fd``); read again from
    its start (``pread``: any thread), it is produced afresh.
    Opening it is most of the cost on a crash's path (40-60 us of a cold thread, against 5 us
    for the read), so it is opened while the worker is well."""
    try:
        # os-level reads: this runs on a crash's path, where buffered I/O cost 0.1 ms cold.
        if stat_fd is not None:
            data = os.pread(stat_fd, 4096, 0)
        else:
            fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
            try:
                data = os.read(fd, 4096)
            finally:
                os.close(fd)
        # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
        fields = data.rpartition(b")")[2].split()
        state, flags, status = fields[0], int(fields[6]), int(fields[49])
    except (OSError, IndexError, ValueError):
        return None
    if state != b"Z" and not flags & _PF_EXITING:
        return None  # running: its channel closed some other way
    if status == 0 and state != b"Z":
        return None
    if status & 0x7F:
        return -(status & 0x7F)
    return (status >> 8) & 0xFF


def base_environment() -> dict[str, str]:
    """The host's environment minus the variables that would make the env's interpreter
    import the host's packages: what a worker's environment starts from, and what an env's
    activation scripts run with (``_activation``)."""
    return {k: v for k, v in os.environ.items() if k not in _STRIPPED_ENV}


def worker_environment(
    config: Settings, worker_id: str = "", activation: Activation | None = None
) -> dict[str, str]:
    """A worker's environment, in order of precedence (the later wins): the host's minus
    ``_STRIPPED_ENV``, ``PYTHONNOUSERSITE`` and ``PYTHONUNBUFFERED`` (and ``OMP_WAIT_POLICY=
    PASSIVE`` unless the host sets it), the env's activation
    (``_activation``: a script's ``PYTHONPATH`` is the env's own choice, as env_vars),
    ``PoolConfig.env_vars``, then the host and worker ids."""
    env = base_environment()
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # OpenMP's threads (torch, numpy's BLAS, OpenCV) spin for a while after each parallel
    # region by default. In a worker that spin takes a core from the worker's own thread and
    # from the host exactly while they exchange the reply: a node doing small tensor ops was
    # 4-10x slower isolated than in-process on 2 cores. Passive waiting puts idle OpenMP
    # threads to sleep at once; large ops are unaffected. The host's setting, the env's
    # activation or PoolConfig.env_vars override it.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if activation is not None:
        activation.apply(env)
    env.update(config.env_vars)
    # The sweep's proof that a process is this host's worker (a look-alike command line has
    # no such variable); set last so env_vars cannot forge or drop it.
    env[HOST_ID_VAR] = host_id()
    if worker_id:
        env[WORKER_ID_VAR] = worker_id  # one generation's mark (see _descendants)
    return env


class WorkerProcess:
    """One launched worker process of generation ``generation`` and its host-side channel."""

    def __init__(
        self,
        spec: EnvSpec,
        generation: int,
        config: Settings,
        reactor: Reactor,
        runtime_dir: RuntimeDir,
        on_exit: Callable[[WorkerProcess], None],
        on_finished: Callable[[WorkerProcess], None],
    ) -> None:
        self.spec = spec
        self.generation = generation
        self.config = config
        self.reactor = reactor
        self.runtime_dir = runtime_dir
        self._on_exit = on_exit
        self._on_finished = on_finished
        self._finished = False
        self._output_closed = False
        # The exit is reported once (``_reaped``, then ``_maybe_finished``) by whichever thread
        # gets there first: the reactor (its pidfd) or the caller whose read saw the EOF
        # (``collect_exit``). ``_exit_reported``: the pool's ``on_exit`` ran.
        self._exit_lock = threading.Lock()
        self._exit_reported = False
        # One thread at a time reads an output pipe (the tail keeps the order of its lines);
        # the streams read to their end, whose pipes the reactor closes (it owns the selector).
        self._output_lock = threading.Lock()
        self.retire_reason: RetireReason | None = None  # set by the pool's gate
        self.cancel_kill: CancelKill | None = None  # set by the gate with the reason
        self.popen: subprocess.Popen[bytes] | None = None
        # The channel: two socketpairs, one per direction (see ``launch``). ``sock`` is the
        # host's end of the requests (it only writes there), ``reply_sock`` its end of the
        # replies (``reader`` reads it).
        self.sock: socket.socket | None = None
        self.reply_sock: socket.socket | None = None
        self.reader: FrameReader | None = None
        self.pid: int | None = None  # the interpreter's own pid, from its hello
        self.hello: dict[str, Any] = {}
        self.returncode: int | None = None
        self.death_detail: str | None = None  # exit codes say it all here
        self.death_reported = False  # by the pool (breaker, WorkerRetired), once
        self._dying = False  # its exit status was read before the reaping (status_at_eof)
        self.exited = threading.Event()
        self.startup_seconds = 0.0
        self.log = WorkerLog(spec.key, spec.name, generation, config.stderr_tail_lines)
        self.output_done = threading.Event()  # reaped, and its output read to the end
        # Read ends of the worker's stdout, stderr and log pipes, and the write ends the host
        # keeps open (see ``launch``): nothing reaches EOF while the worker dies.
        self._stdout: Any = None
        self._stderr: Any = None
        self._log_pipe: Any = None
        self._held_ends: list[int] = []
        self._cancel_fd: int | None = None  # write end of the cancel pipe (CANCEL frames)
        self._cancel_lock = threading.Lock()  # a descriptor is never closed under a writer
        self._pidfd: int | None = None
        # Pidfds of the worker's named threads, whose end is the first sign of its death (see
        # ``_watchdog``), watched by the reactor and by a caller waiting for a reply (the
        # channel's reader). Closed with the channel (``dispose``: no caller reads any more);
        # the reactor only stops watching them (``_watched_fds``, reactor thread only).
        self._thread_fds: list[int] = []
        self._watched_fds: set[int] = set()
        self._thread_lookups = 0
        # ``/proc/<pid>/stat``, opened with the named threads' pidfds and closed with them: a
        # notice reads it again instead of opening it on the crash's path (``exiting_status``).
        self._stat_fd: int | None = None
        self._pidfd_fired = False  # (``_on_pidfd``): the reaping is scheduled
        self._exit_watch_paused = False  # the notice took the pidfd off the reactor a moment
        self._watch_quiet = False  # the death is known: no reader of it wakes the reactor
        # The exit status read when a named thread's end, with the process exiting, shut the
        # channel down (the kernel's final word: the caller need not read it); None until then.
        self.noticed_status: int | None = None
        # ``dispose`` closes the sockets under it, and a shutdown from another thread
        # (``_shut_channel``) runs under it: a descriptor number is never shut after its close.
        self._sock_lock = threading.Lock()
        self._escalation: Any = None
        # The scan for the generation's marked descendants, due shortly after the exit (see
        # _reaped); None once it ran or when none is due.
        self._marked_scan: Any = None
        self._disposed = False
        self._kill_requested = False
        self._owner_pid = os.getpid()  # a forked copy of this object must never signal
        self.worker_id = f"{host_id()}-w{next(_serials)}"  # marks the generation's processes
        # Shared memory, set up at the handshake when both sides can use it.
        self.shm_wanted = config.shared_memory and shm.shm_available()
        if config.shared_memory and not self.shm_wanted:
            _warn_once(f"{shm.SHM_DIR} is not usable here; large buffers are streamed inline")
        self.blocks: shm.BlockPool | None = None
        self.mappings: shm.PeerMappings | None = None
        # "on" (the last large transfer went through shared memory), "off" (configured off),
        # "unavailable" (wanted, but /dev/shm is missing or full: buffers stream inline).
        self.shm_state = "on" if self.shm_wanted else "off"
        if config.shared_memory and not self.shm_wanted:
            self.shm_state = "unavailable"
        self.ack_consumed = True  # tests turn this off to exercise the worker's TTL
        # Loaned reply blocks whose last view died (call ids), appended by finalizers on any
        # thread; the lease holder sends their CONSUMED frames ahead of its next request.
        self.returned: deque[int] = deque()
        # Reply mappings lent out and still alive (each may hold a descriptor), in a list so
        # that the finalizers need no reference to this object.
        self._loans = [0]
        self._loans_lock = threading.Lock()
        # Our argument blocks a result holds (the worker echoed them back), by name: LENT
        # until finish_request, then FINISHED until the last view dies (its finalizer puts
        # the block back in the pool); RETURNED when the views died before finish_request.
        self._own_lent: dict[str, int] = {}
        # Threads faulting in a spare argument block (joined before our blocks go).
        self._spares: list[threading.Thread] = []
        self._orphan_lock = threading.Lock()
        self._exit_seen = False
        self._dispose_seen = False
        self._orphans_unlinked = False

    # ---- launch and handshake ----

    @property
    def python_version(self) -> tuple[int, ...]:
        return tuple(self.hello.get("python", ()))

    def launch(
        self,
        before_launch: Callable[[], None] | None = None,
        after_launch: Callable[[WorkerProcess], None] | None = None,
        activation: Activation | None = None,
    ) -> None:
        """Start the process on the reactor thread and begin watching it.

        ``before_launch`` runs on the reactor thread just before the fork and may raise to
        refuse it (the pool refuses once it is closing); ``after_launch`` runs right after, on
        the same thread, so the pool registers the process before anything can stop the
        reactor. ``activation``: the env's, worked out by the pool beforehand (never here:
        its scripts must not run on the reactor thread)."""
        environment = worker_environment(self.config, self.worker_id, activation)
        # One socketpair per direction, never one for both: a Unix stream socket wakes every
        # thread asleep on it when the bytes it *sent* are read (the "write space" wake-up,
        # whatever the sleeper waits for), so on one socket each call woke its caller, asleep
        # in ``recv`` for the reply, the moment the worker read the request, and the worker
        # likewise when the caller read the reply: about one context switch more per call on
        # one CPU (2.9-3.0 a call on a shared socket, 2.0 on split ones), and wake-ups of the
        # other CPU for nothing across (benchmarks/HISTORY.md, tenth round).
        try:
            parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # out of descriptors (EMFILE/ENFILE): nothing to release
            raise self._no_channel(exc) from exc
        try:
            reply_sock, child_reply_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            parent_sock.close()
            child_sock.close()
            raise self._no_channel(exc) from exc
        # stdout, stderr and the log pipe (records between calls, see comfy_env_worker.logs).
        # The host keeps their write ends open until it has reaped the worker: a dying
        # worker's pipes then never reach EOF, so the reactor thread is not woken by the
        # death three times over at the moment the caller whose call it failed wakes (it
        # cost crash detection about 0.2 ms). The exit is the pidfd's news; the output ends
        # at the reaping (``_end_output``), and a descendant that escaped the group cannot
        # hold it open.
        # And the cancel pipe: CANCEL frames, read by the worker's watchdog while its main
        # thread runs the call. All four made here, so that a host out of descriptors gets
        # the typed error below whichever of them fails, and nothing of them kept.
        pipes: list[int] = []
        try:
            for _ in range(4):
                pipes.extend(os.pipe())
        except OSError as exc:
            for fd in pipes:
                os.close(fd)
            for end in (parent_sock, child_sock, reply_sock, child_reply_sock):
                end.close()
            raise self._no_channel(exc) from exc
        out_read, out_write, err_read, err_write, log_read, log_write = pipes[:6]
        cancel_read, self._cancel_fd = pipes[6:]
        self._stdout = os.fdopen(out_read, "rb", buffering=0)
        self._stderr = os.fdopen(err_read, "rb", buffering=0)
        self._log_pipe = os.fdopen(log_read, "rb", buffering=0)
        self._held_ends = [out_write, err_write, log_write]
        os.set_blocking(self._cancel_fd, False)
        self.sock = parent_sock
        self.reply_sock = reply_sock
        self.reader = FrameReader(reply_sock, self.config.max_frame_bytes)
        if thread_watch_supported():
            # Before any read: a ``recv`` keeps the timeout it began with, and the first call
            # may begin before the named threads are found (``_watch_threads``).
            try:
                self.reader.set_read_timeout(_ALARM_AFTER)
            except OSError:
                pass  # no caller alarms on this channel: the reactor watches alone
        try:
            child_fd = child_sock.fileno()
            child_reply_fd = child_reply_sock.fileno()
            argv = [
                self.spec.interpreter,
                "-c",
                BOOT,
                self.runtime_dir.path,
                str(child_fd),
                str(os.getpid()),
                str(log_write),
                str(cancel_read),
                str(child_reply_fd),
            ]

            def popen() -> subprocess.Popen[bytes]:
                if self._kill_requested:
                    raise WorkerStartError(
                        "the worker was stopped before it was launched",
                        env=self.spec.key,
                        generation=self.generation,
                    )
                if before_launch is not None:
                    before_launch()
                cwd = self.config.cwd
                if cwd is not None and not os.path.isdir(cwd):
                    # Popen's FileNotFoundError names no field and reads like a missing
                    # interpreter.
                    raise WorkerStartError(
                        f"cannot launch a worker for env {self.spec.key}: its cwd {cwd!r} "
                        "(PoolConfig.cwd) is not an existing directory",
                        env=self.spec.key,
                        generation=self.generation,
                    )
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out_write,
                    stderr=err_write,
                    pass_fds=(child_fd, log_write, cancel_read, child_reply_fd),
                    close_fds=True,
                    start_new_session=True,
                    env=environment,
                    cwd=cwd,
                )
                self.popen = proc
                # The launched process's pid until the hello names the interpreter's own
                # (they differ only behind a wrapper script): set before ``_watch`` starts
                # reading its output, so what it says before its hello (a broken env's
                # interpreter) is printed and logged with a pid, not ``pid=None``.
                self.log.pid = proc.pid
                self._watch()
                if after_launch is not None:
                    after_launch(self)
                if self._kill_requested:  # kill() ran while Popen was forking
                    self._signal_group(signal.SIGKILL)
                return proc

            try:
                self.reactor.run_sync(popen)
            except (OSError, ReactorFailed) as exc:
                raise WorkerStartError(
                    f"cannot launch {self.spec.interpreter} for env {self.spec.key}: {exc}",
                    env=self.spec.key,
                    generation=self.generation,
                ) from exc
        except BaseException:
            self.dispose()
            if self.popen is None:  # nothing forked, so the reactor never took the pipes
                self._close_pipes()
            raise
        finally:
            child_sock.close()  # the worker holds the only other ends now
            child_reply_sock.close()
            os.close(cancel_read)

    def _no_channel(self, exc: OSError) -> WorkerStartError:
        return WorkerStartError(
            f"cannot create the channel to a worker of env {self.spec.key}: {exc} (is the "
            "host out of file descriptors? see ulimit -n)",
            env=self.spec.key,
            generation=self.generation,
        )

    def handshake(self, deadline: float) -> None:
        """HELLO -> CONFIG -> READY, then the canary. Raises ``WorkerStartError``."""
        started = time.monotonic()
        assert self.reader is not None and self.sock is not None
        # HELLO and READY are a few hundred bytes: until the worker is known to speak our
        # protocol, a frame announcing more is refused before anything is allocated for it.
        self.reader.limit = min(self.config.max_frame_bytes, _HANDSHAKE_FRAME_BYTES)
        # The runtime dir is filled (by the pool's first spawn) while the worker's interpreter
        # starts; GO lets the worker import from it.
        try:
            self.runtime_dir.ready()
        except (OSError, ImportError) as exc:
            raise self._start_error(
                f"could not be given its runtime directory {self.runtime_dir.path}: {exc}"
            ) from exc
        try:
            self.sock.sendall(GO, MSG_NOSIGNAL)
        except OSError:
            pass  # the worker died already: its EOF is read below, and its exit reported
        # The canary is encoded, and its block made and filled, while the interpreter still
        # starts (this thread would only wait for HELLO): off the first call's path when the
        # host has a CPU of its own. A worker that turns out unable to use shared memory gets
        # it inline instead (the block goes back with the pool, below).
        if self.shm_wanted:
            self.blocks = shm.BlockPool(
                f"{shm.NAME_PREFIX}{host_id()}-h{next(_serials)}-", self.config.shm_pool_bytes
            )
            self.blocks.hold = Deferred  # (blocks made, given up, destroyed: see BlockPool)
        canary = self._canary_prepare()
        try:
            ftype, _, _, payload = self.reader.read(deadline)
            if ftype != FrameType.HELLO:
                raise FrameError(f"expected HELLO, got frame type {ftype}")
            hello = pickle.loads(payload)
            if hello.get("protocol") != PROTOCOL_VERSION:
                raise FrameError(
                    f"worker speaks protocol {hello.get('protocol')}, host {PROTOCOL_VERSION}"
                )
            self.hello = hello
            self.pid = int(hello["pid"])
            self.log.pid = self.pid
            use_shm = self.shm_wanted and bool(hello.get("shm"))
            config = worker_config(
                self.config,
                self.generation,
                host_id() if use_shm else None,
                self.config.shm_pool_bytes,
            )
            if use_shm:
                self.mappings = shm.PeerMappings(f"{shm.NAME_PREFIX}{host_id()}-w{self.pid}-")
            else:
                if self.blocks is not None:  # prepared for a worker without shared memory
                    self.blocks.destroy_all()
                    self.blocks = None
                    canary = self._canary_prepare()
                if self.config.shared_memory:
                    self.shm_state = "unavailable"
            send_frame(self.sock, FrameType.CONFIG, 0, pickle.dumps(config, protocol=5))
            # The canary goes out right behind CONFIG, without waiting for READY: the worker
            # reads it once configured (one round trip less at every start). A worker that
            # fails its configuration never reads it; its exit is reported as before.
            value, parts, block = canary
            try:
                self._send_large(parts, deadline)
            except BaseException:
                self.finish_request(block, [])
                raise
            # The lookup of the worker's named threads (started while we answered HELLO), a
            # moment later. Scheduled here, while this thread waits for READY, the wake-up of
            # the reactor it takes costs nothing; after the canary it took the GIL from this
            # thread on its way to the first call.
            if self.reactor.running:
                self.reactor.call_later(self._THREAD_LOOKUP_DELAY, self._watch_threads)
            ftype, _, _, _ = self.reader.read(deadline)
            if ftype != FrameType.READY:
                raise FrameError(f"expected READY, got frame type {ftype}")
            self.reader.limit = self.config.max_frame_bytes
            self._canary_check(deadline, value, block)
            # Only now: the handshake and the canary wait on an interpreter's start-up.
            self.reader.spin_wait(self.config.spin_wait, self.pid or 0)
        except TimeoutError:
            raise self._start_error(
                f"did not finish its start-up within {self.config.start_timeout:g}s "
                "(PoolConfig.start_timeout)"
            ) from None
        except (ChannelClosed, OSError) as exc:  # EOF, reset, broken pipe, partial send
            rc = self.wait_exit(1.0)
            if rc == TOO_OLD_EXIT:
                raise self._too_old_error() from None
            # Silent and gone before its HELLO: likely no Python at all (``/bin/true``).
            hint = "" if self.hello else f" (is {self.spec.interpreter} a Python interpreter?)"
            raise self._start_error(f"{describe_exit(rc)} during start-up", hint) from exc
        except (FrameError, pickle.UnpicklingError, KeyError, ValueError, TypeError) as exc:
            raise self._start_error(f"failed its handshake: {exc}") from exc
        self.startup_seconds = time.monotonic() - started

    def read_frame(
        self,
        deadline: float | None,
        pending: tuple[int, int, Payload] | None = None,
        on_event: Callable[[int, Payload], None] | None = None,
    ) -> tuple[int, int, int, Payload]:
        """The next frame that is not a log record or a call event; log records met on the way
        are emitted and EVENT frames handed to ``on_event(call id, payload)`` (dropped without
        one), so whatever a call logged or emitted is handled before its reply is returned.
        ``pending`` is such a frame (type, call id, payload) the caller already read."""
        reader = self.reader
        assert reader is not None
        return self.log.read_past_side_frames(reader.read, deadline, pending, on_event)

    def _canary_prepare(self) -> tuple[Any, list[Any], shm.Block | None]:
        """Encode the canary: one real call through the codec, with a buffer out of band
        (through shared memory when ``blocks`` is set). Returns the value, the frame's parts
        (header first) and the request's block."""
        oob = self.config.shm_threshold_bytes
        if self.blocks is None:
            oob = min(oob, self.config.max_frame_bytes // 4)
        value = canary_value(oob)
        body, buffers, _ = encode_call(
            CANARY_TARGET, (value,), {}, oob_threshold(self.config.shm_threshold_bytes)
        )
        try:
            parts, block, length = shm.pack(body, buffers, self.blocks)
        except OSError as exc:  # /dev/shm full: inline, as send_request does
            self._shm_unavailable(f"cannot create a block ({exc})", exc.errno)
            parts, block, length = shm.pack(body, buffers, None)
        parts.insert(0, encode_header(FrameType.CALL, 1, length, FLAG_OOB))
        return value, parts, block

    def _canary_check(self, deadline: float, value: Any, block: shm.Block | None) -> None:
        """Read the canary's reply: anything but an equal echo refuses the worker."""
        assert self.reader is not None
        ftype, flags, call_id, reply = self.read_frame(deadline)
        if call_id != 1 or ftype not in (FrameType.REPLY_OK, FrameType.REPLY_ERR):
            raise FrameError(f"canary: unexpected frame type {ftype} for call {call_id}")
        body_in, buffers_in, retained = self.open_reply(1, flags, reply)
        self.finish_request(block, retained)
        try:
            echoed = decode_reply(ftype, body_in, CANARY_TARGET, buffers_in)
        except Exception as exc:
            raise FrameError(f"canary call failed: {type(exc).__name__}: {exc}") from exc
        if echoed != value:
            raise FrameError("canary came back different from what was sent")

    # ---- requests and replies (the caller thread holding the slot) ----

    def send_request(
        self, call_id: int, body: bytes, buffers: list[memoryview], deadline: float | None
    ) -> shm.Block | None:
        """Send a CALL frame. Out-of-band buffers go into one of our shared-memory blocks (one
        memcpy) or, without shared memory, inline from the caller's memory. Returns the block,
        to be released when the reply arrives (``finish_request``).

        Raises ``SerializationError`` (nothing sent) if the frame would exceed the limit, the
        socket's own error if the first write fails (nothing sent), ``PartialSend`` if a later
        one does, and ``TimeoutError`` when a large write passes ``deadline``."""
        sock = self.sock
        assert sock is not None
        # Loans returned since the last request ride in front of it, in the same write.
        returns = self.take_returns() if self.returned else b""
        if not buffers:
            if len(body) <= 65536:
                sock.sendall(
                    returns + encode_header(FrameType.CALL, call_id, len(body)) + body,
                    MSG_NOSIGNAL,
                )
                return None
            parts: list[Any] = [returns + encode_header(FrameType.CALL, call_id, len(body)), body]
            self._send_large(parts, deadline)
            return None
        block = None
        if self.blocks is not None and use_shm(buffers, self.config.shm_threshold_bytes):
            try:
                parts, block, length = shm.pack(body, buffers, self.blocks)
                self.shm_state = "on"
            except OSError as exc:  # /dev/shm full (ENOSPC at reservation): inline this time
                self._shm_unavailable(f"cannot create a block ({exc})", exc.errno)
                parts, block, length = shm.pack(body, buffers, None)
        else:
            parts, block, length = shm.pack(body, buffers, None)
        if length + HEADER_SIZE > self.config.max_frame_bytes:
            self.finish_request(block, [])
            raise SerializationError(
                f"the call's payload is {length} bytes, over PoolConfig.max_frame_bytes="
                f"{self.config.max_frame_bytes} (shared memory is off or full)"
            )
        parts.insert(0, returns + encode_header(FrameType.CALL, call_id, length, FLAG_OOB))
        try:
            self._send_large(parts, deadline)
        except BaseException:
            self.finish_request(block, [])
            raise
        return block

    def _send_large(self, parts: list[Any], deadline: float | None) -> None:
        sock = self.sock
        assert sock is not None
        if deadline is None:
            send_parts(sock, parts)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(remaining)
        try:
            send_parts(sock, parts)
        finally:
            sock.settimeout(None)

    def open_reply(
        self, call_id: int, flags: int, payload: Payload
    ) -> tuple[Payload | memoryview, list[Any] | None, list[str]]:
        """Split a reply into (body, out-of-band buffers, our blocks the worker retained).

        Shared-memory buffers are *loaned*: they are views of a loan root (``shm.loan_root``:
        a new exporter of the worker's reply block, over our cached mapping of it), so the
        result is built on them without a copy, a system call or a page fault. The worker
        keeps that block pinned (out of its pool) until ``CONSUMED`` for the call arrives,
        which is sent only once the last view of the root is gone (a finalizer queues the
        call id in ``returned``; the next request carries it). A result therefore never
        aliases memory the worker will reuse: a block the worker gives up after its TTL is
        unlinked, never reused, and the root keeps its mapping. Buffers the worker sent back
        in our own argument block (``echo`` entries) are views of a loan root of that block,
        which stays out of our pool until they die (``_lend_own``, ``finish_request``). A
        forged or malformed table raises ``FrameError``."""
        if flags & ~FLAG_OOB:
            raise FrameError(f"unknown frame flags 0x{flags:x} on the reply of call {call_id}")
        if not flags & FLAG_OOB:
            return payload, None, []
        # Beyond MAX_LOANS live loans (a caller collecting many results) replies are copied
        # out and returned at once: every loan pins a block of the worker's (and, where ctypes
        # is missing, a fresh mapping that keeps a descriptor before Python 3.13).
        loaned: list[Any] | None = [] if self._loans[0] < MAX_LOANS else None
        echoed: list[tuple[shm.Block, Any]] = []
        try:
            body, buffers, sources, retained = shm.unpack(
                payload,
                self.mappings,
                copy_out=loaned is None,
                loaned=loaned,
                loan_min=LOAN_MIN,
                own=self.blocks,
                echoed=echoed,
            )
        except ValueError as exc:
            raise FrameError(f"bad out-of-band reply: {exc}") from None
        except OSError as exc:
            if exc.errno == errno.ENOENT and self._names_its_block(exc.filename):
                # The frame was read whole and its table is well formed, naming a block of the
                # worker's own shape: the block is gone, not forged. Something removed it from
                # /dev/shm, or the worker gave it up after its TTL (it counts only time this
                # host was seen running: a host starved of CPU that long). Nothing the worker
                # sent was invalid, so it is kept; the result is lost and the call says so.
                self._send_consumed(call_id, FLAG_GONE)  # (the worker gives the block up)
                raise self._reply_block_gone(call_id, exc) from None
            if exc.errno not in _HOST_OUT_OF_RESOURCES:
                # A name no block of the worker can have (ENOENT), or a name it planted that
                # is no block: a directory (EISDIR), a symlink (ELOOP), another's file (EACCES).
                raise FrameError(f"bad out-of-band reply: {exc}") from None
            self._send_consumed(call_id)
            raise self._host_fault(call_id, exc) from None
        except MemoryError as exc:
            self._send_consumed(call_id)
            raise self._host_fault(call_id, exc) from None
        if self.mappings is not None and buffers:
            if echoed or any(source is not None for source in sources):
                self.shm_state = "on"
            elif use_shm(buffers, self.config.shm_threshold_bytes):
                # Enough for shared memory (the worker's rule too), yet inline: the worker could
                # not create a reply block. (Under the threshold inline is the rule, not a
                # failure: a pool whose threshold is above its messages, say.)
                self._shm_unavailable("the worker cannot create a block")
        for block, root in echoed:
            if root is not None:
                self._lend_own(block, root)
        if loaned:
            self._lend(call_id, loaned)
        elif any(source is not None for source in sources):
            self._send_consumed(call_id)  # copied out (few bytes, or too many loans)
        return body, buffers, retained

    def _host_fault(self, call_id: int, exc: BaseException) -> HostResourceError:
        """Out of descriptors or address space *here* (EMFILE, ENOMEM): the host's fault. The
        frame was read whole, so the channel is in sync; the worker got its blocks back
        (``_send_consumed``) and stays, and only this call fails."""
        return HostResourceError(
            f"the host could not open the reply of call {call_id} from env "
            f"{self.spec.key}: {exc} (out of file descriptors or memory in the host? see "
            "ulimit -n); the worker is fine and was kept",
            errno=getattr(exc, "errno", None),
        )

    def _names_its_block(self, path: object) -> bool:
        """Whether ``path`` (an ``OSError``'s file) is shaped like a block of this worker."""
        mappings = self.mappings
        if mappings is None or not isinstance(path, str):
            return False
        if os.path.dirname(path) != shm.SHM_DIR:
            return False
        return shm.names_a_block_of(os.path.basename(path), mappings.prefix)

    def _reply_block_gone(self, call_id: int, exc: OSError) -> HostResourceError:
        """A shared-memory block of the reply of ``call_id`` no longer exists when the host
        opens it. The channel is in sync and the worker broke no rule: it is kept."""
        name = os.path.basename(str(exc.filename)) if exc.filename else "?"
        return HostResourceError(
            f"the reply of call {call_id} from env {self.spec.key} was lost: its shared-memory "
            f"block {name} was gone before the host opened it (removed from /dev/shm by "
            "something else, or given up by the worker after "
            f"shm_pinned_ttl={self.config.shm_pinned_ttl:g}s of this host running without "
            "taking it); the worker is fine and was kept",
            errno=exc.errno,
        )

    def _lend(self, call_id: int, roots: list[Any]) -> None:
        """Queue ``CONSUMED(call_id)`` for when every loan root of the reply has died."""
        left = [len(roots)]
        lock, loans, returned = self._loans_lock, self._loans, self.returned
        with lock:
            loans[0] += len(roots)

        def gone() -> None:  # any thread, at any time (garbage collection)
            with lock:
                left[0] -= 1
                loans[0] -= 1
                last = left[0] == 0
            if last:
                returned.append(call_id)

        for root in roots:
            weakref.finalize(root, gone)

    def _lend_own(self, block: shm.Block, root: Any) -> None:
        """The result views our own argument block ``block`` (through the loan root ``root``):
        keep the block out of our pool until the root dies, so that no later request writes
        into memory a result still shows."""
        lock, loans, lent, pool = self._loans_lock, self._loans, self._own_lent, self.blocks
        name = block.name
        with lock:
            loans[0] += 1
            lent[name] = _LENT

        def gone() -> None:  # any thread, at any time (garbage collection)
            with lock:
                loans[0] -= 1
                state = lent.get(name)
                if state == _LENT:
                    lent[name] = _RETURNED  # finish_request puts it back
                    return
                if state is None:
                    return
                del lent[name]
            if pool is not None:
                pool.release(block)  # a no-op once the block was given up

        weakref.finalize(root, gone)

    def take_returns(self) -> bytes:
        """CONSUMED frames of the loans returned so far (lease holder only)."""
        frames = []
        while True:
            try:
                call_id = self.returned.popleft()
            except IndexError:
                break
            frames.append(encode_header(FrameType.CONSUMED, call_id, 0))
        # Tests turn acks off to exercise the worker's TTL: the returns are then dropped.
        return b"".join(frames) if self.ack_consumed else b""

    def _send_consumed(self, call_id: int, flags: int = 0) -> None:
        if not self.ack_consumed:
            return
        sock = self.sock
        assert sock is not None
        try:
            sock.sendall(encode_header(FrameType.CONSUMED, call_id, 0, flags), MSG_NOSIGNAL)
        except OSError:
            pass  # the worker is gone; its blocks go with it (see dispose)

    def _shm_unavailable(self, why: str, err: int | None = None) -> None:
        """Shared memory failed (``err``: the errno, where this side saw it): stream inline,
        and warn once per process, whichever side failed first."""
        self.shm_state = "unavailable"
        _log.debug("comfy-env: shared memory failed: %s", why)
        _warn_once(
            f"shared memory is unavailable ({why}); large buffers are streamed inline "
            f"until it works again ({shm_failure_hint(err)})",
            key="shm-unavailable",
        )

    def finish_request(self, block: shm.Block | None, retained: list[str]) -> None:
        """The request's block may be reused, unless the worker kept a view of it."""
        blocks = self.blocks
        if block is None or blocks is None:
            return
        name = block.name
        lent = False
        if self._own_lent:
            with self._loans_lock:
                state = self._own_lent.get(name)
                if state == _LENT:
                    self._own_lent[name] = _FINISHED  # the loan's finalizer puts it back
                    lent = True
                elif state == _RETURNED:
                    del self._own_lent[name]
        if name in retained:
            blocks.give_up(block)  # the result's mapping keeps its memory
        elif not lent:
            blocks.release(block)
        elif blocks.wants_spare(block.size):
            self._spare_soon(block.size)

    def _spare_soon(self, size: int) -> None:
        """A result holds our last idle argument block of its size (``shm.BlockPool.
        wants_spare``): fault in a spare on a helper thread, so that the next request of that
        size (results kept) finds one ready instead of faulting fresh pages on its path (about
        175 ms per 256 MiB)."""
        blocks = self.blocks
        assert blocks is not None
        with self._loans_lock:
            self._spares = [t for t in self._spares if t.is_alive()]
            if self._spares or self._disposed:
                return  # one at a time: a caller keeping results gets one per call anyway

            def make() -> None:
                try:
                    if not blocks.has_idle(size):
                        blocks.add_spare(size)
                except OSError:
                    pass  # /dev/shm full: the next request makes its own or goes inline

            thread = threading.Thread(target=make, name="comfy-env-spare", daemon=True)
            self._spares.append(thread)
        thread.start()

    def _too_old_error(self) -> WorkerStartError:
        self.wait_output(1.0)
        tail = self.log.tail()
        match = re.search(r"unsupported Python (\d+\.\d+)", tail)
        version = match.group(1) if match else "older than 3.8"
        return WorkerStartError(
            f"env {self.spec.key} runs Python {version} ({self.spec.interpreter}); comfy-env "
            "workers need Python 3.8 or newer",
            env=self.spec.key,
            generation=self.generation,
            stderr_tail=tail,
            unsupported=True,
        )

    def _start_error(self, what: str, silent_hint: str = "") -> WorkerStartError:
        """The start-up failure ``what``; ``silent_hint`` is added when the worker said nothing."""
        self.kill(Stop.KILL)
        self.wait_output(1.0)
        tail = self.log.tail()
        message = (
            f"worker for env {self.spec.key} (interpreter {self.spec.interpreter}, "
            f"generation {self.generation}) {what}"
        )
        if not tail:
            message += silent_hint
        if tail:
            message += "\n--- worker output (last lines) ---\n" + tail
        return WorkerStartError(
            message,
            env=self.spec.key,
            pid=self.pid,
            generation=self.generation,
            stderr_tail=tail,
        )

    # ---- watching (reactor thread) ----

    def _watch(self) -> None:
        popen = self.popen
        assert popen is not None
        for stream, pipe in self._streams():
            os.set_blocking(pipe.fileno(), False)
            self.reactor.add_reader(pipe, self._make_pipe_reader(stream, pipe))
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is not None:
            try:
                self._pidfd = pidfd_open(popen.pid)
            except OSError:
                self._pidfd = None
        if self._pidfd is not None:
            self.reactor.add_reader(self._pidfd, self._on_pidfd)
        else:  # pragma: no cover - kernels without pidfd: poll the exit status
            self._poll_exit()

    def _streams(self) -> tuple[tuple[str, Any], ...]:
        return (("stdout", self._stdout), ("stderr", self._stderr), ("log", self._log_pipe))

    def _make_pipe_reader(self, stream: str, pipe: Any) -> Callable[[], None]:
        fd = pipe.fileno()

        def on_readable() -> None:
            with self._output_lock:
                if pipe.closed:
                    return
                if self._read_locked(stream, fd, drain=False):
                    # EOF although we hold a write end: only after ``_close_pipes`` began.
                    self.reactor.remove_reader(pipe)

        return on_readable

    def _read_locked(self, stream: str, fd: int, drain: bool) -> bool:
        """Under ``_output_lock``: read what ``stream`` holds (one read, or until it would block
        when ``drain``) into the log. True at EOF."""
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return False
            except OSError:
                data = b""
            if not data:
                return True
            if stream == "log":
                self.log.feed_pipe(data)
            else:
                self.log.feed_native(stream, data)
            if not drain:
                return False

    def status_at_eof(self) -> int | None:
        """Caller thread, after its read of the channel saw the worker's EOF: the exit status
        if the kernel has it already, with the output pipes drained (everything the worker
        wrote is in them: it closed its descriptors); None if not (the caller then waits for
        it, ``collect_exit``). Nothing is reaped here: the reactor reaps and reports the exit
        as usual a moment later, so this thread does no more than the crash report needs.

        Known already: a zombie (``waitid`` with ``WNOWAIT`` peeks at its status; usually
        the case by the time the caller runs), or a process the kernel is tearing down. A
        dying process closes its descriptors (our EOF) before it becomes a zombie, but its
        status is set before either (``exiting_status``)."""
        popen = self.popen
        if popen is None or os.getpid() != self._owner_pid:
            return None
        rc = self.noticed_status  # read by the reactor when it shut the channel down
        if rc is None:
            rc = _peek_exit(popen)
        if rc is None:
            rc = exiting_status(popen.pid)  # several times dearer than the peek
        if rc is None:
            return None
        self._dying = True  # ``kill`` has nothing left to signal until the reaping
        self._drain_output()
        self._finish_lines()
        return rc

    @property
    def exit_noticed(self) -> bool:
        """Whether a named thread's end shut the channel down (see ``_on_thread_exit``)."""
        return self.noticed_status is not None

    def request_unread(self) -> bool:
        """After an EOF on the replies: whether the worker is gone with bytes we sent it still
        unread (the call never ran, and may run on a fresh worker). Its exit tells that as a
        reset, but on the *requests* socket, not on the replies we read: the reply end of a
        dead worker reads a plain EOF. So the requests socket is asked.

        ``SIOCOUTQ``: what we sent that the worker has not read yet, while its socket lives.
        Once its exit has released that socket (0.5 ms after the kill for a bare worker: this
        thread may look later), our unread bytes are dropped and the count is 0, but the
        kernel has left the reset pending on our socket (``SO_ERROR``: ``ECONNRESET`` only if
        bytes were unread; set before the bytes are dropped); it is read second, so one of the
        two always tells."""
        sock = self.sock
        if sock is None:
            return False
        import fcntl  # (loaded by ``_watch_threads`` already, off the crash path)
        import termios

        try:
            unread = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            if int.from_bytes(unread, sys.byteorder) > 0:
                return True
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNRESET
        except OSError:
            return False

    def _drain_output(self) -> None:
        """Read what the output pipes hold now, on this thread (until they would block). One
        ``poll`` first, so a pipe with nothing in it (the usual case) costs no read: on a
        crash this runs while the reactor wakes, and each system call hands it the GIL."""
        with self._output_lock:
            streams = {
                pipe.fileno(): stream
                for stream, pipe in self._streams()
                if pipe is not None and not pipe.closed
            }
            if not streams:
                return
            poller = select.poll()
            for fd in streams:
                poller.register(fd, select.POLLIN)
            for fd, _events in poller.poll(0):
                self._read_locked(streams[fd], fd, drain=True)

    def _finish_lines(self) -> None:
        """The output is complete (the worker has exited): a last line without its newline
        is a line too. (The pipes never reach EOF, which used to tell this: see ``launch``.)"""
        with self._output_lock:
            self.log.finish_native("stdout")
            self.log.finish_native("stderr")

    def _end_output(self) -> None:
        """After the reaping (any thread): read what is left; the output is complete then
        (a descendant still writing is being killed with the group). The descriptors are
        closed on the reactor thread, which owns the selector."""
        self._drain_output()
        self._close_output()

    def collect_exit(self) -> None:
        """Caller thread, after its read of the channel saw the worker's EOF: reap the process
        and drain its output pipes here when the exit is already there, instead of waiting for
        the reactor thread to be scheduled, take the GIL, do it and wake us (a hand-off of two
        threads on a busy machine: most of what crash detection costs over a raw child's EOF).
        Whatever is not ready (the process still exiting, a descendant holding a pipe open)
        stays the reactor's, as before. Both threads may run this at once safely: the exit is
        reported once (``_exit_lock``; the pool's gate drops the second ``Exited`` anyway), a
        pipe is read by one thread at a time (``_output_lock``), and descriptors (pidfd,
        pipes) are closed only on the reactor thread, which owns the selector: the pidfd of a
        process reaped here stays readable, and the reactor's callback then finds the exit
        reported."""
        popen = self.popen
        if popen is None or self.exited.is_set() or os.getpid() != self._owner_pid:
            return
        if popen.poll() is None and not self._await_exit(popen.pid, _COLLECT_WAIT):
            return
        if popen.poll() is None:
            return  # the reactor holds the wait (it reaps at this moment): leave it the rest
        assert popen.returncode is not None
        self._reaped(popen.returncode)  # drains the output too (``_end_output``)

    def _on_pidfd(self) -> None:
        if self._exit_watch_paused or self._pidfd is None:
            return  # unwatched by a callback of the same wake-up (``_notice_exit``)
        assert self.popen is not None
        self._pidfd_fired = True
        self.reactor.remove_reader(self._pidfd)
        # Reaped and reported a moment later: a caller whose read saw the EOF writes its
        # crash report first, on its own thread (status_at_eof), instead of trading the GIL
        # with this thread at each of the reaping's system calls (the hand-off measured most
        # of crash detection's cost over a raw child's EOF). Nobody waits on this for an idle
        # worker; close waits for ``exited`` and force_close reaps what is still due.
        self.reactor.call_later(_EXIT_REPORT_DELAY, self._reap)

    def _reap(self) -> None:
        """Reactor thread, just after the exit: reap (no zombie lingers) and report."""
        assert self.popen is not None
        if self._pidfd is None:
            return  # force_close got here first
        self.reactor.remove_reader(self._pidfd)  # (done by _on_pidfd; never close one watched)
        os.close(self._pidfd)
        self._pidfd = None
        self._unwatch_threads()
        self._reaped(self.popen.wait())

    # Seconds from CONFIG (sent) to the first lookup of the named threads (they name
    # themselves as they start, so usually before it), doubling between lookups; after the
    # last one, what was found is watched (nothing: the death is seen at its EOF).
    _THREAD_LOOKUP_DELAY = 0.005
    _THREAD_LOOKUPS = 7
    _NAMED_THREADS = 2  # the watchdog and the sentinel

    def _watch_threads(self) -> None:
        """Reactor thread, once CONFIG is out: watch the worker's named threads (see
        ``_watchdog``), looked up again a little later until both have named themselves."""
        if self._pidfd is None or self.pid is None or self._disposed or self._kill_requested:
            return  # exited (or reaped, or never watched), or on its way out
        tids = named_threads(self.pid)
        self._thread_lookups += 1
        if len(tids) < self._NAMED_THREADS and self._thread_lookups < self._THREAD_LOOKUPS:
            delay = self._THREAD_LOOKUP_DELAY * 2 ** (self._thread_lookups - 1)
            self.reactor.call_later(delay, self._watch_threads)
            return
        with self._sock_lock:  # (``dispose`` closes them: never one opened after it)
            pid, reader = self.pid, self.reader
            if self._disposed or self._thread_fds or pid is None:
                return
            for tid in tids:
                fd = thread_pidfd(pid, tid)
                if fd is not None:
                    self._thread_fds.append(fd)
            if not self._thread_fds:
                return
            try:
                self._stat_fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
            except OSError:
                self._stat_fd = None  # read by path then (``exiting_status``)
            fds = list(self._thread_fds)
            if reader is not None and reader.read_timeout:
                # A caller whose wait for a reply outlasts ``_ALARM_AFTER`` watches them too
                # (``_reader_alarm``): the reactor's notice must first be scheduled, take the
                # GIL and shut the channel down, and on a 2-CPU machine it was often queued
                # behind the dying worker's teardown, on the very CPU that teardown ran on,
                # for its whole length (0.5 ms bare), while the caller's own CPU was free.
                reader.set_alarms(fds, self._reader_alarm)
        for fd in fds:
            self._watched_fds.add(fd)
            self.reactor.add_reader(fd, functools.partial(self._on_thread_exit, fd))
        # Loaded here, off every call's path, not on the first crash's (``request_unread``:
        # 0.5 ms of a cold thread for two extension modules).
        import fcntl  # noqa: F401
        import termios  # noqa: F401

    def _reader_alarm(self) -> bool:
        """Caller thread, in a wait for a reply: a named thread ended. True (the read ends as
        at EOF) if the worker is exiting, with its status noted for the crash report, as the
        reactor's notice does; False if not (yet: the reader asks again for a while, then
        forgets that thread: an ``exec``, a core dump being written, a thread ending alone)."""
        popen = self.popen
        if popen is None or os.getpid() != self._owner_pid:
            return False
        rc = exiting_status(popen.pid, self._stat_fd)  # (closed only by ``dispose``)
        if rc is None:
            return False
        self.noticed_status = rc
        return True

    def _unwatch_threads(self) -> None:
        """Reactor thread: stop watching the named threads (their pidfds stay open until
        ``dispose``: a caller may be polling them)."""
        for fd in list(self._watched_fds):
            self._unwatch_thread(fd)

    def _unwatch_thread(self, fd: int) -> None:
        if fd in self._watched_fds:
            self._watched_fds.discard(fd)
            self.reactor.remove_reader(fd)

    def _on_thread_exit(self, fd: int) -> None:
        """Reactor thread: a named thread ended. If the process is exiting (its status is
        stored), shut the channel down now, so a caller reading it sees EOF before the
        kernel's teardown would close it (about 1 ms for a bare worker, tens of ms for one
        holding a GiB); its crash report then reads the same status (``status_at_eof``).
        Anything else (an ``exec``, the thread ending alone, a core dump in progress) is left
        to the exit and the EOF, as without this."""
        if fd not in self._watched_fds or self._watch_quiet:
            return  # no longer watched (a stale wake-up)
        self._notice_exit(0)  # first: a caller may be waiting; the descriptors can wait
        if self.exit_noticed or self._dying:
            self._quiet()  # noticed here, by a caller's alarm, or its EOF: it is reporting
        else:
            self._unwatch_thread(fd)

    # The main thread may not have begun to exit when a named thread has ended (not yet
    # scheduled on a busy machine): looked at again this often, this many times.
    _EXIT_RECHECK_DELAY = 0.001
    _EXIT_RECHECKS = 20

    def _notice_exit(self, rechecks: int) -> None:
        """Reactor thread: shut the channel down if the process is exiting; else look again
        (``rechecks`` so far), until ``_EXIT_RECHECKS``."""
        popen = self.popen
        if popen is None or self.exit_noticed or self._dying or self._disposed:
            return
        if self.exited.is_set():  # reaped: nobody can be waiting for its EOF any more
            return
        rc = exiting_status(popen.pid, self._stat_fd)
        if rc is None:
            if rechecks < self._EXIT_RECHECKS:
                again = functools.partial(self._notice_exit, rechecks + 1)
                self.reactor.call_later(self._EXIT_RECHECK_DELAY, again)
            return
        self.noticed_status = rc
        self._quiet()
        self._shut_channel()

    def _quiet(self) -> None:
        """Reactor thread, the death known: stop every reader of this worker that would wake
        this thread again (the named threads, the exit's pidfd) until ``_after_notice``, 2 ms
        later. A caller is writing its crash report now, and work here (closing descriptors,
        the exit's own wake-up a moment later) would trade the GIL with it at each system
        call (measured: 50-500 us added to a third of the crashes). Done before the shutdown
        that wakes the caller."""
        if self._watch_quiet:
            return
        self._watch_quiet = True
        reactor = self.reactor
        self._unwatch_threads()
        if self._pidfd is not None and not self._pidfd_fired:
            reactor.remove_reader(self._pidfd)
            self._exit_watch_paused = True
        reactor.call_later(_EXIT_REPORT_DELAY, self._after_notice)

    def _after_notice(self) -> None:
        """Reactor thread, a moment after the notice: watch the exit again (already there,
        usually: it is reaped at once)."""
        if self._exit_watch_paused:
            self._exit_watch_paused = False
            if self._pidfd is not None:  # (None: ``force_close`` reaped it meanwhile)
                self.reactor.add_reader(self._pidfd, self._on_pidfd)

    def _shut_channel(self) -> None:
        """Shut the channel down (any thread), which wakes a thread blocked reading it with
        EOF (the replies), and makes the worker read EOF and our writes fail (the requests);
        never after ``dispose`` closed it."""
        with self._sock_lock:
            if self._disposed:
                return
            for end in (self.reply_sock, self.sock):
                if end is not None:
                    try:
                        end.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def _poll_exit(self) -> None:  # pragma: no cover - fallback without pidfd
        assert self.popen is not None
        rc = self.popen.poll()
        if rc is None:
            self.reactor.call_later(0.02, self._poll_exit)
        else:
            self._reaped(rc)

    @staticmethod
    def _await_exit(pid: int, timeout: float) -> bool:
        """Caller thread: wait up to ``timeout`` for ``pid`` (our child, not yet reaped) to
        exit, on a pidfd of our own (never the reactor's, which it may close at any moment).
        The channel's EOF comes when the dying process closes its descriptors, a moment
        before it becomes a zombie; a core dump widens that gap."""
        pidfd_open = getattr(os, "pidfd_open", None)
        if pidfd_open is None:  # pragma: no cover - kernels without pidfd
            return False
        try:
            fd = pidfd_open(pid)
        except OSError:  # reaped meanwhile (by the reactor)
            return False
        try:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return bool(poller.poll(timeout * 1000))
        finally:
            os.close(fd)

    def _reaped(self, returncode: int) -> None:
        with self._exit_lock:
            if self.returncode is not None:
                return  # reported already (collect_exit on the caller, or the reactor)
            self.returncode = returncode
        if self._escalation is not None:
            self._escalation.cancel()
        self._worker_blocks_orphaned(exited=True)
        # Survivors of the group (the worker's own children) go with it.
        self._signal_group(signal.SIGKILL)
        # Report before waking waiters, so a caller that waited for the exit sees the pool's
        # bookkeeping (gate, breaker) already up to date.
        self._on_exit(self)
        with self._exit_lock:
            self._exit_reported = True
        self._end_output()
        self.exited.set()
        # Descendants that left the group (setsid) carry the generation's mark. Found by a
        # scan of /proc (about 10 us a process, over a millisecond on a busy machine) that
        # holds the GIL between its reads: run at once, it kept the caller whose call the crash
        # failed from waking (measured: the crash reached the caller after the scan, about
        # 1.2 ms late). A short timer lets the reactor block in select first, so the caller
        # raises before the scan starts; pool close runs a scan still due (force_close).
        if os.getpid() == self._owner_pid:
            if self.reactor.running:  # call_later is safe from a caller (collect_exit)
                with _due_scans_lock:
                    _due_scans.add(self)
                self._marked_scan = self.reactor.call_later(
                    _MARKED_SCAN_DELAY, self._kill_marked_descendants
                )
            else:
                self._kill_marked_descendants()

    def _kill_marked_descendants(self) -> None:
        with _due_scans_lock:
            _due_scans.discard(self)
        self._marked_scan = None
        kill_marked(WORKER_ID_VAR, self.worker_id)

    def _maybe_finished(self) -> None:
        """Once the process is reaped (and reported) *and* its output drained, report it
        (exit code and last output lines are final then); once, on either thread."""
        with self._exit_lock:
            if self._finished or not self._exit_reported or not self._output_closed:
                return
            self._finished = True
        self._on_finished(self)

    def _close_pipes(self) -> None:
        """Reactor thread (or no reactor): stop reading the output pipes and close both our
        ends of each. Idempotent."""
        with self._output_lock:  # never under a thread draining them
            for _stream, pipe in self._streams():
                if pipe is not None and not pipe.closed:
                    if self.popen is not None:
                        self.reactor.remove_reader(pipe)
                    pipe.close()
            held, self._held_ends = self._held_ends, []
            for fd in held:
                os.close(fd)

    def _close_output(self) -> None:
        """The output ends here: after the reaping (``_end_output``), or at pool close even if
        the worker was not reaped (``force_close``). The descriptors are closed on the reactor
        thread, which owns the selector."""
        self._finish_lines()
        with self._output_lock:
            self._output_closed = True
        self._maybe_finished()
        self.output_done.set()
        if self.reactor.running and not self.reactor.in_reactor_thread():
            self.reactor.call_soon(self._close_pipes)
        else:
            self._close_pipes()

    # ---- stopping ----

    def _signal_group(self, sig: int) -> None:
        if self.popen is None or os.getpid() != self._owner_pid:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self, stop: Stop) -> None:
        """Stop the process group. Idempotent.

        ``ASK`` sends SHUTDOWN (the worker runs its release hooks and exits; only for a worker
        nobody is talking to); ``TERMINATE`` sends SIGTERM; both escalate to SIGKILL after
        ``kill_grace``. ``KILL`` is SIGKILL at once. All but ``ASK`` also shut the channel down,
        which wakes a thread blocked reading it."""
        self._kill_requested = True
        if self._dying:
            return  # its exit status is known: nothing of it is left to stop or wake
        if stop is not Stop.ASK:
            self._shut_channel()
        if self.popen is None or self.exited.is_set():
            return
        if stop is Stop.KILL or self.config.kill_grace <= 0:
            self._signal_group(signal.SIGKILL)
            return
        if stop is Stop.ASK:
            try:
                assert self.sock is not None
                self.sock.send(
                    encode_header(FrameType.SHUTDOWN, 0, 0), socket.MSG_DONTWAIT | MSG_NOSIGNAL
                )
            except (OSError, AssertionError):
                self._signal_group(signal.SIGTERM)
        else:
            self._signal_group(signal.SIGTERM)
        if self.reactor.running and self._escalation is None:
            self._escalation = self.reactor.call_later(
                self.config.kill_grace, lambda: self._signal_group(signal.SIGKILL)
            )

    def idle_channel_state(self) -> str:
        """Before a call: ``"quiet"`` if nothing is waiting on the idle channel (the normal
        case: one ``poll`` syscall), ``"closed"`` if the worker hung up, ``"dirty"`` if it
        wrote something nobody asked for (a stray thread, garbage): such a worker must not get
        the call, or its bytes would be taken for the reply."""
        reader = self.reader
        assert reader is not None and self.reply_sock is not None
        if reader.quiet():
            return "quiet"
        if reader.buffered:
            return "dirty"
        try:
            peek = self.reply_sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return "quiet"
        except OSError:
            return "closed"
        return "dirty" if peek else "closed"

    def ping(self, timeout: float) -> bool:
        """Health check of an idle worker: PING, then PONG within ``timeout`` seconds."""
        assert self.sock is not None and self.reader is not None
        try:
            self.sock.sendall(encode_header(FrameType.PING, 0, 0), MSG_NOSIGNAL)
            ftype, _, _, _ = self.read_frame(time.monotonic() + timeout)
        except (OSError, ChannelClosed, FrameError):
            return False
        return ftype == FrameType.PONG

    def send_cancel(self, call_id: int) -> bool:
        """Ask the worker to stop call ``call_id`` (any thread; never blocks). False if the
        frame could not be written (the worker is gone; the grace timer settles it)."""
        with self._cancel_lock:
            fd = self._cancel_fd
            if fd is None:
                return False
            try:
                # 20 bytes, under PIPE_BUF: written whole or not at all. A pipe takes no
                # MSG_NOSIGNAL: a worker gone is EPIPE here, never SIGPIPE (``_sigpipe``).
                frame = encode_header(FrameType.CANCEL, call_id, 0)
                return _sigpipe.write(fd, frame) == HEADER_SIZE
            except OSError:
                return False

    def release_refs(self, ref_ids: list[int]) -> None:
        """Tell the worker to drop kept objects (no reply)."""
        assert self.sock is not None
        payload = pickle.dumps(ref_ids, protocol=5)
        self.sock.sendall(
            encode_header(FrameType.RELEASE_REFS, 0, len(payload)) + payload, MSG_NOSIGNAL
        )

    def release_refs_now(self, ref_ids: list[int]) -> bool:
        """Tell the idle worker to drop kept objects, without blocking (the background
        release, ``_policies.release_idle``: its caller holds the entry's lock and the slot is
        idle and not leased, so nothing else writes on the channel). True if the frame went
        out whole, or if the worker is gone (its objects went with it; its exit retires it);
        False if nothing could be written now (the channel is full: a stopped worker).
        ``PartialSend`` if only part of it went out (the stream is torn)."""
        sock = self.sock
        if sock is None or self._dying:
            return True
        payload = pickle.dumps(ref_ids, protocol=5)
        frame = encode_header(FrameType.RELEASE_REFS, 0, len(payload)) + payload
        try:
            sent = sock.send(frame, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        if sent != len(frame):
            raise PartialSend(f"{sent} of a {len(frame)}-byte release frame written")
        return True

    def wait_exit(self, timeout: float) -> int | None:
        """The return code once the process is reaped, or None if it is still running."""
        popen = self.popen
        if popen is None or self.reactor.running:
            return self.returncode if self.exited.wait(timeout) else None
        # The reactor, which reaps, has ended (or was stopped): this thread reaps instead.
        try:
            returncode = popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reaped(returncode)
        return self.returncode

    def wait_output(self, timeout: float) -> None:
        self.output_done.wait(timeout)

    def dispose(self) -> None:
        """Close the host's channel sockets and release its shared memory. Only when no thread
        uses them any more."""
        with self._sock_lock:
            if self._disposed:
                return
            self._disposed = True
            self._close_channel()
            fds, self._thread_fds = self._thread_fds, []
            if self._stat_fd is not None:
                fds.append(self._stat_fd)
                self._stat_fd = None
        if fds:
            reactor = self.reactor
            if reactor.running and not reactor.in_reactor_thread():
                # Unwatched (if still watched) and closed on the reactor thread, which owns
                # the selector: never a descriptor number closed while still registered.
                reactor.call_soon(functools.partial(self._close_thread_fds, fds))
            else:
                self._close_thread_fds(fds)
        self._close_cancel_pipe()
        self._release_shm()

    def _close_thread_fds(self, fds: list[int]) -> None:
        """Reactor thread (or none running): stop watching ``fds`` and close them."""
        for fd in fds:
            if self.reactor.running:
                self._unwatch_thread(fd)
            os.close(fd)
        self._watched_fds.difference_update(fds)

    def _close_cancel_pipe(self) -> None:
        with self._cancel_lock:
            fd, self._cancel_fd = self._cancel_fd, None
        if fd is not None:
            os.close(fd)

    def _release_shm(self) -> None:
        """Unlink our argument blocks, close mappings of the worker's blocks, and unlink the
        worker's blocks by name prefix (a dead worker cannot unlink its own)."""
        if self.blocks is not None:
            self.blocks.destroy_all()  # a spare still being made is destroyed when done
            with self._loans_lock:
                spares, self._spares = self._spares, []
            for thread in spares:
                thread.join()
        if self.mappings is not None:
            self.mappings.close_all()
        self._worker_blocks_orphaned(disposed=True)

    def _worker_blocks_orphaned(self, exited: bool = False, disposed: bool = False) -> None:
        """Unlink the blocks the worker created (pinned replies, its pool) once it has exited
        *and* the host is done with it: a caller may still have to open the block of a
        complete reply the worker wrote just before it died. Whichever comes last unlinks."""
        with self._orphan_lock:
            self._exit_seen |= exited
            self._dispose_seen |= disposed
            due = self._exit_seen and self._dispose_seen and not self._orphans_unlinked
            if due:
                self._orphans_unlinked = True
        if due and self.pid is not None and self.blocks is not None:
            shm.unlink_blocks(f"{shm.NAME_PREFIX}{host_id()}-w{self.pid}-")

    def _close_channel(self) -> None:
        """Close both of the host's channel sockets (kept as closed objects: ``fileno()``
        reads -1)."""
        for end in (self.sock, self.reply_sock):
            if end is not None:
                end.close()

    def abandon_in_forked_child(self) -> None:
        """In a forked child: close this process's inherited descriptors; never signal it."""
        self._disposed = True
        self._kill_requested = True
        self._close_channel()
        self._close_cancel_pipe()
        for _stream, pipe in self._streams():
            if pipe is not None:
                pipe.close()
        held, self._held_ends = self._held_ends, []
        for fd in held:
            os.close(fd)
        popen = self.popen
        if popen is not None:
            popen.returncode = 0  # not our child: never wait for it here
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        fds, self._thread_fds = self._thread_fds, []
        self._watched_fds.clear()  # (the reactor thread does not exist here)
        if self._stat_fd is not None:
            fds.append(self._stat_fd)
            self._stat_fd = None
        for fd in fds:
            os.close(fd)

    def force_close(self) -> None:
        """Last resort at pool close: release pipes and pidfd even if something still holds
        the other ends (a grandchild that escaped the process group). Reactor thread only."""
        popen = self.popen
        if popen is None:
            return
        self._close_output()
        if self._pidfd is not None:
            self.reactor.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self._unwatch_threads()
        if not self.exited.is_set():
            try:
                rc = popen.wait(0.5)
            except subprocess.TimeoutExpired:
                return
            self._reaped(rc)
        # The reactor stops next and its timers never fire: run every scan still due on it,
        # this generation's and those of earlier generations the pool no longer lists.
        with _due_scans_lock:
            due = [p for p in _due_scans if p.reactor is self.reactor]
        for process in due:
            scan = process._marked_scan
            if scan is not None:
                scan.cancel()
            process._kill_marked_descendants()


def python_mismatch(process: WorkerProcess) -> str | None:
    """Why a by-value callable cannot go to this worker, or None if it can."""
    env_version = process.python_version[:2]
    if env_version == tuple(sys.version_info[:2]):
        return None
    return (
        f"env {process.spec.key} runs Python {'.'.join(map(str, env_version))}, the host "
        f"{sys.version_info[0]}.{sys.version_info[1]}: a function sent by value (a lambda, a "
        "closure, or one defined in __main__) only loads in the same Python version; pass it "
        "as 'package.module:function' instead"
    )
