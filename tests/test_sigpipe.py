"""A host whose SIGPIPE is at its default action survives a worker that dies under its writes.

Many command-line programs set ``signal(SIGPIPE, SIG_DFL)``. A write into a socket or pipe
whose reader is gone then kills the writer outright (exit -13) instead of failing with
``EPIPE``. The host writes to its workers (requests, sometimes hundreds of MiB, and cancel
frames on a pipe), and a worker may die at any moment: every such write is immune
(``MSG_NOSIGNAL`` on the channel's sockets, SIGPIPE blocked around the cancel pipe's write) and
a broken channel is reported as the worker's death, as with SIGPIPE ignored.

Each test runs a real host process with SIGPIPE at SIG_DFL.
"""

from __future__ import annotations

import pytest
from conftest import run_host

_BIG_ARGUMENT_HOST = """
import os, signal, threading, time
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
import comfy_env

# No shared memory: the argument streams through the channel itself.
config = comfy_env.PoolConfig(shared_memory=False, kill_grace=0.5, close_timeout=3.0)
with comfy_env.Pool(config) as pool:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    # The worker stops reading: the host's write of the 128 MiB argument fills the socket and
    # blocks; the worker dies under it. (SIGKILL ends a stopped process too.)
    os.kill(pid, signal.SIGSTOP)

    def kill():
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        w.call("comfy_env_worker.tasks:echo", bytes(128 << 20))
    except comfy_env.WorkerCrashed as exc:
        print("crashed", type(exc).__name__, exc.pid == pid, flush=True)
    else:
        print("returned", flush=True)
    killer.join()
    # The next call gets a fresh worker.
    print("next", w.call("comfy_env_worker.tasks:echo", 5), w.generation, flush=True)
"""


_CANCEL_PIPE_HOST = """
import signal, time
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
import comfy_env


def close_cancel_pipe_then_sleep():
    # Runs in the worker (by value): closes the worker's end of the cancel pipe, so that the
    # host's cancel frame meets a pipe without a reader, as when the worker is gone.
    import os, stat, sys, time

    fd = int(sys.argv[5])  # BOOT's argv: runtime dir, channel, host pid, log, cancel, replies
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        raise RuntimeError("argv[5] is not the cancel pipe")
    os.close(fd)
    time.sleep(30)


config = comfy_env.PoolConfig(cancel_grace=0.5, kill_grace=0.5, close_timeout=3.0)
with comfy_env.Pool(config) as pool:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    call = w.submit(close_cancel_pipe_then_sleep)
    time.sleep(1.0)  # the worker runs the function and closes its end
    print("cancel", call.cancel(), flush=True)
    try:
        call.result(timeout=20)
    except comfy_env.ComfyEnvError as exc:
        print("ended", type(exc).__name__, flush=True)
    else:
        print("returned", flush=True)
    print("next", w.call("comfy_env_worker.tasks:echo", 5), flush=True)
"""


@pytest.mark.timeout(90)
def test_a_worker_dying_while_the_host_writes_a_large_argument_does_not_kill_the_host() -> None:
    host = run_host(_BIG_ARGUMENT_HOST)
    out, err = host.communicate(timeout=80)
    assert host.returncode == 0, (host.returncode, out, err[-3000:])
    assert "crashed WorkerCrashed True\n" in out, (out, err[-3000:])
    assert "next 5 2\n" in out, (out, err[-3000:])


@pytest.mark.timeout(90)
def test_a_cancel_into_a_pipe_without_reader_does_not_kill_the_host() -> None:
    host = run_host(_CANCEL_PIPE_HOST)
    out, err = host.communicate(timeout=80)
    assert host.returncode == 0, (host.returncode, out, err[-3000:])
    assert "cancel " in out and "ended CallCancelled\n" in out, (out, err[-3000:])
    assert "next 5\n" in out, (out, err[-3000:])


_PIPE_WRITE_HOST = """
import os, signal
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
from comfy_env import _sigpipe

r, w = os.pipe()
os.close(r)
for _ in range(3):
    try:
        _sigpipe.write(w, b"x")
    except BrokenPipeError:
        print("EPIPE", flush=True)
# The thread's mask is as it was, and nothing is left pending to kill us later.
print("blocked", signal.SIGPIPE in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)
print("pending", signal.SIGPIPE in signal.sigpending(), flush=True)
"""


def test_a_pipe_write_without_reader_is_broken_pipe_error_and_leaves_no_signal_behind() -> None:
    host = run_host(_PIPE_WRITE_HOST)
    out, err = host.communicate(timeout=30)
    assert host.returncode == 0, (host.returncode, out, err)
    assert out == "EPIPE\nEPIPE\nEPIPE\nblocked False\npending False\n", (out, err)
