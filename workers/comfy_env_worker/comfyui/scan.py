"""Import a pack's node module in the worker and describe its nodes as plain data.

``scan(pack_dir, module)`` runs in the pack's env, never in the ComfyUI server: the stand-ins
are installed first (``standins.install``), then the node module is imported as a submodule of
a synthetic package whose path is the pack directory (so the pack's relative imports work and
its ``__init__.py``, which imports comfy_env, is *not* executed here). The result is a dict of
lists, strings, numbers and booleans that the host caches as JSON:

    {"kind": "v1" | "v3", "has_torch": bool, "standins": [...],
     "nodes": [{"name": ..., "display_name": ..., "attrs": {...}, "methods": {...}}, ...]}

V1 nodes report every class attribute ComfyUI reads (``INPUT_TYPES()`` called once here) and
whether ``IS_CHANGED`` / ``VALIDATE_INPUTS`` / ``check_lazy_status`` exist, with their argument
names (ComfyUI passes ``VALIDATE_INPUTS`` only the inputs it names). V3 nodes report their
``define_schema()`` as the recorded call path on the ``io`` stand-in, which the host replays on
ComfyUI's real ``io`` module. Stdlib only.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import types
from typing import Any, Dict, List, Optional, Tuple

from . import routes, standins, values

V1_ATTRS = (
    "RETURN_TYPES",
    "RETURN_NAMES",
    "FUNCTION",
    "CATEGORY",
    "OUTPUT_NODE",
    "OUTPUT_IS_LIST",
    "INPUT_IS_LIST",
    "DESCRIPTION",
    "OUTPUT_TOOLTIPS",
    "NOT_IDEMPOTENT",
    "DEPRECATED",
    "EXPERIMENTAL",
    "SEARCH_ALIASES",
    "API_NODE",
)
V1_METHODS = ("IS_CHANGED", "VALIDATE_INPUTS", "check_lazy_status")
V3_METHODS = ("fingerprint_inputs", "validate_inputs", "check_lazy_status")

_MODULES: Dict[Tuple[str, str], types.ModuleType] = {}
# ``module=`` naming the pack's own ``__init__.py`` (the pack directory is the package).
OWN_INIT = "__init__"
_V3_NODES: Dict[Tuple[str, str], Dict[str, Any]] = {}


def package_name(pack_dir: str) -> str:
    digest = hashlib.sha1(os.path.abspath(pack_dir).encode("utf-8")).hexdigest()[:12]
    return "comfy_env_pack_%s" % digest


def load_module(pack_dir: str, module: str) -> types.ModuleType:
    """The pack's node module, imported once per worker."""
    key = (pack_dir, module)
    if key in _MODULES:
        return _MODULES[key]
    standins.install()
    name = package_name(pack_dir)
    routes.LOADING.append((pack_dir, module))  # routes registered now are this pack's
    try:
        if module == OWN_INIT:
            loaded = _load_own_init(name, pack_dir)
        else:
            if name not in sys.modules:
                package = types.ModuleType(name, "comfy-env: the node pack at %s" % pack_dir)
                package.__path__ = [pack_dir]
                sys.modules[name] = package
            loaded = importlib.import_module("%s.%s" % (name, module))
    finally:
        routes.LOADING.pop()
    _MODULES[key] = loaded
    return loaded


def _load_own_init(name: str, pack_dir: str) -> types.ModuleType:
    """The pack's own ``__init__.py`` as its package (``module="__init__"``: a shim pack
    isolates another, unchanged pack directory whose ``__init__`` builds the mappings from its
    submodules with relative imports)."""
    existing = sys.modules.get(name)
    if existing is not None and getattr(existing, "__file__", None):
        return existing
    init = os.path.join(pack_dir, "__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[pack_dir])
    if spec is None or spec.loader is None:
        raise ImportError("cannot import %s as a package" % init)
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    try:
        spec.loader.exec_module(package)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return package


def _run(value: Any) -> Any:
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def v3_nodes(pack_dir: str, module: str) -> Dict[str, Any]:
    """node_id -> class of a V3 pack (the extension's node list, loaded once per worker)."""
    key = (pack_dir, module)
    if key not in _V3_NODES:
        loaded = load_module(pack_dir, module)
        extension = _run(loaded.comfy_entrypoint())

        async def node_list() -> Any:
            return await extension.get_node_list()

        nodes = {}
        for cls in asyncio.run(node_list()):
            nodes[_schema_kwargs(cls.define_schema()).get("node_id") or cls.__name__] = cls
        _V3_NODES[key] = nodes
    return _V3_NODES[key]


def warm(
    pack_dir: str, module: str, kind: str, directories: Optional[Dict[str, Any]] = None
) -> None:
    """Import the pack's node module (and list a V3 pack's nodes) ahead of its first node call,
    as that call would: ``isolate(..., warm=True)`` runs it in a fresh worker."""
    standins.prepare(directories)
    if kind == "v3":
        v3_nodes(pack_dir, module)
    else:
        load_module(pack_dir, module)


def input_types(
    pack_dir: str, module: str, names: List[str], directories: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """``INPUT_TYPES()`` of the V1 nodes ``names``, as they answer now (lists of files change
    while the server runs); a node whose ``INPUT_TYPES`` raises is left out."""
    standins.prepare(directories)
    mappings = load_module(pack_dir, module).NODE_CLASS_MAPPINGS
    answer: Dict[str, Any] = {}
    for name in names:
        try:
            answer[name] = standins._plain(mappings[name].INPUT_TYPES())
        except Exception:  # noqa: BLE001 - the host keeps the scanned value for it
            continue
    return answer


def serve_route(
    pack_dir: str,
    module: str,
    kind: str,
    method: str,
    path: str,
    request: Dict[str, Any],
    directories: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Serve one HTTP request the host forwarded to a route the pack registered."""
    warm(pack_dir, module, kind, directories)
    return routes.serve((pack_dir, module), method, path, request)


def node_class(pack_dir: str, module: str, kind: str, name: str) -> Any:
    if kind == "v3":
        return v3_nodes(pack_dir, module)[name]
    return load_module(pack_dir, module).NODE_CLASS_MAPPINGS[name]


def _schema_kwargs(schema: Any) -> Dict[str, Any]:
    if isinstance(schema, standins.Recorded):
        step = schema._path[-1]
        if step[0] == "call":
            return dict(step[2])
    return {}


def _argspec(function: Any) -> Optional[Dict[str, Any]]:
    try:
        spec = inspect.getfullargspec(function)
    except TypeError:
        return None
    args = [a for a in spec.args if a not in ("self", "cls", "s")]
    return {"args": args, "varkw": spec.varkw is not None}


def _overridden(cls: Any, name: str) -> bool:
    own = getattr(cls, name, None)
    base = getattr(standins.ComfyNode, name, None)
    if own is None:
        return False
    return getattr(own, "__func__", own) is not getattr(base, "__func__", base)


def _server_comfyui() -> Optional[str]:
    """The server's ComfyUI directory this worker imported (``comfyui="server"``), else None."""
    real = sys.modules.get("comfy_env_worker.comfyui.real")
    return getattr(real, "STATE", {}).get("dir") if real is not None else None


def scan(
    pack_dir: str, module: str, directories: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """Describe the pack's nodes as plain data. ``directories`` are the server's directories
    (``standins.DIRECTORY_KEYS``), known to ``folder_paths`` before the pack's module imports."""
    standins.prepare(directories)
    loaded = load_module(pack_dir, module)
    nodes: List[Dict[str, Any]] = []
    mappings = getattr(loaded, "NODE_CLASS_MAPPINGS", None)
    if mappings is not None:
        kind = "v1"
        display = getattr(loaded, "NODE_DISPLAY_NAME_MAPPINGS", None) or {}
        for name, cls in mappings.items():
            attrs: Dict[str, Any] = {"INPUT_TYPES": standins._plain(cls.INPUT_TYPES())}
            for attr in V1_ATTRS:
                if hasattr(cls, attr):
                    attrs[attr] = standins._plain(getattr(cls, attr))
            function = getattr(cls, attrs.get("FUNCTION", ""), None)
            methods: Dict[str, Any] = {
                "FUNCTION_is_async": inspect.iscoroutinefunction(function),
            }
            for method in V1_METHODS:
                if hasattr(cls, method):
                    methods[method] = _argspec(getattr(cls, method))
            nodes.append(
                {
                    "name": str(name),
                    "display_name": display.get(name),
                    "attrs": attrs,
                    "methods": methods,
                }
            )
    elif hasattr(loaded, "comfy_entrypoint"):
        kind = "v3"
        if _server_comfyui() is not None:
            raise TypeError(
                "%s is a V3 pack (comfy_entrypoint): V3 schemas are recorded on comfy-env's "
                'stand-in io module, so comfyui="server" does not support V3 packs yet; '
                "isolate it with the stand-ins (the default)" % loaded.__name__
            )
        for node_id, cls in v3_nodes(pack_dir, module).items():
            schema = cls.define_schema()
            if not isinstance(schema, standins.Recorded):
                raise TypeError(
                    "%s.define_schema() did not return io.Schema(...) (got %r)"
                    % (cls.__name__, type(schema).__name__)
                )
            methods = {m: _argspec(getattr(cls, m)) for m in V3_METHODS if _overridden(cls, m)}
            methods["execute_is_async"] = inspect.iscoroutinefunction(cls.execute)
            nodes.append(
                {
                    "name": str(node_id),
                    "display_name": _schema_kwargs(schema).get("display_name"),
                    "schema": schema.to_data(),
                    "methods": methods,
                }
            )
    else:
        raise ImportError(
            "%s defines neither NODE_CLASS_MAPPINGS (V1) nor comfy_entrypoint (V3)"
            % loaded.__name__
        )
    return {
        "kind": kind,
        "has_torch": values.env_has_torch(),
        "standins": standins.install(),
        "python": "%d.%d.%d" % sys.version_info[:3],
        "comfyui": _server_comfyui(),
        "nodes": nodes,
        **routes.table((pack_dir, module)),
    }
