"""Mechanism: watch one worker process's exit, reap it once, and signal its process group.

Data flow (all facts, no policy: what a death means is the pool's gate's business):

    pidfd readable (reactor)      ``_on_pidfd`` -> ``_reap`` a moment later -> ``_reaped``:
                                  returncode, survivors of the group SIGKILLed, ``on_exit``,
                                  output ended (``OutputPipes.end``), ``exited`` set, then the
                                  scan for the generation's marked descendants on a timer
    a named thread ends (reactor) ``_on_thread_exit`` -> ``_notice_exit``: the process is
                                  exiting (``exiting_status``): ``noticed_status`` and the
                                  channel shut down, so the caller's read ends at once
    a caller's long read          ``_reader_alarm`` (set on the channel's reader): the same
                                  check on the caller's own thread
    the caller's read saw EOF     ``status_at_eof`` (peek, never reap), then ``collect_exit``
                                  (reap here if the exit is already there)
    output ended and reported     ``maybe_finished`` -> ``on_finished`` (once)

The reactor watches a pidfd (exit, reaped at once so no zombie lingers) and the worker's two
named threads (``_watchdog``: thread pidfds, Linux 6.9+). A killed worker's descriptors
close, and its channel reaches EOF, only after the kernel has freed its memory; its other
threads end first. When a named thread has ended and the main thread is exiting, the reactor
shuts the channel down, so the caller's read ends at once. A caller whose wait for a reply
has lasted ``_channel._ALARM_AFTER`` watches the same pidfds itself: it need not wait for the
reactor to be scheduled. The thread pidfds are closed with the channel (``WorkerProcess.
dispose``); the reactor only stops watching them. Once the death is known the reactor goes
quiet until the caller is done (``ThreadWatch._quiet``).

Races it prevents: the exit is reported once (``_exit_lock``) by whichever thread gets there
first (the reactor or the caller in ``collect_exit``); descriptors (pidfd, thread pidfds) are
closed only on the reactor thread, which owns the selector; the reactor reports an exit a
moment after reaping it (``_EXIT_REPORT_DELAY``), and scans for descendants later still
(``_MARKED_SCAN_DELAY``), so the caller whose call the crash failed writes its report first
instead of trading the GIL with the reactor at each system call. A forked copy of this object
never signals (``owner_pid``).
"""

from __future__ import annotations

import functools
import os
import select
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from ._descendants import kill_marked
from ._outputpipes import OutputPipes
from ._reactor import Reactor
from ._watchdog import named_threads, thread_pidfd

if TYPE_CHECKING:
    from ._channel import Channel
    from ._memlimit import WorkerMemory

WORKER_ID_VAR = "COMFY_ENV_WORKER_ID"
# Seconds a caller whose read saw the worker's EOF waits for the exit itself (collect_exit)
# before it leaves the rest to the reactor; a closed channel means the exit is moments away.
_COLLECT_WAIT = 0.1
# Seconds from a worker's exit (its pidfd) to the reactor's reaping and report (see _on_pidfd).
_EXIT_REPORT_DELAY = 0.002
# Seconds from a worker's exit to the scan for its marked descendants (see _reaped), and the
# watches whose scan is still due (any pool's; run at the latest by force_close at close).
_MARKED_SCAN_DELAY = 0.005
_due_scans: set[ExitWatch] = set()
_due_scans_lock = threading.Lock()

# How far an exit's report got (``ExitWatch._report``), and the pidfd's watch on the reactor.
ExitReport = Literal["pending", "reaped", "reported", "finished"]
PidfdWatch = Literal["watched", "paused", "fired"]


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

    ``stat_fd``: that file, opened beforehand (``ThreadWatch.stat_fd``); read again from
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


def _await_exit(pid: int, timeout: float) -> bool:
    """Caller thread: wait up to ``timeout`` for ``pid`` (our child, not yet reaped) to exit,
    on a pidfd of our own (never the reactor's, which it may close at any moment). The
    channel's EOF comes when the dying process closes its descriptors, a moment before it
    becomes a zombie; a core dump widens that gap."""
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


class ExitWatch:
    """The exit of one worker process: its pidfd, its named threads' pidfds, the reaping
    (once), the status at EOF, and signals to its process group."""

    def __init__(
        self,
        reactor: Reactor,
        channel: Channel,
        pipes: OutputPipes,
        worker_id: str,
        reports: tuple[Callable[[], None], Callable[[], None]],
    ) -> None:
        self.reactor = reactor
        self.channel = channel  # shut down on a noticed exit; its lock guards the thread fds
        self.pipes = pipes
        self.worker_id = worker_id  # marks the generation's processes (see _descendants)
        # ``on_exit``: reaped (before waiters wake); ``on_finished``: reaped and output ended.
        self._on_exit, self._on_finished = reports
        pipes.on_closed = self.maybe_finished
        self.popen: subprocess.Popen[bytes] | None = None
        self.memory: WorkerMemory | None = None  # the generation's memory leaf (``_memlimit``)
        self.returncode: int | None = None
        self.exited = threading.Event()
        # The exit is reported once (``_reaped``, then ``maybe_finished``) by whichever thread
        # gets there first: the reactor (its pidfd) or the caller whose read saw the EOF
        # (``collect_exit``). How far the report got, under ``_exit_lock``: "reaped" (the
        # return code is set, ``on_exit`` runs), "reported" (it ran), "finished"
        # (``on_finished`` ran too, the output having ended).
        self._exit_lock = threading.Lock()
        self._report: ExitReport = "pending"
        self.dying = False  # its exit status was read before the reaping (status_at_eof)
        self.kill_requested = False
        self.owner_pid = os.getpid()  # a forked copy of this object must never signal
        self._pidfd: int | None = None
        # The pidfd's watch on the reactor (reactor thread only): "paused" while a noticed
        # death keeps it off for a moment, "fired" once its exit is seen (the reaping is due).
        self._pidfd_watch: PidfdWatch = "watched"
        # The exit status read when a named thread's end, with the process exiting, shut the
        # channel down (the kernel's final word: the caller need not read it); None until then.
        self.noticed_status: int | None = None
        self._escalation: Any = None
        # The scan for the generation's marked descendants, due shortly after the exit (see
        # _reaped); None once it ran or when none is due.
        self._marked_scan: Any = None
        self.threads = ThreadWatch(self)

    # ---- watching (reactor thread) ----

    def watch(self, popen: subprocess.Popen[bytes]) -> None:
        """Reactor thread, right after the fork: watch the output pipes and the exit."""
        self.popen = popen
        self.pipes.watch()
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
        if popen is None or os.getpid() != self.owner_pid:
            return None
        rc = self.noticed_status  # read by the reactor when it shut the channel down
        if rc is None:
            rc = _peek_exit(popen)
        if rc is None:
            rc = exiting_status(popen.pid)  # several times dearer than the peek
        if rc is None:
            return None
        self.dying = True  # ``kill`` has nothing left to signal until the reaping
        self.pipes.drain()
        self.pipes.finish_lines()
        return rc

    @property
    def exit_noticed(self) -> bool:
        """Whether a named thread's end shut the channel down (see ``_on_thread_exit``)."""
        return self.noticed_status is not None

    def collect_exit(self) -> None:
        """Caller thread, after its read of the channel saw the worker's EOF: reap the process
        and drain its output pipes here when the exit is already there, instead of waiting for
        the reactor thread to be scheduled, take the GIL, do it and wake us (a hand-off of two
        threads on a busy machine: most of what crash detection costs over a raw child's EOF).
        Whatever is not ready (the process still exiting, a descendant holding a pipe open)
        stays the reactor's, as before. Both threads may run this at once safely: the exit is
        reported once (``_exit_lock``; the pool's gate drops the second ``Exited`` anyway), a
        pipe is read by one thread at a time (``OutputPipes.lock``), and descriptors (pidfd,
        pipes) are closed only on the reactor thread, which owns the selector: the pidfd of a
        process reaped here stays readable, and the reactor's callback then finds the exit
        reported."""
        popen = self.popen
        if popen is None or self.exited.is_set() or os.getpid() != self.owner_pid:
            return
        if popen.poll() is None and not _await_exit(popen.pid, _COLLECT_WAIT):
            return
        if popen.poll() is None:
            return  # the reactor holds the wait (it reaps at this moment): leave it the rest
        assert popen.returncode is not None
        self._reaped(popen.returncode)  # drains the output too (``OutputPipes.end``)

    def _on_pidfd(self) -> None:
        if self._pidfd_watch != "watched" or self._pidfd is None:
            return  # unwatched by a callback of the same wake-up (``_notice_exit``)
        assert self.popen is not None
        self._pidfd_watch = "fired"
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
        self.threads.unwatch_all()
        self._reaped(self.popen.wait())

    @property
    def watching(self) -> bool:
        """Whether the exit's pidfd is open (not yet reaped here, nor closed)."""
        return self._pidfd is not None

    def pause(self) -> None:
        """Reactor thread, the death noticed: stop watching the pidfd until ``resume``."""
        if self._pidfd is not None and self._pidfd_watch == "watched":
            self.reactor.remove_reader(self._pidfd)
            self._pidfd_watch = "paused"

    def resume(self) -> None:
        """Reactor thread, a moment after the notice: watch the exit again (already there,
        usually: it is reaped at once)."""
        if self._pidfd_watch == "paused":
            self._pidfd_watch = "watched"
            if self._pidfd is not None:  # (None: ``force_close`` reaped it meanwhile)
                self.reactor.add_reader(self._pidfd, self._on_pidfd)

    def _poll_exit(self) -> None:  # pragma: no cover - fallback without pidfd
        assert self.popen is not None
        rc = self.popen.poll()
        if rc is None:
            self.reactor.call_later(0.02, self._poll_exit)
        else:
            self._reaped(rc)

    def _release_memory(self, tries: int) -> None:
        """Remove the generation's memory cgroup leaf; the kernel lets a killed process go a
        moment after its exit (and the group's survivors were just killed), so a busy leaf is
        tried again on the reactor every 50 ms for about 2 s, then left to the next host's
        sweep of the leaves of hosts that are gone."""
        memory = self.memory
        if memory is None or memory.release() or tries >= 40:
            return
        if self.reactor.running:
            self.reactor.call_later(0.05, lambda: self._release_memory(tries + 1))

    def _reaped(self, returncode: int) -> None:
        with self._exit_lock:
            if self._report != "pending":
                return  # reported already (collect_exit on the caller, or the reactor)
            self.returncode = returncode
            self._report = "reaped"
        if self._escalation is not None:
            self._escalation.cancel()
        self.channel.worker_blocks_orphaned(exited=True)
        # Survivors of the group (the worker's own children) go with it.
        self.signal_group(signal.SIGKILL)
        if self.memory is not None:
            self.memory.seal()  # the leaf's counters, before the leaf goes
            self._release_memory(0)
        # Report before waking waiters, so a caller that waited for the exit sees the pool's
        # bookkeeping (gate, breaker) already up to date.
        self._on_exit()
        with self._exit_lock:
            self._report = "reported"
        self.pipes.end()
        self.exited.set()
        # Descendants that left the group (setsid) carry the generation's mark. Found by a
        # scan of /proc (about 10 us a process, over a millisecond on a busy machine) that
        # holds the GIL between its reads: run at once, it kept the caller whose call the crash
        # failed from waking (measured: the crash reached the caller after the scan, about
        # 1.2 ms late). A short timer lets the reactor block in select first, so the caller
        # raises before the scan starts; pool close runs a scan still due (force_close).
        if os.getpid() == self.owner_pid:
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

    def maybe_finished(self) -> None:
        """Once the process is reaped (and reported) *and* its output drained, report it
        (exit code and last output lines are final then); once, on either thread."""
        with self._exit_lock:
            if self._report != "reported" or not self.pipes.closed:
                return
            self._report = "finished"
        self._on_finished()

    # ---- stopping ----

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (never from a forked copy)."""
        if self.popen is None or os.getpid() != self.owner_pid:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def escalate(self, grace: float) -> None:
        """SIGKILL the group ``grace`` seconds from now unless it is reaped first (once)."""
        if self.reactor.running and self._escalation is None:
            self._escalation = self.reactor.call_later(
                grace, lambda: self.signal_group(signal.SIGKILL)
            )

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

    def force_close(self) -> None:
        """Last resort at pool close: release pipes and pidfd even if something still holds
        the other ends (a grandchild that escaped the process group). Reactor thread only."""
        popen = self.popen
        if popen is None:
            return
        self.pipes.close()
        if self._pidfd is not None:
            self.reactor.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self.threads.unwatch_all()
        if not self.exited.is_set():
            try:
                rc = popen.wait(0.5)
            except subprocess.TimeoutExpired:
                return
            self._reaped(rc)
        # The reactor stops next and its timers never fire: run every scan still due on it,
        # this generation's and those of earlier generations the pool no longer lists.
        with _due_scans_lock:
            due = [w for w in _due_scans if w.reactor is self.reactor]
        for watch in due:
            scan = watch._marked_scan
            if scan is not None:
                scan.cancel()
            watch._kill_marked_descendants()

    def abandon(self) -> None:
        """In a forked child: close the inherited descriptors; never signal or wait."""
        self.kill_requested = True
        popen = self.popen
        if popen is not None:
            popen.returncode = 0  # not our child: never wait for it here
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self.threads.abandon()  # (the reactor thread does not exist here)


class ThreadWatch:
    """The worker's named threads (``_watchdog``): their pidfds, watched by the reactor and
    by a caller's long read, whose end with the process exiting is noticed before its EOF."""

    def __init__(self, owner: ExitWatch) -> None:
        self.exit = owner  # the process's exit: its status, its pidfd paused while quiet
        self.reactor = owner.reactor
        self.channel = owner.channel
        # Pidfds of the worker's named threads, whose end is the first sign of its death (see
        # ``_watchdog``), watched by the reactor and by a caller waiting for a reply (the
        # channel's reader). Closed with the channel (``WorkerProcess.dispose``: no caller
        # reads any more); the reactor only stops watching them (``_watched_fds``, reactor
        # thread only).
        self._fds: list[int] = []
        self._watched_fds: set[int] = set()
        self._thread_lookups = 0
        # ``/proc/<pid>/stat``, opened with the named threads' pidfds and closed with them: a
        # notice reads it again instead of opening it on the crash's path (``exiting_status``).
        self.stat_fd: int | None = None
        self._watch_quiet = False  # the death is known: no reader of it wakes the reactor

    # Seconds from CONFIG (sent) to the first lookup of the named threads (they name
    # themselves as they start, so usually before it), doubling between lookups; after the
    # last one, what was found is watched (nothing: the death is seen at its EOF).
    _THREAD_LOOKUP_DELAY = 0.005
    _THREAD_LOOKUPS = 7
    _NAMED_THREADS = 2  # the watchdog and the sentinel

    def watch_soon(self) -> None:
        """Once CONFIG is out: look the worker's named threads up a moment later."""
        if self.reactor.running:
            self.reactor.call_later(self._THREAD_LOOKUP_DELAY, self._watch_threads)

    def _watch_threads(self) -> None:
        """Reactor thread, once CONFIG is out: watch the worker's named threads (see
        ``_watchdog``), looked up again a little later until both have named themselves."""
        channel = self.channel
        owner = self.exit
        if not owner.watching or channel.pid is None or channel.disposed or owner.kill_requested:
            return  # exited (or reaped, or never watched), or on its way out
        tids = named_threads(channel.pid)
        self._thread_lookups += 1
        if len(tids) < self._NAMED_THREADS and self._thread_lookups < self._THREAD_LOOKUPS:
            delay = self._THREAD_LOOKUP_DELAY * 2 ** (self._thread_lookups - 1)
            self.reactor.call_later(delay, self._watch_threads)
            return
        with channel.lock:  # (``dispose`` closes them: never one opened after it)
            pid, reader = channel.pid, channel.reader
            if channel.disposed or self._fds or pid is None:
                return
            for tid in tids:
                fd = thread_pidfd(pid, tid)
                if fd is not None:
                    self._fds.append(fd)
            if not self._fds:
                return
            try:
                self.stat_fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
            except OSError:
                self.stat_fd = None  # read by path then (``exiting_status``)
            fds = list(self._fds)
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
        popen = self.exit.popen
        if popen is None or os.getpid() != self.exit.owner_pid:
            return False
        rc = exiting_status(popen.pid, self.stat_fd)  # (closed only by ``dispose``)
        if rc is None:
            return False
        self.exit.noticed_status = rc
        return True

    def unwatch_all(self) -> None:
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
        if self.exit.exit_noticed or self.exit.dying:
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
        owner = self.exit
        popen = owner.popen
        if popen is None or owner.exit_noticed or owner.dying or self.channel.disposed:
            return
        if owner.exited.is_set():  # reaped: nobody can be waiting for its EOF any more
            return
        rc = exiting_status(popen.pid, self.stat_fd)
        if rc is None:
            if rechecks < self._EXIT_RECHECKS:
                again = functools.partial(self._notice_exit, rechecks + 1)
                self.reactor.call_later(self._EXIT_RECHECK_DELAY, again)
            return
        owner.noticed_status = rc
        self._quiet()
        self.channel.shut()

    def _quiet(self) -> None:
        """Reactor thread, the death known: stop every reader of this worker that would wake
        this thread again (the named threads, the exit's pidfd) until ``ExitWatch.resume``, 2 ms
        later. A caller is writing its crash report now, and work here (closing descriptors,
        the exit's own wake-up a moment later) would trade the GIL with it at each system
        call (measured: 50-500 us added to a third of the crashes). Done before the shutdown
        that wakes the caller."""
        if self._watch_quiet:
            return
        self._watch_quiet = True
        self.unwatch_all()
        self.exit.pause()
        self.reactor.call_later(_EXIT_REPORT_DELAY, self.exit.resume)

    def take_fds(self) -> list[int]:
        """Under the channel's lock, at ``dispose``: the named threads' pidfds and the stat
        file, to be closed (``close_fds``); none is opened after this."""
        fds, self._fds = self._fds, []
        if self.stat_fd is not None:
            fds.append(self.stat_fd)
            self.stat_fd = None
        return fds

    def close_fds(self, fds: list[int]) -> None:
        """Stop watching ``fds`` and close them, on the reactor thread if one runs."""
        if not fds:
            return
        reactor = self.reactor
        if reactor.running and not reactor.in_reactor_thread():
            # Unwatched (if still watched) and closed on the reactor thread, which owns
            # the selector: never a descriptor number closed while still registered.
            reactor.call_soon(functools.partial(self._close_fds, fds))
        else:
            self._close_fds(fds)

    def _close_fds(self, fds: list[int]) -> None:
        """Reactor thread (or none running): stop watching ``fds`` and close them."""
        for fd in fds:
            if self.reactor.running:
                self._unwatch_thread(fd)
            os.close(fd)
        self._watched_fds.difference_update(fds)

    def abandon(self) -> None:
        """In a forked child: close the inherited pidfds (no reactor thread here)."""
        fds = self.take_fds()
        self._watched_fds.clear()
        for fd in fds:
            os.close(fd)
