"""Recipes: what an env should hold, as a value, and the content key that names its build.

Data flow::

    Recipe(requirements=[...], python="3.12")      Recipe.from_file("env-requirements.txt")
    Recipe.from_pyproject("pack/pyproject.toml")   ([project] dependencies + [tool.comfy.isolation])
            |
            v
    recipe.key(interpreter)   sha256 over RECIPE_VERSION, the normalised requirements, the
            |                 indexes and their routing, a shipped lock's bytes, the found
            |                 interpreter's implementation and version, and the platform
            v
    _build.build_env(recipe) -> <env root>/envs/<key>/   (built once, never changed in place)

A recipe is frozen and hashable: the same recipe built twice on one machine is one env, a
changed recipe (one pin, one index, another Python) is another env, side by side. Nothing here
touches the disk except the constructors that read a file (``from_file``, ``from_pyproject``)
and ``key``'s read of a shipped lock; building lives in ``_build``, listing and collecting in
``_envstore``.

``cuda_wheels`` routes packages to a second index as ComfyUI's isolation manifest does
(``[tool.comfy.isolation] cuda_wheels = {index_url(s), packages, package_map}``): each listed
package is looked up on its page of that index (``<index_url>/<name>/``, or the name
``package_map`` gives), and the lock names the wheel it chose and its hash, so a shipped lock
reinstalls the same CUDA build on another machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ._errors import ArgumentError, EnvBuildError

# Bumped whenever the way a recipe becomes an env changes (uv flags, layout of the env
# directory): an env built by an older recipe version is then never reused for a new recipe.
RECIPE_VERSION = 1

# The lock a pack or a recipe's directory may ship; installed as is when present.
SHIPPED_LOCK_NAME = "env.lock"

# The ``[tool.comfy.isolation]`` keys ``from_pyproject`` reads.
_ISOLATION_KEYS = frozenset(
    {"package_manager", "index_url", "extra_index_urls", "cuda_wheels", "python"}
)

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirement_name(requirement: str) -> str | None:
    """The normalised project name a requirement line names (PEP 503: lower case, runs of
    ``-_.`` as one ``-``), or None for a line that is not a plain requirement (a URL, a path)."""
    match = _NAME.match(requirement)
    if match is None or "://" in requirement.split(";")[0].split("@")[0]:
        return None
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _normalise_requirement(line: str) -> str:
    # One spelling per requirement so that "six == 1.16.0" and "six==1.16.0" are one key;
    # markers and extras are kept as written apart from spaces (they change the env).
    text = " ".join(line.split())
    name = requirement_name(text)
    if name is None:
        return text
    rest = _NAME.sub("", text, count=1)
    return name + re.sub(r"\s*([=<>!~]=?|===)\s*", r"\1", rest).replace(" ,", ",").replace(
        ", ", ","
    )


def _strings(value: object, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise EnvBuildError(f"{what} must be a list of strings, not {value!r}", stage="recipe")
    items = tuple(value)
    bad = [item for item in items if not isinstance(item, str)]
    if bad:
        raise EnvBuildError(f"{what} must be strings; not {bad[0]!r}", stage="recipe")
    return items


@dataclass(frozen=True)
class CudaWheels:
    """ComfyUI's ``cuda_wheels`` routing: ``packages`` come from ``index_urls`` (each
    package's page ``<index_url>/<name>/``; ``package_map`` renames a package's page)."""

    index_urls: tuple[str, ...]
    packages: tuple[str, ...]
    package_map: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str) -> CudaWheels:
        """From the TOML table (``index_url`` or ``index_urls``, ``packages``,
        ``package_map``)."""
        urls: list[str] = []
        if "index_url" in table:
            url = table["index_url"]
            if not isinstance(url, str):
                raise EnvBuildError(f"{where}: cuda_wheels.index_url must be a string, not {url!r}")
            urls.append(url)
        urls.extend(_strings(table.get("index_urls", ()), f"{where}: cuda_wheels.index_urls"))
        if not urls:
            raise EnvBuildError(
                f"{where}: cuda_wheels needs index_url or index_urls", stage="recipe"
            )
        packages = _strings(table.get("packages", ()), f"{where}: cuda_wheels.packages")
        mapping = table.get("package_map", {})
        if not isinstance(mapping, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
        ):
            raise EnvBuildError(
                f"{where}: cuda_wheels.package_map must map package names to index names",
                stage="recipe",
            )
        return cls(
            tuple(urls),
            tuple(sorted({requirement_name(p) or p for p in packages})),
            tuple(sorted((requirement_name(k) or k, v) for k, v in mapping.items())),
        )

    def pages(self, package: str) -> list[str]:
        """The index pages holding ``package``'s wheels, in the order tried."""
        names = dict(self.package_map)
        page = names.get(package)
        variants = [page] if page else [package, package.replace("-", "_")]
        return [
            f"{url.rstrip('/')}/{name}/"
            for url in self.index_urls
            for name in dict.fromkeys(variants)
        ]


def _env_settings(settings: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A recipe's own settings, checked now as ``Pool.configure`` will take them (a bad one is
    an ``ArgumentError`` or ``ConfigError`` here, not at the first call); read-only."""
    if not settings:
        return MappingProxyType({})
    if not isinstance(settings, Mapping):
        raise ArgumentError(
            f"Recipe(settings=...) must be a mapping of setting names, not "
            f"{type(settings).__name__}"
        )
    from ._config import settings_for_env
    from ._settings import Settings

    settings_for_env(Settings(), dict(settings))
    return MappingProxyType(dict(settings))


@dataclass(frozen=True, init=False)
class Recipe:
    """What an env holds: requirement lines, the Python version (``"3.12"``; None: the host's
    own ``major.minor``), indexes (``index_url`` replaces the default index,
    ``extra_index_urls`` add to it), ``cuda_wheels`` routing, and ``lock``: the path of a lock
    the author ships (``uv pip compile --generate-hashes`` output, installed as is instead of
    resolving). ``name`` labels the env in logs and ``comfy-env env list`` (not in its key);
    ``source`` says where the recipe came from, for messages. ``settings``: the env's own
    settings (``Pool.configure``'s fields: ``{"memory_limit": 2 << 30, "env_vars": {...}}``),
    given to every pool that uses the recipe; not in the key (they change no file).

    Accepted wherever an env is (``get_worker(recipe)``, ``Pool.get_worker``,
    ``isolate(env=...)``): it is built on first use (``comfy_env.build_env``) and then used as
    any env directory."""

    requirements: tuple[str, ...] = ()
    python: str | None = None
    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    cuda_wheels: CudaWheels | None = None
    lock: str | None = None
    name: str | None = field(default=None, compare=False)
    source: str | None = field(default=None, compare=False)
    settings: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __init__(
        self,
        requirements: Iterable[str] = (),
        python: str | None = None,
        *,
        index_url: str | None = None,
        extra_index_urls: Iterable[str] = (),
        cuda_wheels: CudaWheels | Mapping[str, Any] | None = None,
        lock: str | os.PathLike[str] | None = None,
        name: str | None = None,
        source: str | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        lines = tuple(
            _normalise_requirement(line)
            for line in _strings(requirements, "Recipe(requirements=...)")
            if line.split("#", 1)[0].strip()
        )
        if python is not None and (
            not isinstance(python, str) or not re.fullmatch(r"\d+(\.\d+){0,2}", python)
        ):
            raise EnvBuildError(
                f'Recipe(python=...) must be a version such as "3.12", not {python!r}',
                stage="recipe",
            )
        if isinstance(cuda_wheels, Mapping):
            cuda_wheels = CudaWheels.from_table(cuda_wheels, "Recipe(cuda_wheels=...)")
        set_ = object.__setattr__  # frozen: the dataclass's own __init__ is replaced
        set_(self, "requirements", tuple(sorted(dict.fromkeys(lines))))
        set_(self, "python", python)
        set_(self, "index_url", index_url)
        set_(self, "extra_index_urls", _strings(extra_index_urls, "extra_index_urls"))
        set_(self, "cuda_wheels", cuda_wheels)
        set_(self, "lock", None if lock is None else os.path.abspath(os.fspath(lock)))
        set_(self, "name", name)
        set_(self, "source", source)
        set_(self, "settings", _env_settings(settings))
        if not self.requirements and self.lock is None:
            raise EnvBuildError(
                f"recipe {source or ''} lists no requirements and ships no lock: nothing to "
                "build (pass None as the env for the host's own interpreter)".replace("  ", " "),
                stage="recipe",
            )

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], python: str | None = None, **options: Any
    ) -> Recipe:
        """A recipe from a requirements file (one requirement a line; ``#`` comments;
        ``--index-url`` / ``--extra-index-url`` lines are taken as the recipe's indexes; ``-r``
        includes are not followed). An ``env.lock`` beside the file is used as the shipped
        lock unless ``lock=`` says otherwise."""
        file = Path(path).resolve()
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise EnvBuildError(
                f"cannot read the requirements file {file}: {exc.strerror or exc}", stage="recipe"
            ) from None
        requirements: list[str] = []
        extra: list[str] = list(options.pop("extra_index_urls", ()))
        index_url = options.pop("index_url", None)
        for raw in text.splitlines():
            line = raw.split(" #", 1)[0].strip()
            if not line or line.startswith("#"):
                continue
            option, _, value = line.partition(" ")
            if option in ("--index-url", "-i"):
                index_url = value.strip()
            elif option == "--extra-index-url":
                extra.append(value.strip())
            elif line.startswith("-"):
                raise EnvBuildError(
                    f"{file}: option line {line!r} is not supported in a recipe (list "
                    "requirements, --index-url and --extra-index-url only)",
                    stage="recipe",
                )
            else:
                requirements.append(line)
        shipped = file.parent / SHIPPED_LOCK_NAME
        options.setdefault("lock", shipped if shipped.is_file() else None)
        options.setdefault("name", file.parent.name)
        return cls(
            requirements,
            python,
            index_url=index_url,
            extra_index_urls=extra,
            source=str(file),
            **options,
        )

    @classmethod
    def from_pyproject(cls, path: str | os.PathLike[str], python: str | None = None) -> Recipe:
        """A recipe from a pack's ``pyproject.toml`` (or its directory), read as ComfyUI's
        isolation loader reads it: ``[project] dependencies`` plus ``[tool.comfy.isolation]``
        (``package_manager`` must be ``"uv"`` or absent, ``extra_index_urls``, ``index_url``,
        ``cuda_wheels``, ``python``). An ``env.lock`` beside it is the shipped lock. A
        ``package_manager = "conda"`` manifest raises ``EnvBuildError``: conda envs are used
        as existing directories (``env="path/to/env"``), not built."""
        file = Path(path).resolve()
        if file.is_dir():
            file = file / "pyproject.toml"
        document = _read_toml(file)
        project = document.get("project", {})
        tool = document.get("tool", {})
        comfy = tool.get("comfy", {}) if isinstance(tool, Mapping) else {}
        isolation = comfy.get("isolation", {}) if isinstance(comfy, Mapping) else {}
        if not isinstance(project, Mapping) or not isinstance(isolation, Mapping):
            raise EnvBuildError(f"{file}: [project] and [tool.comfy.isolation] must be tables")
        unknown = sorted(set(isolation) - _ISOLATION_KEYS)
        if unknown:
            # Keys of ComfyUI's manifest that do not change how an env is built here (or that
            # are misspelled): said once per read, never silently dropped.
            import logging

            logging.getLogger("comfy_env.build").warning(
                "comfy-env: %s: [tool.comfy.isolation] %s not used by comfy-env's env build "
                "(it reads %s)",
                file,
                ", ".join(unknown),
                ", ".join(sorted(_ISOLATION_KEYS)),
            )
        manager = isolation.get("package_manager", "uv")
        if manager != "uv":
            raise EnvBuildError(
                f'{file}: [tool.comfy.isolation] package_manager = "{manager}" is not built by '
                'comfy-env, which builds envs with uv (package_manager = "uv"). Create that env '
                "yourself (e.g. `conda create -p <dir> ...`) and pass its directory: "
                'isolate(__file__, env="<dir>", module=...)',
                stage="recipe",
            )
        requirements = _strings(project.get("dependencies", ()), f"{file}: [project] dependencies")
        extra = _strings(
            isolation.get("extra_index_urls", ()), f"{file}: tool.comfy.isolation.extra_index_urls"
        )
        cuda = isolation.get("cuda_wheels")
        if cuda is not None and not isinstance(cuda, Mapping):
            raise EnvBuildError(f"{file}: tool.comfy.isolation.cuda_wheels must be a table")
        if python is None:
            python = isolation.get("python")
        shipped = file.parent / SHIPPED_LOCK_NAME
        index_url = isolation.get("index_url")
        return cls(
            requirements,
            python,
            index_url=index_url if isinstance(index_url, str) else None,
            extra_index_urls=extra,
            cuda_wheels=None if cuda is None else CudaWheels.from_table(cuda, str(file)),
            lock=shipped if shipped.is_file() else None,
            name=str(project.get("name") or file.parent.name),
            source=str(file),
        )

    # ---- the key ------------------------------------------------------------------------

    def key(self, interpreter: Mapping[str, str]) -> str:
        """The content key of this recipe built with ``interpreter`` (``implementation``,
        ``version``, ``platform``, ``machine``, as ``_build`` probes them): 20 hex digits."""
        document = {
            "recipe_version": RECIPE_VERSION,
            "requirements": list(self.requirements),
            "index_url": self.index_url,
            "extra_index_urls": list(self.extra_index_urls),
            "cuda_wheels": self._cuda_wheels_json(pairs=True),
            "lock": None if self.lock is None else _digest_file(self.lock),
            "interpreter": {k: interpreter[k] for k in sorted(interpreter)},
        }
        encoded = json.dumps(document, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(encoded).hexdigest()[:20]

    def _cuda_wheels_json(self, pairs: bool) -> dict[str, Any] | None:
        """``cuda_wheels`` as JSON: its package map as ``[name, wheel]`` pairs (``pairs``:
        the content key's form, which must never change) or as an object (the record's)."""
        cuda = self.cuda_wheels
        if cuda is None:
            return None
        package_map: Any = [list(p) for p in cuda.package_map] if pairs else dict(cuda.package_map)
        return {
            "index_urls": list(cuda.index_urls),
            "packages": list(cuda.packages),
            "package_map": package_map,
        }

    def describe(self) -> str:
        """A short label: the name, else the first requirements."""
        if self.name:
            return self.name
        shown = ", ".join(self.requirements[:3])
        return shown + (", ..." if len(self.requirements) > 3 else "") or "lock only"

    def as_json(self) -> dict[str, Any]:
        """What the env's record keeps of the recipe."""
        return {
            "requirements": list(self.requirements),
            "python": self.python,
            "index_url": self.index_url,
            "extra_index_urls": list(self.extra_index_urls),
            "cuda_wheels": self._cuda_wheels_json(pairs=False),
            "lock": self.lock,
            "name": self.name,
            "source": self.source,
        }


def _digest_file(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        raise EnvBuildError(
            f"cannot read the shipped lock {path}: {exc.strerror or exc}", stage="recipe"
        ) from None


def _read_toml(file: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[import-not-found]
        except ImportError:
            raise EnvBuildError(
                f"reading {file} needs Python 3.11+ or the tomli package", stage="recipe"
            ) from None
    try:
        with open(file, "rb") as fh:
            document: dict[str, Any] = tomllib.load(fh)
            return document
    except OSError as exc:
        raise EnvBuildError(f"cannot read {file}: {exc.strerror or exc}", stage="recipe") from None
    except tomllib.TOMLDecodeError as exc:
        raise EnvBuildError(f"{file} is not valid TOML: {exc}", stage="recipe") from None
