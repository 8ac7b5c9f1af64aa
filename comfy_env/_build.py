"""Building a recipe into an env with uv: found, locked, installed, published atomically.

Data flow of ``build_env(recipe)``::

    find_python(recipe.python)      uv's discovery (system interpreters only, never a
        |                           download), then the pyenv / PATH folders uv skips behind a
        |                           shim; the interpreter is probed once for its version,
        v                           implementation and platform
    key = recipe.key(probe)         the content key; the env is <root>/envs/<key>/
        |
        +-- <root>/envs/<key>/comfy-env-env.json exists?  -> done (the fast path: one stat)
        |
    failure record younger than RETRY_AFTER?  -> EnvBuildError("retry-later") at once
        |
    flock(<root>/locks/<key>.lock)  one builder per key across threads, processes and servers;
        |                           the others wait (and log that they do), then find it built
        v
    <root>/envs/<key>.tmp-<pid>-<rand>/       (stale ones of dead builders removed first)
        uv venv --relocatable                  scripts and entry points use relative paths
        uv pip compile --generate-hashes       -> env.lock  (or the recipe's shipped lock, as is)
        uv pip sync --require-hashes env.lock  exactly the lock, nothing else
        comfy-env-env.json                     the record; its presence means "complete"
        |
    os.rename(tmp, <root>/envs/<key>)         atomic on one volume: nobody sees half an env
    <key>/bin/python -c sys.prefix            checked after the rename: it runs, and knows
                                              where it lives

Why a temporary directory and a rename (and not a build in place plus a marker): a reader
that never takes the lock (``get_worker`` on the fast path, a user passing the directory
itself) can only ever see a complete env or none. Venvs embed absolute paths (activation
scripts, console-script shebangs); ``uv venv --relocatable`` makes those relative, and
``pyvenv.cfg`` names only the base interpreter's folder, so the renamed env works; the
post-rename check proves it on every build (a failure removes the env and raises ``verify``).

Crash safety: a builder killed at any point leaves at most a ``<key>.tmp-*`` directory (never
a published env), a lock file whose flock died with it, and its running uv, which carries the
builder's host mark (``COMFY_ENV_HOST_ID``) and so is killed by the next sweep, as a dead
host's workers are. The next builder of that key
removes the temporary directories under the lock; ``comfy-env env gc`` removes those of keys
nobody holds. A failed build writes ``<root>/failures/<key>.json``; the next use within
``RETRY_AFTER`` seconds raises the same error (saying when it retries) instead of hitting the
index again, so a ComfyUI server does not rebuild on every prompt.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ._errors import EnvBuildError
from ._identity import HOST_ID_VAR, host_id
from ._recipe import Recipe, requirement_name

log = logging.getLogger("comfy_env.build")

# Seconds a failed recipe is not rebuilt for (each use meanwhile raises the recorded error).
RETRY_AFTER = 60.0
# The record a published env holds; its presence means the env is complete.
RECORD_NAME = "comfy-env-env.json"
LOCK_NAME = "env.lock"
TMP_MARK = ".tmp-"

_PROBE = (
    "import json,platform,sys;print(json.dumps({'implementation':sys.implementation.name,"
    "'version':platform.python_version(),'platform':sys.platform,'machine':platform.machine()}))"
)

_probes: dict[tuple[str, int], dict[str, str]] = {}
_found: dict[str | None, str] = {}
_built: dict[tuple[Recipe, str], Path] = {}
_memo_lock = threading.Lock()


# ---- where envs live ---------------------------------------------------------------------


def env_root() -> Path:
    """The root all built envs live under: ``$COMFY_ENV_HOME``, else
    ``$XDG_CACHE_HOME/comfy-env/envs`` (``~/.cache/comfy-env/envs``)."""
    home = os.environ.get("COMFY_ENV_HOME")
    if home:
        return Path(os.path.abspath(os.path.expanduser(home)))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "comfy-env" / "envs"


def _subdir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True, mode=0o755)
    return path


def uv_bin() -> str:
    """The uv binary of the ``uv`` package (a dependency of comfy-env)."""
    try:
        from uv import find_uv_bin
    except ImportError:
        raise EnvBuildError(
            "building envs needs the uv package (pip install uv), a dependency of comfy-env",
            stage="find-python",
        ) from None
    return str(find_uv_bin())


def _uv_cache_dir() -> str:
    explicit = os.environ.get("UV_CACHE_DIR")
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "uv")


def _uv_environ(root: Path) -> dict[str, str]:
    environ = dict(os.environ)
    environ["UV_PYTHON_DOWNLOADS"] = "never"  # never fetch an interpreter behind the user
    environ["UV_NO_PROGRESS"] = "1"
    environ["NO_COLOR"] = "1"
    environ.pop("VIRTUAL_ENV", None)  # --python names the target; an active venv must not
    # Marked as this host's, like its workers: if the builder is SIGKILLed, its uv (now an
    # orphan, writing only into the dead builder's temporary directory) is killed by the host
    # watcher or the next sweep (``_sweep``), which kill what a proven-dead host launched.
    environ[HOST_ID_VAR] = host_id()
    if "UV_LINK_MODE" not in environ:
        # Hardlinks from uv's cache share one copy of a package's files between every env
        # holding it; they need the cache and the envs on one volume. Said explicitly so that
        # a copy (two volumes) is chosen quietly instead of after a failed link and a warning.
        environ["UV_LINK_MODE"] = "hardlink" if _same_volume(_uv_cache_dir(), root) else "copy"
    return environ


def _same_volume(a: str | Path, b: str | Path) -> bool:
    def device(path: str | Path) -> int | None:
        probe = Path(path)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:
            return probe.stat().st_dev
        except OSError:
            return None

    da, db = device(a), device(b)
    return da is not None and da == db


# ---- finding the interpreter ---------------------------------------------------------------


def _probe(python: str) -> dict[str, str] | None:
    try:
        mtime = os.stat(python).st_mtime_ns
    except OSError:
        return None
    cached = _probes.get((python, mtime))
    if cached is not None:
        return cached
    try:
        out = subprocess.run(
            [python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        info = {str(k): str(v) for k, v in json.loads(out).items()}
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    _probes[(python, mtime)] = info
    return info


def _matches(version: str, request: str) -> bool:
    return version.split(".")[: len(request.split("."))] == request.split(".")


def _candidates(request: str) -> list[str]:
    """Interpreters of version ``request`` that uv's discovery may miss: pyenv's versions
    (uv stops at a pyenv shim that does not answer) and PATH entries outside shim folders."""
    minor = ".".join(request.split(".")[:2])
    found: list[str] = []
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    with contextlib.suppress(OSError):
        for version in sorted(os.listdir(pyenv), reverse=True):
            if _matches(version, request):
                found.append(str(pyenv / version / "bin" / f"python{minor}"))
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if folder and "shims" not in Path(folder).parts:
            found.append(os.path.join(folder, f"python{minor}"))
    return [path for path in found if os.access(path, os.X_OK)]


def find_python(request: str | None, root: Path | None = None) -> tuple[str, dict[str, str]]:
    """An installed interpreter for ``request`` (``"3.12"``; None: the host's own base
    interpreter) and its probe. Never downloads one. ``EnvBuildError("find-python")`` names
    what was looked for."""
    if request is None:
        base = getattr(sys, "_base_executable", None) or sys.executable
        path = os.path.realpath(base)
        if os.access(path, os.X_OK):
            # The host's own interpreter: what a probe would print is known here, without
            # starting it (a fresh process reusing a built env pays one stat, not a launch).
            import platform

            return path, {
                "implementation": sys.implementation.name,
                "version": platform.python_version(),
                "platform": sys.platform,
                "machine": platform.machine(),
            }
        request = f"{sys.version_info.major}.{sys.version_info.minor}"
    cached = _found.get(request)
    if cached is not None:
        info = _probe(cached)
        if info is not None:
            return cached, info
    tried: list[str] = []
    uv_said = ""
    try:
        result = subprocess.run(
            [uv_bin(), "python", "find", "--system", "--python-preference", "only-system", request],
            capture_output=True,
            text=True,
            timeout=120,
            env=_uv_environ(root or env_root()),
        )
        if result.returncode == 0 and result.stdout.strip():
            tried.append(result.stdout.strip())
        else:
            uv_said = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    except (OSError, subprocess.SubprocessError) as exc:
        uv_said = str(exc)
    tried.extend(_candidates(request))
    for path in dict.fromkeys(tried):
        info = _probe(path)
        if info is not None and _matches(info["version"], request):
            _found[request] = path
            return path, info
    raise EnvBuildError(
        f"comfy-env: no installed Python {request} found to build the env with (looked with "
        f"uv's discovery of system interpreters, downloads disabled"
        + (f": {uv_said}" if uv_said else "")
        + (f"; also tried {', '.join(tried)}" if tried else "")
        + f"). Install Python {request} (or pass another python=...)",
        stage="find-python",
        uv_message=uv_said,
    )


# ---- the lock per key ---------------------------------------------------------------------


@contextlib.contextmanager
def key_lock(root: Path, key: str, what: str) -> Iterator[None]:
    """Hold ``<root>/locks/<key>.lock`` (flock: released by the kernel if we die). A waiter
    logs who holds it."""
    path = _subdir(root, "locks") / f"{key}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            log.info(
                "comfy-env: env %s (%s) is being built by another builder (pid %s); waiting",
                key,
                what,
                holder,
            )
            started = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            log.info(
                "comfy-env: env %s: the other builder finished after %.1f s",
                key,
                time.monotonic() - started,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # (closing releases the flock)


def lock_is_free(root: Path, key: str) -> bool:
    """Whether nobody builds ``key`` now (its flock can be taken at once)."""
    path = root / "locks" / f"{key}.lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


# ---- failure records ----------------------------------------------------------------------


def _failure_path(root: Path, key: str) -> Path:
    return root / "failures" / f"{key}.json"


def _recorded_failure(root: Path, key: str) -> EnvBuildError | None:
    """The recorded failure of ``key`` if it is younger than ``RETRY_AFTER``."""
    try:
        record = json.loads(_failure_path(root, key).read_text())
        at = float(record["at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    retry_at = at + RETRY_AFTER
    now = time.time()
    if not at <= now < retry_at:
        return None
    when = time.strftime("%H:%M:%S", time.localtime(retry_at))
    return EnvBuildError(
        f"{record.get('message', 'the build failed')}\n(this recipe failed "
        f"{now - at:.0f} s ago; it is built again at the next use after {when}, in "
        f"{retry_at - now:.0f} s)",
        stage=str(record.get("stage", "retry-later")),
        requirements=tuple(record.get("requirements", ())),
        uv_message=str(record.get("uv_message", "")),
        log_path=record.get("log_path"),
        key=key,
        retry_at=retry_at,
    )


def _record_failure(root: Path, key: str, error: EnvBuildError) -> None:
    record = {
        "at": time.time(),
        "message": str(error),
        "stage": error.stage,
        "requirements": list(error.requirements),
        "uv_message": error.uv_message,
        "log_path": error.log_path,
    }
    path = _subdir(root, "failures") / f"{key}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)


# ---- running uv ---------------------------------------------------------------------------


class _UvFailed(Exception):
    def __init__(self, output: list[str]) -> None:
        super().__init__("uv failed")
        self.output = output


def _run_uv(
    args: Sequence[str], environ: dict[str, str], logfile: Any, cwd: Path | None = None
) -> list[str]:
    """Run uv, streaming its lines to the build logger and the log file; its output, or
    ``_UvFailed`` with it. Never leaves the process behind (killed if we are interrupted)."""
    command = [uv_bin(), *args]
    logfile.write(f"$ {' '.join(command)}\n")
    output: list[str] = []
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=environ,
        cwd=cwd,
    ) as process:
        try:
            assert process.stdout is not None
            for line in process.stdout:
                line = line.rstrip("\n")
                output.append(line)
                logfile.write(line + "\n")
                if line.strip():
                    log.info("uv: %s", line)
            code = process.wait()
        except BaseException:
            process.kill()
            process.wait()
            raise
    logfile.flush()
    if code != 0:
        raise _UvFailed(output)
    return output


def _index_args(recipe: Recipe, route: Path | None = None) -> list[str]:
    args: list[str] = []
    if route is not None:
        # First: uv tries extra indexes before the default one, earlier ones first, and (index
        # strategy "first-index") takes a package from the first index that has it. The route
        # index holds only the routed packages, so those come from the second index and
        # nothing else does.
        args += ["--extra-index-url", route.as_uri()]
    if recipe.index_url:
        args += ["--index-url", recipe.index_url]
    for url in recipe.extra_index_urls:
        args += ["--extra-index-url", url]
    return args


_HREF = re.compile(r"""<a\s[^>]*href\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def write_route_index(recipe: Recipe, where: Path) -> Path | None:
    """The ``cuda_wheels`` routing as a local PEP 503 index: for each routed package, the
    links of its page on the second index (``<index_url>/<name>/``, or the page
    ``package_map`` names), absolute and with their ``#sha256=`` fragments, under the
    package's own normalised name. uv then locks those wheels with their hashes (uv does not
    hash ``--find-links`` wheels, so a flat link page would not do), and a package
    ``package_map`` renames is still found under its real name."""
    wheels = recipe.cuda_wheels
    if wheels is None or not wheels.packages:
        return None
    import urllib.parse
    import urllib.request

    root = where / "route-index"
    for package in wheels.packages:
        links: list[str] = []
        tried: list[str] = []
        for page in wheels.pages(package):
            tried.append(page)
            try:
                with urllib.request.urlopen(page, timeout=60) as response:
                    html = response.read().decode("utf-8", "replace")
            except (OSError, ValueError) as exc:
                log.info("comfy-env: cuda_wheels page %s: %s", page, exc)
                continue
            links += [urllib.parse.urljoin(page, href) for href in _HREF.findall(html)]
        if not links:
            raise EnvBuildError(
                f"comfy-env: no wheels of {package} found on the cuda_wheels index (tried "
                f"{', '.join(tried)})",
                stage="resolve",
                requirements=(package,),
            )
        folder = root / package
        folder.mkdir(parents=True, exist_ok=True)
        body = "".join(
            f'<a href="{link}">{urllib.parse.unquote(link.split("#")[0].rsplit("/", 1)[-1])}</a>\n'
            for link in links
        )
        (folder / "index.html").write_text(f"<!DOCTYPE html><html><body>{body}</body></html>\n")
    return root


def _uv_error(output: list[str]) -> str:
    """uv's own message: from its first error line to the end, without the trace noise."""
    for i, line in enumerate(output):
        if line.lstrip().startswith(("error:", "\u00d7", "x ")):  # (uv's fancy "x")
            return "\n".join(output[i:]).strip()
    return "\n".join(output[-20:]).strip()


def _blamed(recipe: Recipe, message: str) -> tuple[str, ...]:
    names = {requirement_name(r) for r in recipe.requirements} - {None}
    text = message.lower().replace("_", "-")
    return tuple(
        sorted(n for n in names if n and re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text))
    )


def _sync_stage(message: str) -> str:
    lowered = message.lower()
    if any(
        what in lowered
        for what in ("failed to download", "failed to fetch", "network", "hash mismatch")
    ):
        # (a hash mismatch: what was downloaded is not what the lock names)
        return "download"
    return "install"


# ---- building -----------------------------------------------------------------------------


def dir_size(path: Path) -> int:
    total = 0
    seen: set[tuple[int, int]] = set()
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                if (st.st_dev, st.st_ino) not in seen:  # a hardlinked file counts once
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def _remove_stale_tmp(envs: Path, key: str) -> None:
    """Under ``key``'s lock: remove temporary directories of earlier (dead) builders."""
    with contextlib.suppress(OSError):
        for name in os.listdir(envs):
            if name.startswith(key + TMP_MARK):
                log.info("comfy-env: removing %s left by a builder that died", envs / name)
                shutil.rmtree(envs / name, ignore_errors=True)


def read_record(env_dir: Path) -> dict[str, Any] | None:
    """The record of a published env, or None (not an env comfy-env built, or not complete)."""
    try:
        record = json.loads((env_dir / RECORD_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def build_env(
    recipe: Recipe, *, root: str | os.PathLike[str] | None = None, retry_now: bool = False
) -> Path:
    """Build ``recipe`` into an env (once: an env already built is returned at once) and
    return its directory. Safe to call from many threads and processes at once: one builds,
    the others wait for it. ``root``: where envs live (default ``env_root()``).
    ``retry_now``: build even if the same recipe failed less than ``RETRY_AFTER`` seconds
    ago (the CLI's ``env build`` does). Raises ``EnvBuildError``."""
    if not isinstance(recipe, Recipe):
        raise EnvBuildError(
            f"build_env needs a comfy_env.Recipe, not {type(recipe).__name__}", stage="recipe"
        )
    base = Path(os.path.abspath(os.fspath(root))) if root is not None else env_root()
    memo = (recipe, str(base))
    with _memo_lock:
        known = _built.get(memo)
    if known is not None and (known / RECORD_NAME).is_file():
        _touch_use(base, known.name)
        return known
    python, info = find_python(recipe.python, base)
    key = recipe.key(info)
    envs = _subdir(base, "envs")
    final = envs / key
    if (final / RECORD_NAME).is_file():
        _remember(memo, final, base)
        return final
    if not retry_now:
        failed = _recorded_failure(base, key)
        if failed is not None:
            raise failed
    with key_lock(base, key, recipe.describe()):
        if (final / RECORD_NAME).is_file():  # another builder published it while we waited
            _remember(memo, final, base)
            return final
        failed = _recorded_failure(base, key)
        if failed is not None and not retry_now:
            # Another builder failed it while we waited: its error, not a second try.
            raise failed
        _remove_stale_tmp(envs, key)
        if final.exists():
            # Not a complete env (no record) at the published name: nothing of ours puts one
            # there (the record goes in before the rename), so it is a leftover; move it away.
            shutil.rmtree(final, ignore_errors=True)
        try:
            _build(recipe, python, info, base, final)
        except EnvBuildError as exc:
            _record_failure(base, key, exc)
            raise
    _remember(memo, final, base)
    return final


def _remember(memo: tuple[Recipe, str], final: Path, base: Path) -> None:
    with _memo_lock:
        _built[memo] = final
    _touch_use(base, final.name)


def _touch_use(base: Path, key: str) -> None:
    record_use(base, key)


# Seconds between two last-use writes of one env by one process.
USE_RECORD_INTERVAL = 60.0
_last_recorded: dict[tuple[str, str], float] = {}


def record_use(root: Path, key: str) -> None:
    """Note that ``key``'s env is used now (throttled; never raises)."""
    now = time.monotonic()
    memo = (str(root), key)
    last = _last_recorded.get(memo)
    if last is not None and now - last < USE_RECORD_INTERVAL:
        return
    _last_recorded[memo] = now
    with contextlib.suppress(OSError):
        used = root / "used"
        used.mkdir(parents=True, exist_ok=True)
        path = used / key
        path.touch()
        os.utime(path)


def _build(recipe: Recipe, python: str, info: dict[str, str], base: Path, final: Path) -> None:
    """Build ``recipe``'s env with the interpreter ``python`` (``info``: its facts) into a
    temporary directory beside ``final`` (``<base>/envs/<key>``) and rename it into place;
    its log under ``<base>/logs``. Fails with ``EnvBuildError`` naming the stage, leaving
    nothing behind."""
    started = time.monotonic()
    key = final.name
    tmp = final.parent / f"{key}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    log_path = _subdir(base, "logs") / f"{key}.log"
    label = recipe.describe()
    log.info(
        "comfy-env: building env %s (%s) with Python %s at %s", key, label, info["version"], final
    )
    stage = "find-python"

    def fail(output: list[str], what: str) -> EnvBuildError:
        message = _uv_error(output)
        blamed = _blamed(recipe, message)
        return EnvBuildError(
            f"comfy-env: could not build env {key} ({label}): {what} failed"
            + (f" for {', '.join(blamed)}" if blamed else "")
            + f"; uv said:\n{message}\n(full log: {log_path})",
            stage=what,
            requirements=blamed,
            uv_message=message,
            log_path=str(log_path),
            key=key,
            env=str(final),
        )

    try:
        with open(log_path, "w", encoding="utf-8") as logfile:
            logfile.write(f"comfy-env build of {key} ({label}) at {time.ctime()}\n")
            run = functools.partial(_run_uv, environ=_uv_environ(base), logfile=logfile)
            try:
                run(["venv", "--relocatable", "--no-project", "--python", python, str(tmp)])
                stage = "resolve"
                route = write_route_index(recipe, tmp / ".comfy-env-build")
                lock = _lock(recipe, tmp, route, run, key)
                stage = "install"
                _sync(recipe, tmp, route, lock, run)
                shutil.rmtree(tmp / ".comfy-env-build", ignore_errors=True)
            except _UvFailed as exc:
                what = _sync_stage(_uv_error(exc.output)) if stage == "install" else stage
                raise fail(exc.output, what) from None
            seconds = time.monotonic() - started
            _commit(tmp, final, _record(recipe, key, info, python, seconds))
    except EnvBuildError as exc:  # (the route index's): tell where and which env
        shutil.rmtree(tmp, ignore_errors=True)
        exc.key = exc.key or key
        exc.log_path = exc.log_path or str(log_path)
        raise
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise EnvBuildError(
            f"comfy-env: could not build env {key} ({label}): {exc}",
            stage=stage,
            log_path=str(log_path),
            key=key,
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _verify(final, key, label, log_path)
    with contextlib.suppress(OSError):
        _failure_path(base, key).unlink()
    log.info(
        "comfy-env: built env %s (%s) in %.1f s, %.1f MiB on disk (hardlinked files count once)",
        key,
        label,
        time.monotonic() - started,
        dir_size(final) / 2**20,
    )


def _lock(
    recipe: Recipe, tmp: Path, route: Path | None, run: Callable[..., list[str]], key: str
) -> Path:
    """The env's lock in ``tmp``: the one the recipe ships, copied as is, or the recipe
    resolved by ``uv pip compile`` with hashes (``run``: ``_run_uv`` bound to the build)."""
    lock = tmp / LOCK_NAME
    if recipe.lock is not None:
        shutil.copyfile(recipe.lock, lock)
        log.info("comfy-env: installing the shipped lock %s as is", recipe.lock)
        return lock
    source = tmp / "comfy-env-requirements.in"
    source.write_text("\n".join(recipe.requirements) + "\n")
    # Quiet (the lock is written to the file, not echoed line by line into the log) and run
    # in the temporary directory, so that the lock's "# via -r" notes name the input file,
    # not a path that is gone.
    run(
        [
            "pip",
            "compile",
            "--quiet",
            "--generate-hashes",
            "--no-header",
            "--python",
            str(tmp / "bin" / "python"),
            *_index_args(recipe, route),
            source.name,
            "-o",
            LOCK_NAME,
        ],
        cwd=tmp,
    )
    source.unlink()
    pins = lock.read_text(errors="replace").count("==")
    log.info("comfy-env: env %s: resolved %d packages, locked with hashes", key, pins)
    return lock


def _sync(
    recipe: Recipe, tmp: Path, route: Path | None, lock: Path, run: Callable[..., list[str]]
) -> None:
    """Install exactly the lock into ``tmp`` (``uv pip sync``), its hashes required when it
    has them (a shipped lock may not)."""
    hashed = "--hash=" in lock.read_text(errors="replace")
    run(
        [
            "pip",
            "sync",
            "--python",
            str(tmp / "bin" / "python"),
            *_index_args(recipe, route),
            *(["--require-hashes"] if hashed else []),
            str(lock),
        ]
    )


def _record(
    recipe: Recipe, key: str, info: dict[str, str], python: str, seconds: float
) -> dict[str, Any]:
    """What ``read_record`` gives back of a built env (``RECORD_NAME``)."""
    return {
        "key": key,
        "recipe": recipe.as_json(),
        "interpreter": info,
        "base_python": python,
        "created": time.time(),
        "build_seconds": round(seconds, 3),
        "comfy_env_version": _version(),
    }


def _commit(tmp: Path, final: Path, record: dict[str, Any]) -> None:
    """Write the env's record, synced to disk, then rename the finished env into place (and
    sync its directory): no one ever sees a half-built env under ``final``."""
    with open(tmp / RECORD_NAME, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def _verify(final: Path, key: str, label: str, log_path: Path) -> None:
    """The published env runs and knows where it lives (it was built at another path)."""
    python = final / "bin" / "python"
    try:
        out = subprocess.run(
            [str(python), "-c", "import sys; print(sys.prefix)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        ok = out.returncode == 0 and os.path.realpath(out.stdout.strip()) == os.path.realpath(final)
        said = (out.stdout + out.stderr).strip()
    except (OSError, subprocess.SubprocessError) as exc:
        ok, said = False, str(exc)
    if not ok:
        shutil.rmtree(final, ignore_errors=True)
        raise EnvBuildError(
            f"comfy-env: env {key} ({label}) was built but its interpreter does not run from "
            f"{final} (said: {said!r}); it was removed (full log: {log_path})",
            stage="verify",
            log_path=str(log_path),
            key=key,
        )


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _version() -> str:
    from . import __version__

    return __version__
