"""Stand-ins for the parts of ComfyUI that node code imports, for envs without ComfyUI.

A pack's node module typically does ``import folder_paths``, ``from comfy.utils import
ProgressBar``, ``import comfy.model_management`` or ``from server import PromptServer``. The env
has none of these (it must not need ComfyUI's dependencies), so ``install()`` puts small modules
under those names into ``sys.modules``, each only when the real one cannot be found in the env.

Data flow:

- **Host to worker**: every node call carries a context dict (prompt id, node id, ComfyUI's
  output/temp/input directories); ``runner`` hands it to ``set_context`` before the node runs,
  so ``folder_paths.get_output_directory()`` names the server's directory.
- **Worker to host**: ``ProgressBar.update*`` becomes ``comfy_env_worker.progress`` (coalesced,
  the latest wins), preview images and ``PromptServer.instance.send_sync`` become
  ``comfy_env_worker.emit`` events of the running call; the host's node proxy turns them into
  ComfyUI's own progress hook and websocket messages. Outside a call they are no-ops.
- **Interrupt**: ``throw_exception_if_processing_interrupted()`` and ``ProgressBar.update()``
  raise ``InterruptProcessingException`` once the host asked this call to stop cooperatively
  (``cancelled``); a node stuck in native code never gets there, and the host kills the worker.

The hooks into the worker runtime (``progress``, ``emit``, ``cancelled``) are looked up on the
``comfy_env_worker`` package at call time (no import cycle at install time). Stdlib only.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import routes

# The context of the node call running now (one call at a time per worker).
CONTEXT: Dict[str, Any] = {}
INSTALLED: List[str] = []  # names this worker got stand-ins for, for the scan report
# The server's directories, kept across calls: the host sends them with the scan and with every
# node call, and the pack's module may read them when it is imported (a very common pattern:
# ``INPUT_DIR = folder_paths.get_input_directory()`` at module level), which happens at the scan
# or, in a worker started later (after a crash, or when the scan came from the cache), inside
# the first node call, after its context was set.
DIRECTORY_KEYS = ("output_directory", "temp_directory", "input_directory")
DIRECTORIES: Dict[str, str] = {}


def set_directories(directories: Dict[str, Any]) -> None:
    """Remember the server's directories (``output_directory``, ``temp_directory``,
    ``input_directory``) for ``folder_paths``; other keys are ignored."""
    for key in DIRECTORY_KEYS:
        value = directories.get(key)
        if value:
            DIRECTORIES[key] = str(value)


def set_context(context: Dict[str, Any]) -> None:
    CONTEXT.clear()
    CONTEXT.update(context)
    set_directories(context)


def _runtime_hook(name: str) -> Optional[Callable[..., Any]]:
    package = sys.modules.get("comfy_env_worker")
    hook = getattr(package, name, None)
    return hook if callable(hook) else None


def emit(kind: str, data: Any) -> None:
    """Send an event to the host on the running call's channel (dropped where there is none)."""
    hook = _runtime_hook("emit")
    if hook is not None:
        hook(kind, data)


def progress(done: Any, total: Any, **info: Any) -> None:
    """Report progress of the running call (coalesced by the runtime: the latest wins)."""
    hook = _runtime_hook("progress")
    if hook is not None:
        hook(done, total, **info)


def cancelled() -> bool:
    """Whether the host asked the running call to stop."""
    hook = _runtime_hook("cancelled")
    return bool(hook()) if hook is not None else False


def report_progress(value: Any, total: Any, preview: Any, node: Any) -> None:
    """A progress update of the running node: ComfyUI's progress on the host (the stand-in
    ``ProgressBar`` and, with the server's ComfyUI in the worker, its global progress hook)."""
    if preview is not None:
        # Not coalesced: a preview image is its own event, in order with the progress.
        emit("comfyui.preview", {"value": value, "max": total, "node": node, "preview": preview})
    else:
        progress(value, total, node=node)


def prepare(directories: Optional[Dict[str, Any]]) -> List[str]:
    """Everything a pack's module needs before it runs in this worker: the server's
    directories, the server's own ComfyUI where the pack asked for it (``comfyui`` in
    ``directories``: ``real.set_up``), then the stand-ins for whatever is still missing."""
    if directories:
        set_directories(directories)
        server = directories.get("comfyui")
        if server:
            from . import real

            real.set_up(server, directories)
    return install()


# ---- comfy.model_management ------------------------------------------------------------------


class InterruptProcessingException(Exception):
    """Raised inside node code when ComfyUI's interrupt reached this call (the same name as
    ComfyUI's; the host turns it back into ComfyUI's own)."""


_LOCAL_INTERRUPT = [False]


def interrupt_current_processing(value: bool = True) -> None:
    _LOCAL_INTERRUPT[0] = value


def processing_interrupted() -> bool:
    return _LOCAL_INTERRUPT[0] or cancelled()


def throw_exception_if_processing_interrupted() -> None:
    if processing_interrupted():
        _LOCAL_INTERRUPT[0] = False
        raise InterruptProcessingException()


# ---- comfy.utils -----------------------------------------------------------------------------


class ProgressBar:
    """ComfyUI's ``ProgressBar``: updates become websocket ``progress`` messages of the running
    prompt and node; an update after an interrupt raises, as in ComfyUI."""

    def __init__(self, total: Any, node_id: Any = None) -> None:
        self.total = total
        self.current = 0
        self.node_id = node_id

    def update_absolute(self, value: Any, total: Any = None, preview: Any = None) -> None:
        if total is not None:
            self.total = total
        if value > self.total:
            value = self.total
        self.current = value
        throw_exception_if_processing_interrupted()
        report_progress(value, self.total, preview, self.node_id)

    def update(self, value: Any) -> None:
        self.update_absolute(self.current + value)


# ---- server.PromptServer ---------------------------------------------------------------------


class _PromptServerInstance:
    client_id = None
    last_node_id = None
    last_prompt_id = None
    # The pack's routes, recorded; the host serves them and forwards each request (routes.py).
    routes = routes.RouteTable()

    def send_sync(self, event: str, data: Any, sid: Any = None) -> None:
        emit("comfyui.send_sync", {"event": event, "data": data, "sid": sid})

    def __getattr__(self, name: str) -> Any:  # what the stand-in lacks (routes, loop, ...)
        raise AttributeError(
            "PromptServer.instance has no attribute %r: it is comfy-env's stand-in for the "
            "server's PromptServer in a worker, which offers only send_sync, routes, "
            "client_id, last_node_id and last_prompt_id (the server's loop and app live in "
            "the ComfyUI process)" % name
        )


class PromptServer:
    instance = _PromptServerInstance()


# ---- folder_paths ----------------------------------------------------------------------------


def _dir(name: str) -> str:
    path = CONTEXT.get(name) or DIRECTORIES.get(name)
    if not path:
        raise RuntimeError(
            "folder_paths.%s is not known in this worker: comfy-env's folder_paths stand-in "
            "learns the server's directories from the host, with the scan and with each node "
            "call, and this worker has had neither (is it running outside ComfyUI?)" % name
        )
    return str(path)


def get_output_directory() -> str:
    return _dir("output_directory")


def get_temp_directory() -> str:
    return _dir("temp_directory")


def get_input_directory() -> str:
    return _dir("input_directory")


def get_directory_by_type(type_name: str) -> Optional[str]:
    return {
        "output": get_output_directory,
        "temp": get_temp_directory,
        "input": get_input_directory,
    }.get(type_name, lambda: None)()


def get_save_image_path(
    filename_prefix: str, output_dir: str, image_width: int = 0, image_height: int = 0
) -> Tuple[str, str, int, str, str]:
    """ComfyUI's own rule (folder_paths.py of 0.3.64), so files are named as ComfyUI names
    them."""

    def map_filename(filename: str) -> Tuple[int, str]:
        prefix_len = len(os.path.basename(filename_prefix))
        prefix = filename[: prefix_len + 1]
        try:
            digits = int(filename[prefix_len + 1 :].split("_")[0])
        except ValueError:
            digits = 0
        return digits, prefix

    if "%" in filename_prefix:
        now = time.localtime()
        for key, value in (
            ("%width%", str(image_width)),
            ("%height%", str(image_height)),
            ("%year%", str(now.tm_year)),
            ("%month%", str(now.tm_mon).zfill(2)),
            ("%day%", str(now.tm_mday).zfill(2)),
            ("%hour%", str(now.tm_hour).zfill(2)),
            ("%minute%", str(now.tm_min).zfill(2)),
            ("%second%", str(now.tm_sec).zfill(2)),
        ):
            filename_prefix = filename_prefix.replace(key, value)
    subfolder = os.path.dirname(os.path.normpath(filename_prefix))
    filename = os.path.basename(os.path.normpath(filename_prefix))
    full_output_folder = os.path.join(output_dir, subfolder)
    if os.path.commonpath((output_dir, os.path.abspath(full_output_folder))) != output_dir:
        raise Exception("Saving image outside the output folder is not allowed: %s" % subfolder)
    try:
        counter = (
            max(
                d
                for d, p in map(map_filename, os.listdir(full_output_folder))
                if os.path.normcase(p[:-1]) == os.path.normcase(filename) and p[-1] == "_"
            )
            + 1
        )
    except (ValueError, FileNotFoundError):
        counter = 1
    os.makedirs(full_output_folder, exist_ok=True)
    return full_output_folder, filename, counter, subfolder, filename_prefix


# ---- comfy_api.latest (V3) -------------------------------------------------------------------


class Recorded:
    """A call or attribute path on the ``io`` stand-in, kept as data: ``io.Int.Input("n",
    default=1)`` records ``Int -> Input("n", default=1)``. The host replays the same path on
    ComfyUI's real ``comfy_api.latest.io`` to build the real schema."""

    def __init__(self, path: Tuple[Any, ...]) -> None:
        self._path = path

    def __getattr__(self, name: str) -> "Recorded":
        if name.startswith("__"):
            raise AttributeError(name)
        return Recorded(self._path + (("attr", name),))

    def __call__(self, *args: Any, **kwargs: Any) -> "Recorded":
        return Recorded(self._path + (("call", args, kwargs),))

    def to_data(self) -> Any:
        return {"__recorded__": [_plain(step) for step in self._path]}


def _plain(value: Any) -> Any:
    """``value`` as plain data (lists, dicts, scalars), recorded paths included."""
    if isinstance(value, Recorded):
        return value.to_data()
    if isinstance(value, tuple) and value and value[0] in ("attr", "call"):
        if value[0] == "attr":
            return ["attr", value[1]]
        return ["call", [_plain(a) for a in value[1]], {k: _plain(v) for k, v in value[2].items()}]
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or type(value) in (bool, int, float, str):
        return value
    for plain in (bool, int, float, str):
        # A subclass (a pack's ``AnyType(str)`` for "*" sockets) would pickle by reference
        # to the pack's module, which the host cannot import: its plain value crosses.
        if isinstance(value, plain):
            return plain(value)
    return repr(value)


class ComfyNode:
    """Base class of V3 nodes (stand-in): the scan calls ``define_schema``; the runner calls
    ``execute``."""

    hidden = None

    @classmethod
    def define_schema(cls) -> Any:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs: Any) -> Any:
        raise NotImplementedError


class NodeOutput:
    def __init__(self, *args: Any, ui: Any = None, expand: Any = None, block_execution: Any = None):
        self.args = args
        self.ui = ui
        self.expand = expand
        self.block_execution = block_execution

    @property
    def result(self) -> Any:
        return self.args if self.args else None


class ComfyExtension:
    async def on_load(self) -> None:
        return None

    async def get_node_list(self) -> List[Any]:
        raise NotImplementedError


def _recording_module(name: str, explicit: Dict[str, Any]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(explicit)

    def __getattr__(attr: str) -> Any:  # PEP 562: unknown names are recorded
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Recorded((("attr", attr),))

    setattr(module, "__getattr__", __getattr__)  # noqa: B010 - a module-level __getattr__
    return module


# ---- installation ----------------------------------------------------------------------------


def _absent(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _module(name: str, attrs: Dict[str, Any], package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, "comfy-env stand-in for ComfyUI's %s" % name)
    module.__dict__.update(attrs)
    module.__comfy_env_standin__ = True  # type: ignore[attr-defined]
    if package:
        module.__path__ = []

    def __getattr__(attr: str) -> Any:  # PEP 562: what the stand-in lacks, said as such
        if attr.startswith("__") and attr != "__file__":
            raise AttributeError(attr)  # (probes such as hasattr(module, "__path__"))
        offered = sorted(n for n in module.__dict__ if not n.startswith("_"))
        raise AttributeError(
            "module %r has no attribute %r: it is comfy-env's stand-in for ComfyUI's %s in an "
            "env without ComfyUI, which offers only %s (see docs/comfyui.md, 'The env')"
            % (name, attr, name, ", ".join(offered) or "nothing")
        )

    setattr(module, "__getattr__", __getattr__)  # noqa: B010 - a module-level __getattr__
    return module


def install() -> List[str]:
    """Install the stand-ins whose real module this env lacks; idempotent. Returns the names
    installed by this worker so far."""
    if INSTALLED:
        return list(INSTALLED)
    mm = {
        "InterruptProcessingException": InterruptProcessingException,
        "interrupt_current_processing": interrupt_current_processing,
        "processing_interrupted": processing_interrupted,
        "throw_exception_if_processing_interrupted": throw_exception_if_processing_interrupted,
    }
    utils = {"ProgressBar": ProgressBar, "PROGRESS_BAR_HOOK": None}
    fp = {
        "get_output_directory": get_output_directory,
        "get_temp_directory": get_temp_directory,
        "get_input_directory": get_input_directory,
        "get_directory_by_type": get_directory_by_type,
        "get_save_image_path": get_save_image_path,
    }
    if _absent("comfy"):
        comfy = _module("comfy", {}, package=True)
        management = _module("comfy.model_management", mm)
        helpers = _module("comfy.utils", utils)
        comfy.model_management = management  # type: ignore[attr-defined]
        comfy.utils = helpers  # type: ignore[attr-defined]
        sys.modules["comfy"] = comfy
        sys.modules["comfy.model_management"] = management
        sys.modules["comfy.utils"] = helpers
        INSTALLED.extend(["comfy", "comfy.model_management", "comfy.utils"])
    routes.install_aiohttp()
    if _absent("server"):
        sys.modules["server"] = _module("server", {"PromptServer": PromptServer})
        INSTALLED.append("server")
    if _absent("folder_paths"):
        sys.modules["folder_paths"] = _module("folder_paths", fp)
        INSTALLED.append("folder_paths")
    if _absent("comfy_api"):
        io = _recording_module(
            "comfy_api.latest.io",
            {"ComfyNode": ComfyNode, "NodeOutput": NodeOutput, "__comfy_env_standin__": True},
        )
        ui = _recording_module("comfy_api.latest.ui", {"__comfy_env_standin__": True})
        latest = _module(
            "comfy_api.latest",
            {"ComfyExtension": ComfyExtension, "io": io, "ui": ui},
            package=True,
        )
        api = _module("comfy_api", {"latest": latest}, package=True)
        for name, module in (
            ("comfy_api", api),
            ("comfy_api.latest", latest),
            ("comfy_api.latest.io", io),
            ("comfy_api.latest.ui", ui),
        ):
            sys.modules[name] = module
        INSTALLED.extend(["comfy_api", "comfy_api.latest"])
    if not INSTALLED:
        INSTALLED.append("")  # nothing was needed; remember that we looked
    return [n for n in INSTALLED if n]
