"""The worker end of a node proxy: run a node, and the node's optional hooks.

The host's proxy calls these by name (``"comfy_env_worker.comfyui.runner:run_node"``). Every
call names the node by a spec ``(pack_dir, module, kind, name)``; the module is imported once
per worker (``scan.load_module``). Per call:

1. the stand-ins get the call's context (prompt id, node id, ComfyUI's directories);
2. inputs are rebuilt: tensors from the flat list (``values.join``), and ``Kept`` markers
   replaced by the live objects that earlier nodes left in this worker;
3. the node runs (a coroutine is run to completion here);
4. the result is split again: outputs whose socket type stays in the worker are replaced by
   ``KeptOut`` markers, and the run itself is kept (``run_node_kept`` runs under
   ``Worker.call_ref``), so downstream nodes can reach those outputs through the ``RemoteRef``.

Instances: ComfyUI keeps one node object per node id; the proxy object it keeps carries an
instance id, and this worker keeps one real node object per (node, instance id). A new worker
generation starts with none (they are caches, like everything a worker holds). Stdlib only.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from . import scan, standins, values

Spec = Tuple[str, str, str, str]  # (pack_dir, module, "v1" | "v3", node name)

_INSTANCES: Dict[Tuple[str, str, str, int], Any] = {}


class Kept:
    """In the inputs: output ``index`` of the kept run ``refs[ref]`` (an int, or ``(i, j)``
    for item ``j`` of a list output ``i``)."""

    __slots__ = ("index", "ref")

    def __init__(self, ref: int, index: Any) -> None:
        self.ref = ref
        self.index = index

    def __reduce__(self) -> Any:
        return (Kept, (self.ref, self.index))


class KeptOut:
    """In a result: output ``index`` stayed in the worker (reach it through the run's ref);
    ``(i, j)`` names item ``j`` of an ``OUTPUT_IS_LIST`` output ``i``."""

    __slots__ = ("index", "type_name")

    def __init__(self, index: Any, type_name: str) -> None:
        self.index = index
        self.type_name = type_name

    def __reduce__(self) -> Any:
        return (KeptOut, (self.index, self.type_name))


class NodeRun:
    """One node execution whose result holds outputs that stay in the worker."""

    def __init__(self, outputs: Sequence[Any], crossing: Any) -> None:
        self.outputs = list(outputs)
        self._crossing = crossing

    def crossing(self) -> Any:
        """The part of the result that goes to the host (fetched once, right after the run)."""
        return self._crossing

    def size(self) -> int:
        """Bytes the kept outputs hold now (``measure``)."""
        return measure(self.outputs)


class _Hidden:
    """``cls.hidden`` of a V3 node: the hidden inputs by name, None for any other name."""

    def __init__(self, values: Dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        return None


def _node(spec: Spec, instance_id: Optional[int]) -> Any:
    pack_dir, module, kind, name = spec
    cls = scan.node_class(pack_dir, module, kind, name)
    if kind == "v3" or instance_id is None:
        return cls
    key = (pack_dir, module, name, instance_id)
    obj = _INSTANCES.get(key)
    if obj is None:
        obj = _INSTANCES[key] = cls()
    return obj


def _inputs(inputs: Any, tensors: List[Any], refs: Sequence[Any], context: Dict[str, Any]) -> Any:
    standins.set_context(context)
    standins.prepare(context)
    rebuilt = values.join(inputs, tensors, values.to_env_tensor)
    if not refs:
        return rebuilt
    return values.replace(rebuilt, functools.partial(_resolve_kept, refs))


def _resolve_kept(refs: Sequence[Any], v: Any) -> Any:
    if not isinstance(v, Kept):
        return v
    outputs = refs[v.ref].outputs
    if isinstance(v.index, tuple):
        return outputs[v.index[0]][v.index[1]]
    return outputs[v.index]


def _call(function: Any, kwargs: Dict[str, Any]) -> Any:
    result = function(**kwargs)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return result


def _execute(spec: Spec, instance_id: Optional[int], function: str, kwargs: Dict[str, Any]) -> Any:
    """Run the node; return (kind, outputs, rest) where rest is the ui and other result keys."""
    target = _node(spec, instance_id)
    if spec[2] == "v3":
        # ``cls.hidden.unique_id`` etc., as ComfyUI's clone of the class would have them (one
        # call at a time per worker, so setting it on the class is safe).
        target.hidden = _Hidden(standins.CONTEXT.get("hidden") or {})
        out = _call(target.execute, kwargs)
        if isinstance(out, standins.NodeOutput):
            return "v3", list(out.args), {"ui": _ui(out.ui)}
        return "v3", list(out) if out is not None else [], {}
    out = _call(getattr(target, function), kwargs)
    if isinstance(out, dict):
        rest = {k: v for k, v in out.items() if k != "result"}
        result = out.get("result")
        return "dict", (list(result) if result is not None else None), rest
    return "tuple", list(out) if out is not None else [], {}


def _ui(ui: Any) -> Any:
    if isinstance(ui, standins.Recorded):
        return ui.to_data()
    if ui is not None and hasattr(ui, "as_dict"):
        return ui.as_dict()
    return ui


def _reply(
    kind: str,
    outputs: Optional[List[Any]],
    rest: Dict[str, Any],
    refs: Sequence[Any] = (),
    kept_bytes: int = 0,
) -> List[Any]:
    """``[skeleton, tensor0, tensor1, ...]``: flat, so every tensor sits directly in the result
    and travels out of band (torch tensors nested deeper would be pickled in band).
    ``kept_bytes``: what this run keeps in the worker; ``ref_bytes``: what each kept run it
    used holds now (a node may have loaded more into it, or dropped some), so the host's
    model sizes follow the worker."""
    ref_bytes = [ref.size() if isinstance(ref, NodeRun) else None for ref in refs]
    skeleton, tensors = values.split(
        {
            "kind": kind,
            "outputs": outputs,
            "rest": rest,
            "kept_bytes": kept_bytes,
            "ref_bytes": ref_bytes,
        },
        values.to_wire,
    )
    return [skeleton, *tensors]


_MEASURE_DEPTH = 6
_MEASURE_ITEMS = 100000


def measure(obj: Any) -> int:
    """Bytes held by ``obj`` as ComfyUI's model manager should count them: numpy arrays and
    torch tensors (their data), torch modules (parameters and buffers), bytes-like objects,
    and whatever containers and object attributes hold (6 levels deep, each object once).
    An object may say it itself with a ``comfy_env_size()`` method. Plain Python objects
    count 0 (they are small next to a model)."""
    seen: Set[int] = set()
    budget = [_MEASURE_ITEMS]

    def walk(value: Any, depth: int) -> int:
        if id(value) in seen or budget[0] <= 0:
            return 0
        seen.add(id(value))
        budget[0] -= 1
        custom = getattr(type(value), "comfy_env_size", None)
        if callable(custom):
            return int(custom(value))
        if any((c.__module__ or "").startswith(("numpy", "torch")) for c in type(value).__mro__):
            # numpy/torch objects and their subclasses (a user's torch.nn.Module)
            if hasattr(value, "element_size") and hasattr(value, "numel"):
                return int(value.element_size() * value.numel())
            nbytes = getattr(value, "nbytes", None)
            if isinstance(nbytes, int):
                return nbytes
            if callable(getattr(value, "parameters", None)):
                total = sum(walk(p, depth + 1) for p in value.parameters())
                buffers = getattr(value, "buffers", None)
                if callable(buffers):
                    total += sum(walk(b, depth + 1) for b in buffers())
                return total
        if isinstance(value, (bytes, bytearray)):
            return len(value)
        if isinstance(value, memoryview):
            return value.nbytes
        if depth >= _MEASURE_DEPTH or isinstance(value, (str, int, float, bool, type(None))):
            return 0
        if isinstance(value, dict):
            return sum(walk(v, depth + 1) for v in value.values())
        if isinstance(value, (list, tuple, set, frozenset)):
            return sum(walk(v, depth + 1) for v in value)
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(value, type):
            return sum(walk(v, depth + 1) for v in attrs.values())
        return 0

    try:
        return walk(obj, 0)
    except Exception:  # noqa: BLE001 - a size is advice; a strange object must not fail the run
        sys.stderr.write("comfy-env worker: could not measure %r\n" % (type(obj),))
        return 0


def run_node(
    spec: Spec,
    instance_id: Optional[int],
    function: str,
    inputs: Dict[str, Any],
    tensors: List[Any],
    refs: List[Any],
    context: Dict[str, Any],
) -> List[Any]:
    """Run a node whose outputs all cross to the host. Returns ``[skeleton, *tensors]`` of
    ``{"kind", "outputs", "rest"}`` (see ``_reply``)."""
    kwargs = _inputs(inputs, tensors, refs, context)
    kind, outputs, rest = _execute(spec, instance_id, function, kwargs)
    return _reply(kind, outputs, rest, refs)


def run_node_kept(
    spec: Spec,
    instance_id: Optional[int],
    function: str,
    inputs: Dict[str, Any],
    tensors: List[Any],
    refs: List[Any],
    context: Dict[str, Any],
    keep: Dict[int, str],
    listed: Sequence[int] = (),
) -> NodeRun:
    """Run a node whose outputs ``keep`` (index -> socket type) stay here; those in ``listed``
    are ``OUTPUT_IS_LIST`` outputs, kept item by item (ComfyUI iterates over them). Runs under
    ``call_ref``: the returned ``NodeRun`` stays in the worker; the host then fetches
    ``crossing()``."""
    kwargs = _inputs(inputs, tensors, refs, context)
    kind, outputs, rest = _execute(spec, instance_id, function, kwargs)
    outputs = outputs or []
    crossing: List[Any] = []
    for i, value in enumerate(outputs):
        if i not in keep:
            crossing.append(value)
        elif i in listed:
            crossing.append([KeptOut((i, j), keep[i]) for j in range(len(value))])
        else:
            crossing.append(KeptOut(i, keep[i]))
    kept_bytes = measure([value for i, value in enumerate(outputs) if i in keep])
    return NodeRun(outputs, _reply(kind, crossing, rest, refs, kept_bytes))


def call_hook(
    spec: Spec,
    instance_id: Optional[int],
    method: str,
    inputs: Dict[str, Any],
    tensors: List[Any],
    context: Dict[str, Any],
) -> Any:
    """``IS_CHANGED`` / ``VALIDATE_INPUTS`` / ``check_lazy_status`` (and their V3 names)."""
    kwargs = _inputs(inputs, tensors, (), context)
    target = _node(spec, instance_id if method == "check_lazy_status" else None)
    return _call(getattr(target, method), kwargs)
