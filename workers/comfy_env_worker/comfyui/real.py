"""The server's own ComfyUI in the worker: ``isolate(..., comfyui="server")``.

A pack that imports ComfyUI's modules beyond the stand-ins (``nodes``, ``node_helpers``,
``comfy.sd``, ``comfy_extras``, ``server`` with its real classes) gets the *server's* ComfyUI
here: its source tree, read in place (never a copy), set up the way the server's ``main.py``
set itself up, so the node code sees what it would see in-process.

Data flow (``set_up(info)``, from ``standins.prepare`` before the pack's module is imported,
at the scan, the warm-up, a live ``INPUT_TYPES`` and every node call)::

    host (comfy_env.comfyui._server.describe)        worker (here, once per worker process)
      dir      ComfyUI's source tree             ->  sys.path[1] (where main.py's own
                                                     directory sits for the server)
      site     the server's site-packages        ->  appended after the env's own
                                                     (the pack's packages win; torch and
                                                     friends come from the server)
      python   "3.11"                            ->  must equal this interpreter's
      argv     the server's command line         ->  sys.argv while comfy.cli_args parses it
                                                     (--cpu, device selection, VRAM modes)
      folders  folder_paths' model folders,      ->  set on the real folder_paths (again at
               models_dir, base_path, user dir       every call: packs add folders at run time)
    then main.py's import order: comfy.options (args parsing on), folder_paths,
    comfy.cli_args, utils.extra_config (binds ComfyUI's ``utils`` package before anything can
    find ``comfy/utils.py`` under that name), comfy.utils, execution, server, nodes,
    comfy.model_management (which now picks the device the server picked; on a ``--cpu``
    server it never looks for a GPU driver).

What stays routed to the host, as with the stand-ins (one mechanism, ``standins``):
``comfy.utils``' global progress hook reports through ``standins.report_progress``;
``comfy.model_management.processing_interrupted`` also answers the host's cooperative
cancel (``standins.cancelled``), and ``throw_exception_if_processing_interrupted`` raises
ComfyUI's own ``InterruptProcessingException``; ``server.PromptServer.instance`` is the
stand-in instance (``send_sync`` becomes an event of the running call, ``routes`` are
recorded and served by the host). Stdlib only at module scope.
"""

from __future__ import annotations

import importlib
import os
import site
import sys
from typing import Any, Dict, List

from . import standins

# What ``set_up`` did, per worker process: the ComfyUI directory it imported (a worker serves
# one server, so a second directory is an error) and, per model folder name, the paths it last
# set from the host (so paths the pack itself added in the worker survive a later update).
STATE: Dict[str, Any] = {"dir": None}
_APPLIED: Dict[str, List[str]] = {}

# main.py's imports after argument parsing, in its order.
_MAIN_ORDER = ("comfy.utils", "execution", "server", "nodes", "comfy.model_management")


class ServerComfyUIError(RuntimeError):
    """The server's ComfyUI cannot be imported in this worker (a different Python, arguments
    ComfyUI's parser refuses, an import that fails)."""


def set_up(info: Dict[str, Any], directories: Dict[str, Any]) -> None:
    """Import the server's ComfyUI as described by ``info`` (once per worker) and give its
    ``folder_paths`` the server's current directories and model folders (every time)."""
    comfy_dir = str(info.get("dir") or "")
    if STATE["dir"] is None:
        _import(info, comfy_dir, directories)
        STATE["dir"] = comfy_dir
    elif STATE["dir"] != comfy_dir:
        raise ServerComfyUIError(
            "this worker imported ComfyUI from %s; the host now names %s"
            % (STATE["dir"], comfy_dir)
        )
    else:
        _apply_folders(info, directories)


def _import(info: Dict[str, Any], comfy_dir: str, directories: Dict[str, Any]) -> None:
    want = str(info.get("python") or "")
    have = "%d.%d" % sys.version_info[:2]
    if want and want != have:
        raise ServerComfyUIError(
            "comfyui='server': the server runs Python %s and this env runs Python %s; the "
            "server's packages (torch and friends, compiled for %s) cannot be layered under "
            "this env. Make the env with the server's Python (or pass env=None to use the "
            "server's interpreter)" % (want, have, want)
        )
    if not os.path.isfile(os.path.join(comfy_dir, "folder_paths.py")):
        raise ServerComfyUIError("comfyui='server': %s holds no ComfyUI source tree" % comfy_dir)
    # Another pack of this env (env=None packs share the server's interpreter) may have run
    # here on the stand-ins: its module keeps the stand-ins it imported (they work without
    # sys.modules), but from now on the names are ComfyUI's.
    for name, module in list(sys.modules.items()):
        if module is not None and module.__dict__.get("__comfy_env_standin__", False):
            del sys.modules[name]
    # Where main.py's directory is for the server: first after the worker's runtime dir, so
    # ComfyUI's top-level modules (utils, server, nodes, app) win over same-named packages.
    if comfy_dir in sys.path:
        sys.path.remove(comfy_dir)
    sys.path.insert(1 if sys.path else 0, comfy_dir)
    # The server's site-packages after the env's own (site.addsitedir appends, .pth files
    # included): the pack's pinned packages win, the rest comes from the server.
    for entry in info.get("site") or ():
        if entry not in sys.path and os.path.isdir(entry):
            site.addsitedir(entry)
    saved_argv = sys.argv
    sys.argv = [os.path.join(comfy_dir, "main.py")] + [str(a) for a in info.get("argv") or ()]
    try:
        options = importlib.import_module("comfy.options")
        options.enable_args_parsing()
        try:
            folder_paths = importlib.import_module("folder_paths")  # parses the arguments
            importlib.import_module("comfy.cli_args")
        except SystemExit as exc:  # argparse's way of refusing
            raise ServerComfyUIError(
                "comfyui='server': ComfyUI's argument parser refused the server's arguments "
                "%r (exit status %s)" % (sys.argv[1:], exc.code)
            ) from None
    finally:
        sys.argv = saved_argv
    _apply_folders(info, directories, folder_paths)
    try:
        importlib.import_module("utils.extra_config")  # main.py binds ``utils`` here
    except ImportError:
        pass  # (a ComfyUI without it has no such package to shadow)
    for name in _MAIN_ORDER:
        importlib.import_module(name)
    _hook(sys.modules["comfy.utils"], sys.modules["comfy.model_management"], sys.modules["server"])


def _hook(utils: Any, mm: Any, server: Any) -> None:
    """Route progress, interrupts and ``PromptServer.instance`` to the host, as the stand-ins
    do."""
    real_interrupted = mm.processing_interrupted

    def processing_interrupted() -> bool:
        return bool(real_interrupted()) or standins.cancelled()

    def throw_exception_if_processing_interrupted() -> None:
        if processing_interrupted():
            mm.interrupt_current_processing(False)
            raise mm.InterruptProcessingException()

    mm.processing_interrupted = processing_interrupted
    mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted

    def progress_hook(
        value: Any, total: Any, preview: Any = None, prompt_id: Any = None, node_id: Any = None
    ) -> None:
        throw_exception_if_processing_interrupted()
        standins.report_progress(value, total, preview, node_id)

    utils.set_progress_bar_global_hook(progress_hook)
    server.PromptServer.instance = standins.PromptServer.instance


def _apply_folders(info: Dict[str, Any], directories: Dict[str, Any], fp: Any = None) -> None:
    folder_paths = fp if fp is not None else sys.modules.get("folder_paths")
    if folder_paths is None:
        return
    for key in ("base_path", "models_dir"):
        if info.get(key):
            setattr(folder_paths, key, info[key])
    for key in standins.DIRECTORY_KEYS + ("user_directory",):
        value = directories.get(key) or info.get(key)
        setter = getattr(folder_paths, "set_" + key, None)
        if value and callable(setter):
            setter(str(value))
    table = folder_paths.folder_names_and_paths
    for name, entry in (info.get("folders") or {}).items():
        paths = [str(p) for p in entry[0]]
        current = table.get(name)
        # Paths the pack added in this worker since the last update (add_model_folder_path at
        # import) stay; at the first set-up everything the worker's own defaults hold goes.
        own = [p for p in (current[0] if current else ()) if p not in _APPLIED.get(name, paths)]
        if STATE["dir"] is None:
            own = []
        table[name] = (paths + [p for p in own if p not in paths], set(entry[1]))
        _APPLIED[name] = paths
