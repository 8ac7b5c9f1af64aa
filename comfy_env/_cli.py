"""The ``comfy-env`` command line.

Commands:
  demo [--env ENV]          walk through the lifecycle on a real worker: lazy spawn, a call, a
                            native segfault turned into WorkerCrashed, the replacement
                            generation, a timeout, and the stats.
  doctor [ENV] [--timeout SECONDS]
                            check that an env can run workers, step by step, with timings:
                            config, resolve the interpreter, spawn + handshake + canary,
                            versions, a warm round trip, a 4 MiB shared-memory round trip.
                            SECONDS (default 60) bounds each probe call.
  call ENV TARGET [ARGS] [--timeout SECONDS]
                            run one call, ``module:function`` with ARGS a JSON array
                            (positional) or object (keyword), and print the result.
  sweep                     remove what dead hosts left behind (shared-memory blocks, runtime
                            directories, stray workers, status files).
  status [--all]            list live comfy-env hosts of this login session on this machine
                            (--all: of this user): their envs, worker pids, generations,
                            states, RSS, idle time, call counts.
  env build|list|gc|rm      declared envs built with uv (see ``comfy_env._cli_envs``).

ENV is an env directory or an interpreter path; ``-`` (or, for doctor, nothing) is the current
interpreter. Every command but demo takes ``--json`` for machine-readable output on stdout.

Data flow: ``doctor`` and ``call`` build a private ``Pool`` (``PoolConfig()`` and ``Pool()``,
so the ``COMFY_ENV_*`` variables apply; ``Pool()`` loads no pydantic when none is set), use
only the public API plus two read-only looks at the first slot's process (start-up time,
hello), and close the pool before returning, so nothing outlives the command. Worker output
is held back during ``doctor`` (a failed start shows it in the error) and forwarded to stderr
during ``call``. ``sweep`` is ``comfy_env.sweep()`` plus the removal of dead hosts' status
files. ``status`` reads the files hosts publish under ``<runtime root>/status`` (see
``comfy_env._status``) and measures RSS live; it needs no cooperation from the hosts beyond
those files.

Exit codes:
  0    success (doctor: every step passed; warnings do not fail it)
  1    a step, the call or the command failed (the error is on stderr; with --json also in
       the JSON document on stdout)
  2    bad usage: unknown command or option, malformed JSON arguments, a target not of the form
       module:function, an invalid COMFY_ENV_* setting (demo, doctor and call read them;
       status and sweep do not, so a bad value cannot fail them); with --json also on stdout,
       as ``{"ok": false, "error": {"type": "UsageError", "message": ...}}``
  130  interrupted (Ctrl-C)

A reader that leaves early (``comfy-env demo | head -2``) ends the command quietly with exit
code 1, as Python's documentation recommends (``signal`` module, "Note on SIGPIPE"): the write
into the closed pipe raises ``BrokenPipeError``, which ``main`` catches; it points the closed
stream's descriptor at ``/dev/null``, so that the flush at interpreter exit does not raise
again (that would print "Exception ignored ..." and exit 120), and returns 1. ``main``
flushes both streams itself before returning, so output still buffered (stdout into a pipe is
block-buffered) meets the closed pipe there too. The command's pool is closed on the way out
(the exception leaves its ``with`` block), so no worker outlives it. SIGPIPE's default action
(exit 141, like C tools) is not restored: the worker's channel and pipes would be safe under it
(``MSG_NOSIGNAL``, ``_sigpipe``), but the command's own output would then end it without
stopping its workers in order.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from . import __version__
from ._errors import (
    CallTimeout,
    ComfyEnvError,
    ConfigError,
    EnvError,
    RemoteError,
    RemoteTraceback,
    WorkerCrashed,
    WorkerStartError,
)
from ._stats import CALL_COUNTERS
from ._values import as_dict

# Not ``typing.TYPE_CHECKING``; and json and logging are imported where they are used:
# ``comfy-env status`` (the command run most) needs none of them, nor typing.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn

    from ._config import PoolConfig
    from ._envs import EnvSpec
    from ._status import HostStatus
    from ._worker import Worker

    _Add = Callable[..., argparse.ArgumentParser]  # build_parser's ``add``
    _AddJson = Callable[[argparse.ArgumentParser], None]  # build_parser's ``add_json``

# pydantic, the pool and the process machinery are imported by the commands that run workers
# (demo, doctor, call), not at start-up: ``comfy-env status`` and ``sweep`` stay fast.

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = """\
exit codes:
  0    success (doctor: every step passed)
  1    a step, the call or the command failed (details on stderr; in the JSON with --json),
       or the output had nowhere to go (the reader left early, `| head`; stdout closed,
       `>&-`): quietly
  2    bad usage: unknown option, malformed JSON arguments, target not module:function,
       invalid COMFY_ENV_* setting (demo, doctor, call; status and sweep do not read them)
  130  interrupted"""

ENV_HELP = 'ENV is an env directory or an interpreter path; "-" means the current interpreter.'


class UsageError(Exception):
    """Bad command-line input: reported on stderr, exit code 2."""


_FAILED = object()  # (a doctor step's result when it failed: see ``_run_step``)


def _timed(label: str, fn: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        ms = (time.perf_counter() - started) * 1000
        print(f"  {label:<44} {ms:8.1f} ms  -> {type(exc).__name__}")
        raise
    ms = (time.perf_counter() - started) * 1000
    print(f"  {label:<44} {ms:8.1f} ms  -> {result!r}")
    return result


def demo(env: str | None) -> int:
    """Run the lifecycle walk-through; returns the exit code."""
    from ._config import PoolConfig
    from ._pool import Pool

    ok = True
    with Pool(PoolConfig()) as pool:
        worker = pool.get_worker(env)
        # The env key, as every message below names it (the current interpreter's is its
        # venv or prefix directory).
        what = env or "the current interpreter"
        print(f"comfy-env {__version__} demo on env {worker.env} ({what})\n")
        print(f"1. get_worker() spawns nothing: generation={worker.generation} pid={worker.pid}")
        print("2. the first call spawns, handshakes and canaries a worker, then runs:")
        _timed(
            "call tasks:info (cold)", lambda: worker.call("comfy_env_worker.tasks:info")["python"]
        )
        print(f"   worker is generation {worker.generation}, pid {worker.pid}")
        _timed("call tasks:echo (warm)", lambda: worker.call("comfy_env_worker.tasks:echo", 42))
        started = time.perf_counter()
        n = 2000
        for i in range(n):
            worker.call("comfy_env_worker.tasks:echo", i)
        per_call = (time.perf_counter() - started) / n * 1e6
        print(f"  {n} warm calls: {per_call:.1f} us per round trip")

        print("3. a native library segfaults (ctypes null read) inside a call:")
        first_pid = worker.pid
        try:
            _timed("call tasks:crash", lambda: worker.call("comfy_env_worker.tasks:crash"))
            ok = False
            print("   !! the crash did not surface")
        except WorkerCrashed as exc:
            print(
                f"   WorkerCrashed: signal={exc.signal} exitcode={exc.exitcode} "
                f"pid={exc.pid} generation={exc.generation} call_id={exc.call_id}"
            )
            frames = [ln for ln in exc.stderr_tail.splitlines() if "File" in ln][:2]
            for line in frames:  # (the worker's output above, as the error carries it)
                print(f"   exc.stderr_tail: {line.strip()}")
        print("4. the next call transparently gets a fresh worker:")
        _timed("call tasks:getpid", lambda: worker.call("comfy_env_worker.tasks:getpid"))
        print(f"   generation {worker.generation}, pid {worker.pid} (was {first_pid})")
        if worker.generation != 2:
            ok = False

        print("5. a call that overruns its deadline is stopped and its worker replaced:")
        try:
            _timed(
                "run tasks:sleep(10) with timeout=0.5",
                lambda: worker.run("comfy_env_worker.tasks:sleep", (10,), timeout=0.5),
            )
            ok = False
        except CallTimeout as exc:
            print(f"   CallTimeout: {exc}")
        _timed(
            "call tasks:echo after the timeout",
            lambda: worker.call("comfy_env_worker.tasks:echo", "alive"),
        )
        print(f"   generation {worker.generation}")

        print("6. stats:")
        stats = worker.stats()
        for field in (*CALL_COUNTERS, "stale_events_dropped"):
            print(f"   {field:<22} {getattr(stats, field)}")
    print("\npool closed: no worker process, socket or runtime dir is left behind.")
    return 0 if ok else 1


# ---- shared helpers --------------------------------------------------------------------------


def _env_arg(env: str | None) -> str | None:
    return None if env in (None, "-") else env


def _print_json(document: Any) -> None:
    import json

    print(json.dumps(document, indent=2, default=str))


def _print_usage_json(message: str) -> None:
    """Bad usage under ``--json``: the error on stdout too, so a script reading stdout gets a
    document (``{"ok": false, "error": {"type": "UsageError", ...}}``), not empty input."""
    _print_json({"ok": False, "error": {"type": "UsageError", "message": message}})


def _error_name(exc: BaseException) -> str:
    if isinstance(exc, RemoteError):
        return exc.type_name
    cls = type(exc)
    if cls.__module__ in ("builtins", "comfy_env._errors"):
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _error_message(exc: BaseException) -> str:
    """The error's text without its type name (``RemoteError``'s own text starts with it)."""
    if isinstance(exc, RemoteError):
        return exc.message
    return str(exc)


def _remote_traceback(exc: BaseException) -> str | None:
    if isinstance(exc, RemoteError):
        return exc.traceback_text or None
    cause = exc.__cause__
    if isinstance(cause, RemoteTraceback):
        return cause.traceback_text
    return None


def _error_record(exc: BaseException) -> dict[str, Any]:
    """The JSON form of an error: its type name, message and the facts it carries."""
    record: dict[str, Any] = {"type": _error_name(exc), "message": _error_message(exc)}
    for attr in ("env", "pid", "generation", "exitcode", "signal", "call_id", "target"):
        value = getattr(exc, attr, None)
        if value is not None:
            record[attr] = value
    tried = getattr(exc, "tried", None)
    if tried:
        record["tried"] = list(tried)
    tail = getattr(exc, "stderr_tail", None)
    if tail:
        record["stderr_tail"] = tail
    remote = _remote_traceback(exc)
    if remote:
        record["traceback"] = remote
    return record


def _indent(text: str, prefix: str = "        | ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


# ---- doctor ----------------------------------------------------------------------------------

INFO_TARGET = "comfy_env_worker.tasks:info"
ECHO_TARGET = "comfy_env_worker.tasks:echo"
SHM_STATS_TARGET = "comfy_env_worker.tasks:shm_stats"
SHM_PROBE_BYTES = 4 * 1024 * 1024
WARM_CALLS = 50


NUMPY_TARGET = "comfy_env_worker.arrays:numpy_facts"


def _host_numpy() -> tuple[str | None, str | None]:
    """The host's numpy version, or None and why it is missing."""
    try:
        import numpy
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a numpy broken on import
        return None, f"{type(exc).__name__}: {exc}"
    return str(numpy.__version__), None


def _major(version: str) -> str:
    return version.split(".", 1)[0]


class Step:
    """One doctor check: ``status`` is "ok", "WARN" (works, but not as configured) or "FAIL".
    Filled in as the check runs. (A plain class: ``comfy-env status`` imports this module and
    stays clear of the dataclasses import.)"""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = "ok"
        self.ms: float | None = None
        self.detail = ""
        self.error: dict[str, Any] | None = None
        self.facts: dict[str, Any] = {}

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "ms": None if self.ms is None else round(self.ms, 3),
            "detail": self.detail,
            "error": self.error,
            "facts": self.facts,
        }


class _Doctor:
    """Runs the checks in order and stops at the first failure."""

    def __init__(self, env: str | None, timeout: float) -> None:
        self.env = env
        self.timeout = timeout
        self.steps: list[Step] = []
        self.env_numpy: str | None = None  # the env's numpy version, from the numpy step
        self.env_numpy_error: str | None = None  # or why the env cannot import it

    def run(self) -> bool:
        config = self._config()
        if config is None or not self._resolve(config):
            return False
        from ._cli_output import CaptureLines, worker_output
        from ._pool import Pool

        capture = CaptureLines()
        with worker_output(capture), Pool(config) as pool:
            worker = pool.get_worker(self.env)
            return (
                self._start(worker)
                and self._round_trip(worker)
                and self._numpy(worker)
                and self._shared_memory(worker, config)
            )

    def _fail(self, step: Step, exc: BaseException) -> None:
        step.status = "FAIL"
        step.error = _error_record(exc)
        step.detail = f"{_error_name(exc)}: {exc}"
        tried = getattr(exc, "tried", ())
        if tried and "tried:" not in str(exc):
            step.detail += "\ntried:\n  " + "\n  ".join(tried)
        tail = getattr(exc, "stderr_tail", "")
        if tail and tail not in str(exc):
            step.detail += "\n--- worker output (last lines) ---\n" + tail
        if isinstance(exc, WorkerStartError) and not tail:
            step.detail += "\n(the worker printed nothing)"

    def _timed(self, step: Step, fn: Callable[[], Any]) -> Any:
        self.steps.append(step)
        started = time.perf_counter()
        try:
            return fn()
        finally:
            step.ms = (time.perf_counter() - started) * 1000

    def _run_step(self, step: Step, worker: Worker, target: str) -> Any:
        """Run ``target`` in ``worker`` as ``step`` (timed): its result, or ``_FAILED`` with
        the step marked failed and the error told (``_fail``)."""
        try:
            return self._timed(step, lambda: worker.run(target, timeout=self.timeout))
        except Exception as exc:  # noqa: BLE001 - whatever it is, the report says it
            self._fail(step, exc)
            return _FAILED

    def _config(self) -> PoolConfig | None:
        from ._config import PoolConfig

        step = Step("config")
        try:
            config: PoolConfig = self._timed(step, PoolConfig)
        except ConfigError as exc:
            step.status = "FAIL"
            step.detail = f"invalid COMFY_ENV_* setting:\n{exc}"
            step.error = _error_record(exc)
            return None
        from ._settings import ENV_PREFIX, FIELDS, unknown_variables

        overrides = sorted(
            ENV_PREFIX + f.upper() for f in FIELDS if ENV_PREFIX + f.upper() in os.environ
        )
        step.detail = (
            f"shared_memory={config.shared_memory}, start_timeout={config.start_timeout:g}s, "
            f"from environment: {', '.join(overrides) if overrides else 'nothing'}"
        )
        unknown = unknown_variables()  # PoolConfig() above logged them once
        for name, closest in unknown:
            step.status = "WARN"
            hint = f" (did you mean {closest}?)" if closest else ""
            step.detail += f"\nnote: {name} is not a comfy-env setting and is ignored{hint}"
        step.facts = {"overrides": overrides, "unknown": [name for name, _ in unknown]}
        return config

    def _resolve(self, config: PoolConfig) -> bool:
        from ._envs import resolve_env

        step = Step("resolve env")
        try:
            spec = self._timed(step, lambda: resolve_env(self.env))
        except EnvError as exc:
            self._fail(step, exc)
            return False
        step.detail = f"{spec.key} -> interpreter {spec.interpreter}"
        step.facts = {"env": spec.key, "interpreter": spec.interpreter}
        self._activation(step, spec, config)
        return True

    @staticmethod
    def _activation(step: Step, spec: EnvSpec, config: PoolConfig) -> None:
        """What activating the env gives its workers (the pool's spawn reuses the result)."""
        if not config.activate:
            step.detail += "\nactivation: off (PoolConfig.activate=False)"
            step.facts["activation"] = None
            return
        from ._activation import activation_for
        from ._process import base_environment

        activation = activation_for(spec, base_environment(), config.start_timeout)
        if activation is None:
            step.detail += "\nactivation: none (not a venv, conda or pixi env)"
            step.facts["activation"] = None
            return
        summary = activation.summary()
        step.facts["activation"] = summary
        scripts = len(activation.scripts)
        step.detail += (
            f"\nactivation: {activation.kind} env, {scripts} activate.d script"
            f"{'' if scripts == 1 else 's'}; sets "
            + (", ".join(sorted(activation.variables)) or "nothing")
        )
        if activation.path is not None:
            step.detail += f"; PATH={activation.path}"
        elif activation.path_prefix:
            step.detail += f"; PATH starts {os.pathsep.join(activation.path_prefix)}"
        for failure in activation.failures:
            step.status = "WARN"
            step.detail += "\nnote: " + failure.replace("\n", "\n  ")

    def _start(self, worker: Worker) -> bool:
        step = Step("spawn + handshake + canary")
        info = self._run_step(step, worker, INFO_TARGET)
        if info is _FAILED:
            return False
        process = getattr(worker._entry.slots[0], "process", None)
        startup = getattr(process, "startup_seconds", None)
        hello: dict[str, Any] = dict(getattr(process, "hello", None) or {})
        step.detail = f"worker pid {worker.pid}, generation {worker.generation}"
        if isinstance(startup, float) and step.ms is not None:
            step.detail += (
                f"; interpreter boot + handshake + canary {startup * 1000:.1f} ms, "
                f"launch + first call (tasks:info) {step.ms - startup * 1000:.1f} ms"
            )
        step.facts = {
            "pid": worker.pid,
            "generation": worker.generation,
            "startup_ms": None if startup is None else round(startup * 1000, 3),
        }
        versions = Step("versions")
        self.steps.append(versions)
        import platform

        host_python = platform.python_version()
        worker_python = str(info.get("python", "?"))
        versions.detail = (
            f"worker Python {worker_python} at {info.get('executable')} "
            f"(prefix {info.get('prefix')}); host Python {host_python}, comfy-env {__version__}"
        )
        if "protocol" in hello:
            versions.detail += f", protocol {hello['protocol']}"
        if hello.get("platform"):
            versions.detail += f", {hello['platform']}"
        if worker_python.split(".")[:2] != host_python.split(".")[:2]:
            versions.detail += (
                "\nnote: other Python major.minor than the host: targets must be named as "
                "'module:function' (callables by value need the same version)"
            )
        versions.facts = {
            "comfy_env": __version__,
            "host_python": host_python,
            "worker_python": worker_python,
            "worker_executable": info.get("executable"),
            "worker_prefix": info.get("prefix"),
            "protocol": hello.get("protocol"),
            "platform": hello.get("platform"),
            "worker_shm_available": hello.get("shm"),
        }
        return True

    def _round_trip(self, worker: Worker) -> bool:
        step = Step("warm round trip")
        self.steps.append(step)
        times = []
        try:
            for i in range(WARM_CALLS):
                started = time.perf_counter()
                worker.run(ECHO_TARGET, (i,), timeout=self.timeout)
                times.append(time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the report says it
            self._fail(step, exc)
            return False
        import statistics

        median = statistics.median(times)
        step.ms = median * 1000
        step.detail = (
            f"tasks:echo, median of {WARM_CALLS} calls: {median * 1e6:.1f} us "
            f"(min {min(times) * 1e6:.1f} us)"
        )
        step.facts = {"calls": WARM_CALLS, "median_us": round(median * 1e6, 2)}
        return True

    def _numpy(self, worker: Worker) -> bool:
        """Which numpy each side has, and what that means for arrays: a missing numpy is told
        apart from a version skew (numpy 1.x on one side, 2.x on the other), under which plain
        arrays still cross (``comfy_env_worker.arrays``) but numpy's own pickles do not."""
        step = Step("numpy")
        env = self._run_step(step, worker, NUMPY_TARGET)
        if env is _FAILED:
            return False
        host, host_error = _host_numpy()
        env_version = env.get("version") if isinstance(env, dict) else None
        env_error = env.get("error") if isinstance(env, dict) else None
        self.env_numpy, self.env_numpy_error = env_version, env_error
        step.facts = {
            "host_numpy": host,
            "env_numpy": env_version,
            "host_error": host_error,
            "env_error": env_error,
            "skew": bool(host and env_version and _major(host) != _major(env_version)),
        }
        if host is None and env_version is None:
            step.detail = "neither the host nor the env has numpy"
        elif env_version is None:
            step.detail = (
                f"the env has no numpy ({env_error}); host numpy {host}: arrays cannot be "
                "sent to this env (plain Python values, bytes and memoryviews can)"
            )
        elif host is None:
            step.detail = (
                f"the host has no numpy ({host_error}); env numpy {env_version}: arrays the "
                "env returns cannot be unpickled in the host"
            )
        elif _major(host) == _major(env_version):
            step.detail = f"host numpy {host}, env numpy {env_version}: every array crosses"
        else:
            step.detail = (
                f"host numpy {host}, env numpy {env_version}: a numpy major version skew "
                "(not a missing numpy)\nnote: plain arrays cross both ways (every dtype both "
                "numpy versions have, any shape and memory order); object arrays, ndarray "
                "subclasses (np.matrix, masked arrays, np.memmap), numpy scalars (np.float64) "
                "and numpy-2-only dtypes (StringDType) do not: send a plain array, .tolist() "
                "or float() instead"
            )
        return True

    def _shared_memory(self, worker: Worker, config: PoolConfig) -> bool:
        step = Step("shared memory")
        self.steps.append(step)
        notes = []
        payload: Any
        numpy: Any
        try:
            if self.env_numpy is None:  # (the numpy step said so): bytes go anywhere
                raise ImportError(self.env_numpy_error or "the env has no numpy")
            import numpy

            payload = numpy.arange(SHM_PROBE_BYTES // 4, dtype=numpy.uint32)
            kind = "numpy array"
        except ImportError as exc:
            if self.env_numpy is None:
                notes.append(f"the env cannot import numpy ({exc}); sent bytes instead")
            numpy = None
            payload = os.urandom(SHM_PROBE_BYTES)
            kind = "bytes object"
        started = time.perf_counter()
        try:
            # (An env with numpy that cannot take a plain array fails here: the numpy step
            # told a missing numpy and a version skew apart already.)
            echoed = worker.run(ECHO_TARGET, (payload,), timeout=self.timeout)
            cold_ms = (time.perf_counter() - started) * 1000
            started = time.perf_counter()  # again, on blocks that now exist and are faulted in
            echoed = worker.run(ECHO_TARGET, (payload,), timeout=self.timeout)
            step.ms = (time.perf_counter() - started) * 1000
            shm = worker.run(SHM_STATS_TARGET, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the report says it
            self._fail(step, exc)
            return False
        equal = bool(numpy.array_equal(echoed, payload)) if numpy is not None else echoed == payload
        blocks = int(shm.get("blocks", 0)) if isinstance(shm, dict) else 0
        via = "through shared memory" if blocks > 0 else "streamed inline"
        rate = SHM_PROBE_BYTES * 2 / (step.ms / 1000) / 1e9 if step.ms else 0.0
        step.detail = (
            f"{_mib(SHM_PROBE_BYTES)} {kind} round trip {via} "
            f"({'equal' if equal else 'DIFFERENT'}): {rate:.2f} GB/s warm, first trip "
            f"{cold_ms:.1f} ms{' (the worker imports numpy)' if numpy is not None else ''}; "
            f"worker blocks: {shm}"
        )
        step.facts = {
            "bytes": SHM_PROBE_BYTES,
            "kind": kind,
            "equal": equal,
            "via_shared_memory": blocks > 0,
            "first_trip_ms": round(cold_ms, 3),
            "worker": shm,
            "shared_memory": worker.stats().shared_memory,
        }
        if not equal:
            step.status = "FAIL"
            step.error = {"type": "MismatchError", "message": "the echo came back different"}
        elif blocks == 0:
            if worker.stats().shared_memory == "unavailable":
                step.status = "WARN"
                notes.append(
                    "shared memory is unavailable (/dev/shm is missing, full or too small); "
                    "large buffers are streamed inline"
                )
            elif config.shared_memory:
                step.status = "WARN"
                notes.append(
                    "shared memory is on but unused (no usable /dev/shm in the host or the "
                    "worker?); large buffers are streamed inline"
                )
            else:
                notes.append("shared memory is off (PoolConfig.shared_memory=False)")
        if notes:
            step.detail += "\n" + "\n".join(f"note: {n}" for n in notes)
        return step.status != "FAIL"


def doctor(env: str | None, *, as_json: bool = False, timeout: float = 60.0) -> int:
    """Check an env step by step; returns the exit code (0 healthy, 1 a step failed, 2 an
    invalid ``COMFY_ENV_*`` setting: bad usage, as for every command that reads them)."""
    checks = _Doctor(_env_arg(env), timeout)
    checks.run()
    healthy = all(s.status != "FAIL" for s in checks.steps)
    label = env if _env_arg(env) is not None else "the current interpreter"
    if as_json:
        steps = [s.as_json() for s in checks.steps]
        _print_json({"ok": healthy, "env": label, "steps": steps})
    else:
        print(f"comfy-env {__version__} doctor: {label}")
        for s in checks.steps:
            ms = f"{s.ms:9.2f} ms" if s.ms is not None else " " * 12
            first, *rest = (s.detail or "").splitlines() or [""]
            print(f"  {s.status:<4}  {s.name:<27} {ms}  {first}")
            if rest:
                print(_indent("\n".join(rest)))
        failed = [s.name for s in checks.steps if s.status == "FAIL"]
        if failed:
            print(f"unhealthy: {failed[0]} failed")
        elif any(s.status == "WARN" for s in checks.steps):
            print("healthy, with warnings")
        else:
            print("healthy")
    if healthy:
        return EXIT_OK
    failed_step = next(s for s in checks.steps if s.status == "FAIL")
    # The error's own first line (type: reason), not the detail's: a detail may open with a
    # heading whose reason is on the next line ("invalid COMFY_ENV_* setting:\n...").
    error = failed_step.error or {}
    if "message" in error:
        lines = str(error["message"]).splitlines() or [""]
        first = lines[0]
        if first.endswith(":") and len(lines) > 1:  # a heading ("...; tried:"): its first item
            first += f" {lines[1].strip()}"
            if len(lines) > 2:
                first += f" (and {len(lines) - 2} more, above)"
        reason = f"{error.get('type', 'error')}: {first}"
    else:
        reason = "".join((failed_step.detail or "").splitlines()[:1])
    print(f"comfy-env: doctor: {failed_step.name} failed: {reason}", file=sys.stderr)
    return EXIT_USAGE if failed_step.name == "config" else EXIT_FAILED


# ---- call ------------------------------------------------------------------------------------

_TARGET = re.compile(r"^[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def parse_call_args(raw: str | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """JSON_ARGS -> (args, kwargs): an array is positional, an object is keywords."""
    if raw is None:
        return (), {}
    import json

    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UsageError(f"JSON_ARGS is not valid JSON ({exc}): {raw!r}") from None
    except RecursionError:
        raise UsageError(
            f"JSON_ARGS is nested too deeply to read ({len(raw)} characters): {_shorten(raw)}"
        ) from None
    if isinstance(value, list):
        return tuple(value), {}
    if isinstance(value, dict):
        return (), value
    raise UsageError(
        f"JSON_ARGS must be a JSON array (positional arguments) or object (keyword "
        f"arguments), not {type(value).__name__}: {raw!r}"
    )


def _shorten(text: str, keep: int = 80) -> str:
    """``text`` as a repr, cut in the middle when long (an error message names it)."""
    if len(text) <= 2 * keep:
        return repr(text)
    return f"{text[:keep]!r}...{text[-keep:]!r}"


def check_target(target: str) -> str:
    if not _TARGET.match(target):
        raise UsageError(
            f"TARGET must be 'package.module:function' (or 'module:Class.method'), not {target!r}"
        )
    return target


def _jsonable(value: Any) -> tuple[Any, bool]:
    """(value as JSON-able data, False) or (its repr, True)."""
    import json

    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return repr(value), True
    return value, False


def call(
    env: str,
    target: str,
    json_args: str | None,
    *,
    timeout: float | None = None,
    as_json: bool = False,
) -> int:
    """Run one call and print its result; returns the exit code."""
    from ._cli_output import StderrLines, worker_output
    from ._pool import Pool

    args, kwargs = parse_call_args(json_args)
    check_target(target)
    try:
        # Pool(), not Pool(PoolConfig()): with no COMFY_ENV_* set it loads no pydantic (about
        # 100 ms of every `comfy-env call`); a variable set is still checked here.
        pool = Pool()
    except ConfigError as exc:
        raise UsageError(f"invalid COMFY_ENV_* setting:\n{exc}") from None
    with worker_output(StderrLines()), pool:
        started = time.perf_counter()
        try:
            worker = pool.get_worker(_env_arg(env))
            result = worker.run(target, args, kwargs, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - any remote exception is re-raised here
            remote = _remote_traceback(exc)
            if remote and not as_json:
                print(remote.rstrip(), file=sys.stderr)
            # The worker's output was forwarded as it came; the message need not repeat it.
            message = _error_message(exc).split("\n--- worker output", 1)[0]
            print(f"comfy-env: {_error_name(exc)}: {message}", file=sys.stderr)
            if as_json:
                _print_json({"ok": False, "target": target, "error": _error_record(exc)})
            return EXIT_FAILED
        seconds = time.perf_counter() - started
        if as_json:
            value, is_repr = _jsonable(result)
            _print_json(
                {
                    "ok": True,
                    "env": worker.env,
                    "target": target,
                    "pid": worker.pid,
                    "generation": worker.generation,
                    "seconds": round(seconds, 6),
                    "result": value,
                    "result_is_repr": is_repr,
                }
            )
        else:
            print(repr(result))
    return EXIT_OK


# ---- sweep -----------------------------------------------------------------------------------


def sweep_command(*, as_json: bool = False, dry_run: bool = False) -> int:
    """Remove dead hosts' leftovers and say what went (``dry_run``: what would go, and
    nothing is changed); returns the exit code."""
    from ._sweep import sweep

    report = sweep(dry_run=dry_run)
    removed: dict[str, list[Any]] = {
        "blocks": list(report.blocks),
        "runtime_dirs": list(report.runtime_dirs),
        "processes": list(report.processes),
        "status_files": list(report.status_files),
        "private_roots": list(report.private_roots),
    }
    if as_json:
        _print_json({**removed, "dry_run": dry_run})
        return EXIT_OK
    labels = {
        "blocks": "shared-memory blocks",
        "runtime_dirs": "runtime directories",
        "processes": "worker processes (to kill)" if dry_run else "worker processes (killed)",
        "status_files": "status files",
        "private_roots": "private runtime roots",
    }
    if not any(removed.values()):
        print("nothing to remove: no leftovers of dead hosts")
        return EXIT_OK
    verb = "would remove" if dry_run else "removed"
    for key, items in removed.items():
        print(f"{verb} {len(items)} {labels[key]}")
        for item in items:
            print(f"  {item}")
    return EXIT_OK


# ---- status ----------------------------------------------------------------------------------


def _setting(name: str, value: Any) -> str:
    """One of an env's own settings for ``status``: seconds with an s, bytes in MiB."""
    if name == "env_vars":
        return f"env_vars={' '.join(value) or '-'}"
    if value is None:
        return f"{name}=None"
    if name == "memory_limit":
        return f"{name}={value / (1 << 20):g} MiB"
    if name in ("call_timeout", "cancel_grace", "idle_timeout", "restart_window", "abandon_for"):
        return f"{name}={value:g}s"
    return f"{name}={value}"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


# Said of a host whose status file names another pid namespace (HostStatus.other_pid_namespace).
OTHER_NAMESPACE_NOTE = (
    "another pid namespace: its pids are that namespace's, not processes here, and whether it "
    "is still alive cannot be told from here"
)


def status_command(*, as_json: bool = False, all_hosts: bool = False) -> int:
    """List live hosts from their status files; returns the exit code. Only the hosts of this
    login session unless ``all_hosts`` (see ``own_hosts``)."""
    from ._status import login_session, read_status, status_dir

    notes: list[str] = []
    every = read_status(notes=notes)
    for note in notes:
        print(f"comfy-env: status: note: {note}", file=sys.stderr)
    mine = login_session()
    hosts = every if all_hosts else own_hosts(every, mine)
    hidden = len(every) - len(hosts)
    now = time.time()
    if as_json:
        documents = [_host_document(host, now) for host in hosts]
        _print_json(
            {
                "status_dir": status_dir(),
                "login_session": mine,
                "all": all_hosts,
                "hidden_hosts": hidden,
                "hosts": documents,
                "notes": notes,
            }
        )
        return EXIT_OK
    if not hosts:
        print(f"no live comfy-env hosts for this user (status dir {status_dir()})")
        _say_hidden(hidden)
        return EXIT_OK
    for host in hosts:
        _print_host(host, now)
    _say_hidden(hidden)
    return EXIT_OK


def _host_document(host: HostStatus, now: float) -> dict[str, Any]:
    """One host of ``status --json``: its status file's content, with ages as of ``now``."""
    doc: dict[str, Any] = as_dict(host)
    doc["updated_seconds_ago"] = round(max(0.0, now - host.updated_at), 3)
    doc["note"] = OTHER_NAMESPACE_NOTE if host.other_pid_namespace else None
    for env_doc, env in zip(doc["envs"], host.envs, strict=True):
        for w_doc, w in zip(env_doc["workers"], env.workers, strict=True):
            idle, busy = w.idle_seconds(now), w.busy_seconds(now)
            w_doc["idle_seconds"] = None if idle is None else round(idle, 3)
            w_doc["busy_seconds"] = None if busy is None else round(busy, 3)
    return doc


def _print_host(host: HostStatus, now: float) -> None:
    """One host of ``status``, as text: the host, then each env and its workers."""
    command = " ".join(host.argv) or "?"
    print(
        f"host pid {host.pid} ({host.executable or '?'} {command}), comfy-env "
        f"{host.version or '?'}, up {_ago(now - host.start_ms / 1000)}, "
        f"updated {_ago(now - host.updated_at)} ago"
    )
    if host.other_pid_namespace:
        print(f"  ({OTHER_NAMESPACE_NOTE})")
    if not host.envs:
        print("  no envs yet")
    for env in host.envs:
        print(f"  env {env.env}  (interpreter {env.interpreter or '?'}, pool {env.pool})")
        print(
            f"    calls: {env.submitted} submitted, {env.ok} ok, {env.raised} raised, "
            f"{env.crashed} crashed, {env.timed_out} timed out, {env.cancelled} cancelled, "
            f"{env.failed} failed, {env.in_flight} in flight, {env.queued} queued; "
            f"{env.spawns} spawns"
        )
        if env.own_settings:
            print("    own settings: " + ", ".join(_setting(k, v) for k, v in env.own_settings))
        for w in env.workers:
            parts = [
                f"slot {w.slot}",
                f"pid {w.pid if w.pid is not None else '-'}",
                f"generation {w.generation}",
                w.state + (f" ({w.retire_reason})" if w.retire_reason else ""),
            ]
            if w.stuck:
                parts.append(
                    "STUCK: no start in progress (Pool.reset(env) retires it; so does "
                    "the idle reaper)"
                )
            if w.rss_bytes is not None:
                parts.append(f"rss {_mib(w.rss_bytes)}")
            idle, busy = w.idle_seconds(now), w.busy_seconds(now)
            if idle is not None:
                parts.append(f"idle {_ago(idle)}")
            if busy is not None:
                parts.append(f"in a call for {_ago(busy)}")
            print("    " + ", ".join(parts))


def own_hosts(hosts: list[HostStatus], mine: int | None) -> list[HostStatus]:
    """The hosts ``comfy-env status`` shows by default: those of the reader's login session
    (``_status.login_session``: the kernel's audit session, one per ssh or console login).

    Status files are per user already; this tells apart people who share one account (a
    lab's ``comfy`` account, ``root`` on a shared box): each login sees the hosts it started,
    from any terminal, tmux or ``nohup`` of that login. Where the reader has no login session
    (no audit support, a container) nothing can be told apart and every host is shown.
    Hosts of no login (a service) are shown only with ``--all``."""
    if mine is None:
        return list(hosts)
    return [host for host in hosts if host.login_session == mine]


def _say_hidden(hidden: int) -> None:
    if hidden:
        print(
            f"({hidden} host{'s' if hidden != 1 else ''} of other login sessions of this user "
            "not shown; comfy-env status --all lists every host)"
        )


# ---- the parser ------------------------------------------------------------------------------


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    # The library's own bound (MAX_SECONDS: a deadline the reactor's waits can hold), here
    # too, so that 1e300 is the same bad usage as inf, not a failed call.
    from ._settings import MAX_SECONDS

    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be positive seconds up to {MAX_SECONDS:g}, not {text!r}"
        )
    return value


class _Parser(argparse.ArgumentParser):
    """argparse's parser, keeping the usage error it reports (``_run`` repeats it on stdout
    as JSON when ``--json`` was asked for). Subcommands' parsers are of this class too."""

    usage_error: str | None = None

    def error(self, message: str) -> NoReturn:
        _Parser.usage_error = message
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    _Parser.usage_error = None
    parser = _Parser(
        prog="comfy-env",
        description="Run functions in crash-isolated worker processes, one per Python env.",
        epilog=f"{EXIT_CODES_HELP}\n\n{ENV_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"comfy-env {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str, takes_env: bool = False) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=f"{EXIT_CODES_HELP}\n\n{ENV_HELP}" if takes_env else EXIT_CODES_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    def add_json(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="machine-readable output on stdout")

    _add_call_commands(sub, add, add_json)
    _add_host_commands(add, add_json)

    from ._cli_envs import add_env_commands

    add_env_commands(sub, add_json, argparse.RawDescriptionHelpFormatter, EXIT_CODES_HELP)
    return parser


def _add_call_commands(sub: Any, add: _Add, add_json: _AddJson) -> None:
    """The commands that start a worker: ``demo``, ``doctor``, ``call``."""
    p_demo = sub.add_parser("demo", help="walk through spawn, call, crash, replace, timeout")
    p_demo.add_argument(
        "--env",
        default=None,
        help="env directory or interpreter (default: the current interpreter)",
    )

    p_doctor = add(
        "doctor",
        "check an env step by step: config, resolve, spawn + handshake + canary, versions, "
        "warm round trip, shared memory",
        takes_env=True,
    )
    p_doctor.add_argument(
        "env", nargs="?", default=None, metavar="ENV", help="default: the current interpreter"
    )
    p_doctor.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="deadline of each probe call (start-up is bounded by start_timeout)",
    )
    add_json(p_doctor)

    p_call = add("call", "run one call in an env and print its result", takes_env=True)
    p_call.add_argument("env", metavar="ENV", help='env directory or interpreter; "-": current')
    p_call.add_argument("target", metavar="TARGET", help="module:function (or module:Class.meth)")
    p_call.add_argument(
        "json_args",
        nargs="?",
        default=None,
        metavar="JSON_ARGS",
        help="a JSON array of positional arguments or a JSON object of keyword arguments",
    )
    p_call.add_argument(
        "--timeout", type=_positive_seconds, default=None, metavar="SECONDS", help="deadline"
    )
    add_json(p_call)


def _add_host_commands(add: _Add, add_json: _AddJson) -> None:
    """The commands about this user's hosts: ``sweep``, ``status``."""
    p_sweep = add("sweep", "remove leftovers of dead hosts (shm blocks, dirs, workers, status)")
    p_sweep.add_argument(
        "--dry-run", action="store_true", help="report what would be removed, change nothing"
    )
    add_json(p_sweep)

    p_status = add("status", "list live comfy-env hosts of this login session and their workers")
    p_status.add_argument(
        "--all",
        action="store_true",
        dest="all_hosts",
        help="every host of this user, not only this login session's (an account shared by "
        "several people)",
    )
    add_json(p_status)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    closed = _plug_closed_standard_streams()
    try:
        code = _run(argv)
        # Here, not at interpreter exit: output still buffered meets a closed pipe where the
        # handler below can quiet it.
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # the reader left early (`| head`): exit quietly
        _silence_closed_streams()
        return EXIT_FAILED
    if "stdout" in closed and code == EXIT_OK:
        return EXIT_FAILED  # the output went nowhere, as for a reader that left early
    return code


def _plug_closed_standard_streams() -> set[str]:
    """Started with stdout or stderr closed (``comfy-env status >&-``): Python then has None
    for the stream, and the descriptor is free, so the next file or socket opened would take
    it and anything written to fd 1 or 2 (a worker's native output forwarded, a library's
    ``printf``) would go into it. Each such descriptor gets ``/dev/null`` and its stream a
    writer to it: the command runs, its output goes nowhere, and nothing raises. Returns the
    names of the streams that were closed."""
    closed = set()
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            continue
        if devnull != fd:
            os.dup2(devnull, fd)
            os.close(devnull)
        closed.add(name)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, "w", closefd=False))  # kept for the process
    return closed


def _silence_closed_streams() -> None:
    """Point the descriptor of each standard stream whose pipe is closed at ``/dev/null``, so
    that what is still buffered there, flushed at interpreter exit, does not raise again."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
            except OSError:
                continue
            try:
                os.dup2(devnull, stream.fileno())
            except (OSError, ValueError):  # no descriptor of its own (a replaced stream)
                pass
            finally:
                os.close(devnull)
        except (OSError, ValueError):  # broken otherwise, or closed: nothing is buffered
            pass


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(words)
    except SystemExit as exc:  # --help, --version (0) or a usage error (2)
        if _Parser.usage_error is not None and "--json" in words:
            _print_usage_json(_Parser.usage_error)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        if args.command == "demo":
            return demo(args.env)
        if args.command == "doctor":
            return doctor(args.env, as_json=args.json, timeout=args.timeout)
        if args.command == "call":
            return call(
                args.env, args.target, args.json_args, timeout=args.timeout, as_json=args.json
            )
        if args.command == "sweep":
            return sweep_command(as_json=args.json, dry_run=args.dry_run)
        if args.command == "status":
            return status_command(as_json=args.json, all_hosts=args.all_hosts)
        if args.command == "env":
            from ._cli_envs import env_command

            return env_command(args, _print_json, _error_record)
    except UsageError as exc:
        print(f"comfy-env {args.command}: error: {exc}", file=sys.stderr)
        if getattr(args, "json", False):
            _print_usage_json(str(exc))
        return EXIT_USAGE
    except ConfigError as exc:  # an invalid COMFY_ENV_* setting (demo): bad usage, as for call
        print(
            f"comfy-env {args.command}: error: invalid COMFY_ENV_* setting:\n{exc}", file=sys.stderr
        )
        if getattr(args, "json", False):
            _print_json({"ok": False, "error": _error_record(exc)})
        return EXIT_USAGE
    except ComfyEnvError as exc:
        print(f"comfy-env: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("comfy-env: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_USAGE  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
