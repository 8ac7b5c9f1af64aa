"""``comfy-env env ...``: build, list, collect and remove declared envs.

Commands:
  env build PATH|REQ...     build a recipe into an env and print its directory: PATH is a
                            pack directory or ``pyproject.toml`` (``[project] dependencies``
                            + ``[tool.comfy.isolation]``) or a requirements file; otherwise
                            the words are requirements (``six==1.16.0 idna``). ``--python``
                            picks the interpreter version. uv's lines are shown on stderr.
  env list                  built envs: key, size on disk, Python, last use, live hosts using
                            it.
  env gc [--older-than DAYS] [--dry-run]
                            remove envs unused for DAYS (default 30), never one a live host
                            uses, never a directory comfy-env did not build; and temporary
                            directories of builders that died.
  env rm KEY                remove one env (refused while a live host uses it).

Each takes ``--json``. Data flow: ``build`` is ``comfy_env.build_env`` (a failed recipe is
retried at once here, not after the minute a program waits); ``list``, ``gc`` and ``rm`` are
``comfy_env._envstore``'s, which read the hosts' status files to tell what is in use.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ._errors import EnvBuildError

# Not ``typing.TYPE_CHECKING``: the parser of every command (``comfy-env status`` included, which
# must stay light) imports this module; typing and pathlib load only where they are used.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def add_env_commands(
    sub: Any, add_json: Any, formatter: type[argparse.HelpFormatter], epilog: str
) -> None:
    """Add ``env`` and its subcommands to the parser's subcommands ``sub``."""
    p_env = sub.add_parser(
        "env",
        help="build, list, collect and remove declared envs (recipes, packs' pyproject.toml)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog=epilog,
        formatter_class=formatter,
    )
    env_sub = p_env.add_subparsers(dest="env_command", required=True)
    p_build = env_sub.add_parser(
        "build", help="build a recipe (pack dir, pyproject.toml, requirements file or REQs)"
    )
    p_build.add_argument("what", nargs="+", metavar="PATH|REQ")
    p_build.add_argument("--python", default=None, metavar="VERSION", help='e.g. "3.12"')
    add_json(p_build)
    p_list = env_sub.add_parser("list", help="list built envs")
    add_json(p_list)
    p_gc = env_sub.add_parser("gc", help="remove envs unused for DAYS (never one in use)")
    p_gc.add_argument("--older-than", type=float, default=30.0, metavar="DAYS")
    p_gc.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    add_json(p_gc)
    p_rm = env_sub.add_parser("rm", help="remove one built env by key")
    p_rm.add_argument("key", metavar="KEY")
    add_json(p_rm)


def recipe_from_words(words: list[str], python: str | None) -> Any:
    """The recipe ``env build`` means: a pack directory or ``.toml`` file (its pyproject), a
    requirements file, or requirement strings."""
    from pathlib import Path

    from ._recipe import Recipe

    if len(words) == 1 and os.path.exists(words[0]):
        path = Path(words[0])
        if path.is_dir() or path.suffix == ".toml":
            return Recipe.from_pyproject(path, python)
        return Recipe.from_file(path, python)
    return Recipe(words, python)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _when(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    ago = max(0.0, time.time() - seconds)
    if ago < 120:
        return f"{ago:.0f} s ago"
    if ago < 7200:
        return f"{ago / 60:.0f} min ago"
    if ago < 172800:
        return f"{ago / 3600:.1f} h ago"
    return f"{ago / 86400:.1f} days ago"


def env_command(args: argparse.Namespace, print_json: Any, error_record: Any) -> int:
    """Run ``comfy-env env <subcommand>``; returns the exit code."""
    as_json = bool(getattr(args, "json", False))
    if args.env_command == "build":
        return _env_build(args.what, args.python, as_json, print_json, error_record)
    if args.env_command == "list":
        return _env_list(as_json, print_json)
    if args.env_command == "gc":
        return _env_gc(args.older_than, args.dry_run, as_json, print_json)
    if args.env_command == "rm":
        return _env_rm(args.key, as_json, print_json, error_record)
    return 2  # pragma: no cover - argparse requires a subcommand


def _env_build(
    words: list[str], python: str | None, as_json: bool, print_json: Any, error_record: Any
) -> int:
    """``env build``: build the recipe the words mean, with uv's lines on stderr."""
    import logging

    from ._build import build_env

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    build_log = logging.getLogger("comfy_env.build")
    build_log.addHandler(handler)
    previous = build_log.level
    build_log.setLevel(logging.INFO)
    started = time.monotonic()
    try:
        path = build_env(recipe_from_words(words, python), retry_now=True)
    except EnvBuildError as exc:
        print(f"comfy-env env build: {exc}", file=sys.stderr)
        if as_json:
            record = error_record(exc)
            record.update(
                stage=exc.stage,
                requirements=list(exc.requirements),
                uv_message=exc.uv_message,
                log_path=exc.log_path,
                key=exc.key,
            )
            print_json({"ok": False, "error": record})
        return 1
    finally:
        build_log.removeHandler(handler)
        build_log.setLevel(previous)
    if as_json:
        print_json(
            {
                "ok": True,
                "key": path.name,
                "path": str(path),
                "seconds": round(time.monotonic() - started, 3),
            }
        )
    else:
        print(path)
    return 0


def _env_list(as_json: bool, print_json: Any) -> int:
    """``env list``: one line (or JSON record) per built env."""
    from . import _envstore
    from ._build import env_root

    envs = _envstore.list_envs()
    if as_json:
        print_json({"root": str(env_root()), "envs": [e.as_json() for e in envs]})
        return 0
    if not envs:
        print(f"no built envs under {env_root()}")
        return 0
    for e in envs:
        users = ", ".join(map(str, e.in_use_by)) or "-"
        print(
            f"{e.key}  {e.name or '-'}  Python {e.python or '?'}  {_mib(e.size_bytes)}  "
            f"last used {_when(e.last_used)}  in use by {users}"
        )
    return 0


def _env_gc(older_than: float, dry_run: bool, as_json: bool, print_json: Any) -> int:
    """``env gc``: remove envs unused for ``older_than`` days; 2 for a negative (or NaN) age."""
    from . import _envstore

    if not older_than >= 0:
        print("comfy-env env gc: --older-than must be 0 or more days", file=sys.stderr)
        return 2
    report = _envstore.gc(older_than, dry_run=dry_run)
    if as_json:
        print_json(
            {
                "dry_run": dry_run,
                "removed": list(report.removed),
                "kept_in_use": list(report.kept_in_use),
                "stale_builds": list(report.stale_builds),
                "freed_bytes": report.freed_bytes,
            }
        )
        return 0
    verb = "would remove" if dry_run else "removed"
    print(f"{verb} {len(report.removed)} envs ({_mib(report.freed_bytes)})")
    for key in report.removed:
        print(f"  {key}")
    for key in report.kept_in_use:
        print(f"kept {key}: in use by a live host")
    for name in report.stale_builds:
        print(f"{verb} a dead builder's directory {name}")
    return 0


def _env_rm(key: str, as_json: bool, print_json: Any, error_record: Any) -> int:
    """``env rm``: remove one env; 1 (with the error) when there is none by that key or a live
    host uses it."""
    from . import _envstore
    from ._errors import EnvError

    try:
        removed = _envstore.remove_env(key)
    except EnvError as exc:
        print(f"comfy-env env rm: {exc}", file=sys.stderr)
        if as_json:
            print_json({"ok": False, "error": error_record(exc)})
        return 1
    if as_json:
        print_json({"ok": True, "removed": removed.as_json()})
    else:
        print(f"removed {removed.key} ({_mib(removed.size_bytes)})")
    return 0
