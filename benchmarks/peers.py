"""Install the peers into their own venvs (``python -m venv`` + pip), or say why they are not.

* ``benchmarks/.peers/venv``: loky, pebble, anyio (and numpy for the payload benchmark).
* ``benchmarks/.peers/old-comfy-env``: the published ``comfy-env==0.4.46``. It has our import
  name, so it can never share a venv with this checkout.

Both folders are git-ignored. A venv is reused when its stamp file matches the requested
packages and its import check passes; otherwise it is rebuilt (``--reinstall`` forces that).
Installation failing (no network, a build error) is not an error of the suite: the peer is
reported as "unavailable: reason" in the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from benchlib import BENCH_DIR, clean_env

PEERS_DIR = os.path.join(BENCH_DIR, ".peers")


@dataclass(frozen=True)
class VenvSpec:
    key: str
    path: str
    packages: tuple[str, ...]
    check: str  # python code that must run in the venv


SPECS: tuple[VenvSpec, ...] = (
    VenvSpec(
        "peers",
        os.path.join(PEERS_DIR, "venv"),
        ("loky", "pebble", "anyio", "numpy"),
        "import loky, pebble, anyio, numpy",
    ),
    VenvSpec(
        "old",
        os.path.join(PEERS_DIR, "old-comfy-env"),
        ("comfy-env==0.4.46",),
        "import comfy_env.isolation.workers.subprocess, numpy",
    ),
)

STAMP = ".bench-stamp"


def _python(spec: VenvSpec) -> str:
    return os.path.join(spec.path, "bin", "python")


def _tail(text: bytes | str, lines: int = 3) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    kept = [ln.strip() for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept) or "(no output)"


def _check(spec: VenvSpec, cwd: str) -> str | None:
    """None if the venv's import check passes, else why not. Runs in ``cwd`` (not the repo
    root, where ``comfy_env`` would resolve to this checkout)."""
    try:
        proc = subprocess.run(
            [_python(spec), "-c", spec.check],
            cwd=cwd,
            env=clean_env(),
            capture_output=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"import check failed: {exc}"
    if proc.returncode != 0:
        return f"import check failed: {_tail(proc.stderr)}"
    return None


def ensure(spec: VenvSpec, install: bool, reinstall: bool, cwd: str) -> tuple[str | None, str]:
    """Return (interpreter, note): interpreter None means unavailable, note says why; else
    the note says whether the venv was reused or installed."""
    stamp_path = os.path.join(spec.path, STAMP)
    wanted = json.dumps(list(spec.packages))
    if not reinstall and os.path.exists(_python(spec)):
        try:
            with open(stamp_path) as f:
                stamped = f.read() == wanted
        except OSError:
            stamped = False
        if stamped and _check(spec, cwd) is None:
            return _python(spec), "reused"
    if not install:
        return None, "not installed (the suite ran with --no-install)"
    t0 = time.monotonic()
    steps = (
        [sys.executable, "-m", "venv", "--clear", spec.path],
        [
            _python(spec),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--no-input",
            "-q",
            *spec.packages,
        ],
    )
    for cmd in steps:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"`{' '.join(cmd[:4])}` failed: {exc}"
        if proc.returncode != 0:
            return None, f"`{' '.join(cmd[2:5])}` failed: {_tail(proc.stderr)}"
    why = _check(spec, cwd)
    if why is not None:
        return None, why
    with open(stamp_path, "w") as f:
        f.write(wanted)
    return _python(spec), f"installed in {time.monotonic() - t0:.0f} s"


def setup(install: bool, reinstall: bool, cwd: str) -> tuple[dict[str, str | None], dict[str, str]]:
    """Interpreters per venv key (``stdlib`` is this interpreter) and a note per venv."""
    pythons: dict[str, str | None] = {"stdlib": sys.executable}
    notes: dict[str, str] = {"stdlib": f"this interpreter ({sys.executable})"}
    os.makedirs(PEERS_DIR, exist_ok=True)
    for spec in SPECS:
        python, note = ensure(spec, install, reinstall, cwd)
        pythons[spec.key] = python
        notes[spec.key] = note
    return pythons, notes
