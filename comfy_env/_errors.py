"""The error tree, by cause.

``ComfyEnvError``
  ``PoolClosedError``    you closed the pool
  ``ConfigError``        a ``PoolConfig`` value (or ``COMFY_ENV_*`` variable) is invalid
  ``ArgumentError``      an argument (a target, args, a timeout) cannot be used (also a
                         ``ValueError`` and a ``TypeError``)
  ``HostResourceError``  the host could not take a reply (out of descriptors or memory, or
                         its shared-memory block was gone)
  ``RuntimeRootError``   the runtime root is not ours and no private one could be made
  ``EnvError``           no such env, or no interpreter in it
      ``EnvBuildError``  a declared env (a ``Recipe``) could not be built
  ``SerializationError`` an argument (or a by-value callable) cannot travel to the worker
  ``RefReleasedError``   a ``RemoteRef`` was used after ``release()``
  ``WorkerError``        the worker broke (something outside the call's own code)
      ``WorkerStartError``, ``WorkerCrashed``, ``CallTimeout``, ``CallCancelled``,
      ``ProtocolError``, ``StaleGenerationError``, ``EnvAbandonedError``
  ``RemoteError``        the function raised, and its exception cannot be re-raised as itself

Messages say what probably happened; attributes carry the facts (env, pid, generation, ...).
"""

from __future__ import annotations

# Not ``typing.TYPE_CHECKING``: every ``import comfy_env`` (and ``comfy-env status``) loads this
# module, and typing is a large import that nothing here needs at run time.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeVar

    _E = TypeVar("_E", bound=BaseException)


class ComfyEnvError(Exception):
    """Base class of every error comfy-env raises itself."""


class RuntimeRootError(ComfyEnvError):
    """A directory comfy-env writes or runs code from is not safely ours (a symlink, another
    user's, not a directory) and no private replacement could be made.

    ``path`` is the directory, ``reason`` what is wrong with it."""

    def __init__(self, message: str, *, path: str, reason: str) -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class ArgumentError(ComfyEnvError, ValueError, TypeError):
    """An argument comfy-env cannot use, raised in the caller before anything runs (nothing
    is spawned, queued or counted): a call target that is not ``"module:function"`` or a
    callable, ``args`` that are not a sequence of positional arguments, ``kwargs`` that are
    not a mapping of names, a timeout that is not a finite positive number of seconds. The
    message names the argument and what is expected.

    Both a ``ValueError`` and a ``TypeError``, so that code written against the built-in
    errors these cases raised before (a malformed target: ``ValueError``; a target of the
    wrong type: ``TypeError``) still catches them."""


class HostResourceError(ComfyEnvError):
    """The host could not take a call's reply: it ran out of something (descriptors, memory
    for a mapping), or a shared-memory block of the reply was gone when it came to open it
    (``errno`` is ``ENOENT``: removed from ``/dev/shm`` by something else, or given up by the
    worker after ``shm_pinned_ttl`` seconds of the host running without taking it). Not the
    worker's fault: the worker is kept, the call fails and its result is lost.

    ``errno`` is the operating system's error number, if any."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class PoolClosedError(ComfyEnvError):
    """The pool was closed; it accepts no more calls."""


class ConfigError(ComfyEnvError, ValueError):
    """A ``PoolConfig`` value is invalid. ``field`` is the field, ``variable`` the
    ``COMFY_ENV_*`` variable it came from (None for a value passed in code) and ``value`` the
    bad value as given."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        variable: str | None = None,
        value: Any = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.variable = variable
        self.value = value


class EnvError(ComfyEnvError):
    """The env does not exist or holds no usable interpreter.

    ``tried`` lists the paths that were looked at.
    """

    def __init__(self, message: str, *, env: str | None = None, tried: tuple[str, ...] = ()):
        super().__init__(message)
        self.env = env
        self.tried = tried


class EnvBuildError(EnvError):
    """A declared env (a ``Recipe``, a pack's ``pyproject.toml``) could not be built.

    ``stage`` is what failed: ``"recipe"`` (the declaration itself), ``"find-python"``,
    ``"resolve"``, ``"download"``, ``"install"`` or ``"verify"`` (the built env did not run);
    ``requirements`` the requirement names uv's message blames, ``uv_message`` uv's own words,
    ``log_path`` the full build log, ``key`` the env key (None before an interpreter was
    found), ``retry_at`` when the next build is tried (wall-clock seconds) when this error is
    the recorded one of a build that failed less than a minute ago (not retried yet: a server
    does not hit the index on every prompt), else None."""

    def __init__(
        self,
        message: str,
        *,
        stage: str = "recipe",
        requirements: tuple[str, ...] = (),
        uv_message: str = "",
        log_path: str | None = None,
        key: str | None = None,
        retry_at: float | None = None,
        env: str | None = None,
    ) -> None:
        super().__init__(message, env=env)
        self.stage = stage
        self.requirements = requirements
        self.uv_message = uv_message
        self.log_path = log_path
        self.key = key
        self.retry_at = retry_at


class SerializationError(ComfyEnvError, TypeError):
    """An argument, result or callable cannot be pickled (or is too large for one frame):
    raised in the caller before anything is sent, the worker untouched. Or the call's
    arguments did not unpickle in the worker (the call did not run; the worker lives on); when
    that was an import, the error is also the worker's ``ModuleNotFoundError``/``ImportError``
    (``ArgumentImportError``), so code that catches those still does.
    """


class ArgumentImportError(SerializationError, ImportError):
    """The call's arguments need a module the env cannot import (a class only the host has);
    ``name`` is the module. A ``SerializationError`` and an ``ImportError``."""


class ArgumentModuleNotFound(ArgumentImportError, ModuleNotFoundError):
    """``ArgumentImportError`` for a module not found at all (``ModuleNotFoundError``)."""


class WorkerError(ComfyEnvError):
    """The worker process broke: it did not start, crashed, hung, or spoke garbage.

    ``env`` is the env key, ``pid`` the worker's interpreter pid (None if it never reported
    one), ``generation`` the worker's generation within its env.
    """

    def __init__(
        self,
        message: str,
        *,
        env: str | None = None,
        pid: int | None = None,
        generation: int | None = None,
    ) -> None:
        super().__init__(message)
        self.env = env
        self.pid = pid
        self.generation = generation


class WorkerStartError(WorkerError):
    """The worker could not be started or failed its handshake or canary; it was refused.

    ``stderr_tail`` holds the worker's last output lines, if any: one ``str`` (lines joined
    with ``"\n"``, ``""`` for none), as ``WorkerCrashed.stderr_tail``. ``unsupported`` is True when
    the env's interpreter can never run a worker (Python older than 3.8): the pool then fails
    later calls to that env at once, without starting it again.
    """

    def __init__(
        self, message: str, *, stderr_tail: str = "", unsupported: bool = False, **kw: Any
    ) -> None:
        super().__init__(message, **kw)
        self.stderr_tail = stderr_tail
        self.unsupported = unsupported


class WorkerCrashed(WorkerError):
    """The worker died during a call. The call is not replayed; the next call gets a fresh
    worker (generation + 1).

    ``exitcode`` is the process's return code as ``subprocess`` reports it (negative for a
    signal), ``signal`` the signal's name (``"SIGSEGV"``) or None, ``call_id`` and ``target``
    identify the call that was running, ``stderr_tail`` the worker's last output lines
    (including a ``faulthandler`` stack on a fatal signal).

    ``stderr_tail`` is one ``str``: the last ``PoolConfig.stderr_tail_lines`` lines (40 by
    default) of what the worker wrote (its stdout and stderr, at the Python and at the
    descriptor level, and its log records; a record's traceback stays with it, as one entry),
    oldest first, joined with ``"\n"`` and without a final newline; ``""`` when it wrote
    nothing. Not a list: ``err.stderr_tail.splitlines()``
    gives the lines. The same holds for ``WorkerStartError.stderr_tail``.
    """

    def __init__(
        self,
        message: str,
        *,
        exitcode: int | None = None,
        signal: str | None = None,
        call_id: int | None = None,
        target: str | None = None,
        stderr_tail: str = "",
        **kw: Any,
    ) -> None:
        super().__init__(message, **kw)
        self.exitcode = exitcode
        self.signal = signal
        self.call_id = call_id
        self.target = target
        self.stderr_tail = stderr_tail


class WorkerOutOfMemory(WorkerCrashed):
    """The worker ran out of memory during the call, and was replaced as after any crash.

    ``how`` says who ended it: ``"cgroup v2"`` or ``"cgroup v1"`` (the kernel killed it at
    ``PoolConfig.memory_limit``, counted in the worker's own memory cgroup), ``"RLIMIT_DATA"``
    (no cgroup could be used: an allocation failed at the limit and the worker left), or
    ``"OOM killer"`` (no limit of ours was reached; the kernel's OOM killer ran while the worker
    died by SIGKILL: the machine, or a cgroup above the host, ran out). ``limit`` and ``peak``
    are bytes (``limit`` None for the OOM killer; ``peak`` None where the kernel keeps none).
    """

    def __init__(
        self,
        message: str,
        *,
        limit: int | None = None,
        peak: int | None = None,
        how: str = "",
        **kw: Any,
    ) -> None:
        super().__init__(message, **kw)
        self.limit = limit
        self.peak = peak
        self.how = how


class CallTimeout(WorkerError, TimeoutError):
    """The call's total deadline passed. The worker (if the call had reached one) was killed
    and is replaced on the next call."""

    def __init__(
        self,
        message: str,
        *,
        timeout: float | None = None,
        call_id: int | None = None,
        target: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(message, **kw)
        self.timeout = timeout
        self.call_id = call_id
        self.target = target


class CallCancelled(WorkerError):
    """The call was cancelled with ``Call.cancel()`` (raised by ``Call.result()``). If the
    worker stopped the call within ``PoolConfig.cancel_grace`` it lives on in the same
    generation; otherwise it was killed and is replaced on the next call. The same cancel runs
    for a cancelled ``arun``/``acall`` task and for Ctrl-C in a caller waiting in
    ``call``/``run``, but those callers get ``asyncio.CancelledError`` and
    ``KeyboardInterrupt``."""


class ProtocolError(WorkerError):
    """The worker sent something that is not a valid frame; it was retired."""


class StaleGenerationError(WorkerError):
    """An object bound to an older generation of a worker was used after its worker retired."""


class EnvAbandonedError(WorkerError):
    """The env crashed too often and was cut off until it is reset."""


class RefReleasedError(ComfyEnvError, LookupError):
    """A ``RemoteRef`` was used after ``ref.release()`` freed its object: you released it.
    Raised in the host before anything is sent (for a ref nested deeper than one container
    level, when the worker reports it)."""


class RemoteError(ComfyEnvError):
    """The called function raised an exception that cannot be re-raised in the host as its
    own class (the class does not exist here, it does not unpickle, or it is a
    ``BaseException`` such as ``SystemExit`` that must not unwind the host).

    ``type_name`` is the remote class (``"module.Class"``), ``message`` its text and
    ``traceback_text`` the formatted remote traceback.
    """

    def __init__(self, type_name: str, message: str, traceback_text: str) -> None:
        super().__init__(f"{type_name}: {message}" if message else type_name)
        self.type_name = type_name
        self.message = message
        self.traceback_text = traceback_text

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.type_name, self.message, self.traceback_text))


class RemoteTraceback(Exception):
    """Carries a remote traceback as text; attached as ``__cause__`` of re-raised errors."""

    def __init__(self, traceback_text: str) -> None:
        super().__init__(traceback_text)
        self.traceback_text = traceback_text

    def __str__(self) -> str:
        return f'\n"""\nworker traceback:\n{self.traceback_text}"""'


def signal_name(returncode: int | None) -> str | None:
    """``-11`` -> ``"SIGSEGV"``; None for a normal exit or an unknown status."""
    if returncode is None or returncode >= 0:
        return None
    name = _SIGNAL_NAMES.get(returncode)
    if name is None:
        # The enum lookup runs cold on a crash report (tens of microseconds), and a report
        # names its signal several times: remembered per status.
        import signal  # (here: only a crash report needs it)

        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        _SIGNAL_NAMES[returncode] = name
    return name


_SIGNAL_NAMES: dict[int, str] = {}


_SIGNAL_HINTS = {
    "SIGSEGV": "a native library crashed (segmentation fault)",
    "SIGBUS": "a native library crashed (bus error)",
    "SIGILL": "a native library crashed (illegal instruction)",
    "SIGFPE": "a native library crashed (arithmetic fault)",
    "SIGABRT": "the process aborted (a failed C assertion or os.abort())",
    "SIGKILL": "killed from outside (the OOM killer or a kill -9)",
    "SIGTERM": "terminated from outside",
}


def describe_exit(returncode: int | None) -> str:
    """A human reading of a return code: 'killed by SIGSEGV: a native library crashed ...'."""
    if returncode is None:
        return "closed its channel while still running"
    name = signal_name(returncode)
    if name is not None:
        hint = _SIGNAL_HINTS.get(name)
        return f"was killed by {name}" + (f": {hint}" if hint else "")
    return f"exited with code {returncode}"


def chained(exc: _E, cause: BaseException | None) -> _E:
    """``raise chained(exc, cause)`` does what ``raise exc from cause`` does (``cause=None``:
    ``from None``). The modules of the compiled hot path (``python3 dev.py compile``) spell it
    this way because mypyc ignores the ``from`` clause; setting ``__cause__`` also sets
    ``__suppress_context__``, exactly as ``from`` does."""
    exc.__cause__ = cause
    return exc
