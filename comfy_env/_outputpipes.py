"""Mechanism: a worker's stdout, stderr and log pipes, read into its ``WorkerLog``.

Data flow: ``WorkerProcess.launch`` makes the three pipes and hands their read ends here
(``open``), keeping their write ends open in ``held`` until the worker is reaped. The reactor
thread reads each pipe as it becomes readable (``watch``: one read a wake-up) and feeds the
log (a tail of recent lines for crash reports, forwarded to ``logging``). A caller whose call
a crash failed drains them itself (``drain``, one ``poll`` first) before it writes its crash
report. After the reaping, ``end`` reads what is left and ``close`` ends the output: the last
line without its newline counts (``finish_lines``), ``done`` is set, the owner is told
(``on_closed``), and the descriptors are closed on the reactor thread, which owns the
selector.

Races it prevents: one thread at a time reads a pipe (``lock``), so the tail keeps the order
of its lines; a descriptor is closed only on the reactor thread (or with no reactor), never
while it is registered with the selector or read by another thread. Holding the write ends
means a dying worker's pipes never reach EOF: the reactor is woken once by its death (the
pidfd), not three times more at the moment the caller whose call it failed wakes, and a
descendant that escaped the group cannot hold the output open. Nothing here decides policy.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from typing import Any

from ._logs import WorkerLog
from ._reactor import Reactor


def _nothing() -> None:
    pass


class OutputPipes:
    """The read ends of one worker's stdout, stderr and log pipes, and the write ends the host
    holds until the reaping."""

    def __init__(self, log: WorkerLog, reactor: Reactor) -> None:
        self.log = log
        self.reactor = reactor
        # One thread at a time reads an output pipe (the tail keeps the order of its lines);
        # the streams read to their end, whose pipes the reactor closes (it owns the selector).
        self.lock = threading.Lock()
        self.closed = False  # the output ended (``close``), under ``lock``
        self.done = threading.Event()  # reaped, and its output read to the end
        self.on_closed: Callable[[], None] = _nothing  # the exit watch's ``maybe_finished``
        self._stdout: Any = None
        self._stderr: Any = None
        self._log_pipe: Any = None
        self._held_ends: list[int] = []
        self._watched = False  # registered with the reactor (``watch``)

    def open(self, read_ends: tuple[int, int, int], held_ends: list[int]) -> None:
        """Take the read ends (stdout, stderr, log) and the write ends the host keeps open."""
        out_read, err_read, log_read = read_ends
        self._stdout = os.fdopen(out_read, "rb", buffering=0)
        self._stderr = os.fdopen(err_read, "rb", buffering=0)
        self._log_pipe = os.fdopen(log_read, "rb", buffering=0)
        self._held_ends = held_ends

    def streams(self) -> tuple[tuple[str, Any], ...]:
        return (("stdout", self._stdout), ("stderr", self._stderr), ("log", self._log_pipe))

    def watch(self) -> None:
        """Reactor thread, once the worker is forked: read each pipe as it becomes readable."""
        self._watched = True
        for stream, pipe in self.streams():
            os.set_blocking(pipe.fileno(), False)
            self.reactor.add_reader(pipe, self._make_pipe_reader(stream, pipe))

    def _make_pipe_reader(self, stream: str, pipe: Any) -> Callable[[], None]:
        fd = pipe.fileno()

        def on_readable() -> None:
            with self.lock:
                if pipe.closed:
                    return
                if self._read_locked(stream, fd, drain=False):
                    # EOF although we hold a write end: only after ``close_pipes`` began.
                    self.reactor.remove_reader(pipe)

        return on_readable

    def _read_locked(self, stream: str, fd: int, drain: bool) -> bool:
        """Under ``lock``: read what ``stream`` holds (one read, or until it would block when
        ``drain``) into the log. True at EOF."""
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

    def drain(self) -> None:
        """Read what the output pipes hold now, on this thread (until they would block). One
        ``poll`` first, so a pipe with nothing in it (the usual case) costs no read: on a
        crash this runs while the reactor wakes, and each system call hands it the GIL."""
        with self.lock:
            streams = {
                pipe.fileno(): stream
                for stream, pipe in self.streams()
                if pipe is not None and not pipe.closed
            }
            if not streams:
                return
            poller = select.poll()
            for fd in streams:
                poller.register(fd, select.POLLIN)
            for fd, _events in poller.poll(0):
                self._read_locked(streams[fd], fd, drain=True)

    def finish_lines(self) -> None:
        """The output is complete (the worker has exited): a last line without its newline
        is a line too. (The pipes never reach EOF, which used to tell this: see ``launch``.)"""
        with self.lock:
            self.log.finish_native("stdout")
            self.log.finish_native("stderr")

    def end(self) -> None:
        """After the reaping (any thread): read what is left; the output is complete then
        (a descendant still writing is being killed with the group). The descriptors are
        closed on the reactor thread, which owns the selector."""
        self.drain()
        self.close()

    def close(self) -> None:
        """The output ends here: after the reaping (``end``), or at pool close even if the
        worker was not reaped (``ExitWatch.force_close``). The descriptors are closed on the
        reactor thread, which owns the selector."""
        self.finish_lines()
        with self.lock:
            self.closed = True
        self.on_closed()
        self.done.set()
        if self.reactor.running and not self.reactor.in_reactor_thread():
            self.reactor.call_soon(self.close_pipes)
        else:
            self.close_pipes()

    def close_pipes(self) -> None:
        """Reactor thread (or no reactor): stop reading the output pipes and close both our
        ends of each. Idempotent."""
        with self.lock:  # never under a thread draining them
            for _stream, pipe in self.streams():
                if pipe is not None and not pipe.closed:
                    if self._watched:
                        self.reactor.remove_reader(pipe)
                    pipe.close()
            held, self._held_ends = self._held_ends, []
            for fd in held:
                os.close(fd)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the output to end (``done``)."""
        self.done.wait(timeout)

    def abandon(self) -> None:
        """In a forked child: close the inherited descriptors (no reactor thread here)."""
        for _stream, pipe in self.streams():
            if pipe is not None:
                pipe.close()
        held, self._held_ends = self._held_ends, []
        for fd in held:
            os.close(fd)
