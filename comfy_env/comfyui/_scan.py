"""The scan of a node pack, run in the pack's env and cached on disk.

``scan_pack(pack)`` returns the plain-data description of a pack's nodes
(``comfy_env_worker.comfyui.scan``). Data flow::

    isolate() -> cache key (pack code, env interpreter, library version)
              -> hit: read <cache>/<key>.json       (no worker is spawned)
              -> miss: worker.run("...scan:scan")   (the pack imported in its env, never here)
                       -> write <key>.json atomically -> return

The key hashes every ``.py`` file of the pack (paths and bytes; the env directory, VCS and cache
directories skipped), the env's interpreter (path, size, mtime, and ``pyvenv.cfg``), the
modification time of the env's ``site-packages`` (a package installed or removed), the
comfy-env version, the bytes of the worker-side ComfyUI helpers and the server's directories.
The scan sends those directories (``server_directories``) so that a pack reading them when its
module is imported (``folder_paths.get_input_directory()`` at module level) gets the server's.
Any change invalidates it; an unchanged pack starts warm without a worker. A failed scan is
never cached: it raises ``NodePackError`` carrying the worker's traceback and output (the
pack's package name in the worker shown as its directory name, ``PackSpec.readable``),
``isolate`` retires the worker that ran it, and the next server start tries again.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from comfy_env_worker.comfyui.scan import package_name

from .._envs import EnvSpec
from .._errors import ComfyEnvError
from ._server import describe, key_arguments, server_comfyui

SCAN_TARGET = "comfy_env_worker.comfyui.scan:scan"
_SKIP_DIRS = frozenset((".git", ".hg", "__pycache__", "node_modules", ".venv", ".pixi", "venv"))


class NodePackError(ComfyEnvError):
    """A node pack could not be isolated: its env is missing or its scan failed. Raised from
    ``isolate()``, so ComfyUI lists the pack as IMPORT FAILED with this message; the pack is
    never imported into the server instead.

    ``pack_dir`` and ``env`` name the pack and its env; ``worker_output`` holds what the worker
    printed or logged during the scan. When the message holds the worker's traceback the error
    has no ``__cause__`` (ComfyUI would log the traceback once more); the exception it
    replaces is its ``__context__``."""

    def __init__(self, message: str, *, pack_dir: str, env: str, worker_output: str = "") -> None:
        super().__init__(message)
        self.pack_dir = pack_dir
        self.env = env
        self.worker_output = worker_output


@dataclass(frozen=True)
class PackSpec:
    """What ``isolate`` was told: the pack directory, the node module, the resolved env."""

    pack_dir: str
    module: str
    env: EnvSpec
    cache_dir: str
    # "standins" (the default) or "server": the worker imports the server's own ComfyUI
    # (``_server``, ``comfy_env_worker.comfyui.real``).
    comfyui: str = "standins"

    def readable(self, text: str) -> str:
        """``text`` with the pack's package name in the worker (``comfy_env_pack_<hash>``,
        ``scan.package_name``) replaced by the pack's directory name, the name ComfyUI itself
        imports a pack under: ``audit_pack.impl.helpers.AuditError``, not
        ``comfy_env_pack_cbca63d077bf.impl.helpers.AuditError``, in the messages and worker
        tracebacks the author reads. The hashed name stays in the worker, where it keeps
        two packs of the same directory name, or a pack named like an installed package,
        apart."""
        return text.replace(self.worker_package, self.shown_package)

    @property
    def worker_package(self) -> str:
        """The pack's package name in the worker: ``comfy_env_pack_<hash of its path>``."""
        return package_name(self.pack_dir)

    @property
    def shown_package(self) -> str:
        """The name shown for it (``readable``, worker log records): the directory's name."""
        return os.path.basename(self.pack_dir)


def default_cache_dir() -> str:
    base = os.environ.get("COMFY_ENV_COMFYUI_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "comfy-env",
        "comfyui-scan",
    )
    return base


def _library_digest() -> str:
    import comfy_env
    import comfy_env_worker.comfyui as helpers

    h = hashlib.sha256(comfy_env.__version__.encode())
    folder = os.path.dirname(helpers.__file__ or "")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as fh:
                h.update(name.encode() + b"\0" + fh.read())
    return h.hexdigest()


def server_directories(pack: PackSpec | None = None) -> dict[str, Any]:
    """The ComfyUI server's output, temp and input directories, when this process is a ComfyUI
    server (its ``folder_paths`` is imported), else ``{}``. Sent to the env with the scan and
    with every node call (the ``folder_paths`` stand-in answers with them). For a pack with
    ``comfyui="server"`` also the server's ComfyUI (``_server.server_comfyui``) under
    ``"comfyui"``: the worker imports it before the pack's module."""
    folder_paths = sys.modules.get("folder_paths")
    if folder_paths is None:
        return {}
    directories: dict[str, Any] = {
        "output_directory": str(folder_paths.get_output_directory()),
        "temp_directory": str(folder_paths.get_temp_directory()),
        "input_directory": str(folder_paths.get_input_directory()),
    }
    if pack is not None and pack.comfyui == "server":
        server = server_comfyui()
        if server is not None:
            directories["comfyui"] = server
    return directories


def cache_key(pack: PackSpec) -> str:
    """Changes whenever the pack's code, the env's interpreter, the library or the server's
    directories change (a module may have read them at import)."""
    h = hashlib.sha256()
    h.update(f"module={pack.module}\0lib={_library_digest()}\0".encode())
    h.update(json.dumps(server_directories(), sort_keys=True).encode())
    if pack.comfyui == "server":  # the server's ComfyUI: where, which arguments, which Python
        described = describe() or {}
        described["argv"] = key_arguments(described.get("argv") or [])
        h.update(f"comfyui=server\0{json.dumps(described, sort_keys=True)}\0".encode())
    env_dir = os.path.realpath(pack.env.key)
    for root, dirs, files in os.walk(pack.pack_dir):
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in _SKIP_DIRS and os.path.realpath(os.path.join(root, d)) != env_dir
        )
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, "rb") as fh:
                    h.update(os.path.relpath(path, pack.pack_dir).encode() + b"\0" + fh.read())
    interpreter = pack.env.interpreter
    st = os.stat(interpreter)
    h.update(f"{interpreter}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    cfg = os.path.join(pack.env.key, "pyvenv.cfg")
    if os.path.isfile(cfg):
        with open(cfg, "rb") as fh:
            h.update(fh.read())
    # Installing or removing a package touches its site-packages directory: a cheap signal
    # that what the pack imports may have changed (its INPUT_TYPES may list new choices).
    for site in sorted(
        glob.glob(os.path.join(glob.escape(pack.env.key), "lib", "python*", "site-packages"))
        + glob.glob(os.path.join(glob.escape(pack.env.key), "Lib", "site-packages"))
    ):
        h.update(f"{site}\0{os.stat(site).st_mtime_ns}\0".encode())
    return h.hexdigest()[:32]


def read_cached(pack: PackSpec, key: str) -> dict[str, Any] | None:
    path = os.path.join(pack.cache_dir, f"{key}.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def write_cached(pack: PackSpec, key: str, result: dict[str, Any]) -> None:
    os.makedirs(pack.cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=pack.cache_dir, prefix=".scan-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({**result, "key": key}, fh)
        os.replace(tmp, os.path.join(pack.cache_dir, f"{key}.json"))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# ComfyUI's top-level modules; a scan that fails on one of them needs comfyui="server".
_COMFYUI_MODULES = re.compile(
    r"No module named '(nodes|node_helpers|comfy_extras|comfy_execution|latent_preview|"
    r"execution|comfy\.[a-z_.]+|comfy_api\.[a-z_.]+)'|it is comfy-env's stand-in"
)


def _needs_server_comfyui(text: str) -> bool:
    return _COMFYUI_MODULES.search(text) is not None


def run_scan(pack: PackSpec, worker: Any, timeout: float) -> dict[str, Any]:
    """Scan in the env (a worker call); failures become ``NodePackError``."""
    collect = _Collect()
    # Worker output arrives on this logger, gated by its level; open it to INFO for the scan so
    # a failure can quote what the worker printed (restored afterwards).
    logger = logging.getLogger(f"comfy_env.worker.{pack.env.name}")
    old_level = logger.level
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    logger.addHandler(collect)
    try:
        args = (pack.pack_dir, pack.module, server_directories(pack))
        result: dict[str, Any] = worker.run(SCAN_TARGET, args, timeout=timeout)
        return result
    except Exception as exc:
        remote = exc.__cause__
        detail = getattr(remote, "traceback_text", None) or getattr(exc, "traceback_text", "")
        tail = getattr(exc, "stderr_tail", "")
        output = "\n".join(collect.lines) or tail
        message = (
            f"comfy-env could not scan node pack {pack.pack_dir} (module {pack.module!r}) in env "
            f"{pack.env.key}: {type(exc).__name__}: {pack.readable(str(exc))}"
        )
        if detail:
            message += f"\nworker traceback:\n{pack.readable(detail).rstrip()}"
        if output:
            message += f"\nworker output:\n{output.rstrip()}"
        if pack.comfyui == "standins" and _needs_server_comfyui(f"{exc}\n{detail}"):
            message += (
                "\n(the pack imports ComfyUI's own modules, which the stand-ins do not cover: "
                'isolate(..., comfyui="server") imports the server\'s ComfyUI in its worker; '
                "see docs/comfyui.md, 'ComfyUI's own modules')"
            )
        message += "\n(the pack is not imported into the server instead)"
        error = NodePackError(
            message, pack_dir=pack.pack_dir, env=pack.env.key, worker_output=output
        )
        if detail:
            # The message holds the worker's traceback; chaining the exception would print it
            # again (its RemoteTraceback cause) above ComfyUI's "Cannot import" line, which
            # repeats the message: ~30 lines a pack, three times. The exception stays
            # reachable as ``__context__``.
            raise error from None
        raise error from exc
    finally:
        logger.removeHandler(collect)
        logger.setLevel(old_level)
