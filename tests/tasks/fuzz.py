"""What a hostile or buggy worker writes on its channel, for tests/test_fuzz_channel.py.

Importable on both sides (the ``config`` fixture puts ``tests/`` on the worker's ``sys.path``).
The host describes the bytes (``Frame`` specs, plain data); the worker builds them with its own
call id and block names, writes them on its channel under the send lock, between whole frames,
then does what ``then`` says:

- ``"return"``: return normally, so the worker's own valid reply follows the junk on the
  channel (junk interleaved with, and ahead of, a real reply);
- ``"hang"``: sleep, so nothing follows (the host must act on the junk alone, never wait);
- ``"exit"``: ``os._exit(3)`` at once (EOF right after the junk).

Placeholders in a spec are filled in the worker: ``CALL`` is the current call id (``CALL+n``
and ``CALL-n`` too), ``BLOCK`` the name of a real reply block of this worker's shared-memory
pool (``BLOCK_SIZE`` its size), ``PREFIX`` the prefix every block of this worker carries.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

HANG_SECONDS = 60.0  # the host retires the worker long before


def _call_id() -> int:
    from tasks import remote as remote_tasks

    return remote_tasks.CURRENT_CALL_ID_PROBE()


class _Filler:
    """Resolves placeholders against this worker (made lazily: a block only if one is named)."""

    def __init__(self) -> None:
        self.call_id = _call_id()
        self._block: Any = None

    def block(self) -> Any:
        if self._block is None:
            from comfy_env_worker import main

            assert main.WORKER is not None and main.WORKER.pool is not None
            self._block = main.WORKER.pool.acquire(1)
        return self._block

    def fill(self, value: Any) -> Any:
        if isinstance(value, str):
            if value == "CALL":
                return self.call_id
            if value.startswith("CALL+"):
                return self.call_id + int(value[5:])
            if value.startswith("CALL-"):
                return self.call_id - int(value[5:])
            if value == "BLOCK":
                return self.block().name
            if value == "BLOCK_SIZE":
                return self.block().size
            if value.startswith("PREFIX"):
                from comfy_env_worker import main

                assert main.WORKER is not None and main.WORKER.pool is not None
                return main.WORKER.pool._base + value[6:]
            return value
        if isinstance(value, tuple):
            return tuple(self.fill(v) for v in value)
        if isinstance(value, list):
            return [self.fill(v) for v in value]
        return value


def build(spec: Any, filler: _Filler) -> bytes:
    """One piece of what goes on the wire:

    - ``("raw", data)``: the bytes as they are;
    - ``("frame", ftype, call, payload)`` with optional keywords in a trailing dict
      ``{"flags": f, "length": n, "magic": m}``: a header (the true payload length unless
      ``length`` is given) and ``payload`` (bytes, or ``("pickle", obj)``, or
      ``("oob", table, retained, dropped, body_obj, inline)``: an out-of-band envelope).
    """
    from comfy_env_worker import protocol, shm

    if spec[0] == "raw":
        return bytes(spec[1])
    _, ftype, call, payload, *extra = spec
    options = extra[0] if extra else {}
    call_id = filler.fill(call)
    if isinstance(payload, tuple) and payload and payload[0] == "pickle":
        data = pickle.dumps(filler.fill(payload[1]), protocol=5)
    elif isinstance(payload, tuple) and payload and payload[0] == "oob":
        _, table, retained, dropped, body_obj, inline = payload
        head = pickle.dumps(
            (filler.fill(table), filler.fill(retained), filler.fill(dropped)), protocol=5
        )
        body = pickle.dumps(body_obj, protocol=5)
        data = shm._U32.pack(len(head)) + head + body + bytes(inline)
    elif isinstance(payload, tuple) and payload and payload[0] == "oob-raw":
        head = bytes(payload[1])
        data = shm._U32.pack(payload[2] if len(payload) > 2 else len(head)) + head
    else:
        data = bytes(payload)
    flags = options.get("flags", 0)
    length = options.get("length", len(data))
    magic = options.get("magic", protocol.MAGIC)
    return protocol.HEADER.pack(magic, ftype, flags, length, call_id) + data


def _plant(what: Any, filler: _Filler) -> None:
    """Put something that is no block of ours under one of our block names in /dev/shm:
    ``("dir", name)``, ``("fifo", name)`` or ``("symlink", name, target)``."""
    from comfy_env_worker import shm

    kind, name, *rest = filler.fill(what)
    path = os.path.join(shm.SHM_DIR, name)
    if kind == "dir":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink(rest[0], path)
    else:
        raise ValueError(kind)


def misbehave(specs: list[Any], then: str, plant: Any = None) -> str:
    """Write ``specs`` (see ``build``) on the channel as one write, then ``then``. ``plant``:
    see ``_plant``, done first."""
    from comfy_env_worker import main

    filler = _Filler()
    if plant is not None:
        _plant(plant, filler)
    data = b"".join(build(spec, filler) for spec in specs)
    channel, worker = main.CHANNEL, main.WORKER
    assert channel is not None and worker is not None, "not inside a worker"
    with worker.outbox.lock:
        channel.sendall(data)
    if then == "exit":
        os._exit(3)
    if then == "hang":
        time.sleep(HANG_SECONDS)
        raise AssertionError("the host never retired this worker")
    return "the real reply"


def replace_block_then_reply(how: str, size: int) -> Any:
    """Reply with a ``size``-byte array through shared memory, but first change the block the
    reply will use behind the envelope's back: ``"unlink"`` (its name is gone; a host that
    mapped the block before still has its memory), ``"shrink"`` (truncated to one page: the
    worker's own copy into it faults)."""
    import numpy as np

    from comfy_env_worker import main, shm

    assert main.WORKER is not None and main.WORKER.pool is not None
    pool = main.WORKER.pool
    block = pool.acquire(size)  # the block the reply will get back from the pool
    pool.release(block)
    path = os.path.join(shm.SHM_DIR, block.name)
    if how == "unlink":
        os.unlink(path)
    elif how == "shrink":
        os.truncate(path, 4096)
    return np.ones(size // 8, dtype=np.float64)
