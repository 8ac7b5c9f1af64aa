"""Mechanism: launch a worker process; the facade over its channel and its exit watch.

Nothing here decides policy. ``WorkerProcess`` does what the pool's gate tells it (kill,
dispose) and reports what it sees (exit, EOF, bad frames) back as facts. It owns three parts,
each watching one thing, and wires them together:

    ``_channel.Channel``          the host end of the channel: requests, replies, the cancel
                                  pipe, shared-memory loans (the per-call path)
    ``_exitwatch.ExitWatch``      pidfd, named threads' pidfds, reaping once, status at EOF,
                                  signals to the process group
    ``_outputpipes.OutputPipes``  stdout, stderr and the log pipe, read into ``log``

and ``_handshake`` runs HELLO -> CONFIG -> READY and the canary. The channel's per-call
methods (``send_request``, ``read_frame``, ``open_reply``, ``finish_request``,
``idle_channel_state``...) are the channel's own bound methods, set on the facade in
``__init__``: a call pays no extra Python frame for the facade. ``process.channel`` is the
channel itself (a Ray generation has none).

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
the peer reads what it wrote on the other (see ``_open_descriptors``).

Stopping: ``kill`` signals the whole process group (a launcher wrapper such as ``pixi run`` and
its interpreter alike), SIGTERM then SIGKILL after the grace period, or SIGKILL at once; it also
shuts the channel down so a thread blocked reading it wakes with EOF. Closing the channel's
sockets is ``dispose``, which the pool calls only when no caller holds them, so a descriptor
number is never closed under a thread that still reads it.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from comfy_env_worker import shm
from comfy_env_worker.protocol import FrameReader

from . import _handshake
from ._channel import Channel
from ._exitwatch import WORKER_ID_VAR, ExitWatch
from ._generation import Birth, GenerationFacts
from ._handshake import GO as GO  # (re-exported: BOOT's byte)
from ._handshake import SERIALS
from ._handshake import TOO_OLD_EXIT as TOO_OLD_EXIT  # (re-exported: BOOT's exit code)
from ._identity import HOST_ID_VAR, host_id
from ._lifecycle import Stop
from ._logs import WorkerLog
from ._memlimit import WorkerMemory
from ._outputpipes import OutputPipes
from ._reactor import ReactorFailed
from ._rundir import runtime_root as runtime_root  # (re-exported: tests import it from here)
from ._runtime_store import RuntimeDir as RuntimeDir  # (re-exported for the pool and backends)
from ._settings import Settings

if TYPE_CHECKING:
    from ._activation import Activation

# The first line parses under any Python (2.7 included) and refuses one older than 3.8 with a
# recognisable exit code, before the runtime (which needs 3.8) is imported. Then the worker
# waits for GO, the one byte the host writes on the channel once the runtime dir is complete
# (``RuntimeDir``): the first worker's interpreter starts while the host fills the dir. No GO
# (the host closed the channel first) is a quiet exit. The runtime dir takes the place of the
# ``''`` entry ``-c`` puts first in ``sys.path`` (the worker's cwd must not shadow the runtime),
# or goes before the rest where there is none (``PYTHONSAFEPATH``, ``-P``): overwriting the
# first entry then would drop a stdlib entry (the zip).
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


class _ChildEnds(NamedTuple):
    """The descriptors the worker inherits (the host closes its copies after the fork)."""

    sock: socket.socket  # its end of the requests
    reply_sock: socket.socket  # its end of the replies
    stdout: int  # write ends of its output pipes (the host keeps them until the reaping)
    stderr: int
    log: int
    cancel: int  # read end of the cancel pipe


_Hooks = tuple["Callable[[], None] | None", "Callable[[WorkerProcess], None] | None"]


class WorkerProcess(GenerationFacts):
    """One launched worker process of generation ``generation``: a facade over its
    ``channel``, its exit ``watch`` and its output ``pipes`` (see the module docstring).
    (``death_detail`` stays None: exit codes say it all here.)"""

    def __init__(self, birth: Birth) -> None:
        super().__init__(birth)
        spec, generation, config, reactor = self.spec, self.generation, self.config, self.reactor
        on_exit, on_finished = birth.on_exit, birth.on_finished
        self.startup_seconds = 0.0
        self.log = WorkerLog(spec.key, spec.name, generation, config.stderr_tail_lines)
        # The channel's ends, set once at launch and never replaced (read on every call).
        self.sock: socket.socket | None = None
        self.reply_sock: socket.socket | None = None
        self.reader: FrameReader | None = None
        # The memory cgroup leaf and OOM evidence of this generation (``_memlimit``), made at
        # launch; the exit watch keeps its counters at the reaping and removes the leaf.
        self.memory: WorkerMemory | None = None
        self.worker_id = f"{host_id()}-w{next(SERIALS)}"  # marks the generation's processes
        self.channel = channel = Channel(spec.key, config, self.log)
        self.pipes = pipes = OutputPipes(self.log, reactor)
        reports = (functools.partial(on_exit, self), functools.partial(on_finished, self))
        self.watch = watch = ExitWatch(reactor, channel, pipes, self.worker_id, reports)
        self.exited = watch.exited  # (the same event)
        self.output_done = pipes.done  # reaped, and its output read to the end
        # The per-call methods are the channel's own (no extra frame on a call's path).
        self.read_frame = channel.read_frame
        self.send_request = channel.send_request
        self.open_reply = channel.open_reply
        self.finish_request = channel.finish_request
        self.idle_channel_state = channel.idle_channel_state
        self.ping = channel.ping
        self.send_cancel = channel.send_cancel
        self.release_refs = channel.release_refs
        self.request_unread = channel.request_unread
        # What a caller whose read saw the EOF asks the exit watch.
        self.status_at_eof = watch.status_at_eof
        self.collect_exit = watch.collect_exit
        self.wait_exit = watch.wait_exit
        self.force_close = watch.force_close

    def wait_output(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the worker's output to end (it ends after the
        reaping); at once for a worker never launched: it has no output to wait for."""
        if self.watch.popen is not None:
            self.pipes.wait(timeout)

    # ---- facts read through the parts ----

    @property
    def python_version(self) -> tuple[int, ...]:
        return tuple(self.hello.get("python", ()))

    @property
    def popen(self) -> subprocess.Popen[bytes] | None:
        return self.watch.popen

    @property
    def returncode(self) -> int | None:
        return self.watch.returncode

    @property
    def noticed_status(self) -> int | None:
        """The exit status read when a named thread's end shut the channel down."""
        return self.watch.noticed_status

    @property
    def exit_noticed(self) -> bool:
        """Whether a named thread's end shut the channel down."""
        return self.watch.exit_noticed

    @property
    def shm_state(self) -> str:
        """``"on"``, ``"off"`` or ``"unavailable"`` (see ``_channel.Loans``)."""
        return self.channel.loans.shm_state

    @property
    def blocks(self) -> shm.BlockPool | None:
        return self.channel.loans.blocks

    @property
    def mappings(self) -> shm.PeerMappings | None:
        return self.channel.loans.mappings

    # ---- launch and handshake ----

    def launch(
        self,
        before_launch: Callable[[], None] | None = None,
        after_launch: Callable[[WorkerProcess], None] | None = None,
        activation: Activation | None = None,
    ) -> int:
        """Start the process on the reactor thread and begin watching it; returns its pid.

        ``before_launch`` runs on the reactor thread just before the fork and may raise to
        refuse it (the pool refuses once it is closing); ``after_launch`` runs right after, on
        the same thread, so the pool registers the process before anything can stop the
        reactor. ``activation``: the env's, worked out by the pool beforehand (never here:
        its scripts must not run on the reactor thread)."""
        environment = worker_environment(self.config, self.worker_id, activation)
        try:
            self.memory = self.watch.memory = WorkerMemory(self.config.memory_limit)
        except OSError as exc:  # the hierarchy is usable, but no leaf could be made now
            raise self.start_error(
                f"cannot give a worker of env {self.spec.key} its memory limit "
                f"(PoolConfig.memory_limit): making its memory cgroup failed: {exc}"
            ) from exc
        environment.update(self.memory.worker_variables())
        child = self._open_descriptors()
        try:
            try:
                self.reactor.run_sync(
                    functools.partial(
                        self._start, child, environment, (before_launch, after_launch)
                    )
                )
            except (OSError, ReactorFailed) as exc:
                raise self.start_error(
                    f"cannot launch {self.spec.interpreter} for env {self.spec.key}: {exc}"
                ) from exc
        except BaseException:
            self.dispose()
            if self.popen is None:  # nothing forked, so the reactor never took the pipes
                self.pipes.close_pipes()
                self.memory.release()  # an empty leaf
            raise
        finally:
            child.sock.close()  # the worker holds the only other ends now
            child.reply_sock.close()
            os.close(child.cancel)
        popen = self.watch.popen
        assert popen is not None  # (forked: ``_start`` ran without raising)
        return popen.pid

    def _open_descriptors(self) -> _ChildEnds:
        """Both socketpairs and the four pipes; the host's ends go to the channel and the
        output pipes. Raises ``WorkerStartError`` (with nothing kept) when out of descriptors.
        """
        # One socketpair per direction, never one for both: a Unix stream socket wakes every
        # thread asleep on it when the bytes it *sent* are read (the "write space" wake-up,
        # whatever the sleeper waits for), so on one socket each call woke its caller, asleep
        # in ``recv`` for the reply, the moment the worker read the request, and the worker
        # likewise when the caller read the reply: about one context switch more per call on
        # one CPU (2.9-3.0 a call on a shared socket, 2.0 on split ones), and wake-ups of the
        # other CPU for nothing across (benchmarks/HISTORY.md, tenth round).
        ends: list[socket.socket] = []
        pipes: list[int] = []
        try:
            for _ in range(2):
                ends.extend(socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM))
            # stdout, stderr and the log pipe (records between calls, see
            # comfy_env_worker.logs). The host keeps their write ends open until it has reaped
            # the worker: a dying worker's pipes then never reach EOF, so the reactor thread is
            # not woken by the death three times over at the moment the caller whose call it
            # failed wakes (it cost crash detection about 0.2 ms). The exit is the pidfd's
            # news; the output ends at the reaping (``OutputPipes.end``), and a descendant that
            # escaped the group cannot hold it open.
            # And the cancel pipe: CANCEL frames, read by the worker's watchdog while its main
            # thread runs the call. All made here, so that a host out of descriptors gets the
            # typed error below whichever of them fails, and nothing of them kept.
            for _ in range(4):
                pipes.extend(os.pipe())
        except OSError as exc:  # out of descriptors (EMFILE/ENFILE)
            for fd in pipes:
                os.close(fd)
            for end in ends:
                end.close()
            raise self.start_error(
                f"cannot create the channel to a worker of env {self.spec.key}: {exc} (is the "
                "host out of file descriptors? see ulimit -n)"
            ) from exc
        parent_sock, child_sock, reply_sock, child_reply_sock = ends
        out_read, out_write, err_read, err_write, log_read, log_write = pipes[:6]
        cancel_read, cancel_write = pipes[6:]
        self.pipes.open((out_read, err_read, log_read), [out_write, err_write, log_write])
        self.channel.open(parent_sock, reply_sock, cancel_write)
        self.sock, self.reply_sock, self.reader = parent_sock, reply_sock, self.channel.reader
        return _ChildEnds(
            child_sock, child_reply_sock, out_write, err_write, log_write, cancel_read
        )

    def _start(
        self, child: _ChildEnds, environment: dict[str, str], hooks: _Hooks
    ) -> subprocess.Popen[bytes]:
        """Reactor thread: fork the worker (unless stopped or refused first) and watch it."""
        before_launch, after_launch = hooks
        if self.watch.kill_requested:
            raise self.stopped_before_launch()
        if before_launch is not None:
            before_launch()
        cwd = self.config.cwd
        if cwd is not None and not os.path.isdir(cwd):
            # Popen's FileNotFoundError names no field and reads like a missing interpreter.
            raise self.start_error(
                f"cannot launch a worker for env {self.spec.key}: its cwd {cwd!r} "
                "(PoolConfig.cwd) is not an existing directory"
            )
        child_fd, child_reply_fd = child.sock.fileno(), child.reply_sock.fileno()
        argv = [self.spec.interpreter, "-c", BOOT, self.runtime_dir.path, str(child_fd)]
        argv += [str(os.getpid()), str(child.log), str(child.cancel), str(child_reply_fd)]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=child.stdout,
            stderr=child.stderr,
            pass_fds=(child_fd, child.log, child.cancel, child_reply_fd),
            close_fds=True,
            start_new_session=True,
            env=environment,
            cwd=cwd,
        )
        self._adopt(proc)
        # The launched process's pid until the hello names the interpreter's own (they
        # differ only behind a wrapper script): set before the watch starts reading its
        # output, so what it says before its hello (a broken env's interpreter) is printed
        # and logged with a pid, not ``pid=None``.
        self.log.pid = proc.pid
        self.watch.watch(proc)
        if after_launch is not None:
            after_launch(self)
        if self.watch.kill_requested:  # kill() ran while Popen was forking
            self.watch.signal_group(signal.SIGKILL)
        return proc

    def _adopt(self, proc: subprocess.Popen[bytes]) -> None:
        """Move the fresh worker into its memory cgroup leaf, if it has one: before the GO
        byte (the handshake sends it), so nothing of the env's runs outside the leaf."""
        leaf = self.memory.leaf if self.memory is not None else None
        if leaf is None:
            return
        try:
            leaf.adopt(proc.pid)
        except OSError as exc:
            proc.kill()
            proc.wait()
            raise self.start_error(
                f"cannot move a worker of env {self.spec.key} into its memory cgroup "
                f"{leaf.path}: {exc}"
            ) from exc

    def handshake(self, deadline: float) -> None:
        """HELLO -> CONFIG -> READY, then the canary (``_handshake``). Raises
        ``WorkerStartError``."""
        _handshake.handshake(self, deadline)

    # ---- stopping ----

    def kill(self, stop: Stop) -> None:
        """Stop the process group. Idempotent.

        ``ASK`` sends SHUTDOWN (the worker runs its release hooks and exits; only for a worker
        nobody is talking to); ``TERMINATE`` sends SIGTERM; both escalate to SIGKILL after
        ``kill_grace``. ``KILL`` is SIGKILL at once. All but ``ASK`` also shut the channel down,
        which wakes a thread blocked reading it."""
        watch = self.watch
        watch.kill_requested = True
        if watch.dying:
            return  # its exit status is known: nothing of it is left to stop or wake
        if stop is not Stop.ASK:
            self.channel.shut()
        if watch.popen is None or watch.exited.is_set():
            return
        if stop is Stop.KILL or self.config.kill_grace <= 0:
            watch.signal_group(signal.SIGKILL)
            return
        if stop is not Stop.ASK or not self.channel.ask_shutdown():
            watch.signal_group(signal.SIGTERM)
        watch.escalate(self.config.kill_grace)

    def release_refs_now(self, ref_ids: list[int]) -> bool:
        """Tell the idle worker to drop kept objects, without blocking (the background
        release, ``_policies.release_idle``: its caller holds the entry's lock and the slot is
        idle and not leased, so nothing else writes on the channel). True if the frame went
        out whole, or if the worker is gone (its objects went with it; its exit retires it);
        False if nothing could be written now (the channel is full: a stopped worker).
        ``PartialSend`` if only part of it went out (the stream is torn)."""
        if self.watch.dying:
            return True
        return self.channel.release_refs_now(ref_ids)

    def dispose(self) -> None:
        """Close the host's channel sockets and release its shared memory. Only when no thread
        uses them any more."""
        channel = self.channel
        with channel.lock:
            if channel.disposed:
                return
            channel.disposed = True
            channel.close_sockets()
            fds = self.watch.threads.take_fds()
        self.watch.threads.close_fds(fds)
        channel.close_cancel_pipe()
        channel.release_shm()

    def abandon_in_forked_child(self) -> None:
        """In a forked child: close this process's inherited descriptors; never signal it."""
        self.channel.abandon()
        self.pipes.abandon()
        self.watch.abandon()
