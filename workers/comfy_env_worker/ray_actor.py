"""The Ray actor that hosts one worker generation (the ``ray`` backend, see ``comfy_env._ray``).

The actor runs the ordinary worker runtime (``main.Worker``: the serve loop, call control,
refs, logs) on a private socketpair *inside the actor process*, so targets, ``RemoteRef``s,
``cancelled()``/``progress()`` and error records behave exactly as in a local worker. Ray only
carries the frames::

    host (comfy_env._ray.RayWorker)             actor process (this class)
    ----------------------------------          ------------------------------------------
    actor.hello(CONFIG) -------------------->   read HELLO, send CONFIG, read READY  <--+
    actor.call(id, flags, payload) --------->   CALL frame --socketpair--> serve thread |
                                                 (main.Worker.serve runs the call)      |
    actor.drain() (while the call runs) ---->   LOG/EVENT frames read so far            |
    <-- (side frames, reply frame) ----------   reply frame (REPLY_OK / REPLY_ERR) -----+
    actor.cancel(id) ----------------------->   CANCEL on the cancel pipe -> watchdog
    actor.wait_until_dead() (never returns)     its failure tells the host the actor died

The class is shipped to the cluster *by value* (the host registers this module with Ray's
cloudpickle), and ``__init__`` receives the worker package's files: it writes them into a
private directory on the actor's node (once per content digest, owner-checked) and imports the
runtime from there. No ``py_modules`` upload, no shared file system, and nothing but the env's
own site-packages (which must hold ``ray``) on the path.

**SIGTERM** (a supervisor, ``docker stop`` of a node, the raylet stopping its workers) kills
the actor at once, as it kills a local worker (whose runtime keeps the default disposition).
Ray's own handler in a worker raises ``SystemExit`` on the main thread, and its core worker
then waits for the tasks in flight to end before the process exits: ``wait_until_dead`` never
ends and a call may run for hours, so the process lived on wedged, serving nothing and dead to
nobody, and the host's call waited for its ``call_timeout`` (for ever without one). The actor
replaces that handler (``_die_of_sigterm``): it writes ``SIGTERM_WORDS`` to its stderr (Ray's
``.err`` log, where the host reads the signal back) and dies of the signal. Ray then reports
the death like any crash, and the call in flight fails as ``WorkerCrashed`` at once.

Only ``__init__`` and the method bodies import the runtime; this module itself is stdlib-only
and never imports ``ray``. Parses under Python 3.8.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
from collections import deque

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Deque, Dict, List, Tuple

# Side frames (LOG between and during calls, EVENT during calls) kept until the host drains
# them; the oldest are dropped beyond this (a chatty background thread while nobody calls).
SIDE_MAX = 4096
# The actor's last words on its stderr (Ray's worker ``.err`` log) as it dies of SIGTERM: the
# host finds them in the log's tail and reports the signal (``comfy_env._ray``).
SIGTERM_WORDS = "comfy-env: the Ray actor received SIGTERM and dies of it"


def _die_of_sigterm(signum: int, frame: Any) -> None:
    """The actor's SIGTERM handler (main thread): say so, then die of the signal (see the
    module docstring for why Ray's own handler would wedge the actor)."""
    try:
        os.write(2, ("\n%s (pid %d)\n" % (SIGTERM_WORDS, os.getpid())).encode())
    except OSError:
        pass  # no stderr: the death is still reported, without its signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)  # delivered to this thread before it returns
    os._exit(128 + signal.SIGTERM)  # not reached; never outlive the signal


def own_sigterm() -> bool:
    """Put ``_die_of_sigterm`` in place of Ray's SIGTERM handler; False where this thread may
    not (only the main thread sets handlers; Ray creates an actor there)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _die_of_sigterm)
    return True


def install_runtime(files: Dict[str, bytes], digest: str) -> str:
    """Write the runtime's files under ``<tmp>/comfy-env-ray-<uid>/<digest>`` (once per node and
    digest; atomically, by rename) and return that directory. The parent is private (0700) and
    must be ours: nobody else can put code where the actor imports it from."""
    base = os.path.join(tempfile.gettempdir(), "comfy-env-ray-%d" % os.getuid())
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError("%s is not a private directory of this user" % base)
    target = os.path.join(base, digest)
    if os.path.isdir(target):
        return target
    staging = tempfile.mkdtemp(prefix=".staging-", dir=base)
    for rel, data in files.items():
        path = os.path.join(staging, rel)
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise ValueError("bad runtime file name %r" % rel)
        os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    try:
        os.rename(staging, target)
    except OSError:  # another actor of the same digest won the race: use its copy
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def _serve(sock: Any, log_fd: int, cancel_fd: int, stopped: threading.Event) -> None:
    """The serve thread: ``comfy_env_worker.main`` without the process set-up that belongs to
    Ray here (no parent check, no stdio of its own). The actor's process ends with it."""
    import faulthandler

    from comfy_env_worker import main

    faulthandler.enable(all_threads=False)  # a segfault's stack goes to the actor's .err log
    main.CHANNEL = sock
    # The Worker is built on this thread: call control interrupts the thread that serves.
    code = main.serve(main.Worker(sock, log_fd), 0, cancel_fd)
    if code == 0 and stopped.is_set():
        return  # SHUTDOWN: release hooks ran; the actor's ``shutdown`` ends the actor
    os._exit(code)  # a broken channel: the actor goes with its serve loop


class RayWorkerActor:
    """One worker generation as a threaded Ray actor (``max_concurrency`` >= 4: a call, a
    drain, a cancel and the death sentinel run at the same time)."""

    def __init__(self, files: Dict[str, bytes], digest: str) -> None:
        # First: Ray's handler is in place from the worker's start, and a SIGTERM from here
        # on must kill the actor rather than wedge it.
        own_sigterm()
        path = install_runtime(files, digest)
        if path not in sys.path:
            sys.path.insert(0, path)
        import socket

        from comfy_env_worker.protocol import DEFAULT_MAX_FRAME_BYTES, FrameReader

        self.host, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log_r, log_w = os.pipe()
        cancel_r, self.cancel_w = os.pipe()
        self.reader = FrameReader(self.host, DEFAULT_MAX_FRAME_BYTES)
        self.side: Deque[Tuple[int, int, bytes]] = deque(maxlen=SIDE_MAX)
        self.side_lock = threading.Lock()
        self.forever = threading.Event()
        self.stopped = threading.Event()
        self.serve_thread = threading.Thread(
            target=_serve,
            args=(child, log_w, cancel_r, self.stopped),
            name="comfy-env-serve",
            daemon=True,
        )
        self.serve_thread.start()
        threading.Thread(
            target=self._pump_log_pipe, args=(log_r,), name="comfy-env-log-pipe", daemon=True
        ).start()

    def _pump_log_pipe(self, fd: int) -> None:
        """Records written between calls (the log pipe) wait in ``side`` for the next drain."""
        from comfy_env_worker.protocol import HEADER_SIZE, FrameError, decode_header

        buf = bytearray()
        while True:
            try:
                data = os.read(fd, 65536)
            except InterruptedError:
                continue
            if not data:
                return
            buf += data
            while len(buf) >= HEADER_SIZE:
                try:
                    ftype, _flags, length, call_id = decode_header(buf)
                except FrameError:  # not a record (something else wrote on the pipe): dropped
                    buf.clear()
                    break
                if len(buf) < HEADER_SIZE + length:
                    break
                payload = bytes(buf[HEADER_SIZE : HEADER_SIZE + length])
                del buf[: HEADER_SIZE + length]
                with self.side_lock:
                    self.side.append((ftype, call_id, payload))

    def _read(self) -> Tuple[int, int, int, Any]:
        """The next frame from the serve thread that is not a side frame."""
        from comfy_env_worker.protocol import FrameType

        while True:
            ftype, flags, call_id, payload = self.reader.read(None)
            if ftype != FrameType.LOG and ftype != FrameType.EVENT:
                return ftype, flags, call_id, payload
            with self.side_lock:
                self.side.append((ftype, call_id, bytes(payload)))

    def hello(self, config: bytes) -> Dict[str, Any]:
        """The handshake: HELLO, CONFIG (the host's bytes), READY. Returns the HELLO."""
        import pickle

        from comfy_env_worker.protocol import FrameType, send_frame

        ftype, _flags, _call_id, payload = self.reader.read(None)
        if ftype != FrameType.HELLO:
            raise RuntimeError("expected HELLO, got frame type %d" % ftype)
        hello: Dict[str, Any] = pickle.loads(payload)
        send_frame(self.host, FrameType.CONFIG, 0, config)
        ftype, _flags, _call_id, _payload = self._read()
        if ftype != FrameType.READY:
            raise RuntimeError("expected READY, got frame type %d" % ftype)
        return hello

    def call(
        self, call_id: int, flags: int, payload: bytes
    ) -> Tuple[List[Tuple[int, int, bytes]], Tuple[int, int, int, Any]]:
        """Run one call: (the side frames not drained yet, in order; the reply frame)."""
        from comfy_env_worker.protocol import FrameType, encode_header, send_parts

        header = encode_header(FrameType.CALL, call_id, len(payload), flags)
        send_parts(self.host, [header, payload])
        reply = self._read()
        return self.drain(), reply

    def drain(self) -> List[Tuple[int, int, bytes]]:
        """The side frames read so far (LOG and EVENT: frame type, call id, payload)."""
        with self.side_lock:
            frames = list(self.side)
            self.side.clear()
        return frames

    def cancel(self, call_id: int) -> bool:
        """Write CANCEL(call id) on the cancel pipe (the runtime's watchdog reads it)."""
        from comfy_env_worker.protocol import FrameType, encode_header

        return os.write(self.cancel_w, encode_header(FrameType.CANCEL, call_id, 0)) > 0

    def ping(self) -> bool:
        from comfy_env_worker.protocol import FrameType, send_frame

        send_frame(self.host, FrameType.PING, 0)
        return self._read()[0] == FrameType.PONG

    def release_refs(self, payload: bytes) -> None:
        from comfy_env_worker.protocol import FrameType, send_frame

        send_frame(self.host, FrameType.RELEASE_REFS, 0, payload)

    def shutdown(self, timeout: float) -> None:
        """SHUTDOWN: the serve loop runs the release hooks, then the actor exits the way Ray
        expects of an intended exit (the host's ``ray.kill`` follows after its grace)."""
        from comfy_env_worker.protocol import FrameType, send_frame

        self.stopped.set()
        send_frame(self.host, FrameType.SHUTDOWN, 0)
        self.serve_thread.join(timeout)
        import importlib

        importlib.import_module("ray.actor").exit_actor()

    def wait_until_dead(self) -> None:
        """Never returns: the host holds this task's result as the actor's death notice."""
        self.forever.wait()
