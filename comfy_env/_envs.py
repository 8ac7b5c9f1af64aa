"""Env resolution: what the caller passed -> (env key, interpreter path).

An env is named by one of:
- ``None``: the current interpreter (``sys.executable``; key ``sys.prefix``);
- an env directory: a venv (``bin/python``, ``Scripts/python.exe``), a conda env (``bin/python``
  or ``python.exe``), a pixi project (``.pixi/envs/default/...``);
- an interpreter path: its env directory is the parent of ``bin``/``Scripts``, else its folder.

The env key (the pool's key) is the absolute env directory, not symlink-resolved: two venvs
sharing a base interpreter are two envs. An interpreter path keys on its env directory only when
that directory is an env (``pyvenv.cfg``, ``conda-meta``, a pixi layout) and the path is the
same file (by realpath) as the directory's own interpreter, the one resolving the directory
picks: ``venv/bin/python3.11`` and ``venv`` are one env. Any other interpreter path is its own
key: ``/usr/bin/python3.10`` and ``/usr/bin/python3.12`` must not share the key ``/usr``, where
the pool's entry for the first would silently run every call meant for the second.

The interpreter path is kept as found, never ``realpath``-ed, because a venv's ``bin/python``
symlink is what makes Python pick up the venv's ``pyvenv.cfg``; launching the resolved base
binary would silently run the base env.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ._errors import EnvError
from ._values import value

# Not ``typing.TYPE_CHECKING``: typing is a large import this module does not need at run time.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._recipe import Recipe

# Interpreter locations inside an env directory, in the order they are tried.
INTERPRETER_CANDIDATES: tuple[str, ...] = (
    "bin/python",
    "bin/python3",
    "Scripts/python.exe",
    "python.exe",
    ".pixi/envs/default/bin/python",
    ".pixi/envs/default/bin/python3",
    ".pixi/envs/default/python.exe",
)

# Env directory names that say nothing about the env (``python -m venv .venv``): such an env is
# named after the directory holding it. Compared as spelled (``.Venv`` is a name of its own).
GENERIC_ENV_DIRS: tuple[str, ...] = (".venv", "venv", "env", ".env")


@value
class EnvSpec:
    """A resolved env: ``key`` names it in the pool, ``interpreter`` is what gets launched."""

    key: str
    interpreter: str
    is_current: bool

    @property
    def name(self) -> str:
        """A short label for logs, and the last part of the env's logger name
        (``comfy_env.worker.<name>``) and output prefix: ``"current"`` for the host's own
        interpreter, else the env directory's name, or its parent's when the directory has a
        generic name (``GENERIC_ENV_DIRS``: every ComfyUI pack's ``.venv`` is named after its
        pack, so packs get loggers of their own), with each ``.`` replaced by ``_`` (a dot
        would split the logger tree: ``3.12.1``, ``.venv``). Not unique: ``key`` is the env."""
        if self.is_current:
            return "current"
        path = Path(self.key)
        label = path.name
        if label in GENERIC_ENV_DIRS and path.parent.name:
            label = path.parent.name
        if not label:  # the root directory: "/" would make the logger "comfy_env.worker./"
            label = Path(self.interpreter).name
        return label.replace(".", "_")


def current_env() -> EnvSpec:
    return EnvSpec(key=os.path.abspath(sys.prefix), interpreter=sys.executable, is_current=True)


def _is_interpreter(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def resolve_env(env: str | os.PathLike[str] | Recipe | None) -> EnvSpec:
    """Resolve ``env`` or raise ``EnvError`` listing every path that was tried.

    A ``comfy_env.Recipe`` is built first (``build_env``: once per machine, then a stat) and
    resolves to its env directory; a failed build raises ``EnvBuildError`` (an ``EnvError``).
    """
    if type(env).__name__ == "Recipe" and not isinstance(env, (str, os.PathLike)):
        # (by name first: the recipe machinery is imported only by programs that use it)
        from ._build import build_env
        from ._recipe import Recipe

        if isinstance(env, Recipe):
            return _resolve(build_env(env))
    try:
        return _resolve(env)  # type: ignore[arg-type]
    except PermissionError as exc:  # pathlib lets EACCES through; it is the env's problem
        where = exc.filename or os.fspath(env or "")  # type: ignore[arg-type]
        raise EnvError(
            f"env {where} cannot be read by this user (permission denied)",
            env=str(where),
            tried=(str(where),),
        ) from None


def _resolve(env: str | os.PathLike[str] | None) -> EnvSpec:
    if env is None:
        return current_env()
    if not isinstance(env, (str, os.PathLike)):
        raise EnvError(
            "env must be None, an env directory, an interpreter path or a comfy_env.Recipe, "
            f"not {type(env).__name__}"
        )
    raw = os.fspath(env)
    if not isinstance(raw, str):  # an os.PathLike may give bytes
        raise EnvError(
            f"env must be None, an env directory or an interpreter path, not a path of bytes "
            f"({raw!r}); pass it decoded (os.fsdecode)"
        )
    if not raw:
        raise EnvError("env is an empty string; pass None for the current interpreter")
    if "\0" in raw:  # no file can be named so; the OS would refuse it at the launch
        raise EnvError(f"env {raw!r} contains a NUL character, so it names no path", env=raw)
    path = Path(_absolute(os.path.expanduser(raw)))
    if path.is_dir():
        if not os.access(path, os.R_OK | os.X_OK):
            raise EnvError(
                f"env directory {path} cannot be read by this user (permission denied)",
                env=str(path),
                tried=(str(path),),
            )
        tried = []
        for rel in INTERPRETER_CANDIDATES:
            candidate = path / rel
            tried.append(str(candidate))
            if _is_interpreter(candidate):
                return _spec(path, candidate)
        raise EnvError(
            f"no Python interpreter found in env directory {path}{_dangling(path)}; tried:\n  "
            + "\n  ".join(tried),
            env=str(path),
            tried=tuple(tried),
        )
    if path.exists():
        if not _is_interpreter(path):
            raise EnvError(
                f"{path} is neither an env directory nor an executable interpreter",
                env=str(path),
                tried=(str(path),),
            )
        if str(path) == os.path.abspath(sys.executable):
            return current_env()  # one entry for the host's interpreter, however it is named
        folder = path.parent
        env_dir = folder.parent if folder.name in ("bin", "Scripts") else folder
        if env_kind(env_dir) is not None and _same_file(_default_interpreter(env_dir), path):
            return _spec(env_dir, path)
        return _spec(path, path)
    try:
        os.stat(path)
    except PermissionError:
        raise EnvError(
            f"env {path} cannot be reached by this user (permission denied on a parent directory)",
            env=str(path),
            tried=(str(path),),
        ) from None
    except (OSError, ValueError):
        pass
    raise EnvError(f"env {path} does not exist", env=str(path), tried=(str(path),))


def _absolute(raw: str) -> str:
    """``raw`` made absolute, symlinks kept, except that ``..`` means what the OS makes of it.

    ``os.path.abspath`` collapses ``lnk/..`` by string rules, but the kernel follows ``lnk``
    first: ``/tmp/lnk/../venv`` with ``lnk -> /tmp/deep/a`` is ``/tmp/deep/venv``. So the part
    before the last ``..`` is realpath-ed and the rest (no ``..`` in it) appended.
    """
    joined = os.path.join(os.getcwd(), raw)
    parts = joined.split(os.sep)
    if os.pardir not in parts:
        return os.path.abspath(joined)
    last = len(parts) - 1 - parts[::-1].index(os.pardir)
    head = os.path.realpath(os.sep.join(parts[:last]) or os.sep)
    return os.path.normpath(os.path.join(head, *parts[last:]))


def _dangling(env_dir: Path) -> str:
    """A note on the first candidate that is a dangling symlink (a venv whose base Python was
    removed or upgraded away), else ``""``."""
    for rel in INTERPRETER_CANDIDATES:
        candidate = env_dir / rel
        if candidate.is_symlink() and not candidate.exists():
            return (
                f" ({rel} is a dangling symlink to {os.path.realpath(candidate)}: was its base "
                "Python removed?)"
            )
    return ""


def env_kind(path: Path) -> str | None:
    """What kind of env's own directory ``path`` is: ``"venv"`` (``pyvenv.cfg``), ``"pixi"``
    (``.pixi/envs/<name>``, which holds a ``conda-meta`` too), ``"conda"`` (``conda-meta/``),
    or None. A folder that merely holds interpreters (``/usr``, a pyenv shims dir) is none."""
    if (path / "pyvenv.cfg").is_file():
        return "venv"
    if path.parent.name == "envs" and path.parent.parent.name == ".pixi":
        return "pixi"
    if (path / "conda-meta").is_dir():
        return "conda"
    return None


def _default_interpreter(env_dir: Path) -> Path | None:
    """The interpreter resolving ``env_dir`` itself would launch, if any."""
    for rel in INTERPRETER_CANDIDATES:
        candidate = env_dir / rel
        if _is_interpreter(candidate):
            return candidate
    return None


def _same_file(a: Path | str | None, b: Path | str) -> bool:
    return a is not None and os.path.realpath(a) == os.path.realpath(b)


def same_interpreter(a: str, b: str) -> bool:
    """Whether two interpreter paths are the same file (compared by realpath)."""
    return _same_file(a, b)


def _spec(env_dir: Path, interpreter: Path) -> EnvSpec:
    key = str(env_dir)
    current = os.path.abspath(sys.prefix)
    is_current = key == current and os.path.realpath(interpreter) == os.path.realpath(
        sys.executable
    )
    return EnvSpec(key=key, interpreter=str(interpreter), is_current=is_current)
