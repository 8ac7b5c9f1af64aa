"""A host watcher: the moment the host dies, its ``setsid`` descendants are stopped and what it
left behind is removed.

Workers die with their host through ``PR_SET_PDEATHSIG``, and their process groups with them.
A descendant that called ``setsid`` left the group and is re-parented to init: nothing the
host set up reaches it, and a host killed with SIGKILL (or SIGTERM without a handler: ``docker
stop``, systemd) runs no code, so its shared-memory blocks, runtime dirs and status file stay
too. So each pool starts one small watcher process that outlives the host, on the reactor
right after its first worker's fork, before the runtime dir that worker needs is made: no
leftover of the host exists before its watcher does (a host killed in the first moments after
its first worker, when the watcher came 50 ms after it, left its runtime dir and status file
until the next sweep)::

    host (pool)  --pipe, write end (close-on-exec)-->  watcher: /bin/sh, blocked in ``read``
    pool.close(): writes "q", closes      ->  watcher exits (close stopped the workers itself)
    host dies: the kernel closes the pipe ->  watcher reads EOF, execs python -I -S, which
                                              reads EOF too -> SIGKILLs every process marked
                                              COMFY_ENV_HOST_ID=<host> (``_descendants``)
                                          ->  waits (bounded) until the host is proven dead,
                                              removes its blocks ``ce-<host>-...``, runtime dirs
                                              ``host-<host>-...`` and status file (its whole
                                              root, if private) (``_leftovers``), exits

The end of file alone proves nothing: a host that ``exec``'d closes the pipe too and lives on.
Nothing is removed until ``_identity.owner_dead`` proves the death, and only what the sweep
would remove for that one host (``_leftovers``: names parsed alike, a regular file or a real
directory of our uid): never a live host's or another host's.

The watcher runs in its own session (Ctrl-C to the host's group does not stop it before it
has done its job) with stdout and stderr on ``/dev/null``; it inherits no descriptor but the
pipe. It carries no host mark itself, so neither it nor a sweep mistakes it for a worker. At
its start it imports two small modules of this package (``_descendants``, ``_identity``) and
nothing else: not the package's ``__init__``, nor ``logging``, ``signal`` or ``re``, which it
needs only once the host died, like the clean-up's module (see ``_BODY``). If the watcher
itself is killed with the host, the sweep of the next pool start (or
``comfy-env sweep``) still finds the marked processes and the leftovers: the watcher makes the
common case immediate, the sweep stays the backstop.
"""

from __future__ import annotations

import os
import subprocess
import sys

from comfy_env_worker import shm

# The package is entered without its ``__init__`` (a bare module with the package's path
# stands in for it): that ``__init__`` imports the public API (typing, logging, pydantic),
# three quarters of the watcher's start for a process that then sleeps in a read. Counted
# with callgrind, to the read: 114 million instructions with the ``__init__``, 36 without,
# 34 for a bare ``python -I -S``; on-CPU time 20 ms against 49 (15 interleaved starts). That
# CPU was spent 50 ms after a new pool's first call, beside whatever the host did next; now only
# a host that died pays for it (``_WAIT``).
_BODY = (
    "import os, sys; package = type(sys)('comfy_env'); "
    "package.__path__ = [os.path.join(sys.argv[1], 'comfy_env')]; "
    "sys.modules['comfy_env'] = package; "
    "from comfy_env._descendants import watch_host; watch_host(*sys.argv[2:])"
)


# What the watcher runs while its host lives: a shell blocked in ``read`` on the pipe, so that
# launching it with the first worker costs a fork and a shell's start (about a millisecond),
# not an interpreter's (20 ms of CPU against that worker's start and the first call: about 10
# ms of the call on two CPUs). "q" (the pool closed) ends it; end of file (the host is gone)
# turns it into the Python watcher (``_BODY``), which reads the same end of file and acts.
# ``$0`` is the watcher's name in ``ps``; ``$@`` the interpreter's command line.
_SHELL = "/bin/sh"
_WAIT = 'IFS= read -r said; [ "$said" = q ] && exit 0; exec "$@"'


class HostWatcher:
    """One watcher process and the write end of its pipe; ``close`` ends it cleanly."""

    def __init__(self, popen: subprocess.Popen[bytes], write_fd: int) -> None:
        self.popen = popen
        self._write_fd: int | None = write_fd

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    def start(cls, name: str, value: str, *, runtime_root: str | None = None) -> HostWatcher:
        """Launch the watcher for the processes marked ``name=value``. With ``runtime_root``
        (the host's runtime root; ``value`` is then the host's token) it also removes the dead
        host's leftovers: its shared-memory blocks, and its runtime dirs and status file under
        that root (the root itself if it is the host's private one). ``OSError`` if it cannot
        be launched (the caller decides what that means)."""
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        args = [package_parent, name, value]
        if runtime_root is not None:
            args += [runtime_root, shm.SHM_DIR, shm.NAME_PREFIX]
        argv = [sys.executable, "-I", "-S", "-c", _BODY, *args]
        if os.path.exists(_SHELL):
            argv = [_SHELL, "-c", _WAIT, "comfy-env-watcher", *argv]
        read_fd, write_fd = os.pipe()  # both close-on-exec: no worker inherits them
        try:
            popen = subprocess.Popen(
                argv,
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        return cls(popen, write_fd)

    def close(self, timeout: float) -> None:
        """The pool closed cleanly: tell the watcher to exit, and reap it (bounded)."""
        fd, self._write_fd = self._write_fd, None
        if fd is not None:
            from . import _sigpipe  # (here: the watcher process itself never writes)

            try:
                _sigpipe.write(fd, b"q")  # a watcher gone is EPIPE, never SIGPIPE
            except OSError:
                pass  # it is gone already; reaped below
            os.close(fd)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def forget_in_forked_child(self) -> None:
        """In a forked child: drop the inherited write end (only the host may hold it, or the
        watcher would not see the host's death until this child exits too)."""
        fd, self._write_fd = self._write_fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        # The watcher is the parent's child, never ours to wait for: mark the handle settled so
        # that dropping it here neither waits nor warns.
        self.popen.returncode = 0
