"""The worker's serve loop: handshake, then one call at a time until EOF or SHUTDOWN.

Data flow (one worker process, one channel)::

    host  --GO------>  BOOT          one byte, once the runtime dir (this package) is complete
    host  <--HELLO---  worker        protocol, pid, Python version, shared memory usable
    host  --CONFIG-->  worker        after the worker's HELLO (the worker meanwhile starts its
                                     watchdog and imports the canary's module)
    host  <--READY---  worker
    host  --CALL(1)--> worker        the canary, sent right behind CONFIG
    host  --CALL(id)-> worker        target, args, kwargs (pickle 5; cloudpickle by value)
    host  <-REPLY_OK(id) or REPLY_ERR(id)

The channel is two socketpairs: requests come in on one, replies (and events, log records) go
out on the other, so neither side is woken when the other reads what it sent. The main thread
owns it: it blocks in ``recv`` on the requests between calls, so the host closing its end (or
dying) is an EOF here and the worker exits. While a call runs, the main thread is busy, so a
small watchdog thread polls the requests socket for hang-up (``POLLRDHUP``, without reading)
and exits the process if the host goes away. The same thread reads CANCEL frames from the cancel
pipe (a second host -> worker descriptor, so the channel keeps one reader) and runs what call
control has due: see ``control`` for cancellation, progress and events. ``PR_SET_PDEATHSIG`` is
the second line of defence on Linux. Together they close the race "host killed while the worker
is inside a long native call".

The worker's own threads (the watchdog, the sentinel, a spare block's helper) never load a
library (a first import of an extension module, a ``dlopen`` or symbol lookup through ctypes)
while the env's code may run: a native library whose load-time initialiser drops and retakes
the GIL (USD in ``bpy``) deadlocks against them. What they need from C is loaded on the main
thread during the handshake (``native.load``) or before the helper starts
(``shm.load_native``).

The env's code may fork this process during a call (``os.fork``, ``multiprocessing``): an
``os.register_at_fork`` hook (``_forked_by_env_code``) gives the child a dead copy of the
channel, so only the worker ever reads a request or answers a call, and sends the child's
records to the log pipe. Code that closes the channel's descriptors ends the worker with a
line on fd 2 that says so (``_channel_failed``, the watchdog's ``POLLNVAL``).

The worker never writes to fd 1/2 on behalf of the protocol: those are pipes the host reads as
plain output. ``faulthandler`` writes there on a fatal signal, which is how a segfault's Python
stack reaches the host.

Stdlib only; parses under Python 3.8. Start-up imports only what the first call needs: the
channel is the C socket type (``_socket``), locks and the watchdog come from ``_thread``,
``_ctypes`` alone (not the ``ctypes`` package) arms the parent-death signal, and ``logging``,
``threading`` and ``ctypes`` load when first used, on the main thread.
"""

from __future__ import annotations

import _socket
import _thread
import faulthandler
import importlib
import io
import os
import pickle
import select
import sys
import time

from . import arrays, control, logs, native, refs, shm
from .protocol import (
    CANARY_TARGET,
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_GONE,
    FLAG_OOB,
    HEADER_SIZE,
    MSG_NOSIGNAL,
    PROTOCOL_VERSION,
    SENTINEL_THREAD_NAME,
    WATCHDOG_THREAD_NAME,
    CallNotLoaded,
    ChannelClosed,
    FrameError,
    FrameReader,
    FrameType,
    decode_header,
    encode_header,
    send_frame,
    send_parts,
)

TYPE_CHECKING = False  # typing costs ~3-5 ms at worker start-up; annotations are strings
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Set

_PICKLE_PROTOCOL = 5
# Bound at import, like everything the serve loop calls on a module: the env's code may
# replace ``pickle.dumps`` or ``time.monotonic`` in its own process.
_loads = pickle.loads
_dumps = pickle.dumps
_monotonic = time.monotonic

# Resolved "module:qualname" targets. Bounded: a host that sends many distinct names
# must not grow the worker without limit.
_TARGETS: Dict[str, Callable[..., Any]] = {}
_TARGET_CACHE_MAX = 1024


def resolve_target(target: str) -> Callable[..., Any]:
    """Import ``"pkg.module:function"`` (or ``module:Class.method``) and return the callable."""
    cached = _TARGETS.get(target)
    if cached is not None:
        return cached
    module_name, sep, qualname = target.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError("call target %r is not of the form 'package.module:function'" % (target,))
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise type(exc)(
            "cannot import module %r for call target %r in this env (%s): %s"
            % (module_name, target, sys.executable, exc)
        ) from None
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(
                "module %r has no attribute %r (call target %r)" % (module_name, qualname, target)
            ) from None
    if not callable(obj):
        raise TypeError("call target %r is a %s, not a callable" % (target, type(obj).__name__))
    if len(_TARGETS) >= _TARGET_CACHE_MAX:
        _TARGETS.clear()
    fn: Callable[..., Any] = obj
    _TARGETS[target] = fn
    return fn


def _salvage(get: Callable[[], Any], fallback: str) -> str:
    """``get()`` as a plain str, or ``fallback`` if it raises anything at all (an exception's
    ``__str__`` may raise even ``SystemExit``) or returns something else."""
    try:
        value = get()
        if type(value) is not str:
            return fallback
        return "".join((value,))  # a real str, not a subclass with surprises
    except BaseException:  # noqa: BLE001 - whatever it raises, the error reply must go out
        return fallback


def error_record(exc: BaseException, limit: Optional[int] = None) -> bytes:
    """Encode a remote exception: (type name, module, message, traceback text, pickled exc).

    The exception object itself is pickled when possible so the host can re-raise the same
    class; the text fields always survive, so an unpicklable exception is never lost. Nothing
    the exception does (a ``__str__``, ``__repr__`` or ``__reduce__`` that raises, even a
    ``BaseException``) stops the record: whatever can be salvaged goes out. With ``limit``
    (the frame limit) the record fits it: the pickled exception is dropped first, then the
    texts are clipped with a visible marker.
    """
    exc_type = type(exc)
    qualname = _salvage(lambda: exc_type.__qualname__, "<exception>")
    module = _salvage(lambda: exc_type.__module__, "builtins")
    message = _salvage(lambda: str(exc), "<unprintable %s>" % qualname)

    def formatted() -> str:
        import traceback  # only on the error path: it is slow to import at start-up

        return "".join(traceback.format_exception(exc_type, exc, exc.__traceback__))

    def stack_only() -> str:
        import traceback

        lines = traceback.format_tb(exc.__traceback__)
        return "".join(lines) + "%s: %s\n" % (qualname, message)

    tb_text = _salvage(formatted, "")
    if not tb_text:
        tb_text = _salvage(stack_only, "%s: %s\n" % (qualname, message))
    pickled: Optional[bytes]
    try:
        pickled = _dumps(exc, protocol=_PICKLE_PROTOCOL)
    except BaseException:  # noqa: BLE001 - a raising __reduce__: the text fields carry it
        pickled = None
    record = _dumps((qualname, module, message, tb_text, pickled), protocol=_PICKLE_PROTOCOL)
    budget = None if limit is None else limit - HEADER_SIZE - 1024
    if budget is None or len(record) <= budget:
        return record
    # Too large for one frame (a 2 MiB message under a 1 MiB limit): clip what is text.
    chars = max(256, budget // 10)
    return _dumps(
        (qualname[:256], module[:256], logs.clip(message, chars), logs.clip(tb_text, chars), None),
        protocol=_PICKLE_PROTOCOL,
    )


def _dumps_result(result: Any) -> bytes:
    try:
        return _dumps(result, protocol=_PICKLE_PROTOCOL)
    except Exception as plain_exc:  # noqa: BLE001
        try:
            import cloudpickle  # copied into the runtime dir by the host

            np = sys.modules.get("numpy")
            if np is None:
                return bytes(cloudpickle.dumps(result, protocol=_PICKLE_PROTOCOL))
            # Arrays version-neutral here too (``arrays``), all in band.
            out = io.BytesIO()
            pickler = arrays.array_pickler(cloudpickle.Pickler)(out, protocol=_PICKLE_PROTOCOL)
            arrays.use(pickler, np)
            pickler.dump(result)
            return out.getvalue()
        except Exception:  # noqa: BLE001
            raise TypeError(
                "the call returned a %s.%s, which cannot be pickled back to the host: %s"
                % (type(result).__module__, type(result).__qualname__, plain_exc)
            ) from None


class Worker:
    """One channel, one call at a time."""

    def __init__(
        self,
        sock: _socket.socket,
        log_fd: Optional[int] = None,
        requests: Optional[_socket.socket] = None,
    ) -> None:
        # ``sock`` is where frames go out (replies, events, log records); ``requests``, where
        # they come in: the other socketpair of a local worker's channel (one per direction,
        # see comfy_env._process), or None: ``sock`` both ways (the Ray actor's).
        self.sock = sock
        self.requests = sock if requests is None else requests
        # Every write on the channel goes through the outbox's lock (log records from other
        # threads share the channel during a call).
        self.outbox = logs.Outbox(sock, log_fd)
        self.log_level = "INFO"
        self.reader = FrameReader(self.requests, DEFAULT_MAX_FRAME_BYTES)
        self.max_frame_bytes = DEFAULT_MAX_FRAME_BYTES
        self.threshold = shm.MIN_BLOCK
        self.oob_min = shm.MIN_BLOCK
        # Shared memory (set up by CONFIG when the host enables it): blocks we send replies
        # in, mappings of the host's argument blocks, and reply blocks pinned until CONSUMED.
        self.pool: Optional[shm.BlockPool] = None
        self.mappings: Optional[shm.PeerMappings] = None
        self.pinned: Dict[int, _Pin] = {}
        self.pinned_ttl = 60.0
        # The host's pid (0: unknown, a Ray actor's), and what the watchdog saw of it at its
        # last look at the pins (``expire_pins``): when, whether it was running, and how long
        # it then meant to wait before the next look.
        self.host_pid = 0
        self.pins_seen_at = _monotonic()
        self.host_was_running = True
        self.pins_wait = 1.0
        self.pin_lock = _thread.allocate_lock()
        self.spares_pending: Set[int] = set()  # size classes a helper thread is faulting in
        self.control = control.CallControl(self.send_event, 0.5)
        self.spin_wait = 0.0  # seconds the serve loop polls for the next frame (CONFIG)

    def send_event(self, call_id: int, payload: bytes) -> bool:
        """An EVENT frame of the running call, in band (dropped once its reply went out)."""
        frame = encode_header(FrameType.EVENT, call_id, len(payload)) + payload
        outbox = self.outbox
        with outbox.lock:
            if not outbox.in_call:
                return False
            self.sock.sendall(frame, MSG_NOSIGNAL)
            return True

    def send(self, ftype: int, call_id: int, payload: bytes = b"") -> None:
        with self.outbox.lock:
            send_frame(self.sock, ftype, call_id, payload)

    def reply(self, ftype: int, call_id: int, payload: bytes) -> None:
        """Send a call's reply and end the call in one locked step: a log record written by
        another thread goes before the reply (in band) or after the call (to the log pipe),
        never after the reply on the channel where no caller would read it."""
        outbox = self.outbox
        with outbox.lock:
            send_frame(self.sock, ftype, call_id, payload)
            outbox.in_call = False

    def send_hello(self) -> None:
        hello = {
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "python": tuple(sys.version_info[:3]),
            "executable": sys.executable,
            "platform": "%s-%s"
            % (sys.platform, os.uname().machine if hasattr(os, "uname") else ""),
            "shm": shm.shm_available(),
        }
        self.send(FrameType.HELLO, 0, _dumps(hello, protocol=_PICKLE_PROTOCOL))

    def configure(self) -> None:
        """Read CONFIG, apply it, answer READY."""
        ftype, _flags, _call_id, payload = self.reader.read()
        if ftype != FrameType.CONFIG:
            raise FrameError("expected CONFIG, got frame type %d" % ftype)
        config = _loads(payload)
        self.apply_config(config)
        self.send(FrameType.READY, 0)

    def apply_config(self, config: Dict[str, Any]) -> None:
        for entry in reversed(config.get("sys_path") or ()):
            if entry not in sys.path:
                sys.path.insert(1, entry)
        activation = config.get("activation")
        if activation:  # the env's activation, where the host did not launch this process
            os.environ.update(activation.get("env") or {})
            if activation.get("path") is not None:
                os.environ["PATH"] = activation["path"]
            elif activation.get("path_prefix"):
                entries = list(activation["path_prefix"])
                if os.environ.get("PATH"):
                    entries.append(os.environ["PATH"])
                os.environ["PATH"] = os.pathsep.join(entries)
        os.environ.update(config.get("env") or {})  # env_vars win over the activation
        cwd = config.get("cwd")
        if cwd:
            os.chdir(cwd)
        self.log_level = str(config.get("log_level") or "INFO")
        limit = int(config.get("max_frame_bytes") or DEFAULT_MAX_FRAME_BYTES)
        self.max_frame_bytes = limit
        self.reader.limit = limit
        self.outbox.max_payload = min(logs.RECORD_CAP, limit - 4096)
        self.control.max_payload = limit
        self.threshold = int(config.get("shm_threshold_bytes") or shm.MIN_BLOCK)
        # Buffers this large leave the pickle; all of a reply's go through shared memory when
        # they add up to ``threshold``, else inline (never a mix of the two paths).
        self.oob_min = int(config.get("oob_min_bytes") or self.threshold)
        refs.GENERATION = int(config.get("generation") or 0)
        self.control.interrupt_after = float(config.get("cancel_interrupt_after") or 0.0)
        self.spin_wait = float(config.get("spin_wait") or 0.0)
        host_id = config.get("shm_host_id")
        if host_id and shm.shm_available():
            prefix = "%s%s-w%d-" % (shm.NAME_PREFIX, host_id, os.getpid())
            self.pool = shm.BlockPool(prefix, int(config.get("shm_pool_bytes") or 0))
            self.mappings = shm.PeerMappings("%s%s-h" % (shm.NAME_PREFIX, host_id))
            self.pinned_ttl = float(config.get("shm_pinned_ttl") or 60.0)

    def serve(self) -> None:
        read = self.reader.read
        call = FrameType.CALL
        while True:
            ftype, flags, call_id, payload = read()
            if ftype == call:
                try:
                    self.run_call(call_id, flags, payload)
                except control.Cancelled as exc:
                    # The asynchronous Cancelled landed in run_call's own error handling,
                    # before the reply went out: the call ends cancelled.
                    self.control.end()
                    self.reply(FrameType.REPLY_ERR, call_id, error_record(exc))
            elif ftype == FrameType.CONSUMED:
                self.consumed(call_id, bool(flags & FLAG_GONE))
            elif ftype == FrameType.RELEASE_REFS:
                refs.release(_loads(payload))
            elif ftype == FrameType.PING:
                self.send(FrameType.PONG, call_id)
            elif ftype == FrameType.SHUTDOWN:
                refs.run_release_hooks()  # drop caches cleanly before the host reaps us
                return
            else:
                # Never silence: the host learns at once that we did not understand.
                msg = "worker does not accept frame type %d" % ftype
                self.send(FrameType.ERROR, call_id, msg.encode("utf-8"))

    def run_call(self, call_id: int, flags: int, payload: Any) -> None:
        # No lock needed to start a call: a record another thread is writing right now went
        # to the log pipe, and it was logged before the call began.
        self.outbox.in_call = True
        arg_views: List[Any] = []
        sources: List[Optional[str]] = []
        try:
            try:
                if flags & FLAG_OOB:
                    target, args, kwargs = self._load_oob(payload, arg_views, sources)
                else:
                    target, args, kwargs = _loads(payload)
            except (FrameError, refs.StaleRefError):
                raise  # (a released RemoteRef among the arguments: told as itself)
            except (Exception, SystemExit) as exc:  # whatever the arguments' reducers raise
                raise _not_loaded(exc) from exc
            del payload
            if type(target) is str:
                fn = _TARGETS.get(target) or resolve_target(target)
            else:
                fn = target  # a function sent by value (cloudpickle)
            calls = self.control
            if calls.begin(call_id):
                calls.end()
                raise control.Cancelled("the call was cancelled before it started")
            try:
                result = fn(*args, **kwargs)
            finally:
                calls.end()
            del args, kwargs
            try:
                if type(result) in shm.SCALARS:  # the common small result: nothing to scan
                    data, buffers = _dumps(result, protocol=_PICKLE_PROTOCOL), shm.NO_BUFFERS
                else:
                    data, buffers = shm.encode(result, self.oob_min, _dumps, (result,))
            except Exception:  # noqa: BLE001 - cloudpickle fallback, or a clear TypeError
                data, buffers = _dumps_result(result), []
            del result
        except FrameError:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit/KeyboardInterrupt are replies too
            try:
                data = self._error_data(exc)
            finally:
                del exc  # (its traceback holds the call's frames, and views in them)
            retained = self.release_args(arg_views, sources) if arg_views else arg_views
            self.reply_error(call_id, data, retained)
            return
        if not buffers:
            retained = self.release_args(arg_views, sources) if arg_views else arg_views
        else:
            # Copy the result's buffers into our reply block *before* letting go of the
            # arguments: a result that is (a view of) an argument still points into the
            # host's block, and must not make that block look retained.
            # A result in the host's own argument blocks (an echo, a slice, an update in
            # place) goes back as references to them: no copy here, and the host keeps that
            # block out of its pool while the result lives.
            echo = shm.echo_table(buffers, self.mappings, sources) if sources else None
            if echo is not None:
                del buffers  # (before the release: these views point into the host's blocks)
                self._reply_echo(call_id, data, echo, arg_views, sources)
                return
            table, block, inline = _place(buffers, self.pool, self.threshold)
            if block is not None:
                del buffers
                buffers = []
            retained = self.release_args(arg_views, sources) if arg_views else arg_views
            self.reply_oob(call_id, data, table, block, inline, retained)
            return
        if not retained:
            if len(data) > self.max_frame_bytes:
                self.reply_too_big(call_id, len(data), [])
                return
            self.reply(FrameType.REPLY_OK, call_id, data)
            return
        self.reply_oob(call_id, data, [], None, [], retained)

    def _error_data(self, exc: BaseException) -> bytes:
        """The error record of a call that raised ``exc`` (a worker out of memory under its
        limit exits instead, see ``_exit_out_of_memory``); the call control disarmed first."""
        self.control.end()  # idempotent: disarm before anything else runs
        if _memory_rlimit and isinstance(exc, MemoryError):
            _exit_out_of_memory(self)
        return error_record(exc, self.max_frame_bytes)

    def _load_oob(self, payload: Any, arg_views: List[Any], sources: List[Optional[str]]) -> Any:
        """Unpickle a call whose buffers came out of band: ``arg_views`` and ``sources`` (the
        caller's, empty) get the buffers' views and the host's blocks they lie in as soon as
        they are known, so the caller releases them whatever fails next."""
        try:
            body, views, names, _ = shm.unpack(payload, self.mappings, copy_out=False)
        except ValueError as exc:
            raise FrameError("bad out-of-band call payload: %s" % exc) from None
        arg_views.extend(views)
        sources.extend(names)
        del views
        return _loads(body, buffers=[pickle.PickleBuffer(v) for v in arg_views])

    def _reply_echo(
        self,
        call_id: int,
        data: bytes,
        echo: List[Any],
        arg_views: List[Any],
        sources: List[Optional[str]],
    ) -> None:
        """Reply with a result that lies in the host's own argument blocks (an echo, a slice,
        an update in place): as references to them (``echo``), no copy here; the host keeps
        those blocks out of its pool while the result lives."""
        retained = self.release_args(arg_views, sources)
        if not retained or not any(entry[1] in retained for entry in echo):
            self.reply_oob(call_id, data, echo, None, [], retained)
            return
        # The function also kept what it returned (a cache): the caller gets its own copy
        # instead of sharing memory with the cache, read back from our mapping.
        mappings = self.mappings
        assert mappings is not None
        buffers = [mappings.view(e[1], e[2], e[3]) for e in echo]
        table, block, inline = _place(buffers, self.pool, self.threshold)
        self.reply_oob(call_id, data, table, block, inline, retained)

    def reply_oob(
        self,
        call_id: int,
        data: bytes,
        table: shm.Table,
        block: Optional[shm.Block],
        inline: List[memoryview],
        retained: List[str],
    ) -> None:
        pool = self.pool
        parts, length = shm.frame_parts(table, data, inline, pool, retained)
        del inline
        if length > self.max_frame_bytes:
            if block is not None and pool is not None:
                pool.release(block)
            self.reply_too_big(call_id, length, retained)
            return
        if block is not None:
            with self.pin_lock:
                self.pinned[call_id] = _Pin(block, _monotonic())
        header = encode_header(FrameType.REPLY_OK, call_id, length, FLAG_OOB)
        with self.outbox.lock:
            send_parts(self.sock, [header, *parts])
            self.outbox.in_call = False
        if block is not None and pool is not None and pool.wants_spare(block.size):
            self.spare_soon(block.size)

    def spare_soon(self, size: int) -> None:
        """The reply took the last idle block of its size (the host may keep the result, which
        is a loan of that block; ``BlockPool.wants_spare``): fault in a spare on a helper
        thread, after the reply went out, so the next call of that size finds one ready."""
        with self.pin_lock:
            if size in self.spares_pending:
                return
            self.spares_pending.add(size)
        pool = self.pool

        def make() -> None:
            try:
                if pool is not None and not pool.has_idle(size):
                    pool.add_spare(size)
            except Exception:  # noqa: BLE001 - /dev/shm full: the next call makes its own
                pass
            finally:
                with self.pin_lock:
                    self.spares_pending.discard(size)

        import threading  # not at import: see _start_watchdog

        # What the helper needs from C (ctypes, libc's madvise) is loaded here, on the thread
        # that serves: the helper runs beside the env's next call, and a library it loaded
        # could deadlock against one that call loads (see ``native``).
        shm.load_native()
        threading.Thread(target=make, name="comfy-env-spare", daemon=True).start()

    def reply_too_big(self, call_id: int, length: int, retained: List[str]) -> None:
        too_big = OverflowError(
            "the result pickles to %d bytes, over the frame limit of %d bytes "
            "(PoolConfig.max_frame_bytes)" % (length, self.max_frame_bytes)
        )
        self.reply_error(call_id, error_record(too_big, self.max_frame_bytes), retained)

    def reply_error(self, call_id: int, record: bytes, retained: List[str]) -> None:
        """Send a call's error reply. The host's argument blocks the call kept (``retained``:
        a function that cached its argument, then raised) are named in an out-of-band
        envelope around the record, as beside a result, so the host never writes a later
        request into memory the worker still shows. (The envelope carries no dropped names:
        a few dozen bytes, within the margin ``error_record`` leaves under the frame limit.)"""
        if not retained:
            self.reply(FrameType.REPLY_ERR, call_id, record)
            return
        parts, length = shm.frame_parts([], record, [], None, retained)
        header = encode_header(FrameType.REPLY_ERR, call_id, length, FLAG_OOB)
        outbox = self.outbox
        with outbox.lock:
            send_parts(self.sock, [header, *parts])
            outbox.in_call = False

    @staticmethod
    def release_args(views: List[Any], sources: List[Optional[str]]) -> List[str]:
        """Let go of the host's argument blocks after a call. A block whose memory the call
        kept (an array stored in a cache) is reported as retained, so the host never reuses
        it. The views were handed to ``pickle.loads`` wrapped in ``PickleBuffer``, so every
        array built on one holds a buffer export of it: ``release`` fails exactly while such
        an array lives, and that export also keeps the mapping from ever being closed under
        the array."""
        retained = set()
        for view, name in zip(views, sources):
            try:
                view.release()
            except BufferError:
                if name is not None:
                    retained.add(name)
        del views[:]
        return sorted(retained)

    def consumed(self, call_id: int, gone: bool = False) -> None:
        """The host is done with the reply of ``call_id``: its block goes back to the pool,
        or, ``gone`` (the host found its name removed from /dev/shm), is given up."""
        with self.pin_lock:
            entry = self.pinned.pop(call_id, None)
        if entry is not None and self.pool is not None:
            if gone:
                self.pool.give_up(entry.block)
            else:
                self.pool.release(entry.block)

    def expire_pins(self) -> float:
        """Give up reply blocks the host never acknowledged (the TTL, ``shm_pinned_ttl``).
        Called by the watchdog at each wake-up; returns seconds until it should look again.

        The TTL counts only time the host was seen running: a reply sent to a host that is
        stopped (SIGSTOP, Ctrl-Z, a debugger) must still be there when the host goes on and
        opens it, or its result is lost (the race this prevents: a host stopped longer than
        the TTL with a reply in flight, whose block was unlinked before it could map it).
        So a pin's clock is reset whenever the host is seen stopped (state T or t in
        ``/proc/<host pid>/stat``), and an interval is counted only when the host was seen
        running at both ends of it (a new pin's start counts as such an end) and the interval
        was no longer than the watchdog meant to sleep (a longer one means this process did
        not run either: the machine was suspended or the VM paused, and the host may not
        have had a turn yet). A block is given up once the host was seen running for the
        TTL, unstopped, since the reply went out. A host that is gone needs no TTL: the
        watchdog ends the worker, and its blocks with it."""
        now = _monotonic()
        if not self.pinned:  # (read unlocked: a pin made meanwhile counts from its start)
            self.pins_seen_at, self.host_was_running, self.pins_wait = now, True, 1.0
            return 1.0
        stopped = _host_stopped(self.host_pid)
        normal = now - self.pins_seen_at <= self.pins_wait + _PIN_SLACK
        was_running = self.host_was_running
        seen_at = self.pins_seen_at
        ttl = self.pinned_ttl
        expired = []
        left = ttl
        with self.pin_lock:
            for call_id, pin in list(self.pinned.items()):
                if stopped:
                    pin.counted = 0.0
                elif normal and (was_running or pin.since > seen_at):
                    pin.counted += now - pin.since
                pin.since = now
                if pin.counted >= ttl:
                    expired.append(pin.block)
                    del self.pinned[call_id]
                else:
                    left = min(left, ttl - pin.counted)
            pinned = bool(self.pinned)
        self.host_was_running = not stopped
        self.pins_seen_at = now
        if self.pool is not None:
            for block in expired:
                self.pool.give_up(block)
        wait = min(1.0, max(0.01, left)) if pinned and not stopped else 1.0
        self.pins_wait = wait
        return wait

    def shm_stats(self) -> Dict[str, int]:
        with self.pin_lock:
            pinned = len(self.pinned)
        pool = self.pool
        return {
            "pinned": pinned,
            "blocks": len(pool.live) if pool is not None else 0,
            "idle_blocks": pool.idle_blocks if pool is not None else 0,
        }


class _Pin(object):
    """A reply block pinned until the host's CONSUMED: ``counted`` seconds of the TTL have
    passed (time the host was seen running), counted up to ``since``."""

    __slots__ = ("block", "counted", "since")

    def __init__(self, block: shm.Block, since: float) -> None:
        self.block = block
        self.counted = 0.0
        self.since = since


# Seconds a watchdog wake-up may come later than it meant to sleep before the interval is taken
# for a pause of this whole process (a suspended machine), not counted toward a pin's TTL.
_PIN_SLACK = 1.0


def _host_stopped(pid: int) -> bool:
    """Whether the host is stopped (a job-control stop or a debugger: state T or t). False
    where that cannot be read (no /proc, no pid: a Ray actor), and for a host that is gone
    (the watchdog's hang-up check ends the worker then)."""
    if not pid:
        return False
    try:
        fd = os.open("/proc/%d/stat" % pid, os.O_RDONLY)
    except OSError:
        return False
    try:
        data = os.read(fd, 1024)
    except OSError:
        return False
    finally:
        os.close(fd)
    # "pid (comm) S ...": the command may hold ")" and spaces, the state follows the last ")".
    end = data.rfind(b")")
    return end >= 0 and data[end + 2 : end + 3] in (b"T", b"t")


def _name_this_thread(name: str) -> None:
    """Name the calling thread (its ``comm``) so the host can find it; best effort."""
    try:
        fd = os.open("/proc/thread-self/comm", os.O_WRONLY)
    except OSError:
        return  # no /proc: the host then sees this worker's death at its EOF only
    try:
        os.write(fd, name.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _exit_orphaned(worker: Worker, code: int = 0) -> None:
    """The host is gone: unlink our shared-memory blocks (nobody will ack them) and leave."""
    if worker.pool is not None:
        worker.pool.destroy_all()
    os._exit(code)


# The exit code of a worker whose channel the env's code closed or replaced (see
# ``_channel_failed``); 70 is a protocol error.
EXIT_CHANNEL_TAKEN = 71
# The exit code of a worker that met its memory limit where no cgroup counts it (``RLIMIT_DATA``,
# see ``_arm_memory_limit``): a MemoryError left the env's code; the worker's heap may be in any
# state, so it leaves and says so, as a worker the kernel killed at a cgroup's limit would.
EXIT_OUT_OF_MEMORY = 72
MEMORY_LIMIT_VAR = "COMFY_ENV_MEMORY_RLIMIT"
# Bytes of RLIMIT_DATA this worker set on itself (0: none).
_memory_rlimit = 0


def _arm_memory_limit() -> None:
    """Set ``RLIMIT_DATA`` (the heap and private writable mappings; not PROT_NONE reservations,
    not files or shared memory) to the bytes the host put in ``COMFY_ENV_MEMORY_RLIMIT``: the
    host does so only where it cannot give the worker a memory cgroup. On the main thread before
    the handshake (``resource`` is an extension module: no ``dlopen`` once env code may run)."""
    global _memory_rlimit
    raw = os.environ.get(MEMORY_LIMIT_VAR, "")
    if not raw.isdigit() or not int(raw):
        return
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (int(raw), int(raw)))
    except (ImportError, OSError, ValueError) as exc:
        _say("comfy-env: could not set the memory limit (RLIMIT_DATA): %s\n" % (exc,))
        return
    _memory_rlimit = int(raw)


def _peak_bytes() -> int:
    """This process's peak resident set (``VmHWM``), 0 where /proc does not tell."""
    try:
        fd = os.open("/proc/self/status", os.O_RDONLY)
    except OSError:
        return 0
    try:
        data = os.read(fd, 8192)
    except OSError:
        return 0
    finally:
        os.close(fd)
    for line in data.split(b"\n"):
        if line.startswith(b"VmHWM:"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) > 1 and parts[1].isdigit() else 0
    return 0


def _exit_out_of_memory(worker: Worker) -> None:
    """A MemoryError under RLIMIT_DATA: say the limit and the peak on fd 2 (the host reads the
    line back into ``WorkerOutOfMemory``) and leave with ``EXIT_OUT_OF_MEMORY``."""
    _say(
        "comfy-env: memory limit reached: limit=%d peak=%d (RLIMIT_DATA)\n"
        % (_memory_rlimit, _peak_bytes())
    )
    _exit_orphaned(worker, EXIT_OUT_OF_MEMORY)


def _say(text: str) -> None:
    """Write a line on fd 2 itself: ``sys.stderr`` sends records on the channel, which may be
    what failed. The host shows it as native stderr and in a crash report's last lines."""
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except OSError:
        pass


def _channel_failed(exc: OSError) -> int:
    """The channel failed under the serve loop: say why (on fd 2) and return the exit code.

    A process the env's code forked during a call and that returned from it lands here, its
    channel dead (``_forked_by_env_code``): it leaves without a word to the host. A worker
    whose channel descriptor was closed or replaced by the env's code (``os.closerange``, a
    daemonising library) says so, so that the host's crash report names the cause instead
    of a bare traceback; any other error is the host hanging up."""
    if _FORKED_CHILD:
        _say(
            "comfy-env worker: process %d, forked by the env's code during a call, returned "
            "from the call; it exits here (only the worker answers a call)\n" % os.getpid()
        )
        return 0
    import errno

    if exc.errno in (errno.EBADF, errno.ENOTSOCK):
        _say(
            "comfy-env worker: the worker's channel was closed or replaced by code in the "
            "worker (os.closerange, os.close or os.dup2 on a descriptor it does not own, a "
            "daemonising library?): %s; the worker exits\n" % (exc,)
        )
        return EXIT_CHANNEL_TAKEN
    return 0  # the host hung up (EPIPE, ECONNRESET): nobody is left to tell


# True in a process forked from a worker by the env's code (``_forked_by_env_code``).
_FORKED_CHILD = False


def _forked_by_env_code() -> None:
    """``os.register_at_fork(after_in_child=...)``: the env's code forked this process from a
    worker (``os.fork()``, ``multiprocessing`` with the fork start method).

    The child is a copy of the worker in the middle of a call: without this it would share
    the worker's channel, and a child that returns from the call (instead of ``os._exit``)
    would answer it, with its own result, and then read the host's next requests in a race
    with the worker: wrong results, then a ``ProtocolError``. Here its copies of the channel
    become a dead socket (reads see EOF, writes fail; the worker's own descriptors are
    untouched), so the child can never read a request or write a frame: one that returns
    from the call exits (``_channel_failed``). Its output and log records go to the log pipe
    (never in band, where they would interleave with the worker's frames), its locks are new
    (another thread may have held one at the fork), and it forgets the worker's
    shared-memory blocks, which stay the worker's to reuse and unlink."""
    global _FORKED_CHILD
    _FORKED_CHILD = True
    worker = WORKER
    if worker is None:
        return
    worker.pool = None
    worker.mappings = None
    worker.pinned = {}
    worker.pin_lock = _thread.allocate_lock()
    outbox = worker.outbox
    outbox.lock = _thread.allocate_lock()
    outbox.in_call = False
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, logs.LineStream):
            stream.renew_lock()
    fds = {worker.requests.fileno(), worker.sock.fileno()}
    try:
        dead, peer = _socket.socketpair()
    except OSError:  # out of descriptors: no dead socket to put there, so no channel at all
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        return
    peer.close()
    for fd in fds:
        os.dup2(dead.fileno(), fd, inheritable=False)
    dead.close()


def _not_loaded(exc: BaseException) -> CallNotLoaded:
    """The error of a call whose target and arguments did not unpickle (``exc``: what their
    reducers raised), naming which import error it was (any subclass counts) so the host can
    raise one."""
    if isinstance(exc, ModuleNotFoundError):
        kind, named = "ModuleNotFoundError", exc.name
    elif isinstance(exc, ImportError):
        kind, named = "ImportError", exc.name
    elif isinstance(exc, arrays.DtypeNotRepresentable):
        kind, named = "DtypeNotRepresentable", None
    else:
        kind, named = "", None
    return CallNotLoaded("%s: %s" % (type(exc).__name__, exc), kind, named)


def _place(buffers: List[Any], pool: Any, threshold: int) -> Any:
    """``shm.place`` for a reply's buffers: in a block of ``pool`` unless they are small in
    total (inline then, still no pickle copy) or shared memory is full or gone (streamed
    inline instead). Returns ``(table, block, inline)``."""
    if pool is not None and sum(b.nbytes for b in buffers) < threshold:
        pool = None
    try:
        return shm.place(buffers, pool)
    except OSError:
        return shm.place(buffers, None)


def _read_cancels(fd: int, buf: bytearray, calls: control.CallControl) -> bool:
    """Read CANCEL frames from the cancel pipe into ``calls``. False at EOF."""
    try:
        data = os.read(fd, 4096)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        data = b""
    if not data:
        return False
    buf += data
    now = _monotonic()
    while len(buf) >= HEADER_SIZE:
        try:
            ftype, _flags, _length, call_id = decode_header(buf)
        except FrameError:  # not the host's: only CANCEL frames are ever written here
            ftype = call_id = -1
        del buf[:HEADER_SIZE]
        if ftype == FrameType.CANCEL:
            calls.cancel(call_id, now)
    return True


def _start_watchdog(worker: Worker, host_pid: int, cancel_fd: Optional[int] = None) -> None:
    """Exit when the host's end of the channel hangs up, even while a call is running; expire
    pinned reply blocks on time (a timer, not a check on the next call); read CANCEL frames
    from the cancel pipe and run what call control has due (interrupt, progress flush)."""
    poll_hup = getattr(select, "POLLRDHUP", 0) | select.POLLHUP
    fd = worker.requests.fileno()  # the host's requests end: hung up when the host is gone
    calls = worker.control

    def watch() -> None:
        _name_this_thread(WATCHDOG_THREAD_NAME)
        _thread.start_new_thread(_sentinel, ())  # here: off the main thread's first call
        poller = select.poll()
        poller.register(fd, poll_hup)
        if cancel_fd is not None:
            poller.register(cancel_fd, select.POLLIN)
        pending = bytearray()
        wait = 1.0
        while True:
            events = poller.poll(min(wait, 1.0) * 1000 + 1)
            for _fd, ev in events:
                if _fd == cancel_fd:
                    if not _read_cancels(cancel_fd, pending, calls):
                        poller.unregister(cancel_fd)  # the host closed it: it is going away
                    continue
                if ev & select.POLLNVAL:
                    # Our descriptor is gone: the env's code closed it (os.closerange).
                    _say(
                        "comfy-env worker: the worker's channel was closed by code in the "
                        "worker (os.closerange, os.close on a descriptor it does not own, "
                        "a daemonising library?); the worker exits\n"
                    )
                    _exit_orphaned(worker, EXIT_CHANNEL_TAKEN)
                if ev & (poll_hup | select.POLLERR):
                    _exit_orphaned(worker)
            wait = min(worker.expire_pins(), calls.tick(_monotonic()))
            # Fallback for the case a descriptor copy keeps the channel open: the host is gone.
            if host_pid and os.getppid() != host_pid and not _launched_via_wrapper:
                _exit_orphaned(worker)

    # A bare thread: the threading module costs a worker 1.5-2 ms at start-up, before its
    # first call, and nothing on that path needs it. The watchdog never imports it either (an
    # import of threading on this thread would make this thread its main thread).
    _thread.start_new_thread(watch, ())


def _sentinel() -> None:
    """A thread that only waits, forever. When the worker is killed, the last of its threads
    to exit frees the address space before the channel closes; with the main thread and the
    watchdog alone, the watchdog is often that last one. A third thread makes sure one of the
    two the host watches ends early (see ``comfy_env._watchdog``)."""
    _name_this_thread(SENTINEL_THREAD_NAME)
    never = _thread.allocate_lock()
    never.acquire()
    never.acquire()  # blocks for the life of the process; no descriptor held


_launched_via_wrapper = False

# The socket the worker writes its frames on once ``main`` runs (the replies half of the
# channel); tests and fault-injection tasks use it to write raw bytes at the host. Nothing in
# the serve loop reads this global.
CHANNEL: Optional[_socket.socket] = None
WORKER: Optional[Worker] = None


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: ``main([requests fd, host pid, log fd, cancel fd, replies fd])`` (without
    a replies fd, the requests socket carries both directions)."""
    global _launched_via_wrapper, CHANNEL
    args = list(sys.argv[1:] if argv is None else argv)
    fd = int(args[0])
    host_pid = int(args[1]) if len(args) > 1 else 0
    log_fd = int(args[2]) if len(args) > 2 else None
    cancel_fd = int(args[3]) if len(args) > 3 else None
    reply_fd = int(args[4]) if len(args) > 4 else None
    _launched_via_wrapper = bool(host_pid) and os.getppid() != host_pid
    faulthandler.enable(all_threads=False)
    _arm_memory_limit()
    if host_pid and not _launched_via_wrapper and os.getppid() != host_pid:
        os._exit(0)  # the host died before we started
    # The C socket type: the ``socket`` module (its enums, ``selectors``) costs a worker
    # 2-3 ms at start-up, and the channel needs none of it.
    requests = _socket.socket(fileno=fd)
    os.set_inheritable(fd, False)  # our own children must not hold the channel open
    sock = requests
    if reply_fd is not None:
        sock = _socket.socket(fileno=reply_fd)
        os.set_inheritable(reply_fd, False)
    CHANNEL = sock
    # Ctrl-C in the host's terminal is the host's business; we run in our own session, but a
    # host may still forward SIGINT deliberately, which then interrupts the call as usual.
    if log_fd is not None:
        os.set_inheritable(log_fd, False)
    if cancel_fd is not None:
        os.set_inheritable(cancel_fd, False)
    os._exit(serve(Worker(sock, log_fd, requests), host_pid, cancel_fd))


def serve(worker: Worker, host_pid: int, cancel_fd: Optional[int]) -> int:
    """Handshake, then serve calls until the channel ends; returns the exit code (0: the host
    closed the channel or said SHUTDOWN, 70: a protocol error). Shared by ``main`` and the Ray
    actor (``ray_actor``), which sets up its own process."""
    global WORKER
    code = 0
    try:
        worker.host_pid = host_pid  # (whose stops the pins' TTL waits out: ``expire_pins``)
        worker.send_hello()
        # While the host answers HELLO (CONFIG, then the canary right behind it), what needs no
        # configuration: the watchdog's start and the canary's module. Started after READY,
        # the watchdog and the sentinel it starts took the GIL in turns with the canary (thread
        # starts, naming), and the import was part of the canary's call: 0.6 ms of the first
        # call's path (benchmarks/HISTORY.md, thirteenth round). Waiting here for the threads
        # to be up measured worse: the host's turn is shorter than their start.
        _start_watchdog(worker, host_pid, cancel_fd)
        try:
            resolve_target(CANARY_TARGET)
        except Exception:  # noqa: BLE001 - the canary's own call reports it to the host
            pass
        # Here, on this thread and before any of the env's code can run: the parent-death
        # signal, and the C functions the watchdog calls during a call. A library loaded (a
        # dlopen) by another thread while the env's code loads one deadlocks the worker (see
        # ``native``). About 0.5 ms of every start: CONFIG is usually here already (the host's
        # turn is shorter than this thread's work since HELLO), so the wait hides little.
        native.load()
        worker.configure()
        logs.install(worker.outbox, worker.log_level)
        WORKER = worker
        control.CONTROL = worker.control
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_forked_by_env_code)
        if host_pid:
            # From the first call on (the handshake waits on the host's start-up, not on a
            # reply). Not in a Ray actor (host_pid 0): its peer is a thread of this process,
            # which a polling thread would only contend with for the GIL.
            worker.reader.spin_wait(worker.spin_wait, host_pid)
        worker.serve()
    except ChannelClosed:
        code = 0  # the host closed the channel: nothing left to serve
    except FrameError as exc:
        sys.stderr.write("comfy-env worker: protocol error: %s\n" % exc)
        code = 70
    except OSError as exc:  # the channel itself failed (run_call catches the env's errors)
        code = _channel_failed(exc)
    finally:
        if worker.pool is not None:
            worker.pool.destroy_all()
        for stream in (sys.stdout, sys.stderr):
            try:
                if isinstance(stream, logs.LineStream):
                    stream.end_line()  # no newline will come: a pending line is a line
                elif stream is not None:
                    stream.flush()
            except Exception:  # noqa: BLE001
                pass
    return code
