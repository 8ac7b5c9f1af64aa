"""The env root's bookkeeping: last-use records, listing, collecting and removing built envs.

Layout of the env root (``_build.env_root()``)::

    envs/<key>/                 a published env: a venv + env.lock + comfy-env-env.json
    envs/<key>.tmp-<pid>-<rand> a build in progress, or left by a builder that died
    locks/<key>.lock            the flock file of a key (held by its builder, or by gc)
    logs/<key>.log              the last build's full log
    failures/<key>.json         the last failure, for the retry rate limit
    used/<key>                  its mtime is the env's last use

Data flow: ``resolve_env(recipe)`` (and ``build_env``) -> ``record_use`` touches ``used/<key>``
(at most once a minute per process: a ComfyUI pack resolves its env on every node call).
``gc`` lists ``envs/``, keeps what is not ours (no record: never removed), what a live host
uses (its status file names the env directory: ``_status.read_status``) and what was used
within the age asked, and removes the rest under the key's lock: first renamed to a temporary
name (one atomic step: nobody resolves half a removed env), then deleted. Temporary build
directories of keys nobody holds are removed too (a builder killed by SIGKILL left them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ._build import (
    RECORD_NAME,
    TMP_MARK,
    dir_size,
    env_root,
    key_lock,
    lock_is_free,
    read_record,
    record_use,
)
from ._errors import EnvError


def record_use_of_dir(env_dir: str) -> None:
    """``record_use`` for an env directory, when it is a built env under the env root."""
    root = env_root()
    path = Path(env_dir)
    if path.parent == root / "envs" and (path / RECORD_NAME).is_file():
        record_use(root, path.name)


@dataclass(frozen=True)
class BuiltEnv:
    """A built env as ``comfy-env env list`` shows it."""

    key: str
    path: str
    name: str | None
    python: str | None
    size_bytes: int
    created: float | None
    last_used: float | None
    in_use_by: tuple[int, ...]  # pids of live hosts whose pools hold the env

    def as_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "path": self.path,
            "name": self.name,
            "python": self.python,
            "size_bytes": self.size_bytes,
            "created": self.created,
            "last_used": self.last_used,
            "in_use_by": list(self.in_use_by),
        }


def _users() -> dict[str, list[int]]:
    """Env key (directory) -> pids of live hosts using it, from the status files."""
    from ._status import read_status

    users: dict[str, list[int]] = {}
    try:
        hosts = read_status(measure=False, remove_stale=False)
    except (OSError, EnvError, ValueError):  # no readable status dir: nobody is known
        return users
    except Exception:  # noqa: BLE001 - a RuntimeRootError: the same
        return users
    for host in hosts:
        for env in host.envs:
            users.setdefault(os.path.realpath(env.env), []).append(host.pid)
    return users


def _last_used(root: Path, key: str, record: dict[str, object]) -> float | None:
    try:
        return (root / "used" / key).stat().st_mtime
    except OSError:
        created = record.get("created")
        return float(created) if isinstance(created, (int, float)) else None


def list_envs(root: str | os.PathLike[str] | None = None, *, sizes: bool = True) -> list[BuiltEnv]:
    """Every complete env comfy-env built under ``root`` (default ``env_root()``)."""
    base = Path(root) if root is not None else env_root()
    envs = base / "envs"
    users = _users()
    found: list[BuiltEnv] = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(envs)):
            path = envs / name
            if TMP_MARK in name or not path.is_dir():
                continue
            record = read_record(path)
            if record is None:
                continue  # not one comfy-env built (or not complete): never listed, never removed
            recipe = record.get("recipe") if isinstance(record.get("recipe"), dict) else {}
            interpreter = record.get("interpreter")
            created = record.get("created")
            found.append(
                BuiltEnv(
                    key=name,
                    path=str(path),
                    name=recipe.get("name") if isinstance(recipe, dict) else None,
                    python=interpreter.get("version") if isinstance(interpreter, dict) else None,
                    size_bytes=dir_size(path) if sizes else 0,
                    created=float(created) if isinstance(created, (int, float)) else None,
                    last_used=_last_used(base, name, record),
                    in_use_by=tuple(users.get(os.path.realpath(path), ())),
                )
            )
    return found


@dataclass(frozen=True)
class GcReport:
    """What ``gc`` removed (or would remove), what it kept because a live host uses it, and
    the temporary directories of dead builders it removed."""

    removed: tuple[str, ...]
    kept_in_use: tuple[str, ...]
    stale_builds: tuple[str, ...]
    freed_bytes: int


def _unpublish(base: Path, key: str) -> bool:
    """Remove ``key``'s env under its lock: rename away (atomic), then delete."""
    envs = base / "envs"
    path = envs / key
    with key_lock(base, key, "removal"):
        if read_record(path) is None:
            return False
        grave = envs / f"{key}{TMP_MARK}rm-{os.getpid()}"
        os.rename(path, grave)
        shutil.rmtree(grave, ignore_errors=True)
        # (The lock file stays: another process may hold it open to flock it; it is empty.)
        for leftover in (
            base / "used" / key,
            base / "failures" / f"{key}.json",
            base / "logs" / f"{key}.log",
        ):
            with contextlib.suppress(OSError):
                leftover.unlink()
    return True


def gc(
    older_than_days: float = 30.0,
    *,
    dry_run: bool = False,
    root: str | os.PathLike[str] | None = None,
) -> GcReport:
    """Remove built envs not used for ``older_than_days`` days, except those a live host
    uses; and temporary directories of builders that died. ``dry_run``: remove nothing."""
    base = Path(root) if root is not None else env_root()
    cutoff = time.time() - older_than_days * 86400.0
    removed: list[str] = []
    kept: list[str] = []
    freed = 0
    for env in list_envs(base):
        if env.in_use_by:
            kept.append(env.key)
            continue
        if env.last_used is not None and env.last_used > cutoff:
            continue
        if dry_run or _unpublish(base, env.key):
            removed.append(env.key)
            freed += env.size_bytes
    stale: list[str] = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(base / "envs")):
            if TMP_MARK not in name:
                continue
            key = name.split(TMP_MARK, 1)[0]
            if lock_is_free(base, key):
                stale.append(name)
                if not dry_run:
                    shutil.rmtree(base / "envs" / name, ignore_errors=True)
    return GcReport(tuple(removed), tuple(kept), tuple(stale), freed)


def remove_env(key: str, *, root: str | os.PathLike[str] | None = None) -> BuiltEnv:
    """Remove one built env by key (``comfy-env env rm``); ``EnvError`` if there is no such
    env, it is not one comfy-env built, or a live host uses it."""
    base = Path(root) if root is not None else env_root()
    if not key or "/" in key or key.startswith(".") or TMP_MARK in key:
        raise EnvError(f"{key!r} is not an env key (see `comfy-env env list`)", env=key)
    matches = [env for env in list_envs(base) if env.key == key]
    if not matches:
        raise EnvError(
            f"no env {key} built by comfy-env under {base / 'envs'} (see `comfy-env env list`)",
            env=key,
        )
    env = matches[0]
    if env.in_use_by:
        raise EnvError(
            f"env {key} is in use by live host(s) {', '.join(map(str, env.in_use_by))}; "
            "stop them (or wait for them to exit) first",
            env=env.path,
        )
    _unpublish(base, key)
    return env
