"""Mechanism: a launched worker's start-up, HELLO -> CONFIG -> READY, then the canary.

Data flow (the spawning thread, ``WorkerProcess.handshake``)::

    runtime dir ready, GO         the worker imports from the runtime dir only after GO
    canary prepared               encoded, its shared-memory block made and filled, while the
                                  worker's interpreter still starts (this thread would only
                                  wait for HELLO)
    HELLO                         protocol version, pid, Python version, shared memory or not
    CONFIG + canary               in one go, without waiting for READY (one round trip less)
    (named threads looked up)     scheduled on the reactor while this thread waits for READY
    READY, canary reply           anything but an equal echo refuses the worker

Until the worker is known to speak our protocol, a frame announcing more than
``_HANDSHAKE_FRAME_BYTES`` is refused before anything is allocated for it. Every failure is a
``WorkerStartError`` that tells the story (``start_error``: the worker is killed and its last
output read first); a worker whose Python is older than 3.8 exits with ``TOO_OLD_EXIT`` from
BOOT's first line and gets its own message.
"""

from __future__ import annotations

import itertools
import os
import pickle
import re
import time
from typing import TYPE_CHECKING, Any, Protocol

from comfy_env_worker import shm
from comfy_env_worker.protocol import (
    CANARY_TARGET,
    FLAG_OOB,
    MSG_NOSIGNAL,
    PROTOCOL_VERSION,
    ChannelClosed,
    FrameError,
    FrameType,
    encode_header,
    send_frame,
)

from ._codec import decode_reply, encode_call, oob_threshold, worker_config
from ._errors import WorkerStartError, describe_exit
from ._identity import host_id
from ._inflight import CALLS_IN_FLIGHT
from ._interrupts import Deferred
from ._lifecycle import Stop

if TYPE_CHECKING:
    from ._channel import Channel
    from ._envs import EnvSpec
    from ._exitwatch import ExitWatch
    from ._logs import WorkerLog
    from ._runtime_store import RuntimeDir
    from ._settings import Settings

# BOOT's exit code for a Python older than 3.8, and the byte that lets it go on (``_process``).
TOO_OLD_EXIT = 87
GO = b"\x01"
_HANDSHAKE_FRAME_BYTES = 1 << 20
# Serial numbers for names unique in this host (block pools here, worker ids in ``_process``).
SERIALS = itertools.count(1)

Canary = tuple[Any, list[Any], "shm.Block | None"]


class Starting(Protocol):
    """What the handshake needs of a launched worker (``WorkerProcess``)."""

    spec: EnvSpec
    generation: int
    config: Settings
    runtime_dir: RuntimeDir
    channel: Channel
    watch: ExitWatch
    log: WorkerLog
    hello: dict[str, Any]
    pid: int | None
    startup_seconds: float

    def kill(self, stop: Stop) -> None: ...

    def wait_exit(self, timeout: float) -> int | None: ...

    def wait_output(self, timeout: float) -> None: ...

    def start_error(
        self, text: str, tail: str = "", unsupported: bool = False
    ) -> WorkerStartError: ...


def canary_value(oob_bytes: int) -> Any:
    """Exercises the codec: nested containers, int keys, bytes, floats, a 4 KiB in-band
    buffer, and one buffer of ``oob_bytes`` that travels out of band (shared memory)."""
    return (
        {1: (b"\x00bytes\xff", [1.5, -0.0, None, True]), 2: {"nested": (1, 2, {3: "x"})}},
        [(), [], {}, "\u00e9\u4e2d", 2**70],
        bytes(range(256)) * 16,  # 4 KiB: under the out-of-band size, pickled in band
        bytearray(os.urandom(64)) * (oob_bytes // 64 + 1),
    )


def handshake(process: Starting, deadline: float) -> None:
    """HELLO -> CONFIG -> READY, then the canary. Raises ``WorkerStartError``."""
    started = time.monotonic()
    channel = process.channel
    reader = channel.reader
    assert reader is not None and channel.sock is not None
    # HELLO and READY are a few hundred bytes: until the worker is known to speak our
    # protocol, a frame announcing more is refused before anything is allocated for it.
    reader.limit = min(process.config.max_frame_bytes, _HANDSHAKE_FRAME_BYTES)
    canary = _go(process)
    try:
        _converse(process, deadline, canary)
    except TimeoutError:
        raise start_error(
            process,
            f"did not finish its start-up within {process.config.start_timeout:g}s "
            "(PoolConfig.start_timeout)",
        ) from None
    except (ChannelClosed, OSError) as exc:  # EOF, reset, broken pipe, partial send
        rc = process.wait_exit(1.0)
        if rc == TOO_OLD_EXIT:
            raise _too_old_error(process) from None
        # Silent and gone before its HELLO: likely no Python at all (``/bin/true``).
        hint = "" if process.hello else f" (is {process.spec.interpreter} a Python interpreter?)"
        raise start_error(process, f"{describe_exit(rc)} during start-up", hint) from exc
    except (FrameError, pickle.UnpicklingError, KeyError, ValueError, TypeError) as exc:
        raise start_error(process, f"failed its handshake: {exc}") from exc
    process.startup_seconds = time.monotonic() - started


def _go(process: Starting) -> Canary:
    """The runtime dir made ready, GO written, and the canary prepared (while the worker's
    interpreter starts)."""
    channel, config = process.channel, process.config
    assert channel.sock is not None
    # The runtime dir is filled (by the pool's first spawn) while the worker's interpreter
    # starts; GO lets the worker import from it.
    try:
        process.runtime_dir.ready()
    except (OSError, ImportError) as exc:
        raise start_error(
            process,
            f"could not be given its runtime directory {process.runtime_dir.path}: {exc}",
        ) from exc
    try:
        channel.sock.sendall(GO, MSG_NOSIGNAL)
    except OSError:
        pass  # the worker died already: its EOF is read below, and its exit reported
    # The canary is encoded, and its block made and filled, while the interpreter still
    # starts (this thread would only wait for HELLO): off the first call's path when the
    # host has a CPU of its own. A worker that turns out unable to use shared memory gets
    # it inline instead (the block goes back with the pool, below).
    loans = channel.loans
    if loans.shm_wanted:
        loans.blocks = shm.BlockPool(
            f"{shm.NAME_PREFIX}{host_id()}-h{next(SERIALS)}-", config.shm_pool_bytes
        )
        loans.blocks.hold = Deferred  # (blocks made, given up, destroyed: see BlockPool)
    return _canary_prepare(channel)


def _converse(process: Starting, deadline: float, canary: Canary) -> None:
    """HELLO in, CONFIG and the canary out, READY and the canary's echo in."""
    channel, config = process.channel, process.config
    reader, sock = channel.reader, channel.sock
    assert reader is not None and sock is not None
    canary, worker_settings = _hello(process, deadline, canary)
    send_frame(sock, FrameType.CONFIG, 0, pickle.dumps(worker_settings, protocol=5))
    # The canary goes out right behind CONFIG, without waiting for READY: the worker
    # reads it once configured (one round trip less at every start). A worker that
    # fails its configuration never reads it; its exit is reported as before.
    value, parts, block = canary
    try:
        channel.send_large(parts, deadline)
    except BaseException:
        channel.finish_request(block, [])
        raise
    # The lookup of the worker's named threads (started while we answered HELLO), a
    # moment later. Scheduled here, while this thread waits for READY, the wake-up of
    # the reactor it takes costs nothing; after the canary it took the GIL from this
    # thread on its way to the first call.
    process.watch.threads.watch_soon()
    ftype, _, _, _ = reader.read(deadline)
    if ftype != FrameType.READY:
        raise FrameError(f"expected READY, got frame type {ftype}")
    reader.limit = config.max_frame_bytes
    canary_check(channel, deadline, value, block)
    # Only now: the handshake and the canary wait on an interpreter's start-up.
    reader.spin_wait(config.spin_wait, process.pid or 0, CALLS_IN_FLIGHT)


def _hello(process: Starting, deadline: float, canary: Canary) -> tuple[Canary, Any]:
    """Read HELLO; set up shared memory as both sides can use it. Returns the canary (made
    again inline for a worker without shared memory) and the worker's configuration."""
    channel, config = process.channel, process.config
    assert channel.reader is not None
    ftype, _, _, payload = channel.reader.read(deadline)
    if ftype != FrameType.HELLO:
        raise FrameError(f"expected HELLO, got frame type {ftype}")
    hello = pickle.loads(payload)
    if hello.get("protocol") != PROTOCOL_VERSION:
        raise FrameError(f"worker speaks protocol {hello.get('protocol')}, host {PROTOCOL_VERSION}")
    process.hello = hello
    process.pid = channel.pid = int(hello["pid"])
    process.log.pid = process.pid
    loans = channel.loans
    use_shm = loans.shm_wanted and bool(hello.get("shm"))
    worker_settings = worker_config(
        config, process.generation, host_id() if use_shm else None, config.shm_pool_bytes
    )
    if use_shm:
        loans.mappings = shm.PeerMappings(f"{shm.NAME_PREFIX}{host_id()}-w{process.pid}-")
    else:
        if loans.blocks is not None:  # prepared for a worker without shared memory
            loans.blocks.destroy_all()
            loans.blocks = None
            canary = _canary_prepare(channel)
        if config.shared_memory:
            loans.shm_state = "unavailable"
    return canary, worker_settings


def _canary_prepare(channel: Channel) -> Canary:
    """Encode the canary: one real call through the codec, with a buffer out of band
    (through shared memory when ``blocks`` is set). Returns the value, the frame's parts
    (header first) and the request's block."""
    config = channel.config
    oob = config.shm_threshold_bytes
    if channel.loans.blocks is None:
        oob = min(oob, config.max_frame_bytes // 4)
    value = canary_value(oob)
    body, buffers, _ = encode_call(
        CANARY_TARGET, (value,), {}, oob_threshold(config.shm_threshold_bytes)
    )
    try:
        parts, block, length = shm.pack(body, buffers, channel.loans.blocks)
    except OSError as exc:  # /dev/shm full: inline, as send_request does
        channel.loans.shm_unavailable(f"cannot create a block ({exc})", exc.errno)
        parts, block, length = shm.pack(body, buffers, None)
    parts.insert(0, encode_header(FrameType.CALL, 1, length, FLAG_OOB))
    return value, parts, block


class ReplySide(Protocol):
    """What ``canary_check`` reads a reply through: a local worker's ``Channel``, or a Ray
    actor (``_ray.RayWorker``, whose ``finish_request`` has no shared memory to release)."""

    def read_frame(self, deadline: float | None) -> tuple[int, int, int, Any]: ...

    def open_reply(self, call_id: int, flags: int, payload: Any) -> tuple[Any, Any, list[str]]: ...

    def finish_request(self, block: Any, retained: list[str]) -> None: ...


def canary_check(channel: ReplySide, deadline: float, value: Any, block: shm.Block | None) -> None:
    """Read the canary's reply (call id 1): anything but an equal echo of ``value`` refuses
    the worker (``FrameError``)."""
    ftype, flags, call_id, reply = channel.read_frame(deadline)
    if call_id != 1 or ftype not in (FrameType.REPLY_OK, FrameType.REPLY_ERR):
        raise FrameError(f"canary: unexpected frame type {ftype} for call {call_id}")
    body_in, buffers_in, retained = channel.open_reply(1, flags, reply)
    channel.finish_request(block, retained)
    try:
        echoed = decode_reply(ftype, body_in, CANARY_TARGET, buffers_in)
    except Exception as exc:
        raise FrameError(f"canary call failed: {type(exc).__name__}: {exc}") from exc
    if echoed != value:
        raise FrameError("canary came back different from what was sent")


def _too_old_error(process: Starting) -> WorkerStartError:
    process.wait_output(1.0)
    tail = process.log.tail()
    match = re.search(r"unsupported Python (\d+\.\d+)", tail)
    version = match.group(1) if match else "older than 3.8"
    return process.start_error(
        f"env {process.spec.key} runs Python {version} ({process.spec.interpreter}); comfy-env "
        "workers need Python 3.8 or newer",
        tail,
        unsupported=True,
    )


class Failing(Protocol):
    """What ``start_error`` needs of a generation whose start failed (a ``WorkerProcess``, or
    a Ray actor: ``_ray.RayWorker``)."""

    spec: EnvSpec
    generation: int
    log: WorkerLog

    def kill(self, stop: Stop) -> None: ...

    def wait_output(self, timeout: float) -> None: ...

    def start_error(
        self, text: str, tail: str = "", unsupported: bool = False
    ) -> WorkerStartError: ...


def start_error(
    process: Failing, what: str, silent_hint: str = "", who: str = "worker", drain: float = 1.0
) -> WorkerStartError:
    """The start-up failure ``what`` of ``process`` (``who``: what the message calls it): the
    process is killed and its output drained for up to ``drain`` seconds, so the error carries
    its last words; ``silent_hint`` is added when it said nothing."""
    process.kill(Stop.KILL)
    process.wait_output(drain)
    tail = process.log.tail()
    message = (
        f"{who} for env {process.spec.key} (interpreter {process.spec.interpreter}, "
        f"generation {process.generation}) {what}"
    )
    if not tail:
        message += silent_hint
    if tail:
        message += "\n--- worker output (last lines) ---\n" + tail
    return process.start_error(message, tail)
