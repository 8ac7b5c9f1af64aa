"""Host-side codec: call messages out, replies and remote exceptions in (and the CONFIG a worker
runtime gets at its start-up, ``worker_config``, the same for every backend).

A call message is one pickle (protocol 5) of ``(target, args, kwargs)``:

- ``target`` is a ``"module:qualname"`` string when the caller passed one, or when the caller
  passed a function that is importable by that name (a module-level function of a real module).
  The worker imports it once and caches it: the cheapest and the most portable form, since it
  works across Python versions.
- Otherwise (a lambda, a closure, a function from ``__main__``) ``target`` is the function pickled
  *by value* with cloudpickle, which only loads in the same Python major.minor; the pool checks
  that against the worker's hello before sending.

Arguments are pickled with the C pickler; only if that fails (a lambda among the arguments, say)
with cloudpickle. An argument that cannot be pickled either way raises ``SerializationError`` in
the caller before anything is sent.

Replies: ``REPLY_OK`` carries the pickled result; ``REPLY_ERR`` carries the record built by
``comfy_env_worker.main.error_record``. A remote ``Exception`` whose class unpickles here is
re-raised as itself with the remote traceback as its ``__cause__``; anything else (unknown class,
unpicklable, or a bare ``BaseException`` such as ``SystemExit`` that must not unwind the host)
becomes ``RemoteError``.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from comfy_env_worker import shm
from comfy_env_worker.protocol import CallNotLoaded, FrameError, FrameType
from comfy_env_worker.shm import MIN_BLOCK

from ._errors import (
    ArgumentError,
    ArgumentImportError,
    ArgumentModuleNotFound,
    CallCancelled,
    RefReleasedError,
    RemoteError,
    RemoteTraceback,
    SerializationError,
    chained,
)

if TYPE_CHECKING:
    from ._settings import Settings

# Buffers at least this large leave the pickle (out of band); whether they then go through
# shared memory is decided per call by their total (``oob_threshold``, ``use_shm``).
OOB_MIN_BYTES = 64 * 1024


def oob_threshold(shm_threshold: int) -> int:
    """The per-buffer size from which a buffer travels out of band (never above the total
    that sends buffers through shared memory)."""
    return min(OOB_MIN_BYTES, shm_threshold)


def use_shm(buffers: list[memoryview], shm_threshold: int) -> bool:
    """Whether a message's out-of-band buffers go through shared memory: all of them when
    their total reaches the threshold, else none (measured: a split between in-band pickling
    and shared memory was slower than either path alone)."""
    return sum(b.nbytes for b in buffers) >= shm_threshold


# Function -> "module:qualname" for functions found importable by name (weakly keyed would be
# nicer, but functions are rarely collected; bounded instead).
_REFERENCE_CACHE: dict[Callable[..., Any], str | None] = {}
_REFERENCE_CACHE_MAX = 4096

_TARGET_EXAMPLE = "'package.module:function'"

# "module:qualname" strings already found well-formed (bounded like the cache above).
_VALID_TARGETS: set[str] = set()


def target_problem(target: str) -> str | None:
    """What is wrong with a ``"module:qualname"`` string as a call target, or None.

    The host's rule, checked before anything is sent (the worker would only fail the call
    later, as a plain ``ValueError``, or import something else than meant): exactly one
    ``:``, no whitespace or control characters, a module part of non-empty dotted names (not
    necessarily identifiers: importlib imports a directory such as ``ComfyUI-Foo`` on
    ``sys.path``; no leading dot, since relative imports have no package to be relative to),
    and a qualname of dotted identifiers (``function`` or ``Class.method``)."""
    module, sep, qualname = target.partition(":")
    if not sep:
        return "it has no ':' between the module and the function"
    if ":" in qualname:
        return "it has more than one ':'"
    if any(c.isspace() or not c.isprintable() for c in target):
        return "it contains whitespace or a control character"
    if not module:
        return "the module part before ':' is empty"
    if not qualname:
        return "the function part after ':' is empty"
    if "" in module.split("."):
        return f"the module part {module!r} has an empty name (a leading, trailing or double dot)"
    for part in qualname.split("."):
        if not part.isidentifier():
            return f"{part!r} in the function part {qualname!r} is not a Python identifier"
    return None


def check_target(target: object) -> None:
    """Raise ``ArgumentError`` unless ``target`` can be called: a well-formed
    ``"module:qualname"`` string (``target_problem``) or a callable. A good string is
    remembered, so the check runs once per target."""
    if isinstance(target, str):
        if type(target) is str and target in _VALID_TARGETS:
            return
        problem = target_problem(target)
        if problem is not None:
            raise ArgumentError(
                f"call target {target!r} is not of the form {_TARGET_EXAMPLE} "
                f"(or 'module:Class.method'): {problem}"
            )
        if len(_VALID_TARGETS) >= _REFERENCE_CACHE_MAX:
            _VALID_TARGETS.clear()
        if type(target) is str:  # not a str subclass, whose equality could lie
            _VALID_TARGETS.add(target)
    elif not callable(target):
        raise ArgumentError(
            f"call target must be a string {_TARGET_EXAMPLE} or a callable, "
            f"not {type(target).__name__} {_short_repr(target)}"
        )


def _short_repr(obj: object) -> str:
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a __repr__ that raises: the type name says enough
        return "(unprintable)"
    return text if len(text) <= 80 else text[:77] + "..."


def target_label(target: str | Callable[..., Any]) -> str:
    """How a target is named in errors and stats."""
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{qualname}"


def reference_name(fn: Callable[..., Any]) -> str | None:
    """``"module:qualname"`` if ``fn`` can be found again by that name, else None."""
    try:
        cached = _REFERENCE_CACHE.get(fn)
    except TypeError:  # unhashable callable object
        return None
    if cached is not None or fn in _REFERENCE_CACHE:
        return cached
    name = _lookup_reference(fn)
    if len(_REFERENCE_CACHE) >= _REFERENCE_CACHE_MAX:
        _REFERENCE_CACHE.clear()
    _REFERENCE_CACHE[fn] = name
    return name


def _lookup_reference(fn: Callable[..., Any]) -> str | None:
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or module_name == "__main__" or "<" in qualname:
        return None
    module = sys.modules.get(module_name)
    if module is None:
        return None
    try:
        import cloudpickle

        if module_name in getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", ()):
            return None  # the user asked for this module's functions to travel by value
    except ImportError:  # pragma: no cover - cloudpickle is a dependency
        pass
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return f"{module_name}:{qualname}" if obj is fn else None


def encode_call(
    target: str | Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    threshold: int = MIN_BLOCK,
    plain: bool = False,
) -> tuple[bytes, list[memoryview], bool]:
    """Pickle a call. Returns ``(body, out-of-band buffers, by_value)``.

    ``plain``: the caller already checked that every argument is a scalar (nothing can go out
    of band), so the arguments are not scanned again. A string target is validated once and
    remembered; a malformed one, or a target that is neither a string nor a callable, raises
    ``ArgumentError`` (``check_target``).

    Buffers of at least ``threshold`` bytes are left out of the pickle as raw views of the
    caller's memory (nothing is copied yet; the pool places them in shared memory or inline at
    send time). ``by_value`` means the body holds cloudpickled code and needs a worker on the
    host's Python major.minor."""
    if type(target) is str and target in _VALID_TARGETS:
        wire_target: str | Callable[..., Any] = target
    elif isinstance(target, str):
        check_target(target)
        wire_target = target
    elif callable(target):
        ref = reference_name(target)
        if ref is None:
            # By value: the whole message goes through cloudpickle (code and arguments).
            body, buffers = _cloudpickle(
                (target, args, kwargs),
                f"the callable {target_label(target)}",
                threshold,
                (target, *args, *kwargs.values()),  # (the code is no scalar: scanned for buffers)
            )
            return body, buffers, True
        wire_target = ref
    else:
        check_target(target)  # raises: neither a string nor a callable
    message = (wire_target, args, kwargs)
    if plain:
        try:
            return pickle.dumps(message, protocol=5), [], False
        except Exception:  # noqa: BLE001 - a scalar subclass with a broken reduce: general path
            pass
    scan = (*args, *kwargs.values()) if kwargs else args
    try:
        body, buffers = shm.encode(message, threshold, pickle.dumps, scan)
        return body, buffers, False
    except Exception:  # noqa: BLE001 - retry with cloudpickle, which knows lambdas and closures
        what = f"the arguments of {target_label(target)}"
        body, buffers = _cloudpickle(message, what, threshold, scan)
        return body, buffers, True


def _cloudpickle(
    obj: Any, what: str, threshold: int, scan: tuple[Any, ...]
) -> tuple[bytes, list[memoryview]]:
    """``obj`` pickled with cloudpickle; the arguments in ``scan`` are swapped for
    out-of-band stand-ins as with the C pickler (``shm.encode``), so a large ``bytes`` or a
    memoryview travels the same way whatever the target is."""
    import cloudpickle

    try:
        return shm.encode(obj, threshold, cloudpickle.dumps, scan, cloudpickle.Pickler)
    except Exception as exc:  # noqa: BLE001 - re-raised, typed (chained)
        raise chained(  # noqa: B904 - see chained
            SerializationError(f"{what} cannot be pickled: {type(exc).__name__}: {exc}"), exc
        )


def decode_reply(
    ftype: int,
    payload: bytes | bytearray | memoryview,
    target: str | Callable[..., Any],
    buffers: list[Any] | None = None,
) -> Any:
    """Return the call's result, or raise what the function raised. ``buffers`` are the
    reply's out-of-band buffers (already private copies).

    A result that does not unpickle here is a ``SerializationError`` (the function's value:
    a class the host lacks, a reducer that raises); an error record that is not the one the
    worker runtime writes raises ``FrameError``, which the caller turns into
    ``ProtocolError`` (the worker broke the protocol)."""
    if ftype == FrameType.REPLY_OK:
        try:
            return pickle.loads(payload, buffers=buffers)
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a reducer included
            # A result whose reconstruction raises SystemExit or KeyboardInterrupt must fail
            # this call, never unwind the caller as itself.
            error = SerializationError(
                f"the result of {target_label(target)} could not be unpickled in the host: "
                f"{type(exc).__name__}: {_text(exc)}"
            )
            raise chained(error, exc if isinstance(exc, Exception) else None)  # noqa: B904
    raise_remote(payload, target)


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except BaseException:  # noqa: BLE001 - a __str__ that raises
        return f"<unprintable {type(exc).__name__}>"


def error_record(
    payload: bytes | bytearray | memoryview,
) -> tuple[str, str | None, str, str, bytes | None]:
    """A REPLY_ERR payload as the worker runtime writes it (``comfy_env_worker.main.
    error_record``): (type name, module, message, traceback text, pickled exception or
    None), made of plain strings and bytes by the runtime itself, whatever the exception.
    Anything else raises ``FrameError`` (a ``SystemExit`` from a reducer in it included)."""
    try:
        record = pickle.loads(payload)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a record that is no pickle
        error = FrameError(f"malformed error record: {type(exc).__name__}: {_text(exc)[:200]}")
        raise chained(error, None)  # noqa: B904 - see chained
    if type(record) is not tuple or len(record) != 5:
        shape = f"a {len(record)}-tuple" if type(record) is tuple else type(record).__name__
        raise FrameError(f"malformed error record: {shape}, not the runtime's 5-tuple")
    qualname, module, message, tb_text, pickled = record
    if not (
        isinstance(qualname, str)
        and (module is None or isinstance(module, str))
        and isinstance(message, str)
        and isinstance(tb_text, str)
        and (pickled is None or isinstance(pickled, bytes))
    ):
        types = ", ".join(type(field).__name__ for field in record)
        raise FrameError(f"malformed error record: fields of types ({types})")
    return qualname, module, message, tb_text, pickled


def _not_loaded(
    target: str | Callable[..., Any], message: str, pickled: bytes | None
) -> SerializationError:
    """The arguments (or a by-value target) did not unpickle in the worker: the call never
    ran. Told as what it is, not as the bare ``ModuleNotFoundError`` of a class the env lacks;
    an import that failed stays an ``ImportError`` too (``ArgumentImportError``), so code that
    catches the worker's error as before still does (``comfy-env doctor``'s numpy probe)."""
    kind, name = "", None
    try:
        facts = pickle.loads(pickled) if pickled is not None else None
    except BaseException:  # noqa: BLE001 - the text alone says it
        facts = None
    if isinstance(facts, CallNotLoaded) and len(facts.args) == 3:
        kind = facts.args[1] if isinstance(facts.args[1], str) else ""
        name = facts.args[2] if isinstance(facts.args[2], str) else None
    text = (
        f"the call to {target_label(target) if target else '?'} could not be unpickled in the "
        f"worker, so it did not run: {message}"
    )
    if kind == "DtypeNotRepresentable":  # an array of a dtype the env's numpy lacks
        return SerializationError(f"{text} (the env's numpy has no such dtype)")
    if kind not in ("ImportError", "ModuleNotFoundError"):  # a reducer that raised
        return SerializationError(f"{text} (an argument's reducer failed there)")
    text += " (an argument's class or module must be importable in the env too)"
    imported = (ArgumentModuleNotFound if kind == "ModuleNotFoundError" else ArgumentImportError)(
        text
    )
    imported.name = name
    return imported


def raise_remote(
    payload: bytes | bytearray | memoryview, target: str | Callable[..., Any] = ""
) -> NoReturn:
    qualname, module, message, tb_text, pickled = error_record(payload)
    cause = RemoteTraceback(tb_text)
    if (module, qualname) == ("comfy_env_worker.protocol", "CallNotLoaded"):
        raise chained(_not_loaded(target, message, pickled), cause)
    if (module, qualname) == ("comfy_env_worker.control", "Cancelled"):
        # The call stopped on a cancel (cooperatively or interrupted) and its worker lives on.
        # An asynchronous ``Cancelled`` (pure-Python code interrupted after half the grace) is
        # raised as the bare class: no text, and then no empty parentheses either.
        text = "the call was cancelled; it stopped in its worker, which lives on with its caches"
        cancelled = CallCancelled(f"{text} ({message})" if message else text)
        raise chained(cancelled, cause)
    if (module, qualname) == ("comfy_env_worker.refs", "StaleRefError"):
        raise chained(RefReleasedError(message), cause)
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except BaseException:  # noqa: BLE001 - class missing here, broken reduce, even a
            exc = None  # SystemExit from a reconstructor: keep the text
        if isinstance(exc, Exception):
            raise chained(exc, cause)
    type_name = qualname if module in ("builtins", None) else f"{module}.{qualname}"
    raise chained(RemoteError(type_name, message, tb_text), cause)


def worker_config(
    settings: Settings,
    generation: int,
    shm_host_id: str | None,
    shm_pool_bytes: int,
    activation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The CONFIG a worker runtime gets at its start-up, whatever runs it (a process, an
    actor): ``shm_host_id`` None means no shared memory between host and worker.
    ``activation`` (``Activation.for_config``): the env's activation for a runtime whose
    process environment the host did not make (a Ray actor), applied before ``env``."""
    return {
        "activation": activation,
        "sys_path": list(settings.sys_path),
        "cwd": settings.cwd,
        "env": dict(settings.env_vars),
        "log_level": settings.log_level.upper(),
        "max_frame_bytes": settings.max_frame_bytes,
        "shm_threshold_bytes": settings.shm_threshold_bytes,
        "oob_min_bytes": oob_threshold(settings.shm_threshold_bytes),
        "shm_host_id": shm_host_id,
        "shm_pool_bytes": shm_pool_bytes,
        "shm_pinned_ttl": settings.shm_pinned_ttl,
        "generation": generation,
        # Cooperative code gets the first half of the grace to stop by itself.
        "cancel_interrupt_after": settings.cancel_grace / 2,
        "spin_wait": settings.spin_wait,
    }
