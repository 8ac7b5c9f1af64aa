"""Activation: the variables activating an env would set, given to its workers.

A worker is launched as the env's interpreter, directly; nothing sources the env's activation.
Native libraries of conda and pixi envs rely on it (OpenCASCADE's ``CASROOT`` and ``CSF_*``,
``GDAL_DATA``, ``PROJ_DATA``, set by ``etc/conda/activate.d/*.sh``), and so does code that runs
the env's binaries through ``PATH`` (``ninja``, ``ffmpeg``, ``shutil.which``) or reads
``VIRTUAL_ENV`` / ``CONDA_PREFIX``. This module works out those variables, once per env and
host process.

Data flow::

    pool._spawn (the spawning caller's thread, before the worker's start-up deadline begins;
                 never on a warm call: only a spawn gets here)
      activation_for(spec, base, timeout)
        _env_prefix(spec)         None for the current interpreter (env=None) and for an
                                  interpreter outside any env directory: nothing to do
        _fingerprint(prefix)      (path, mtime, size) of the scripts and conda-meta/state
        _cache[prefix]            same fingerprint: the result, no script runs (respawns, later
                                  pools); else computed under the env's lock (one run at a
                                  time per env: parallel spawns wait for it)
          venv (pyvenv.cfg)       VIRTUAL_ENV=<env>, the interpreter's directory first on PATH
          conda / pixi env        CONDA_PREFIX=<env>, <env>/bin first on PATH, the env_vars
                                  of conda-meta/state, then the activate.d scripts sourced in
                                  sorted order in one shell (``_run_scripts``)
      -> Activation(variables, path_prefix, path)
    backend: local  worker_environment(): host environment minus the stripped Python
                    variables, Activation.apply(), PoolConfig.env_vars (wins), the host id
             ray    the same variables in the actor's CONFIG (the runtime applies them)

The scripts run once, in ``bash`` (else ``sh``), with the worker's base environment plus
``CONDA_PREFIX``, ``PATH`` and the state's variables (conda exports those before it sources
the scripts, so a script sees and may override them), stdin ``/dev/null``, in a session of
their own, bounded by ``start_timeout``. Their stdout goes to their stderr; after each script
the shell writes a marker and the whole environment (``env -0``) to a private temporary file,
so a script that hangs, or that ends the shell (``exit``), still leaves the exports of the
scripts before it. What the worker gets is what changed or was added relative to the base
environment (shell bookkeeping such as ``SHLVL`` and ``_`` aside); a variable a script unsets
stays as the host has it.

A script *fails* when it returns a non-zero status, ends the shell, or does not finish within
the timeout. Each failure is one WARNING on the ``comfy_env`` logger, once per host process
(the result is cached), naming the script and its last lines of stderr. The worker then gets
what the shell held after the last script that ran to its end: a script returning non-zero
keeps its exports and the later scripts still run (conda ignores the status too); a script
that ended the shell or timed out loses its own exports and those of every later script.

``PATH`` is kept relative: when the scripts only put entries in front of the base ``PATH``
(the usual case), those entries go in front of the worker's ``PATH`` at each spawn, so a host
that changes its ``PATH`` later is followed; a script that rewrote it otherwise gives its
value as is.

Races: two pools, or two slots of one env, spawning at once: the env's lock lets one run the
scripts and the other take the cached result. A script edited while the host runs: a new
fingerprint, so the next spawn runs the scripts again. A fork while a thread holds a lock:
the child gets fresh locks (``os.register_at_fork``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path

from ._envs import EnvSpec, env_kind
from ._values import value

# Imported where used (json, shlex, tempfile): this module is loaded at a non-current env's
# first spawn, and they cost milliseconds a fresh host need not pay for a venv.

_log = logging.getLogger("comfy_env")

# Variables the shell itself sets or changes; they say nothing about the env.
_SHELL_VARIABLES = frozenset({"_", "SHLVL", "PWD", "OLDPWD"})
# Marks each environment dump in the scripts' output: ``\x1e<index>\0`` then ``env -0``.
_DUMP_MARK = "\x1e"
# Lines and characters of a failing script's stderr quoted in its warning.
_TAIL_LINES = 10
_TAIL_CHARS = 2000


@value
class Activation:
    """What activating one env sets. ``variables`` are set as they are; ``path_prefix`` goes in
    front of the worker's ``PATH``; ``path`` (when not None) replaces ``PATH`` (a script
    rewrote it rather than prepending). ``failures`` are the warnings logged for it."""

    prefix: str
    kind: str  # "venv", "conda" or "pixi"
    variables: dict[str, str]
    path_prefix: tuple[str, ...] = ()
    path: str | None = None
    scripts: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()

    def apply(self, env: dict[str, str]) -> None:
        """Set these variables in ``env`` (a worker's environment, without env_vars yet)."""
        env.update(self.variables)
        if self.path is not None:
            env["PATH"] = self.path
        elif self.path_prefix:
            env["PATH"] = _join_path(self.path_prefix, env.get("PATH", ""))

    def for_config(self) -> dict[str, object]:
        """The form a worker runtime applies itself (the Ray backend's CONFIG): its own
        ``PATH`` is prefixed there, not the host's."""
        return {
            "env": dict(self.variables),
            "path_prefix": list(self.path_prefix),
            "path": self.path,
        }

    def summary(self) -> dict[str, object]:
        """What ``comfy-env doctor`` shows."""
        return {
            "kind": self.kind,
            "prefix": self.prefix,
            "path_prefix": list(self.path_prefix),
            "variables": dict(sorted(self.variables.items())),
            "scripts": list(self.scripts),
            "failures": list(self.failures),
        }


def _join_path(prefix: tuple[str, ...] | list[str], path: str) -> str:
    return os.pathsep.join([*prefix, path] if path else prefix)


# Env directory -> (fingerprint of its scripts and state file, its activation).
_cache: dict[str, tuple[tuple[tuple[str, int, int], ...], Activation]] = {}
_cache_lock = threading.Lock()
_env_locks: dict[str, threading.Lock] = {}


def _reset_locks_in_child() -> None:
    global _cache_lock
    _cache_lock = threading.Lock()
    _env_locks.clear()


os.register_at_fork(after_in_child=_reset_locks_in_child)


def activation_for(spec: EnvSpec, base: Mapping[str, str], timeout: float) -> Activation | None:
    """The activation of ``spec``'s env, or None where there is none to do (the current
    interpreter, an interpreter outside any env directory). ``base`` is the worker's
    environment before activation (the scripts run with it); ``timeout`` bounds them.
    Cached per env directory: scripts run again only when they or the state file change."""
    found = _env_prefix(spec)
    if found is None:
        return None
    prefix, kind = found
    if kind == "venv":  # nothing to run, nothing to cache
        return Activation(
            prefix=prefix,
            kind=kind,
            variables={"VIRTUAL_ENV": prefix},
            path_prefix=(os.path.dirname(spec.interpreter),),
        )
    with _cache_lock:
        lock = _env_locks.setdefault(prefix, threading.Lock())
    with lock:
        fingerprint = _fingerprint(prefix)
        cached = _cache.get(prefix)
        if cached is not None and cached[0] == fingerprint:
            return cached[1]
        activation = _activate_conda(prefix, kind, base, timeout)
        _cache[prefix] = (fingerprint, activation)
        return activation


def forget() -> None:
    """Drop every cached activation (tests; a host that wants the scripts run again)."""
    with _cache_lock:
        _cache.clear()


def _env_prefix(spec: EnvSpec) -> tuple[str, str] | None:
    """The env directory to activate and its kind, from the interpreter's place: the parent of
    its ``bin`` when that is a venv, conda or pixi env. Kept unresolved, as the key."""
    if spec.is_current:
        return None
    interpreter = Path(spec.interpreter)
    if interpreter.parent.name != "bin":
        return None
    prefix = interpreter.parent.parent
    kind = env_kind(prefix)
    return None if kind is None else (str(prefix), kind)


def _scripts(prefix: str) -> list[str]:
    folder = os.path.join(prefix, "etc", "conda", "activate.d")
    try:
        names = sorted(os.listdir(folder))  # the order conda sources them in
    except OSError:
        return []
    return [os.path.join(folder, name) for name in names if name.endswith(".sh")]


def _state_file(prefix: str) -> str:
    return os.path.join(prefix, "conda-meta", "state")


def _fingerprint(prefix: str) -> tuple[tuple[str, int, int], ...]:
    marks = []
    for path in [*_scripts(prefix), _state_file(prefix)]:
        try:
            st = os.stat(path)
        except OSError:
            continue
        marks.append((path, st.st_mtime_ns, st.st_size))
    return tuple(marks)


def _state_variables(prefix: str) -> tuple[dict[str, str], str | None]:
    """``conda env config vars set``'s variables (``conda-meta/state``'s ``env_vars``), and a
    failure note when the file exists but cannot be read as such."""
    path = _state_file(prefix)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError) as exc:
        return {}, f"{path} cannot be read ({exc}); its env_vars are not set"
    import json  # only for an env that has the file

    try:
        state = json.loads(text)
    except ValueError as exc:
        return {}, f"{path} is not readable JSON ({exc}); its env_vars are not set"
    found = state.get("env_vars") if isinstance(state, dict) else None
    if not isinstance(found, dict):
        return {}, None
    # What execve cannot take (an empty name, "=" in a name, a NUL anywhere) is left out, as
    # PoolConfig.env_vars refuses it: the spawn would fail on it.
    return {
        str(k): str(v)
        for k, v in found.items()
        if k and "=" not in str(k) and "\0" not in str(k) and "\0" not in str(v)
    }, None


def _activate_conda(prefix: str, kind: str, base: Mapping[str, str], timeout: float) -> Activation:
    bin_dir = os.path.join(prefix, "bin")
    base_path = base.get("PATH", "")
    start = dict(base)
    start["CONDA_PREFIX"] = prefix
    start["PATH"] = _join_path([bin_dir], base_path)
    failures: list[str] = []
    state_vars, state_failure = _state_variables(prefix)
    if state_failure is not None:
        failures.append(state_failure)
        _log.warning("comfy-env: env %s: %s", prefix, state_failure)
    start.update(state_vars)
    scripts = _scripts(prefix)
    final = start
    if scripts:
        final, script_failures = _run_scripts(prefix, scripts, start, timeout)
        failures.extend(script_failures)
    variables = {
        k: v
        for k, v in final.items()
        if k not in _SHELL_VARIABLES and k != "PATH" and base.get(k) != v
    }
    final_path = final.get("PATH", "")
    path: str | None = None
    path_prefix: tuple[str, ...] = ()
    if not base_path:
        path_prefix = tuple(p for p in final_path.split(os.pathsep) if p)
    elif final_path == base_path:
        pass  # a script put PATH back as it was
    elif final_path.endswith(os.pathsep + base_path):
        head = final_path[: -len(base_path) - 1]
        path_prefix = tuple(head.split(os.pathsep))
    else:
        path = final_path
    return Activation(
        prefix=prefix,
        kind=kind,
        variables=variables,
        path_prefix=path_prefix,
        path=path,
        scripts=tuple(scripts),
        failures=tuple(failures),
    )


def _shell() -> str | None:
    return shutil.which("bash") or shutil.which("sh")


@value
class _ShellRun:
    """What the scripts' shell left: the environment dumped after each script, its stderr
    read into markers (``_parse_markers``), and how it ended."""

    shell: str
    dumps: dict[int, dict[str, str]]
    stderr: str
    begun: int | None  # the last script begun
    statuses: dict[int, int]  # each finished script's status
    texts: dict[int, str]  # what each script wrote on stderr
    returncode: int
    timed_out: bool


def _run_scripts(
    prefix: str, scripts: list[str], start: dict[str, str], timeout: float
) -> tuple[dict[str, str], list[str]]:
    """Source ``scripts`` in order in one shell started with ``start``; return the environment
    after the last script that ran to its end, and one warning per failing script."""
    shell = _shell()
    run = (
        "no POSIX shell (bash or sh) on PATH, so its activate.d scripts were not run"
        if shell is None
        else _run_shell(shell, scripts, start, timeout)
    )
    if isinstance(run, str):  # no shell ran: nothing of the scripts is set
        _log.warning("comfy-env: env %s: %s", prefix, run)
        return start, [run]
    failures = _script_failures(prefix, scripts, run, timeout)
    if not failures:
        unread = _unread_environment(prefix, run)
        if unread is not None:
            failures.append(unread)
    for message in failures:
        _log.warning("comfy-env: %s", message)
    last = max(run.dumps) if run.dumps else None
    return (run.dumps[last] if last is not None else start), failures


def _shell_program(scripts: list[str]) -> str:
    """The shell's program: each script sourced between markers on stderr, then a dump of
    the environment it left on stdout."""
    import shlex

    lines = []
    for index, script in enumerate(scripts):
        # The script's stdout joins its stderr: stdout carries only the dumps. ``$?`` is the
        # status of the ``.`` command, read before anything else runs.
        lines.append(f"printf '\\n{_DUMP_MARK}begin {index}\\n' >&2")
        lines.append(f". {shlex.quote(script)} >&2")
        lines.append(f"printf '\\n{_DUMP_MARK}end {index} %d\\n' \"$?\" >&2")
        lines.append(f"printf '{_DUMP_MARK}{index}\\0'; env -0")
    return "\n".join(lines)


def _run_shell(
    shell: str, scripts: list[str], start: dict[str, str], timeout: float
) -> _ShellRun | str:
    """Run ``scripts`` in ``shell`` with ``start`` as its environment, killed (with all it
    started) past ``timeout``; what it left, or why it could not be started."""
    import tempfile

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        timed_out = False
        try:
            # Own session: a timed-out script is killed with everything it started.
            proc = subprocess.Popen(
                [shell, "-c", _shell_program(scripts)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=start,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            return f"cannot run {shell} for its activate.d scripts: {exc}"
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        out.seek(0)
        dumps = _parse_dumps(out.read())
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
    begun, statuses, texts = _parse_markers(stderr)
    return _ShellRun(shell, dumps, stderr, begun, statuses, texts, proc.returncode, timed_out)


def _script_failures(prefix: str, scripts: list[str], run: _ShellRun, timeout: float) -> list[str]:
    """One message per failing script, in order: its status, its end of the shell or its
    timeout, and the end of what it wrote on stderr."""
    failures = []
    for index, script in enumerate(scripts):
        status = run.statuses.get(index)
        if status is not None and status == 0:
            continue
        if status is not None:
            why = f"returned status {status}; its exports are kept"
        elif index == run.begun and run.timed_out:
            why = (
                f"did not finish within {timeout:g}s (PoolConfig.start_timeout) and was "
                "killed; its exports and those of the scripts after it are not set"
            )
        elif index == run.begun:
            why = (
                f"ended the shell (exit status {run.returncode}); its exports and those of "
                "the scripts after it are not set"
            )
        else:
            continue  # never begun: an earlier script ended the shell
        tail = _tail(run.texts.get(index, ""))
        failures.append(
            f"activation script {script} of env {prefix} {why}"
            + (f"; its stderr ends with:\n{tail}" if tail else " (no output on stderr)")
        )
    return failures


def _unread_environment(prefix: str, run: _ShellRun) -> str | None:
    """The message for a run where no script failed, yet the shell's environment after them
    is missing: the shell did not start the scripts, or ``env -0`` did not work (a minimal
    ``env``). None when it is there."""
    finished = max(run.statuses) if run.statuses else None
    if finished is not None and finished in run.dumps:
        return None
    tail = _tail(run.stderr.replace(_DUMP_MARK, ""))
    return (
        f"the activate.d scripts of env {prefix} ran in {run.shell}, but the environment "
        f"they left could not be read (exit status {run.returncode}); their exports "
        "are not set" + (f"; stderr ends with:\n{tail}" if tail else "")
    )


def _parse_dumps(raw: bytes) -> dict[int, dict[str, str]]:
    """``{script index: environment after it}`` from ``\\x1e<index>\\0`` + ``env -0`` runs."""
    dumps: dict[int, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for item in raw.decode("utf-8", "surrogateescape").split("\0"):
        if item.startswith(_DUMP_MARK) and item[1:].isdigit():
            current = dumps.setdefault(int(item[1:]), {})
        elif current is not None and "=" in item:
            name, _, value = item.partition("=")
            if name:
                current[name] = value
    # An empty dump is an ``env -0`` that did not run (it always holds CONDA_PREFIX at least).
    return {index: dump for index, dump in dumps.items() if dump}


def _parse_markers(stderr: str) -> tuple[int | None, dict[int, int], dict[int, str]]:
    """From the shell's stderr: the last script begun, each finished script's status, and
    what each script wrote."""
    begun: int | None = None
    statuses: dict[int, int] = {}
    texts: dict[int, list[str]] = {}
    for line in stderr.split("\n"):
        if line.startswith(_DUMP_MARK):
            words = line[1:].split()
            if len(words) >= 2 and words[0] == "begin" and words[1].isdigit():
                begun = int(words[1])
                texts[begun] = []
                continue
            if len(words) == 3 and words[0] == "end" and words[1].isdigit():
                try:
                    statuses[int(words[1])] = int(words[2])
                except ValueError:
                    pass
                continue
        if begun is not None and begun not in statuses:
            texts[begun].append(line)
    return begun, statuses, {k: "\n".join(v).strip("\n") for k, v in texts.items()}


def _tail(text: str) -> str:
    lines = text.splitlines()[-_TAIL_LINES:]
    return "\n".join(lines)[-_TAIL_CHARS:]
