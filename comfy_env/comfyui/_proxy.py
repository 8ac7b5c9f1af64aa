"""Host-side node proxies: one class per isolated node, registered with ComfyUI.

A proxy carries the scanned attributes (``INPUT_TYPES``, ``RETURN_TYPES``, ...) and its
``FUNCTION`` is a coroutine, so ComfyUI runs it as an asyncio task on the prompt's event loop and
independent isolated nodes overlap. One node execution::

    ComfyUI task -> proxy.<FUNCTION>(**inputs)               (server process, prompt loop)
      inputs: tensors split out (values.split), KeptOutput handles -> Kept markers + refs;
      context: prompt id, node id, ComfyUI's directories
      -> Worker.arun("...runner:run_node", ..., on_event=bridge)   (pool: lease, send, wait)
         or, when some outputs stay in the worker,
         Worker.arun_ref("...runner:run_node_kept") + a call of the run's crossing()
      <- [skeleton, *tensors]: tensors joined back as torch tensors; KeptOut -> KeptOutput
    ComfyUI caches the outputs under the node's input signature

**Events** (``on_event``, on the loop or the call's thread): ``progress`` (from the stand-in
``ProgressBar``) goes to ComfyUI's ``PROGRESS_BAR_HOOK`` with the node's prompt and node ids,
which sends the websocket ``progress`` message; ``comfyui.preview`` the same with its image;
``comfyui.send_sync`` to ``PromptServer.instance.send_sync``.

**Interrupt** (``POST /interrupt`` sets ComfyUI's flag): while a call runs, the proxy polls the
flag; when set, it cancels the call's task: the library's cooperative cancel (the worker is
asked; the stand-ins raise inside the node at its next check; pure Python is interrupted after
half of ``cancel_grace``; the worker is killed after the grace or the pack's
``interrupt_grace``). Then it raises ComfyUI's own ``InterruptProcessingException`` through
``throw_exception_if_processing_interrupted``, which also clears the flag as ComfyUI expects.
The progress hook would clear the flag too, so the bridge never calls it while an interrupt is
pending (and sets the flag again if the hook consumed one that arrived in between).

**Kept outputs and ComfyUI's cache.** An output whose socket type stays in the worker is a
``KeptOutput`` holding the run's ``RemoteRef``. Such proxies get a hidden ``UNIQUE_ID`` and an
``IS_CHANGED`` whose value is a token remembered per node id: the same token while the run that
produced the cached outputs is alive, a fresh one once its generation is gone. ComfyUI therefore
re-runs the producer after a crash instead of handing out a stale ref.

**Errors.** A node's exception is re-raised in the server (its own class when the server can
import it, else ``RemoteError``) with the worker's traceback folded into ``str()``, the message
ComfyUI shows, and the pack's package name in the worker replaced by its directory name
(``with_remote_traceback``).

**Registered models.** Each kept run is also registered with ComfyUI's model manager
(``_models``), sized as measured in the worker: ComfyUI's ``free_memory`` evicts it (the worker
drops it, the ref is released, so the token above changes and the producer runs again).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import itertools
import keyword
import sys
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from comfy_env_worker.comfyui import runner, values

from .._errors import EnvAbandonedError, RemoteError, RemoteTraceback
from .._refs import RemoteRef
from . import _models
from ._live import has_choices
from ._scan import server_directories

if TYPE_CHECKING:
    from . import _Pack

RUN = "comfy_env_worker.comfyui.runner:run_node"
RUN_KEPT = "comfy_env_worker.comfyui.runner:run_node_kept"
HOOK = "comfy_env_worker.comfyui.runner:call_hook"
UNIQUE_ID_INPUT = "comfy_env_unique_id"
INTERRUPT_POLL = 0.02  # seconds between looks at ComfyUI's interrupt flag while a node runs

# Socket types whose values cross to the host; every other output type stays in the worker
# unless the pack says otherwise (``isolate(crossing_types=...)``).
CROSSING_TYPES = frozenset(
    (
        "IMAGE",
        "MASK",
        "LATENT",
        "INT",
        "FLOAT",
        "STRING",
        "BOOLEAN",
        "COMBO",
        "NOISE",
        "SIGMAS",
        "AUDIO",
        "VIDEO",
        "*",
    )
)

# V3 hidden inputs that cross (``cls.hidden.<name>`` in the worker).
V3_HIDDEN = ("unique_id", "prompt", "extra_pnginfo", "auth_token_comfy_org", "api_key_comfy_org")

_instance_ids = itertools.count(1)
_tokens = itertools.count(1)


class KeptOutput:
    """An output that stayed in the pack's worker (a loaded model, a mesh kernel, ...).

    ComfyUI passes it along like any value; an isolated node of the same env receives the live
    object. ``ref`` is the ``RemoteRef`` of the run that produced it, ``index`` the output
    index (``(i, j)``: item ``j`` of the list output ``i``), ``type_name`` the socket type,
    ``model`` the run's entry in ComfyUI's model manager (``_models.WorkerModel``; None outside
    ComfyUI): held here, so that ComfyUI's output cache owns it as it owns its own models."""

    __slots__ = ("index", "model", "ref", "type_name")

    def __init__(
        self,
        ref: RemoteRef,
        index: int | tuple[int, int],
        type_name: str,
        model: _models.WorkerModel | None = None,
    ) -> None:
        self.ref = ref
        self.index = index
        self.type_name = type_name
        self.model = model

    @property
    def alive(self) -> bool:
        return self.ref.alive

    def __repr__(self) -> str:
        return (
            f"<KeptOutput {self.type_name} #{self.index} in env {self.ref.env!r} "
            f"generation {self.ref.generation}>"
        )


# ---- ComfyUI glue (imported lazily: this module must import without ComfyUI) ----------------


def _server_module(name: str) -> Any:
    """ComfyUI's module ``name`` if this process is a ComfyUI server, else None. Only modules
    already imported are used (ComfyUI imports them all before it runs a node), so a proxy
    called outside ComfyUI pays no failed import per call."""
    return sys.modules.get(name)


def _context(pack: _Pack | None = None) -> dict[str, Any]:
    context: dict[str, Any] = server_directories(pack.spec if pack is not None else None)
    execution = _server_module("comfy_execution.utils")
    if execution is not None:
        executing = execution.get_executing_context()
        if executing is not None:
            context["prompt_id"] = executing.prompt_id
            context["node_id"] = executing.node_id
    return context


def _interrupted() -> bool:
    mm = _server_module("comfy.model_management")
    return mm is not None and bool(mm.processing_interrupted())


def _raise_interrupt() -> None:
    """Raise ComfyUI's own interrupt exception, clearing its flag as ComfyUI does."""
    try:
        import comfy.model_management as mm
    except ImportError:
        raise asyncio.CancelledError() from None
    mm.throw_exception_if_processing_interrupted()
    raise mm.InterruptProcessingException()


_INTERRUPTS = (
    "comfy_env_worker.comfyui.standins.InterruptProcessingException",
    # comfyui="server": ComfyUI's own, raised in the worker (a RemoteError of that name
    # where this process has no comfy.model_management)
    "comfy.model_management.InterruptProcessingException",
)


def _is_interrupt(exc: BaseException) -> bool:
    """Whether the node stopped on an interrupt (the stand-in's or ComfyUI's own)."""
    name = f"{type(exc).__module__}.{type(exc).__name__}"
    return name in _INTERRUPTS or getattr(exc, "type_name", None) in _INTERRUPTS


def _to_host(value: Any) -> Any:
    if type(value).__module__ == "numpy":
        try:
            import torch
        except ImportError:
            return value
        return torch.from_numpy(value)
    return value


def _prepare_for(has_torch: bool) -> Callable[[Any], Any]:
    def prepare(value: Any) -> Any:
        wire = values.to_wire(value)
        if not has_torch and type(wire).__module__.startswith("torch"):
            return wire.numpy()
        return wire

    return prepare


# ---- calls ---------------------------------------------------------------------------------


def _encode_inputs(pack: _Pack, kwargs: dict[str, Any]) -> tuple[Any, list[Any], list[RemoteRef]]:
    refs: list[RemoteRef] = []
    marked = values.replace(kwargs, functools.partial(_mark_kept, pack, refs))
    skeleton, tensors = values.split(marked, _prepare_for(pack.has_torch))
    return skeleton, tensors, refs


def _mark_kept(pack: _Pack, refs: list[RemoteRef], v: Any) -> Any:
    if not isinstance(v, KeptOutput):
        return v
    if v.ref.env != pack.worker.env:
        raise TypeError(f"{v!r} lives in another env's worker; only nodes of that env can use it")
    if v.ref not in refs:
        refs.append(v.ref)
    return runner.Kept(refs.index(v.ref), v.index)


async def _guarded(pack: _Pack, job: Any) -> Any:
    """Await ``job`` (a coroutine running one worker call), watching ComfyUI's interrupt flag.

    On interrupt the call's task is cancelled, which is the library's cooperative cancel: the
    worker is asked to stop (``comfy_env_worker.cancelled()`` turns true, so the stand-ins'
    ``throw_exception_if_processing_interrupted()`` and ``ProgressBar.update()`` raise inside
    the node, and the worker with its loaded models lives on); pure-Python code that never
    checks is interrupted after half of ``PoolConfig.cancel_grace``, and the worker is killed
    after all of it (or after the pack's ``interrupt_grace``, when set). Then ComfyUI's own
    interrupt exception is raised."""
    task = asyncio.ensure_future(job)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=INTERRUPT_POLL)
            if done:
                break
            if _interrupted():
                await _stop(pack, task)
                _raise_interrupt()
        return task.result()
    except asyncio.CancelledError:
        # This coroutine itself was cancelled: stop the call the same way and wait for its end,
        # so the slot is settled and nothing is left running behind the caller.
        if not task.done():
            await _stop(pack, task)
        raise
    except EnvAbandonedError as exc:
        exc.args = (
            f"{exc.args[0] if exc.args else exc}\nTo reset: fix the pack or its env, then "
            "restart ComfyUI (or call comfy_env.default_pool().reset(env) from a console).",
        )
        raise
    finally:
        if not task.done():
            task.cancel()


async def _stop(pack: _Pack, task: asyncio.Future[Any]) -> None:
    """Cancel the call cooperatively; kill its worker once ``interrupt_grace`` passed."""
    task.cancel()
    if pack.interrupt_grace is not None:
        done, _ = await asyncio.wait({task}, timeout=pack.interrupt_grace)
        if not done:
            task.cancel()  # a second cancellation kills the worker at once
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: the call is abandoned, its outcome is the interrupt


def _event_bridge(context: dict[str, Any]) -> Callable[[Any], None]:
    """The call's ``on_event``: worker events become ComfyUI progress and websocket messages
    of the node's prompt (runs on the loop or on the call's thread; both calls below are
    thread-safe in ComfyUI)."""
    prompt_id = context.get("prompt_id")
    node_id = context.get("node_id")

    def progress(value: Any, total: Any, preview: Any, node: Any) -> None:
        try:
            import comfy.model_management as mm
            import comfy.utils
        except ImportError:
            return
        hook = comfy.utils.PROGRESS_BAR_HOOK
        if hook is None or mm.processing_interrupted():
            return  # an interrupt is pending: the proxy handles it, the flag must stay set
        try:
            hook(value, total, preview, prompt_id=prompt_id, node_id=node or node_id)
        except mm.InterruptProcessingException:
            mm.interrupt_current_processing(True)  # the hook cleared the flag; keep it set

    def on_event(event: Any) -> None:
        data = event.data if isinstance(event.data, dict) else {}
        if event.kind == "progress":
            progress(data.get("done"), data.get("total"), None, data.get("node"))
        elif event.kind == "comfyui.preview":
            progress(data.get("value"), data.get("max"), data.get("preview"), data.get("node"))
        elif event.kind == "comfyui.send_sync":
            try:
                from server import PromptServer
            except ImportError:
                return
            PromptServer.instance.send_sync(data.get("event"), data.get("data"), data.get("sid"))

    return on_event


class PlainText(str):
    """A ``str`` whose ``repr`` is its text. ``KeyError`` (and subclasses that keep its
    ``__str__``) shows ``repr(args[0])``: a message with the worker's traceback would reach
    ComfyUI's UI quoted, its newlines as literal ``\\n``. With this argument it reads as written,
    and the exception keeps its exact type."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str.__str__(self)


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a __str__ that raises must not hide the node's error
        return f"<unprintable {type(exc).__name__}>"


# Node exception class -> its subclass that shows a given message (``_shown_as``), made once.
_SHOWN: dict[type, type] = {}


def _shown_str(self: BaseException) -> str:
    text: str = self.__dict__["_comfy_env_message"]
    return text


def _shown_reduce(self: BaseException) -> Any:
    # Pickled (or copied) as the node's own exception, as it came from the worker.
    return self.__dict__["_comfy_env_original"].__reduce_ex__(2)


def _shown_as(exc: BaseException, message: str) -> BaseException | None:
    """A copy of ``exc`` whose ``str()`` is ``message``, for exceptions whose text does not
    come from their ``args`` (their own ``__str__``, ``OSError``'s fields). Python cannot
    change ``str()`` of one instance, so the copy's class is a subclass made here under the
    node class's own module and name: ``except`` clauses, ``isinstance`` and ComfyUI's
    ``exception_type`` (module + qualified name) see the node's type; ``type(exc) is`` does
    not. The copy has the original's attributes and pickles as the original. None if the
    class cannot be subclassed or copied."""
    base = type(exc)
    try:
        cls = _SHOWN.get(base)
        if cls is None:
            namespace = {
                "__module__": base.__module__,
                "__qualname__": base.__qualname__,
                "__doc__": base.__doc__,
                "__str__": _shown_str,
                "__reduce__": _shown_reduce,
            }
            cls = _SHOWN[base] = type(base.__name__, (base,), namespace)
        reduced = exc.__reduce_ex__(2)
        args = exc.args
        if isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[0] is base:
            args = tuple(reduced[1])  # OSError's include the file name, not in .args
        shown: BaseException = cls.__new__(cls, *args)
        _copy_builtin_fields(exc, shown)
        shown.__dict__.update(getattr(exc, "__dict__", {}))
        shown.__dict__["_comfy_env_message"] = message
        shown.__dict__["_comfy_env_original"] = exc
        shown.args = exc.args
        if _safe_str(shown) != message:
            return None
        return shown.with_traceback(exc.__traceback__)
    except Exception:  # noqa: BLE001 - any failure: the caller falls back to RemoteError
        return None


def _copy_builtin_fields(source: BaseException, target: BaseException) -> None:
    """Copy the fields that built-in exception classes keep in C slots, set by their
    ``__init__`` (``UnicodeDecodeError.encoding``/``object``/``start``, ``ImportError.name``,
    ``SyntaxError.lineno``, ``StopIteration.value``...): ``__new__`` alone leaves them empty,
    and they are in neither ``args`` nor ``__dict__``. Calling the node class's ``__init__``
    again instead could run a pack's own code. A field that cannot be read or set (an
    ``OSError.characters_written`` never set) is left as ``__new__`` made it."""
    for klass in type(source).__mro__:
        if klass.__module__ != "builtins" or klass in (BaseException, object):
            continue
        for name, field in vars(klass).items():
            if name.startswith("__") or not isinstance(
                field, (types.MemberDescriptorType, types.GetSetDescriptorType)
            ):
                continue
            try:
                setattr(target, name, getattr(source, name))
            except Exception:  # noqa: BLE001 - see the docstring
                pass


def with_remote_traceback(exc: BaseException, pack: _Pack) -> tuple[BaseException, Any]:
    """What a node proxy raises for ``exc``, the node's exception re-raised in the server,
    and its cause: ``(exception, RemoteTraceback)``.

    ComfyUI shows ``str(exception)`` as the error's message (``execution.py``:
    ``exception_message``) and only the server-side frames as its traceback, so the worker's
    traceback is folded into ``str()``: ``<the node's message>\n\nworker traceback:\n...``,
    for every exception type. In order of preference, keeping the node's type:

    - the exception's text comes from its ``args`` (one argument or several, a string or
      not, ``KeyError`` included through ``PlainText``): ``args`` becomes the one message,
      same object, same type;
    - else (its own ``__str__``, ``OSError``): a copy of a subclass under the same name
      (``_shown_as``);
    - else a ``RemoteError`` naming the type.

    The pack's package name in the worker is shown as the pack's directory name
    (``PackSpec.readable``), in the type name of a ``RemoteError``, the message and the
    traceback. Exceptions without a worker traceback (a crash, a timeout) are left as they
    are."""
    cause = exc.__cause__
    text = getattr(cause, "traceback_text", None)
    if not isinstance(text, str) or not text:
        return exc, cause
    readable = pack.spec.readable
    text = readable(text)
    cause = RemoteTraceback(text)
    if isinstance(exc, RemoteError):
        renamed = RemoteError(readable(exc.type_name), readable(exc.message), text)
        exc = renamed.with_traceback(exc.__traceback__)
    message = f"{readable(_safe_str(exc))}\n\nworker traceback:\n{text.rstrip()}"
    original = exc.args
    for arg in (message, PlainText(message)):
        try:
            exc.args = (arg,)
        except Exception:  # noqa: BLE001 - an exception class with its own ``args``
            break
        if _safe_str(exc) == message:
            return exc, cause
    try:
        exc.args = original
    except Exception:  # noqa: BLE001 - as above
        pass
    shown = _shown_as(exc, message)
    if shown is not None:
        return shown, cause
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return RemoteError(readable(name), message, text).with_traceback(exc.__traceback__), cause


async def run_node(
    pack: _Pack,
    node: NodeInfo,
    instance: Any,
    kwargs: dict[str, Any],
    hidden: dict[str, Any] | None = None,
) -> Any:
    unique_id = kwargs.pop(UNIQUE_ID_INPUT, None)
    skeleton, tensors, refs = _encode_inputs(pack, kwargs)
    instance_id = getattr(instance, "_comfy_env_instance", None)
    context = _context(pack)
    if hidden:
        context["hidden"] = hidden
    args: tuple[Any, ...] = (
        node.spec,
        instance_id,
        node.function,
        skeleton,
        tensors,
        refs,
        context,
    )
    worker = pack.worker
    on_event = _event_bridge(context)
    run_ref: RemoteRef | None = None
    try:
        if node.keep:
            run_ref = await _guarded(
                pack,
                worker.arun_ref(
                    RUN_KEPT,
                    (*args, dict(node.keep), list(node.listed)),
                    timeout=pack.timeout,
                    on_event=on_event,
                ),
            )
            assert run_ref is not None
            reply = await _guarded(
                pack,
                worker.arun(
                    "comfy_env_worker.refs:call_method",
                    (run_ref, "crossing", (), {}),
                    timeout=pack.timeout,
                ),
            )
        else:
            reply = await _guarded(
                pack, worker.arun(RUN, args, timeout=pack.timeout, on_event=on_event)
            )
    except Exception as exc:  # noqa: BLE001 - re-raised, with the worker's traceback folded in
        if _is_interrupt(exc):
            _raise_interrupt()
        shown, cause = with_remote_traceback(exc, pack)
        raise shown from cause
    result = values.join(reply[0], reply[1:], _to_host)

    if unique_id is None:
        unique_id = context.get("node_id")  # ComfyUI's executing context (V3, or no hidden id)
    if refs and result.get("ref_bytes"):
        _models.REGISTRY.update_sizes(refs, result["ref_bytes"])
    model = None
    if run_ref is not None and pack.register_models:
        model = _register_kept(pack, node, run_ref, result.get("kept_bytes"), unique_id)
    outputs = [_unkeep(run_ref, v, model) for v in (result["outputs"] or [])]
    if run_ref is not None and unique_id is not None:
        node.record_run(str(unique_id), run_ref)
    rest = result["rest"]
    if result["kind"] == "v3":
        from comfy_api.latest import io

        return io.NodeOutput(*outputs, ui=rest.get("ui"))
    if result["kind"] == "dict":
        out = dict(rest)
        if result["outputs"] is not None:
            out["result"] = tuple(outputs)
        return out
    return tuple(outputs)


def _register_kept(
    pack: _Pack, node: NodeInfo, run_ref: RemoteRef, kept_bytes: Any, unique_id: Any
) -> _models.WorkerModel | None:
    """Hand the kept run to ComfyUI's model manager (None outside ComfyUI). A failure there
    is logged, never the node's failure: registration is bookkeeping."""
    label = f"{node.name}#{unique_id}" if unique_id is not None else node.name
    try:
        return _models.register(pack.pool, run_ref, int(kept_bytes or 0), label)
    except Exception:  # noqa: BLE001 - see the docstring
        _models.log.exception("comfy-env: could not register %s with ComfyUI", label)
        return None


def _unkeep(run_ref: RemoteRef | None, v: Any, model: _models.WorkerModel | None) -> Any:
    if run_ref is None:
        return v
    if isinstance(v, runner.KeptOut):
        return KeptOutput(run_ref, v.index, v.type_name, model)
    if type(v) is list and v and isinstance(v[0], runner.KeptOut):
        return [KeptOutput(run_ref, item.index, item.type_name, model) for item in v]
    return v


async def call_hook(
    pack: _Pack, node: NodeInfo, method: str, instance: Any, kwargs: dict[str, Any]
) -> Any:
    skeleton, tensors, _ = _encode_inputs(pack, kwargs)
    instance_id = getattr(instance, "_comfy_env_instance", None)
    args = (node.spec, instance_id, method, skeleton, tensors, _context(pack))
    try:
        return await _guarded(pack, pack.worker.arun(HOOK, args, timeout=pack.timeout))
    except Exception as exc:  # noqa: BLE001 - re-raised, with the worker's traceback folded in
        shown, cause = with_remote_traceback(exc, pack)
        raise shown from cause


# ---- classes -------------------------------------------------------------------------------


class NodeInfo:
    """What a proxy class needs to know about its node (from the scan)."""

    def __init__(self, pack: _Pack, data: dict[str, Any], kind: str) -> None:
        self.pack = pack
        self.name: str = data["name"]
        self.kind = kind
        self.spec = (pack.spec.pack_dir, pack.spec.module, kind, self.name)
        self.methods: dict[str, Any] = data.get("methods", {})
        self.data = data
        self.function: str = data.get("attrs", {}).get("FUNCTION", "execute")
        self.keep: dict[int, str] = {}  # output index -> socket type, for outputs kept
        self.listed: tuple[int, ...] = ()  # kept outputs that are OUTPUT_IS_LIST
        self.author_wants_unique_id: str | None = None
        # node id -> (token, the RemoteRef of the run whose outputs ComfyUI may have cached)
        # Weakly: ComfyUI's output cache owns the run (through its KeptOutputs); once the cache
        # drops it, the ref is released and the worker frees the object (a strong ref here
        # would keep it alive in the worker, out of ComfyUI's sight, for as long as the node
        # id is remembered).
        self.runs: dict[str, tuple[str, weakref.ref[RemoteRef]]] = {}
        self.pending: dict[str, str] = {}

    def liveness_token(self, unique_id: str) -> str:
        """The ``IS_CHANGED`` part for node ``unique_id``: the token of its last run while
        that run's worker generation is alive (ComfyUI's cached outputs are usable), a fresh
        one once it is gone (the cache entry misses and the node runs again). The run that
        follows records the token it was scheduled under."""
        entry = self.runs.get(unique_id)
        ref = entry[1]() if entry is not None else None
        if entry is not None and ref is not None and ref.alive:
            token = entry[0]
        else:
            token = f"comfy-env-run-{next(_tokens)}"
        self.pending[unique_id] = token
        return token

    def record_run(self, unique_id: str, ref: RemoteRef) -> None:
        token = self.pending.pop(unique_id, None) or f"comfy-env-run-{next(_tokens)}"
        self.runs[unique_id] = (token, weakref.ref(ref))


def _tupled_inputs(spec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for category, entries in spec.items():
        if isinstance(entries, dict):
            out[category] = {
                name: tuple(value) if isinstance(value, list) else value
                for name, value in entries.items()
            }
        else:
            out[category] = entries
    return out


def _add_hidden(node: NodeInfo, input_types: dict[str, Any]) -> dict[str, Any]:
    """``input_types`` with the hidden input the proxy needs (the node id of a node whose
    outputs stay in the worker, or whose author asked for it); returns it."""
    hidden = input_types.setdefault("hidden", {})
    if node.keep or node.author_wants_unique_id:
        hidden[UNIQUE_ID_INPUT] = "UNIQUE_ID"
    if not hidden:
        del input_types["hidden"]
    return input_types


_TUPLE_ATTRS = ("RETURN_TYPES", "RETURN_NAMES", "OUTPUT_IS_LIST", "OUTPUT_TOOLTIPS")


def _signature_function(
    name: str, argspec: dict[str, Any] | None, body: Callable[..., Any], is_method: bool
) -> Callable[..., Any]:
    """An async function named ``name`` with the author's argument names (ComfyUI reads them
    for ``VALIDATE_INPUTS``), forwarding everything to ``body(self_or_cls, kwargs)``."""
    params = [a for a in (argspec or {}).get("args", []) if a.isidentifier()]
    params = [a for a in params if not keyword.iskeyword(a)]
    varkw = bool((argspec or {}).get("varkw")) or argspec is None
    first = "self" if is_method else "cls"
    sig = ", ".join([first, *params, *(["**kwargs"] if varkw else [])])
    collect = ", ".join(f"{p!r}: {p}" for p in params)
    source = (
        f"async def {name}({sig}):\n"
        f"    args = {{{collect}}}\n"
        f"    {'args.update(kwargs)' if varkw else 'pass'}\n"
        f"    return await _body({first}, args)\n"
    )
    namespace: dict[str, Any] = {"_body": body}
    exec(compile(source, f"<comfy-env proxy {name}>", "exec"), namespace)
    function: Callable[..., Any] = namespace[name]
    return function


def make_v1_proxy(pack: _Pack, data: dict[str, Any]) -> type:
    node = NodeInfo(pack, data, "v1")
    attrs = data["attrs"]
    input_types = _tupled_inputs(attrs["INPUT_TYPES"])
    return_types = tuple(attrs.get("RETURN_TYPES", ()))
    node.keep = {
        i: t
        for i, t in enumerate(return_types)
        if isinstance(t, str) and t not in pack.crossing_types
    }
    is_list = list(attrs.get("OUTPUT_IS_LIST") or ())
    node.listed = tuple(i for i in node.keep if i < len(is_list) and is_list[i])
    for name, value in list(input_types.get("hidden", {}).items()):
        if value == "UNIQUE_ID":
            node.author_wants_unique_id = name
    _add_hidden(node, input_types)

    namespace: dict[str, Any] = {"__module__": __name__, "_comfy_env_node": node}
    for key, value in attrs.items():
        if key == "INPUT_TYPES":
            continue
        namespace[key] = tuple(value) if key in _TUPLE_ATTRS and isinstance(value, list) else value
    frozen = copy.deepcopy(input_types)
    live = pack.live_inputs if has_choices(input_types) else None
    if live is not None:
        live.track(node.name)

    def input_types_method(cls: type) -> dict[str, Any]:
        if live is not None:
            now = live.get(node.name)  # its lists of choices as the env sees them now
            if isinstance(now, dict):
                return _add_hidden(node, _tupled_inputs(now))
        return copy.deepcopy(frozen)

    namespace["INPUT_TYPES"] = classmethod(input_types_method)

    def init(self: Any) -> None:
        self._comfy_env_instance = next(_instance_ids)

    namespace["__init__"] = init

    async def run(self: Any, **kwargs: Any) -> Any:
        if node.author_wants_unique_id and UNIQUE_ID_INPUT in kwargs:
            kwargs[node.author_wants_unique_id] = kwargs[UNIQUE_ID_INPUT]
        return await run_node(pack, node, self, kwargs)

    namespace[node.function] = run

    async def validate(cls: Any, args: dict[str, Any]) -> Any:
        return await call_hook(pack, node, "VALIDATE_INPUTS", None, args)

    if "VALIDATE_INPUTS" in node.methods:
        namespace["VALIDATE_INPUTS"] = classmethod(
            _signature_function("VALIDATE_INPUTS", node.methods["VALIDATE_INPUTS"], validate, False)
        )

    async def is_changed(cls: Any, /, **kwargs: Any) -> Any:
        unique_id = kwargs.pop(UNIQUE_ID_INPUT, None)
        author = None
        if "IS_CHANGED" in node.methods:
            if node.author_wants_unique_id and unique_id is not None:
                kwargs[node.author_wants_unique_id] = unique_id
            author = await call_hook(pack, node, "IS_CHANGED", None, kwargs)
        if not node.keep or unique_id is None:
            return author
        token = node.liveness_token(str(unique_id))
        return token if author is None else [author, token]

    if "IS_CHANGED" in node.methods or node.keep:
        namespace["IS_CHANGED"] = classmethod(is_changed)

    async def lazy(self: Any, **kwargs: Any) -> Any:
        kwargs.pop(UNIQUE_ID_INPUT, None)
        return await call_hook(pack, node, "check_lazy_status", self, kwargs)

    if "check_lazy_status" in node.methods:
        namespace["check_lazy_status"] = lazy

    class_name = "".join(c if c.isalnum() else "_" for c in node.name) or "Node"
    return type(f"Isolated_{class_name}", (), namespace)


def _replay(io_module: Any, data: Any) -> Any:
    """Rebuild a value recorded by the worker's ``io`` stand-in on ComfyUI's real ``io``."""
    if isinstance(data, dict) and "__recorded__" in data:
        current: Any = io_module
        for step in data["__recorded__"]:
            if step[0] == "attr":
                current = getattr(current, step[1])
            else:
                current = current(
                    *[_replay(io_module, a) for a in step[1]],
                    **{k: _replay(io_module, v) for k, v in step[2].items()},
                )
        return current
    if isinstance(data, list):
        return [_replay(io_module, v) for v in data]
    if isinstance(data, dict):
        return {k: _replay(io_module, v) for k, v in data.items()}
    return data


def make_v3_proxy(pack: _Pack, data: dict[str, Any]) -> type:
    from comfy_api.latest import io

    node = NodeInfo(pack, data, "v3")
    schema_data = data["schema"]

    def define_schema(cls: Any) -> Any:
        return _replay(io, schema_data)

    async def execute(cls: Any, /, **kwargs: Any) -> Any:
        # ComfyUI runs execute on a clone whose ``hidden`` holds the hidden inputs; the
        # picklable ones go along (DYNPROMPT is a live server object and stays here).
        holder = getattr(cls, "hidden", None)
        hidden = {name: getattr(holder, name, None) for name in V3_HIDDEN} if holder else {}
        return await run_node(pack, node, None, kwargs, hidden)

    namespace: dict[str, Any] = {
        "__module__": __name__,
        "_comfy_env_node": node,
        "define_schema": classmethod(define_schema),
        "execute": classmethod(execute),
    }
    schema = _replay(io, schema_data)
    outputs = list(getattr(schema, "outputs", None) or [])
    node.keep = {
        i: str(o.get_io_type())
        for i, o in enumerate(outputs)
        if str(o.get_io_type()) not in pack.crossing_types
    }
    node.listed = tuple(i for i in node.keep if getattr(outputs[i], "is_output_list", False))
    if "validate_inputs" in node.methods:

        async def validate(cls: Any, args: dict[str, Any]) -> Any:
            return await call_hook(pack, node, "validate_inputs", None, args)

        namespace["validate_inputs"] = classmethod(
            _signature_function("validate_inputs", node.methods["validate_inputs"], validate, False)
        )
    if "fingerprint_inputs" in node.methods or node.keep:

        async def fingerprint(cls: Any, args: dict[str, Any]) -> Any:
            author = None
            if "fingerprint_inputs" in node.methods:
                author = await call_hook(pack, node, "fingerprint_inputs", None, args)
            unique_id = _context().get("node_id")
            if not node.keep or unique_id is None:
                return author
            token = node.liveness_token(str(unique_id))
            return token if author is None else [author, token]

        namespace["fingerprint_inputs"] = classmethod(
            _signature_function(
                "fingerprint_inputs", node.methods.get("fingerprint_inputs"), fingerprint, False
            )
        )
    if "check_lazy_status" in node.methods:

        async def lazy(cls: Any, args: dict[str, Any]) -> Any:
            return await call_hook(pack, node, "check_lazy_status", None, args)

        namespace["check_lazy_status"] = classmethod(
            _signature_function("check_lazy_status", node.methods["check_lazy_status"], lazy, False)
        )
    class_name = "".join(c if c.isalnum() else "_" for c in node.name) or "Node"
    return type(f"Isolated_{class_name}", (io.ComfyNode,), namespace)


def is_coroutine_proxy(cls: type) -> bool:
    function = getattr(cls, "FUNCTION", "execute")
    return inspect.iscoroutinefunction(getattr(cls, function, None))
