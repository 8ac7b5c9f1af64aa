#!/usr/bin/env python3
"""Bootstrap and run: ``python3 dev.py demo`` or ``python3 dev.py test [pytest args]``.

Creates ``.venv`` next to this file with the project installed in editable mode plus its test
extras (re-installed only when ``pyproject.toml`` changes), then runs the command inside it.
Needs nothing but Python 3.10+ and access to the package index.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(ROOT, ".venv")
STAMP = os.path.join(VENV, ".comfy-env-dev-stamp")
BIN = os.path.join(VENV, "Scripts" if os.name == "nt" else "bin")
PY = os.path.join(BIN, "python.exe" if os.name == "nt" else "python")


def ensure_venv() -> None:
    if sys.version_info < (3, 10):  # noqa: UP036 - dev.py runs under any python3
        sys.exit(f"comfy-env needs Python 3.10 or newer; this is {sys.version.split()[0]}")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        digest = hashlib.sha256(fh.read()).hexdigest()
    if os.path.exists(PY) and os.path.exists(STAMP):
        with open(STAMP) as fh:
            if fh.read().strip() == digest:
                return
    if not os.path.exists(PY):
        print("dev.py: creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    print("dev.py: installing comfy-env and its test dependencies into .venv", flush=True)
    subprocess.check_call(
        [PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e", ".[test]"],
        cwd=ROOT,
    )
    with open(STAMP, "w") as fh:
        fh.write(digest)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__)
        return 2
    ensure_venv()
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return subprocess.call([os.path.join(BIN, "comfy-env"), "demo", *rest], cwd=ROOT)
    rc = subprocess.call([PY, "-m", "pytest", *rest], cwd=ROOT)
    if rc == 5:
        print("dev.py: pytest collected no tests; treating that as a failure", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
