"""The Ray backend: one Ray actor per worker generation (``PoolConfig(backend="ray")``).

Imported only when a pool selects it (``_backend.backend_for``); needs ``ray`` in the host (the
``ray`` extra: ``pip install '.[ray]'`` from the checkout; PyPI's ``comfy-env`` is another
project) and ``ray`` (same version, same Python minor) in every env.

Data flow of one generation (``RayWorker``, driven by the pool exactly like a
``_process.WorkerProcess``)::

    launch      preflight: the env's interpreter imports ray? same ray version and Python
                minor as the cluster? (a subprocess, bounded by start_timeout, cached per
                interpreter) -> else WorkerStartError naming the mismatch
                create the actor (max_restarts=0, max_task_retries=0: Ray never restarts or
                replays; the pool's gate, breaker and reaper stay the authority)
                submit wait_until_dead(): its failure is the actor's death notice (a Ray
                future callback -> the reactor -> on_exit / on_finished)
    handshake   actor.hello(CONFIG) within start_timeout, then the canary through the codec;
                CONFIG carries the env's activation (``_activation``, worked out on the host
                as for a local worker), which the runtime applies to the actor's own
                environment (its PATH prefixed), env_vars over it
    call        send_request: actor.call(id, flags, payload)        (one Ray task)
                reader.read(deadline): wait for it; while it runs, actor.drain() every
                poll interval brings LOG/EVENT frames (progress arrives while the call runs)
                the reply frame is the one the local worker sends (REPLY_OK / REPLY_ERR,
                the same pickled bodies), so _codec.decode_reply works unchanged
    cancel      send_cancel: actor.cancel(id) -> the runtime's CallControl (cooperative);
                the pool's grace timer then kills: ray.kill (no signal grace on Ray)
    crash       the call's task fails with ActorDiedError -> ChannelClosed -> the pool's
                WorkerCrashed; exit code unknown, the signal when the actor's log says it
                (faulthandler's "Segmentation fault" -> -11; the actor's own SIGTERM_WORDS
                -> -15), the log's last lines as tail; both only where the log is on this
                machine (a cluster this process started). A SIGTERM kills the actor at once
                (ray_actor replaces Ray's handler, which would wait for the call in flight)

Inside the actor (``comfy_env_worker.ray_actor``) the ordinary worker runtime serves the frames
on a private socketpair; see that module.

**Races**:
- the actor dies idle: the death notice retires the slot through the gate (``Exited``) and
  ``idle_channel_state`` says ``"closed"``, so the next call starts generation g+1 first. A
  call submitted in the few milliseconds before Ray reports the death fails as
  ``WorkerCrashed`` (Ray cannot tell "died before this task" from "died in it"); it is still
  never replayed.
- results never alias the object store: a reply with out-of-band buffers is copied into a
  private ``bytearray`` before the result is built on it (writable, owned by the caller).
- death notice vs. the caller's read: both end in the gate; whichever comes first retires the
  generation, the other is dropped as terminal. The gate's kill that answers the caller's
  ``ChannelClosed`` may come while the notice's thread still reads the log: a kill after the
  death was told is ignored, so the crash keeps its signal and tail.

**The cluster** (``_join_cluster``): ``ray.init(address=config.ray_address)`` when an address is
given and Ray is not initialised in this process; else an initialised Ray is joined as it is;
else a local cluster is started (``address="local"``: a new one of this process's, never a
``ray start`` cluster or ``$RAY_ADDRESS`` found on the machine; Ray's defaults for this
machine, no dashboard, ``log_to_driver=False``). Whoever initialised Ray shuts it down:
comfy-env calls ``ray.shutdown()`` when the last pool that made it initialise Ray closes, and
never touches a Ray the application initialised itself. Both run on ``_cluster_thread``,
which lives from the one to the other: a local cluster's processes die with the thread that
started them (PR_SET_PDEATHSIG), and the first call may come from a short-lived thread.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib
import json
import logging
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from comfy_env_worker import shm
from comfy_env_worker.protocol import (
    CANARY_TARGET,
    FLAG_OOB,
    HEADER_SIZE,
    ChannelClosed,
    FrameError,
    Payload,
)
from comfy_env_worker.ray_actor import SIGTERM_WORDS

from ._codec import encode_call, oob_threshold, worker_config
from ._envs import EnvSpec
from ._errors import ConfigError, SerializationError, WorkerStartError
from ._generation import Birth, GenerationFacts
from ._lifecycle import Stop
from ._logs import WorkerLog
from ._reactor import Reactor
from ._settings import Settings

if TYPE_CHECKING:
    from ._activation import Activation
    from ._memlimit import WorkerMemory
    from ._runtime_store import RuntimeDir

_log = logging.getLogger("comfy_env")

# None of: exit codes, signal grace, shared memory, fork, fd channel, descendants.
RAY_CAPABILITIES: frozenset[str] = frozenset()
# While a call runs, side frames (logs, progress) are fetched this often; the wait grows from
# the first to the last value, so a short call pays no drain at all.
POLL_INTERVALS = (0.02, 0.05, 0.1, 0.2)
_LOG_TAIL_BYTES = 16384
_FATAL_SIGNALS = (
    (b"Fatal Python error: Segmentation fault", 11),
    (b"Fatal Python error: Bus error", 7),
    (b"Fatal Python error: Aborted", 6),
    (b"Fatal Python error: Floating-point exception", 8),
    (b"Fatal Python error: Illegal instruction", 4),
    # The actor's own words as it dies of SIGTERM (Ray's handler would wedge it, see ray_actor).
    (SIGTERM_WORDS.encode(), 15),
)


def ray_module() -> Any:
    """``ray``, typed loosely (its own annotations are partial); ImportError if missing."""
    return importlib.import_module("ray")


# ---- the cluster ------------------------------------------------------------------------------

_cluster_lock = threading.Lock()
_cluster_users = 0  # pools that joined Ray and have not closed yet (e.g. 2)
# Set while comfy-env owns Ray (it called ray.init, so it calls ray.shutdown): the thread that
# ray.init ran on, kept until ray.shutdown has run on it (see _join_cluster). None otherwise.
_cluster_thread: Reactor | None = None


def cluster_endpoint(address: str) -> tuple[str, int] | None:
    """The (host, port) an address names (``host:port``, ``ray://host:port``), or None where
    Ray resolves it itself (``auto``, ``local``, no port)."""
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _probe(address: str, timeout: float) -> None:
    """Refuse an address nothing answers on within ``timeout``: ``ray.init`` itself retries an
    unreachable cluster for minutes (measured: over 2 min here), which would be a hang."""
    endpoint = cluster_endpoint(address)
    if endpoint is None:
        return
    try:
        socket.create_connection(endpoint, timeout=timeout).close()
    except OSError as exc:
        raise ClusterUnreachable(
            f"cannot reach the Ray cluster at {address!r} (PoolConfig.ray_address) within "
            f"{timeout:g}s: {exc}"
        ) from None


class ClusterUnreachable(OSError):
    """``ray_address`` names a cluster that does not answer (said before ``ray.init``)."""


class _SigtermWarningFilter(logging.Filter):
    """Drops Ray's "SIGTERM handler is not set ..." warning: ``ray.init`` runs off the main
    thread on purpose (see ``_join_cluster``), so the application's SIGTERM handling is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SIGTERM handler is not set")


def _init_ray(address: str | None, timeout: float) -> None:
    """``ray.init`` as comfy-env makes it (on the cluster thread)."""
    ray = ray_module()
    ray_logger = logging.getLogger("ray._private.worker")
    quiet = _SigtermWarningFilter()
    ray_logger.addFilter(quiet)
    try:
        if address:
            _probe(address, timeout)
            ray.init(address=address, log_to_driver=False)
        else:
            # Ray sizes a local cluster to the machine (CPUs, object store); actors need no
            # CPU of their own to run, so any number of workers fit. ``"local"``: a new
            # cluster of this process's, as documented; without it Ray joins whatever a
            # ``ray start`` left running on this machine, or ``$RAY_ADDRESS``, where a crash
            # report could not read the actor's log (and so names no signal).
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
    finally:
        ray_logger.removeFilter(quiet)


def _join_cluster(address: str | None, timeout: float) -> None:
    """Count one more pool on Ray; initialise Ray first if nobody has.

    comfy-env's ``ray.init`` runs on a thread of its own (``_cluster_thread``) that lives
    until the matching ``ray.shutdown``, never on the caller's: a local cluster's processes
    (gcs_server, raylet, agents) die with the *thread* that started them (PR_SET_PDEATHSIG),
    and the first call may come from a short-lived thread (a cold ``acall``, a joined
    ``threading.Thread``). A pool's reactor would not do: the cluster is shared by every pool
    of the process and outlives the pool that started it."""
    global _cluster_users, _cluster_thread
    ray = ray_module()
    with _cluster_lock:
        if not ray.is_initialized():
            thread = Reactor(name="comfy-env-ray-cluster")
            try:
                thread.start()
                thread.run_sync(lambda: _init_ray(address, timeout))
            except BaseException:
                # Also when this wait was interrupted (KeyboardInterrupt) while ray.init goes
                # on: the thread runs what was queued before it ends, so a cluster started
                # after all is shut down rather than left to die with the thread.
                thread.call_soon(_shutdown_if_initialised)
                thread.stop()
                raise
            _cluster_thread = thread
        _cluster_users += 1


def _shutdown_if_initialised() -> None:
    ray = ray_module()
    if ray.is_initialized():
        ray.shutdown()


def _leave_cluster() -> None:
    """Count one pool less; the last one out shuts down a Ray comfy-env initialised, on the
    thread that initialised it, and only then lets that thread end."""
    global _cluster_users, _cluster_thread
    with _cluster_lock:
        _cluster_users -= 1
        thread = _cluster_thread
        if _cluster_users == 0 and thread is not None:
            _cluster_thread = None
            try:
                thread.run_sync(ray_module().shutdown)
            finally:
                thread.stop()


def _local_head() -> Any:
    """The Ray node this process started (a local cluster), or None (joined a cluster)."""
    try:
        from ray._private import worker as ray_worker  # private: best effort only

        node = ray_worker._global_node
    except (ImportError, AttributeError):
        return None
    if node is None or not getattr(node, "head", False):
        return None
    return node


# ---- the actors of this process (the test suite's leak guard reads them) ----------------------

_actors_lock = threading.Lock()
# Actors this process created whose death Ray has not reported yet: actor id (hex) -> pid
# once known. Written under ``_actors_lock``.
_live_actors: dict[str, int | None] = {}


# ---- the runtime shipped to the actors ---------------------------------------------------------


def _runtime_files(runtime_dir: str) -> tuple[dict[str, bytes], str]:
    """The ``.py`` files of the runtime directory (comfy_env_worker and cloudpickle), by
    relative path, and their digest."""
    files: dict[str, bytes] = {}
    for package in ("comfy_env_worker", "cloudpickle"):
        root = os.path.join(runtime_dir, package)
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    with open(path, "rb") as fh:
                        files[os.path.relpath(path, runtime_dir).replace(os.sep, "/")] = fh.read()
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + files[rel] + b"\0")
    return files, digest.hexdigest()[:32]


# Interpreters proven fit (path, inode, mtime: a replaced interpreter is checked again). A
# failure is not kept: the env may be fixed meanwhile, and it is said at every start.
_fit_lock = threading.Lock()
_fit_interpreters: set[tuple[Any, ...]] = set()

_PREFLIGHT = (
    "import json, sys\n"
    "out = {'python': list(sys.version_info[:3]), 'executable': sys.executable}\n"
    "try:\n"
    "    import ray\n"
    "    out['ray'] = ray.__version__\n"
    "except BaseException as exc:\n"
    "    out['ray_error'] = '%s: %s' % (type(exc).__name__, exc)\n"
    "print('COMFY-ENV-PREFLIGHT ' + json.dumps(out))\n"
)


class RayBackend:
    """Workers as Ray actors (see the module docstring)."""

    name = "ray"
    capabilities = RAY_CAPABILITIES

    def __init__(self, config: Settings) -> None:
        try:
            ray_module()  # at pool creation, not at the first call
        except ImportError as exc:
            raise ConfigError(
                # Not 'comfy-env[ray]': on PyPI that name is another project.
                f"PoolConfig.backend='ray' needs ray in the host: pip install 'ray>=2.60' "
                f"(the ray extra of comfy-env) ({exc})",
                field="backend",
                value="ray",
            ) from None
        self.config = config
        self._lock = threading.Lock()
        self._joined = False
        self._closed = False
        self._shipped: tuple[str, Any, str] | None = None  # runtime dir, files ref, digest
        self._actor_class: Any = None

    def new_generation(self, birth: Birth) -> RayWorker:
        return RayWorker(self, birth)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            joined, self._joined = self._joined, False
            self._shipped = None
        if joined:
            _leave_cluster()

    # ---- used by RayWorker.launch ----

    def preflight(self, spec: EnvSpec, timeout: float) -> None:
        """Prove the env can host an actor (ray importable at the cluster's version, same
        Python minor) or raise ``WorkerStartError`` naming the mismatch. A success is kept
        per interpreter file for the process (see ``_fit_interpreters``)."""
        ray = ray_module()
        try:
            st = os.stat(spec.interpreter)
            key: tuple[Any, ...] | None = (spec.interpreter, st.st_ino, st.st_mtime_ns)
        except OSError:
            key = None
        with _fit_lock:
            if key is not None and key in _fit_interpreters:
                return
        try:
            out = subprocess.run(
                [spec.interpreter, "-c", _PREFLIGHT],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=timeout,
                env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
                # Not the caller's directory: ``-c`` puts it first on sys.path, and Ray's own
                # ``/tmp/ray`` session folder, seen from /tmp, imports as an empty ``ray``.
                cwd=os.path.dirname(spec.interpreter) or "/",
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise self._unfit(
                spec, f"importing ray there took longer than start_timeout={timeout:g}s"
            ) from None
        except OSError as exc:
            raise self._unfit(spec, f"its interpreter cannot run: {exc}") from None
        found = re.search(rb"COMFY-ENV-PREFLIGHT (\{.*\})", out.stdout)
        if found is None:
            tail = out.stderr.decode("utf-8", "replace")[-2000:]
            raise self._unfit(spec, f"its interpreter failed (exit {out.returncode}): {tail}")
        facts = json.loads(found.group(1))
        python = tuple(facts["python"][:2])
        host = tuple(sys.version_info[:2])
        why = None
        if python != host:
            why = (
                f"it runs Python {python[0]}.{python[1]}, the Ray cluster Python "
                f"{host[0]}.{host[1]} (Ray actors need the cluster's Python minor version)"
            )
        elif "ray" not in facts:
            why = (
                f"ray is not importable there ({facts.get('ray_error')}); install "
                f"ray=={ray.__version__} in the env"
            )
        elif facts["ray"] != ray.__version__:
            why = (
                f"it has ray {facts['ray']}, the cluster ray {ray.__version__}; install "
                f"ray=={ray.__version__} in the env"
            )
        if why is not None:
            raise self._unfit(spec, why)
        if key is not None:
            with _fit_lock:
                _fit_interpreters.add(key)

    @staticmethod
    def _unfit(spec: EnvSpec, why: str) -> WorkerStartError:
        return WorkerStartError(
            f"env {spec.key} ({spec.interpreter}) cannot host a Ray actor: {why}",
            env=spec.key,
        )

    def create_actor(self, spec: EnvSpec, runtime: RuntimeDir) -> Any:
        ray = ray_module()
        try:
            runtime_dir = runtime.ready()  # its files travel with the actor class
        except (OSError, ImportError) as exc:
            raise WorkerStartError(
                f"cannot prepare the runtime directory {runtime.path} for env {spec.key}: {exc}",
                env=spec.key,
            ) from exc
        with self._lock:
            if self._closed:
                raise WorkerStartError("the pool was closed", env=spec.key)
            if not self._joined:
                try:
                    _join_cluster(self.config.ray_address, self.config.start_timeout)
                except ClusterUnreachable as exc:
                    raise WorkerStartError(str(exc), env=spec.key) from None
                except Exception as exc:  # ray.init's own refusal, told as such
                    # The cluster, not the actor, failed (a malformed address, ``ray://``
                    # without ``ray[client]``, a connection refused): said so, once a pool.
                    address = self.config.ray_address
                    where = (
                        f"join the Ray cluster at {address!r} (PoolConfig.ray_address)"
                        if address
                        else "start a local Ray cluster"
                    )
                    raise WorkerStartError(
                        f"cannot {where} for env {spec.key}: {type(exc).__name__}: {exc}",
                        env=spec.key,
                    ) from exc
                self._joined = True
            if self._actor_class is None:
                from comfy_env_worker import ray_actor

                # The env has no comfy_env_worker yet: the class travels by value, and the
                # runtime's files with it (see ray_actor).
                importlib.import_module("ray.cloudpickle").register_pickle_by_value(ray_actor)
                self._actor_class = ray.remote(ray_actor.RayWorkerActor)
            if self._shipped is None or self._shipped[0] != runtime_dir:
                files, digest = _runtime_files(runtime_dir)
                self._shipped = (runtime_dir, ray.put(files), digest)
            _, files_ref, digest = self._shipped
            actor_class = self._actor_class
        options: dict[str, Any] = {
            "max_restarts": 0,
            "max_task_retries": 0,
            "max_concurrency": 8,
        }
        # Unresolved paths: every venv's python links to the same base interpreter, and a
        # venv is its own env only when launched by its own path.
        same_python = os.path.abspath(spec.interpreter) == os.path.abspath(sys.executable)
        if not (same_python and _local_head() is not None):
            # The actor runs under the env's own interpreter (experimental in Ray). A local
            # cluster of this very interpreter needs none: its pooled workers start faster.
            options["runtime_env"] = {"py_executable": spec.interpreter}
        return actor_class.options(**options).remote(files_ref, digest)


class _Reader:
    """``FrameSource`` of a Ray generation: frames of the call in flight, in order."""

    def __init__(self, worker: RayWorker) -> None:
        self._worker = worker
        self.frames: deque[tuple[int, int, int, Payload]] = deque()

    @property
    def buffered(self) -> int:
        return len(self.frames)

    def read(self, deadline: float | None) -> tuple[int, int, int, Payload]:
        """The next frame: a side frame (LOG, EVENT) fetched while the call runs, or its
        reply. ``ChannelClosed`` if the actor died, ``TimeoutError`` past ``deadline``."""
        if self.frames:
            return self.frames.popleft()
        worker = self._worker
        ref = worker.pending
        if ref is None:
            raise FrameError("nothing was sent to read a reply for")
        ray = ray_module()
        polls = iter(POLL_INTERVALS)
        interval = next(polls)
        while True:
            wait = interval
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            ready, _ = ray.wait([ref], timeout=wait)
            if ready:
                worker.pending = None
                try:
                    side, reply = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    worker.died(exc)
                    raise ChannelClosed() from None
                except ray.exceptions.RayTaskError as exc:
                    # The actor method itself failed (its socketpair broke): a protocol fault.
                    raise FrameError(f"the actor failed to relay the call: {exc}") from None
                except ray.exceptions.RayError as exc:
                    # Ray failed under the call (an object lost, the cluster going away): the
                    # actor cannot be trusted with the next one; reported as its death.
                    worker.fault = RayWorker._said(exc)
                    worker.kill(Stop.KILL)
                    raise ChannelClosed() from None
                self._side(side)
                self.frames.append(reply)
                return self.frames.popleft()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("deadline passed")
            drain_for = 10.0 if deadline is None else deadline - time.monotonic()
            try:
                side = ray.get(worker.actor.drain.remote(), timeout=max(0.01, drain_for))
            except Exception:  # noqa: BLE001 - dead or slow: the call's own result says which
                side = []
            if side:
                self._side(side)
                return self.frames.popleft()
            interval = next(polls, interval)

    def _side(self, side: list[tuple[int, int, bytes]]) -> None:
        for ftype, call_id, payload in side:
            self.frames.append((ftype, 0, call_id, payload))


class RayWorker(GenerationFacts):
    """One worker generation as one Ray actor (the ``WorkerGeneration`` members)."""

    def __init__(self, backend: RayBackend, birth: Birth) -> None:
        super().__init__(birth)  # (``death_detail``: what Ray said about the death)
        self.backend = backend
        self._on_exit = birth.on_exit
        self._on_finished = birth.on_finished
        self.sock: Any = None  # no descriptor: the asyncio path runs calls on a thread
        self.returncode: int | None = None  # Ray reports none; a signal when the log says it
        self.memory: WorkerMemory | None = None  # (Ray counts an actor's memory itself)
        self.fault: str | None = None  # a Ray error that made the host stop the actor
        self.exited = threading.Event()
        self.output_done = threading.Event()
        self.startup_seconds = 0.0
        spec = self.spec
        self.log = WorkerLog(spec.key, spec.name, self.generation, self.config.stderr_tail_lines)
        self.shm_state = "off"
        self.channel = None  # no fd channel: calls go through the actor (see ``_channel``)
        self.actor: Any = None
        self.actor_id = ""
        self.pending: Any = None  # the ObjectRef of the call in flight
        self._sentinel: Any = None  # the ObjectRef of wait_until_dead (the death notice)
        self._reader = _Reader(self)
        # ``read_frame``: the next frame that is not a log record or a call event (those are
        # handled on the way), the same reading as the local channel's, bound once.
        self.read_frame = functools.partial(self.log.read_past_side_frames, self._reader.read)
        self._death_lock = threading.Lock()
        self._dead = False
        self._kill_requested = False
        self._escalation: Any = None
        self._owner_pid = os.getpid()
        self.activation: Activation | None = None  # the env's, given to launch

    @property
    def reader(self) -> _Reader:
        return self._reader

    @property
    def python_version(self) -> tuple[int, ...]:
        return tuple(self.hello.get("python", ()))

    # ---- launch and handshake ----

    def launch(
        self,
        before_launch: Callable[[], None] | None = None,
        after_launch: Callable[[Any], None] | None = None,
        activation: Activation | None = None,
    ) -> None:
        """Preflight the env, then create the actor and watch for its death. ``activation``
        goes to the actor's runtime in its CONFIG (``handshake``)."""
        self.activation = activation
        self.backend.preflight(self.spec, self.config.start_timeout)
        if self._kill_requested:
            raise self.stopped_before_launch()
        if before_launch is not None:
            before_launch()
        try:
            self.actor = self.backend.create_actor(self.spec, self.runtime_dir)
        except WorkerStartError:
            raise
        except Exception as exc:  # Ray refused (bad address, no resources)
            raise WorkerStartError(
                f"cannot create a Ray actor for env {self.spec.key}: {type(exc).__name__}: {exc}",
                env=self.spec.key,
                generation=self.generation,
            ) from exc
        self.actor_id = self.actor._actor_id.hex()
        with _actors_lock:
            _live_actors[self.actor_id] = None
        # Held for the generation's life: the death notice must not depend on Ray keeping a
        # reference nobody holds.
        self._sentinel = self.actor.wait_until_dead.remote()
        self._sentinel.future().add_done_callback(lambda future: self._death_notice(future))
        if after_launch is not None:
            after_launch(self)
        if self._kill_requested:
            self._ray_kill()

    def handshake(self, deadline: float) -> None:
        """HELLO/CONFIG/READY through ``actor.hello``, then the canary. ``WorkerStartError``
        on anything else, a death, or ``start_timeout``."""
        ray = ray_module()
        started = time.monotonic()
        # No shared memory between the host and an actor.
        config = worker_config(
            self.config,
            self.generation,
            None,
            0,
            None if self.activation is None else self.activation.for_config(),
        )
        try:
            hello = ray.get(
                self.actor.hello.remote(pickle.dumps(config, protocol=5)),
                timeout=max(0.0, deadline - time.monotonic()),
            )
            self.hello = dict(hello)
            self.pid = int(hello["pid"])
            self.log.pid = self.pid
            with _actors_lock:
                if self.actor_id in _live_actors:
                    _live_actors[self.actor_id] = self.pid
            self._canary(deadline)
        except (ray.exceptions.GetTimeoutError, TimeoutError):
            raise self._start_error(
                f"did not finish its start-up within {self.config.start_timeout:g}s "
                "(PoolConfig.start_timeout)"
            ) from None
        except (ray.exceptions.RayActorError, ChannelClosed) as exc:
            self.died(exc if isinstance(exc, ray.exceptions.RayActorError) else None)
            raise self._start_error(f"died during start-up ({self._said(exc)})") from None
        except (ray.exceptions.RayError, FrameError, KeyError, ValueError) as exc:
            raise self._start_error(f"failed its handshake: {self._said(exc)}") from None
        self.startup_seconds = time.monotonic() - started

    def _canary(self, deadline: float) -> None:
        from ._handshake import canary_check, canary_value

        value = canary_value(min(self.config.shm_threshold_bytes, self.config.max_frame_bytes // 4))
        body, buffers, _ = encode_call(
            CANARY_TARGET, (value,), {}, oob_threshold(self.config.shm_threshold_bytes)
        )
        self.send_request(1, body, buffers, deadline)
        canary_check(self, deadline, value, None)

    @staticmethod
    def _said(exc: BaseException) -> str:
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else ''}"

    def _start_error(self, what: str) -> WorkerStartError:
        from ._handshake import start_error

        return start_error(self, what, who="Ray actor", drain=2.0)

    # ---- requests and replies (the lease holder) ----

    def send_request(
        self, call_id: int, body: bytes, buffers: list[memoryview], deadline: float | None
    ) -> None:
        """Submit ``actor.call``. Out-of-band buffers travel inline in the payload (one join);
        ``SerializationError`` (nothing sent) over ``max_frame_bytes``; ``BrokenPipeError``
        (nothing sent) if the actor is known dead."""
        flags = 0
        payload: Any = body
        if buffers:
            parts, _, length = shm.pack(body, buffers, None)
            if length + HEADER_SIZE > self.config.max_frame_bytes:
                raise SerializationError(
                    f"the call's payload is {length} bytes, over PoolConfig.max_frame_bytes="
                    f"{self.config.max_frame_bytes}"
                )
            payload = b"".join(parts)
            flags = FLAG_OOB
        elif len(body) + HEADER_SIZE > self.config.max_frame_bytes:
            raise SerializationError(
                f"the call's payload is {len(body)} bytes, over PoolConfig.max_frame_bytes="
                f"{self.config.max_frame_bytes}"
            )
        if self.exited.is_set() or self.actor is None:
            raise BrokenPipeError("the actor is gone")
        self._reader.frames.clear()
        self.pending = self.actor.call.remote(call_id, flags, payload)

    def open_reply(
        self, call_id: int, flags: int, payload: Payload
    ) -> tuple[Payload | memoryview, list[Any] | None, list[str]]:
        """Split a reply. Out-of-band buffers are rebuilt on a private, writable copy of the
        payload: a result never aliases Ray's object store (read-only, pinned)."""
        if flags & ~FLAG_OOB:
            raise FrameError(f"unknown frame flags 0x{flags:x} on the reply of call {call_id}")
        if not flags & FLAG_OOB:
            return payload, None, []
        private = bytearray(payload)
        try:
            body, buffers, _, _ = shm.unpack(private, None, copy_out=True)
        except (ValueError, OSError) as exc:
            raise FrameError(f"bad out-of-band reply: {exc}") from None
        return body, buffers, []

    def finish_request(self, block: Any, retained: list[str]) -> None:
        pass  # no shared memory: nothing to release

    def idle_channel_state(self) -> str:
        """``"closed"`` once Ray reported the actor dead, ``"dirty"`` if frames nobody asked
        for are buffered, else ``"quiet"``."""
        if self.exited.is_set():
            return "closed"
        if self._reader.frames:
            return "dirty"
        return "quiet"

    def ping(self, timeout: float) -> bool:
        ray = ray_module()
        try:
            return bool(ray.get(self.actor.ping.remote(), timeout=timeout))
        except Exception:  # noqa: BLE001 - dead, hung or broken: not healthy
            return False

    def send_cancel(self, call_id: int) -> bool:
        """Ask the actor's runtime to stop ``call_id`` (any thread; submits, never waits)."""
        actor = self.actor
        if actor is None or self.exited.is_set() or os.getpid() != self._owner_pid:
            return False
        try:
            actor.cancel.remote(call_id)
        except Exception:  # noqa: BLE001 - the grace timer settles it
            return False
        return True

    def release_refs(self, ref_ids: list[int]) -> None:
        if self.actor is not None and not self.exited.is_set():
            self.actor.release_refs.remote(pickle.dumps(ref_ids, protocol=5))

    def release_refs_now(self, ref_ids: list[int]) -> bool:
        """Not from the background release: submitting to Ray under the entry's lock could
        wait on Ray itself. The next call on this actor releases them first, as before."""
        return False

    # ---- stopping ----

    def kill(self, stop: Stop) -> None:
        """Stop the actor. Idempotent. ``ASK`` sends SHUTDOWN (release hooks run, the actor
        exits) and ``ray.kill`` after ``kill_grace``; ``TERMINATE`` and ``KILL`` are
        ``ray.kill`` at once (Ray has no signal grace)."""
        with self._death_lock:
            if self._dead:
                # Ray told the death already: a kill now is the pool's answer to it (the
                # gate's kill on ChannelClosed), not its cause, and must not make ``died``,
                # maybe still reading the log on another thread, call it "stopped".
                return
            self._kill_requested = True
        if self.actor is None or self.exited.is_set():
            return
        if stop is Stop.ASK and self.config.kill_grace > 0 and self.reactor.running:
            try:
                self.actor.shutdown.remote(self.config.kill_grace)
            except Exception:  # noqa: BLE001
                self._ray_kill()
                return
            if self._escalation is None:
                self._escalation = self.reactor.call_later(self.config.kill_grace, self._ray_kill)
            return
        self._ray_kill()

    def _ray_kill(self) -> None:
        if self.actor is None or self.exited.is_set() or os.getpid() != self._owner_pid:
            return
        try:
            ray_module().kill(self.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already gone, or Ray shut down
            _log.debug("comfy-env: ray.kill of actor %s: %s", self.actor_id, exc)

    def status_at_eof(self) -> int | None:
        """Never known at once: Ray tells an actor's death in its own notice (``wait_exit``)."""
        return None

    def request_unread(self) -> bool:
        """Never known: an EOF here is the actor's, not one the host made."""
        return False

    def collect_exit(self) -> None:
        """Nothing to collect on the caller's thread: Ray reports an actor's death through its
        own notice (``_death_notice``), which ``wait_exit`` waits for."""

    def wait_exit(self, timeout: float) -> int | None:
        """The return code once Ray reported the death (None: unknown, see ``death_detail``)."""
        self.exited.wait(timeout)
        return self.returncode

    def wait_output(self, timeout: float) -> None:
        self.output_done.wait(timeout)

    # ---- the death notice ----

    def _death_notice(self, future: Any) -> None:
        """A Ray thread: ``wait_until_dead`` failed, so the actor is gone. Handled on the
        reactor (as a local worker's exit is), or on a thread of its own once it stopped: this
        Ray thread must not run pool effects that call back into Ray."""
        try:
            exc = future.exception()
        except BaseException as cancelled:  # noqa: BLE001 - a cancelled future: Ray shut down
            exc = cancelled
        if self.reactor.running:
            self.reactor.call_soon(lambda: self.died(exc))
        else:
            # daemon given: left to inherit it, Thread() would ask current_thread(), which
            # registers this Ray thread with `threading` for good (a _DummyThread).
            threading.Thread(
                target=self.died, args=(exc,), name="comfy-env-ray-death", daemon=True
            ).start()

    def died(self, exc: BaseException | None) -> None:
        """The actor is dead (any thread; once): read what its log says, report the exit, then
        the finish (exit code and last output are final at once)."""
        with self._death_lock:
            if self._dead:
                return
            self._dead = True
            stopped = self._kill_requested  # by the host, before the death (see ``kill``)
        if self._escalation is not None:
            self._escalation.cancel()
        with _actors_lock:
            _live_actors.pop(self.actor_id, None)
        text = str(exc) if exc is not None else ""
        pid = self.pid
        if pid is None:
            found = re.search(r"pid: (\d+)", text)
            pid = int(found.group(1)) if found else None
        tail = self._log_tail(pid) if not stopped else b""
        if tail:
            self.log.feed_native("stderr", tail)
            self.log.finish_native("stderr")
        # faulthandler's words for the fatal signals it reports, and the actor's for SIGTERM
        # (both written before dying).
        for words, signum in _FATAL_SIGNALS:
            if words in tail:
                self.returncode = -signum
                break
        detail = re.search(r"Worker exit detail: ([^.]*\.)", text)
        if self.fault is not None:
            self.death_detail = f"was stopped after a Ray error ({self.fault})"
        elif stopped:
            self.death_detail = "was stopped (ray.kill)"
        else:
            self.death_detail = "died (Ray reports no exit code" + (
                f": {detail.group(1)})" if detail else ")"
            )
        if os.getpid() == self._owner_pid:
            self._on_exit(self)
            self._on_finished(self)
        self.output_done.set()
        self.exited.set()

    @staticmethod
    def _log_tail(pid: int | None) -> bytes:
        """The last lines of the actor's stderr file, when the cluster is local (the file is
        on this machine); bounded, best effort."""
        node = _local_head()
        if pid is None or node is None:
            return b""
        try:
            logs = os.path.join(node.get_session_dir_path(), "logs")
            paths = glob.glob(os.path.join(logs, f"worker-*-{pid}.err"))
            if not paths:
                return b""
            with open(paths[0], "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - _LOG_TAIL_BYTES))
                data = fh.read()
        except (OSError, AttributeError):
            return b""
        # Ray's own markers (":job_id:...", ":actor_name:...") say nothing about the death.
        lines = [ln for ln in data.splitlines() if ln.strip() and not ln.startswith(b":")][-40:]
        return b"\n".join(lines) + b"\n" if lines else b""

    def dispose(self) -> None:
        """Nothing to close (no descriptors); the actor handle goes with this object."""

    def abandon_in_forked_child(self) -> None:
        """In a forked child: never talk to Ray (it hangs after a fork); forget the actor."""
        self._kill_requested = True
        self._dead = True
        self.actor = None
        self.pending = None

    def force_close(self) -> None:
        """Last resort at pool close (reactor thread): kill the actor if it still lives."""
        if not self.exited.is_set():
            self._ray_kill()
