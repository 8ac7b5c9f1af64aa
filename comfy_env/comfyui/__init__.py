"""ComfyUI node packs in their own envs: ``isolate()`` and the node proxies.

A pack's ``__init__.py`` (imported by ComfyUI) holds one line::

    from comfy_env.comfyui import isolate
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = isolate(__file__, env=".venv",
                                                              module="nodes_impl")

A pack that passes no ``env=`` gets the env its ``pyproject.toml`` declares (``[project]
dependencies`` and ComfyUI's ``[tool.comfy.isolation]``), built with uv on first use
(``comfy_env._build``): ``isolate(__file__, module="nodes_impl")``.

``isolate`` resolves the env (relative to the pack directory), then gets the pack's node
description: from the on-disk cache when the pack, the env's interpreter and the library are
unchanged (no worker is spawned: a warm server start stays cheap), else by scanning in the env
(``_scan``). It builds one proxy class per node (``_proxy``) and returns ComfyUI's two mappings.
V1 packs (``NODE_CLASS_MAPPINGS``) and V3 packs (``comfy_entrypoint()``) give the same result.
Any failure raises ``NodePackError``: ComfyUI then lists the pack as IMPORT FAILED with the
message. The pack is never imported into the server process.

Importing ``comfy_env`` does not import this subpackage; importing this subpackage does not
import ComfyUI or torch (the proxies import them lazily, when ComfyUI calls them).
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._build import record_use
from .._envs import resolve_env
from .._errors import ArgumentError, EnvBuildError, EnvError
from .._logs import show_package_as
from .._pool import Pool
from .._recipe import Recipe
from .._settings import MAX_SECONDS, check_timeout
from .._worker import Worker
from ._live import LiveInputs
from ._proxy import CROSSING_TYPES, KeptOutput, make_v1_proxy, make_v3_proxy
from ._routes import register as register_routes
from ._scan import (
    NodePackError,
    PackSpec,
    cache_key,
    default_cache_dir,
    read_cached,
    run_scan,
    write_cached,
)
from ._server import MODES as COMFYUI_MODES
from ._server import describe as describe_server
from ._warm import Warmer

__all__ = ["CROSSING_TYPES", "KeptOutput", "NodePackError", "isolate"]


class _Declared(enum.Enum):
    """``isolate``'s default env: the one the pack's ``pyproject.toml`` declares."""

    FROM_PYPROJECT = "the pack's pyproject.toml"


class _Pack:
    """One isolated pack: its spec, options, scan result and the worker handle."""

    def __init__(
        self,
        spec: PackSpec,
        pool: Pool | None,
        timeout: float | None,
        interrupt_grace: float | None,
        crossing_types: frozenset[str],
        scan: dict[str, Any],
        register_models: bool = True,
        breaker: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        # The pack's own crash-loop breaker settings (``Pool.set_breaker`` arguments), given
        # to each pool the pack's calls go to, once: the default pool may be closed and
        # recreated under a running server, and a new pool knows nothing of the old one's.
        self.breaker = breaker
        self._breaker_pool: Pool | None = None
        self.register_models = register_models
        self._pool = pool
        self.timeout = timeout
        self.interrupt_grace = interrupt_grace
        self.crossing_types = crossing_types
        self.scan = scan
        self.has_torch = bool(scan.get("has_torch"))
        self.warmer: Warmer | None = None  # isolate(..., warm=True)
        self.live_inputs = LiveInputs(self)  # INPUT_TYPES with lists of choices, asked live
        self.built = False  # the env was built from a recipe (comfy_env._build)

    @property
    def pool(self) -> Pool:
        if self._pool is not None:
            return self._pool
        import comfy_env

        return comfy_env.default_pool()

    @property
    def worker(self) -> Worker:
        # Resolved per call: the default pool may have been closed and recreated meanwhile.
        if self.built:
            # A built env's last use, for ``comfy-env env gc`` (throttled to once a minute).
            env_dir = os.path.dirname(self.spec.env.key)
            record_use(Path(os.path.dirname(env_dir)), os.path.basename(self.spec.env.key))
        return self.configured_pool().get_worker(self.spec.env.key)

    def configured_pool(self) -> Pool:
        """The pool, told the pack's breaker settings if it was not yet."""
        pool = self.pool
        if self.breaker and pool is not self._breaker_pool:
            pool.set_breaker(self.spec.env.key, **self.breaker)
            self._breaker_pool = pool
        return pool


def _retire_scan_worker(pack: _Pack) -> None:
    """Retire the env's idle worker that ran a failed scan. ComfyUI lists the pack as IMPORT
    FAILED and never calls it, and failures are not cached: left alone, the worker (its
    interpreter, imports and a shared-memory block) would live until the idle timeout after
    every server start. Through the pool's gate (``Pool.retire_idle``): a worker that another
    pack of the same env is using, or that holds its kept objects, stays."""
    try:
        pack.pool.retire_idle(pack.spec.env.key)
    except Exception:  # the pack's own error is the one to raise
        logging.getLogger("comfy_env").exception(
            "comfy-env: could not retire the scan worker of env %s", pack.spec.env.key
        )


def _scan_seconds(value: object) -> float:
    seconds = check_timeout(value, "isolate(scan_timeout=...)")
    if seconds is None:
        raise ArgumentError("isolate(scan_timeout=...) must be positive seconds, not None")
    return seconds


def _grace_seconds(value: object) -> float | None:
    """``interrupt_grace``: None (the pool's ``cancel_grace``), or zero or more seconds."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value == 0:
            return 0.0  # kill at once
        if 0 < value <= MAX_SECONDS:  # (false for nan)
            return float(value)
    raise ArgumentError(
        f"isolate(interrupt_grace=...) must be zero (kill at once) or more seconds, up to "
        f"{MAX_SECONDS:g}, or None for the pool's cancel_grace; not {value!r}"
    )


def _check_module(module: object) -> None:
    if module == "":
        raise ArgumentError(
            "isolate(module=...) is required: the node module, relative to the pack directory "
            '("nodes_impl", "impl.nodes")'
        )
    if isinstance(module, str) and module.endswith(".py"):
        raise ArgumentError(
            f"isolate(module=...) takes a module name, not a file name: {module[:-3]!r} for "
            f"{module!r}"
        )
    if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
        raise ArgumentError(
            f"isolate(module=...) must be a dotted module name relative to the pack directory "
            f'("nodes_impl", "impl.nodes"), not {module!r}'
        )


def _type_names(what: str, names: Iterable[str] | None) -> frozenset[str] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise ArgumentError(f"isolate({what}=...) must be socket type names, not one string")
    try:
        given = frozenset(names)
    except TypeError as exc:
        raise ArgumentError(f"isolate({what}=...) must be socket type names: {exc}") from None
    bad = sorted(repr(name) for name in given if not isinstance(name, str))
    if bad:
        raise ArgumentError(f"isolate({what}=...) must be socket type names, not {', '.join(bad)}")
    return given


def _declared_recipe(pack_dir: str) -> Recipe:
    """The recipe of a pack that names no env: its ``pyproject.toml``."""
    pyproject = os.path.join(pack_dir, "pyproject.toml")
    if not os.path.isfile(pyproject):
        raise EnvBuildError(
            f"isolate() was given no env= and the pack has no {pyproject} declaring one: add "
            "a pyproject.toml with [project] dependencies (and [tool.comfy.isolation] as "
            "needed), or pass env= (an env directory or a comfy_env.Recipe)",
            stage="recipe",
        )
    return Recipe.from_pyproject(pyproject)


def isolate(
    pack_file: str,
    env: str | os.PathLike[str] | Recipe | _Declared | None = _Declared.FROM_PYPROJECT,
    module: str = "",
    *,
    timeout: float | None = None,
    interrupt_grace: float | None = None,
    scan_timeout: float = 300.0,
    crossing_types: Iterable[str] | None = None,
    extra_crossing_types: Iterable[str] = (),
    pool: Pool | None = None,
    cache_dir: str | None = None,
    register_models: bool = True,
    max_restarts: int | None = None,
    restart_window: float | None = None,
    abandon_for: float | None = None,
    warm: bool = False,
    comfyui: str = "standins",
) -> tuple[dict[str, type], dict[str, str]]:
    """Register a node pack whose nodes run in ``env``; returns ``(NODE_CLASS_MAPPINGS,
    NODE_DISPLAY_NAME_MAPPINGS)``.

    ``pack_file``: the pack's ``__file__`` (or its directory). ``env``: an env directory or
    interpreter path (relative paths resolve against the pack directory; None: ComfyUI's own
    interpreter, still in a separate process), or a ``comfy_env.Recipe``; left out, the env the
    pack's ``pyproject.toml`` declares (``[project] dependencies`` and ComfyUI's
    ``[tool.comfy.isolation]`` table, as ComfyUI's own isolation reads them; an ``env.lock``
    beside it is installed as is), built with uv on first use and shared by every pack and
    server asking for the same recipe (``comfy_env.build_env``). ``module``: the node module,
    relative to the pack directory (``"nodes_impl"`` or ``"impl.nodes"``), imported only in the
    env. ``timeout``: total deadline of each node call in seconds (None: none).
    ``interrupt_grace``: seconds an interrupted node gets to stop cooperatively before its
    worker is killed (None: the pool's ``cancel_grace``; 0: kill at once). ``scan_timeout``:
    deadline of the scan. ``crossing_types`` replaces (``extra_crossing_types`` extends) the
    socket types whose values cross to the server; outputs of any other type stay in the worker
    as ``KeptOutput``. ``pool``: a ``comfy_env.Pool`` (default: the process-wide one).
    ``cache_dir``: where scans are cached (default ``$COMFY_ENV_COMFYUI_CACHE`` or
    ``~/.cache/comfy-env/comfyui-scan``). ``register_models``: register each run whose outputs
    stay in the worker with ComfyUI's model manager (``comfy.model_management``), sized as
    measured in the worker, so ComfyUI counts it and ``free_memory`` / ``unload_all_models`` /
    ``POST /free`` evict it (the producing node then runs again on next use); see
    ``comfy_env.comfyui._models``. ``max_restarts``, ``restart_window``, ``abandon_for``: the
    crash-loop breaker of the pack's env, in place of the pool's ``PoolConfig`` fields of those
    names (None: the pool's; see ``Pool.set_breaker``). ``abandon_for=N`` lifts a block by
    itself N seconds after the death that tripped it, so a batch of crashing prompts does not
    disable the pack until the server restarts. ``warm``: start the pack's
    worker and import its node module in the background now, and again right after each death
    of its worker, so that the first prompt after a server start and the first one after a
    crash do not pay the worker's start and the pack's imports (a prompt arriving meanwhile
    waits for the warm-up); see ``comfy_env.comfyui._warm``. ``comfyui``: ``"standins"``
    (the default: ``folder_paths``, ``comfy.utils``, ``comfy.model_management``, ``server``
    and ``comfy_api`` get small stand-ins where the env lacks ComfyUI) or ``"server"``: the
    worker imports the server's own ComfyUI (its source tree, in place), set up as the server
    set itself up (its command line, so ``comfy.model_management`` picks the server's device;
    its directories and model folders), with the server's site-packages after the env's own
    packages, for packs that import ``nodes``, ``node_helpers``, ``comfy.*`` or
    ``comfy_extras``; see ``comfy_env.comfyui._server``. ``module="__init__"`` names the
    pack's own ``__init__.py`` (a shim pack isolating another pack's unchanged directory).

    Raises ``NodePackError`` when the env is missing, cannot be built or the scan fails,
    ``ArgumentError`` for an argument it cannot use (checked before anything runs, so a typo
    fails the pack's import instead of every prompt): a ``module`` that is no dotted module
    name, a ``timeout`` or ``scan_timeout`` that is not a positive number of seconds, an
    ``interrupt_grace`` that is not zero or more seconds, a ``pool`` that is not a
    ``comfy_env.Pool``, crossing types that are not strings, a breaker setting ``PoolConfig``
    would refuse.
    """
    timeout = check_timeout(timeout, "isolate(timeout=...)", "no deadline per node")
    scan_timeout = _scan_seconds(scan_timeout)
    interrupt_grace = _grace_seconds(interrupt_grace)
    _check_module(module)
    if pool is not None and not isinstance(pool, Pool):
        raise ArgumentError(
            f"isolate(pool=...) must be a comfy_env.Pool or None, not {type(pool).__name__}"
        )
    if not isinstance(warm, bool):
        raise ArgumentError(f"isolate(warm=...) must be True or False, not {warm!r}")
    if comfyui not in COMFYUI_MODES:
        raise ArgumentError(f'isolate(comfyui=...) must be "standins" or "server", not {comfyui!r}')
    crossing_types = _type_names("crossing_types", crossing_types)
    extra_types = _type_names("extra_crossing_types", extra_crossing_types) or frozenset()
    pack_dir = os.path.abspath(
        pack_file if os.path.isdir(pack_file) else os.path.dirname(pack_file)
    )
    env_path: str | Recipe | None = None
    try:
        if env is _Declared.FROM_PYPROJECT:
            env_path = _declared_recipe(pack_dir)
        elif isinstance(env, Recipe):
            env_path = env
        elif env is not None:
            raw = os.fspath(env)
            env_path = raw if os.path.isabs(raw) else os.path.join(pack_dir, raw)
        env_spec = resolve_env(env_path)
    except EnvBuildError as exc:
        # The build's own story (stage, requirement, uv's words, the log): ComfyUI lists the
        # pack as IMPORT FAILED with it, and the server starts without the pack.
        raise NodePackError(
            f"comfy-env: the env of node pack {pack_dir} could not be built: {exc}",
            pack_dir=pack_dir,
            env=exc.env or exc.key or "(not built)",
        ) from None
    except EnvError as exc:
        raise NodePackError(
            f"comfy-env: the env of node pack {pack_dir} is unusable: {exc}\n"
            "(create it, e.g. `python -m venv` and install the pack's requirements; the pack is "
            "not imported into the server instead)",
            pack_dir=pack_dir,
            env=str(env_path),
        ) from None  # (its text is in the message: ComfyUI's log shows it once, not twice)
    if comfyui == "server" and describe_server() is None:
        raise NodePackError(
            f'comfy-env: node pack {pack_dir} asks for comfyui="server", but this process is '
            "no ComfyUI server (ComfyUI's folder_paths is not imported here): the worker "
            "would have no ComfyUI to import",
            pack_dir=pack_dir,
            env=env_spec.key,
        )
    spec = PackSpec(pack_dir, module, env_spec, cache_dir or default_cache_dir(), comfyui)
    # The pack's modules log as ``<pack dir>.impl.nodes`` in the server's logging, the name
    # ``readable`` gives them in messages, not as the hashed package they are in the worker.
    show_package_as(env_spec.key, spec.worker_package, spec.shown_package)
    key = cache_key(spec)
    scan = read_cached(spec, key)
    types = crossing_types if crossing_types is not None else CROSSING_TYPES
    breaker = {
        name: given
        for name, given in (
            ("max_restarts", max_restarts),
            ("restart_window", restart_window),
            ("abandon_for", abandon_for),
        )
        if given is not None
    }
    pack = _Pack(
        spec,
        pool,
        timeout,
        interrupt_grace,
        types | extra_types,
        scan or {},
        register_models,
        breaker,
    )
    pack.built = isinstance(env_path, Recipe)
    if breaker:  # now: a bad setting fails the import, and the scan runs under it too
        pack.configured_pool()
    scanned = scan is None
    if scan is None:
        try:
            scan = run_scan(spec, pack.worker, scan_timeout)
        except NodePackError:
            _retire_scan_worker(pack)
            raise
        write_cached(spec, key, scan)
        pack.scan = scan
        pack.has_torch = bool(scan.get("has_torch"))
    mappings: dict[str, type] = {}
    display: dict[str, str] = {}
    for node in scan["nodes"]:
        try:
            proxy = make_v3_proxy(pack, node) if scan["kind"] == "v3" else make_v1_proxy(pack, node)
        except Exception as exc:
            if scanned:
                _retire_scan_worker(pack)
            raise NodePackError(
                f"comfy-env: cannot build the proxy of node {node.get('name')!r} of pack "
                f"{pack_dir}: {type(exc).__name__}: {exc}",
                pack_dir=pack_dir,
                env=env_spec.key,
            ) from exc
        mappings[node["name"]] = proxy
        if node.get("display_name"):
            display[node["name"]] = node["display_name"]
    register_routes(pack)  # routes the pack's module registered on PromptServer, if any
    if warm:
        pack.warmer = Warmer(pack, scan_timeout)
        if scanned:
            pack.warmer.follow_deaths()  # the scan's worker has the module imported already
        else:
            pack.warmer.start()
    return mappings, display
