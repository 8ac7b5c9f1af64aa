"""The server's ComfyUI, described for a worker that imports it (``isolate(comfyui="server")``).

A pack whose node code imports ComfyUI's own modules (``nodes``, ``node_helpers``,
``comfy.sd``, ``comfy_extras``, ``server``) cannot run on the stand-ins. With
``comfyui="server"`` its worker imports the server's ComfyUI instead
(``comfy_env_worker.comfyui.real``): this module says, from inside the running server, where
that ComfyUI is and how the server set it up.

Data flow::

    describe()        once per process: the source tree holding the server's
                      ``folder_paths`` (read in place, never copied), the server's command
                      line (``comfy.cli_args`` parses it again in the worker: ``--cpu``,
                      device selection, VRAM modes), its Python version and site-packages
                      (layered after the env's own packages)
    folder_state()    at every call: ``folder_paths``' model folders, ``models_dir``,
                      ``base_path`` and the user directory, as they are now (custom nodes add
                      folders while the server loads them)
      -> the "comfyui" entry of the directories sent with the scan, the warm-up, live
         ``INPUT_TYPES``, routes and every node call (``_scan.server_directories``)

Nothing here imports ComfyUI: it reads the modules the server already imported.
"""

from __future__ import annotations

import os
import sys
from typing import Any

MODES = ("standins", "server")
_DESCRIBED: list[dict[str, Any] | None] = []


def describe() -> dict[str, Any] | None:
    """The server's ComfyUI (static part), or None when this process is no ComfyUI server
    (its ``folder_paths`` is not imported, or does not sit in a ComfyUI source tree)."""
    if _DESCRIBED and _DESCRIBED[0] is not None:
        return dict(_DESCRIBED[0])
    folder_paths = sys.modules.get("folder_paths")
    source = getattr(folder_paths, "__file__", None)
    if not source:
        return None
    comfy_dir = os.path.dirname(os.path.abspath(source))
    if not (
        os.path.isfile(os.path.join(comfy_dir, "nodes.py"))
        and os.path.isdir(os.path.join(comfy_dir, "comfy"))
    ):
        return None
    options = sys.modules.get("comfy.options")
    # ComfyUI parses sys.argv only where its main.py enabled it; an embedding host that did
    # not runs on the defaults, and so does the worker.
    argv = list(sys.argv[1:]) if getattr(options, "args_parsing", False) else []
    site = [
        entry
        for entry in sys.path
        if os.path.basename(entry.rstrip(os.sep)) in ("site-packages", "dist-packages")
        and os.path.isdir(entry)
    ]
    described = {
        "dir": comfy_dir,
        "argv": argv,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "site": site,
    }
    _DESCRIBED[:] = [described]
    return dict(described)


# Server arguments that change nothing a pack's module can see at import (how the server
# listens and logs, its front end): left out of the scan's cache key, so a server restarted on
# another port still starts warm. (name, takes a value)
_KEYLESS = {
    "--listen": True,
    "--port": True,
    "--tls-keyfile": True,
    "--tls-certfile": True,
    "--enable-cors-header": True,
    "--max-upload-size": True,
    "--front-end-version": True,
    "--front-end-root": True,
    "--verbose": True,
    "--auto-launch": False,
    "--disable-auto-launch": False,
    "--log-stdout": False,
    "--dont-print-server": False,
}


def key_arguments(argv: list[str]) -> list[str]:
    """``argv`` without the arguments in ``_KEYLESS`` (and their values)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            if not arg.startswith("-"):
                continue
        name = arg.split("=", 1)[0]
        if name in _KEYLESS:
            skip = _KEYLESS[name] and "=" not in arg
            continue
        kept.append(arg)
    return kept


def folder_state() -> dict[str, Any]:
    """``folder_paths``' model folders and base directories as the server holds them now."""
    folder_paths = sys.modules.get("folder_paths")
    if folder_paths is None:
        return {}
    folders = {
        str(name): [[str(p) for p in entry[0]], sorted(str(e) for e in entry[1])]
        for name, entry in getattr(folder_paths, "folder_names_and_paths", {}).items()
    }
    state: dict[str, Any] = {"folders": folders}
    for key in ("models_dir", "base_path"):
        value = getattr(folder_paths, key, None)
        if isinstance(value, str):
            state[key] = value
    user = getattr(folder_paths, "get_user_directory", None)
    if callable(user):
        state["user_directory"] = str(user())
    return state


def server_comfyui() -> dict[str, Any] | None:
    """What a ``comfyui="server"`` worker needs now: ``describe()`` and ``folder_state()``."""
    described = describe()
    if described is None:
        return None
    return {**described, **folder_state()}
