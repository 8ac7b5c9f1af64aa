#!/usr/bin/env python3
"""Bootstrap and run: ``python3 dev.py demo``, ``python3 dev.py test [pytest args]`` or
``python3 dev.py test-comfyui [--comfyui TARBALL] [pytest args]`` or
``python3 dev.py bench [run_all args]`` or
``python3 dev.py bench-comfyui [--comfyui TARBALL] [--no-write]`` or
``python3 dev.py compile [--clean]``.

Creates ``.venv`` next to this file with the project installed in editable mode plus its test
extras (re-installed only when ``pyproject.toml`` changes), then runs the command inside it.
Needs nothing but Python 3.10+ and access to the package index.

``test-comfyui`` runs the integration suite in ``tests_comfyui/`` against a real ComfyUI server.
It prepares, once, outside the repository (``~/.cache/comfy-env-dev/``, or
``$COMFY_ENV_DEV_CACHE``):

- ``comfyui-<hash>/``: the unpacked ComfyUI source and a venv with its requirements, ``requests``
  and the pinned torch/torchvision (about 6 GB, a few minutes). The hash covers the tarball's
  bytes, the pins and this recipe's version; an unchanged input reuses it. comfy-env itself is
  installed editable into that venv from the checkout running the command (re-done, in seconds,
  when another checkout used the cache last).
- ``pack-numpy-<hash>/`` and ``pack-torch-<hash>/``: the example packs' envs (a venv with numpy,
  a venv with a CPU torch). They never get ComfyUI or comfy-env.

``bench`` runs the benchmark suite, ``benchmarks/run_all.py``, with ``.venv``'s interpreter and
the arguments given (``--quick``, ``--only small_call,ray``, ``--out PATH``, ...; see
``benchmarks/README.md``). A full run writes ``benchmarks/RESULTS.md`` (its section 7 is
``bench-comfyui``'s, and is kept); ``--quick`` writes ``benchmarks/out/quick.md``.

``compile`` (opt-in) builds the host's per-call modules (``HOT_MODULES``) with mypyc into
extension modules next to their sources, which Python then imports instead of the ``.py``
files; it needs a C compiler and installs the ``dev`` extra (mypy, which brings mypyc) into
``.venv``. Without it, or after ``compile --clean``, the pure modules run: nothing else changes.
The build records its sources' digests; ``test`` (and every other command) removes a build
whose sources changed since, so an edit is never hidden behind a stale extension.

The tarball comes from ``--comfyui``, else ``$COMFY_ENV_COMFYUI_SRC``, else
``<repo>/../shared/comfyui/ComfyUI-0.3.64-src.tar.gz``. Without one the command says so and exits
0 (skipped); the tests skip the same way when run directly without the harness's variables.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
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


# Bump when the recipe below changes in a way the hashed inputs do not show.
COMFYUI_RECIPE = "1"
COMFYUI_PINS = ("requests", "torch==2.14.1", "torchvision==0.29.1")
PACK_ENVS = {"numpy": ("numpy",), "torch": ("torch==2.13.0", "numpy")}


def _cache_root() -> str:
    root = os.environ.get("COMFY_ENV_DEV_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "comfy-env-dev"
    )
    os.makedirs(root, exist_ok=True)
    return root


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _venv_python(path: str) -> str:
    return os.path.join(path, "bin", "python")


def _build_once(final: str, build: object) -> None:
    """Run ``build(tmpdir)`` unless ``final`` exists; publish by rename so a killed build never
    looks finished (the next run starts over)."""
    if os.path.exists(os.path.join(final, ".complete")):
        return
    import shutil

    tmp = final + ".building"
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)  # type: ignore[operator]
    with open(os.path.join(tmp, ".complete"), "w") as fh:
        fh.write("ok\n")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)


def _pip(python: str, *args: str) -> None:
    subprocess.check_call(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet", *args]
    )


def prepare_comfyui(tarball: str) -> tuple[str, str]:
    """Return (ComfyUI source dir, venv python), building them once per input hash."""
    with open(tarball, "rb") as fh:
        tar_hash = hashlib.sha256(fh.read()).hexdigest()
    key = _digest(COMFYUI_RECIPE, tar_hash, *COMFYUI_PINS, sys.version.split()[0])
    final = os.path.join(_cache_root(), f"comfyui-{key}")

    def build(tmp: str) -> None:
        import tarfile

        print(f"dev.py: preparing ComfyUI in {final} (a few minutes, once)", flush=True)
        os.makedirs(tmp)
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp, filter="data")
        src = os.path.join(tmp, "ComfyUI")
        venv.EnvBuilder(with_pip=True).create(os.path.join(tmp, "venv"))
        # The venv is created at its temporary path; scripts with shebangs are not used (we
        # always run ``venv/bin/python -m ...``) and pyvenv.cfg holds no path, so the rename
        # keeps it valid.
        py = _venv_python(os.path.join(tmp, "venv"))
        _pip(py, "-r", os.path.join(src, "requirements.txt"), *COMFYUI_PINS)

    _build_once(final, build)
    py = _venv_python(os.path.join(final, "venv"))
    stamp = os.path.join(final, "venv", ".comfy-env-editable")
    # The checkout and its dependencies: a pyproject.toml that gained a dependency (uv) is
    # installed again, not only a checkout that moved.
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        wanted = f"{ROOT} {hashlib.sha256(fh.read()).hexdigest()}"
    current = ""
    if os.path.exists(stamp):
        with open(stamp) as fh:
            current = fh.read().strip()
    if current != wanted:
        print(f"dev.py: installing comfy-env (editable, from {ROOT}) into the ComfyUI venv")
        _pip(py, "-e", ROOT)
        with open(stamp, "w") as fh:
            fh.write(wanted)
    return os.path.join(final, "ComfyUI"), py


def prepare_pack_env(name: str) -> str:
    """Return the path of the example packs' env ``name`` (a venv), building it once."""
    pins = PACK_ENVS[name]
    key = _digest(COMFYUI_RECIPE, *pins, sys.version.split()[0])
    final = os.path.join(_cache_root(), f"pack-{name}-{key}")

    def build(tmp: str) -> None:
        print(f"dev.py: preparing the example env {name!r} in {final}", flush=True)
        venv.EnvBuilder(with_pip=True).create(tmp)
        _pip(_venv_python(tmp), *pins)

    _build_once(final, build)
    return final


def comfyui_tarball(argv: list[str]) -> tuple[str | None, list[str]]:
    rest = list(argv)
    chosen: str | None = None
    if "--comfyui" in rest:
        i = rest.index("--comfyui")
        chosen = rest[i + 1]
        del rest[i : i + 2]
    chosen = (
        chosen
        or os.environ.get("COMFY_ENV_COMFYUI_SRC")
        or os.path.join(ROOT, "..", "shared", "comfyui", "ComfyUI-0.3.64-src.tar.gz")
    )
    return (os.path.abspath(chosen) if os.path.isfile(chosen) else None), rest


def test_comfyui(argv: list[str]) -> int:
    tarball, rest = comfyui_tarball(argv)
    if tarball is None:
        print(
            "dev.py: test-comfyui skipped: no ComfyUI source tarball (pass --comfyui PATH or "
            "set COMFY_ENV_COMFYUI_SRC)"
        )
        return 0
    src, py = prepare_comfyui(tarball)
    env = dict(os.environ)
    env["COMFY_ENV_TEST_COMFYUI_DIR"] = src
    env["COMFY_ENV_TEST_COMFYUI_PYTHON"] = py
    for name in PACK_ENVS:
        env[f"COMFY_ENV_TEST_PACK_ENV_{name.upper()}"] = prepare_pack_env(name)
    if "--prepare-only" in rest:
        return 0
    rc = subprocess.call([PY, "-m", "pytest", "tests_comfyui", *rest], cwd=ROOT, env=env)
    if rc == 5:
        print("dev.py: pytest collected no tests; treating that as a failure", file=sys.stderr)
        return 1
    return rc


def bench_comfyui(argv: list[str]) -> int:
    tarball, rest = comfyui_tarball(argv)
    if tarball is None:
        print("dev.py: bench-comfyui needs the ComfyUI source tarball (--comfyui PATH)")
        return 1
    src, py = prepare_comfyui(tarball)
    script = os.path.join(ROOT, "benchmarks", "bench_comfyui.py")
    envs = ["--numpy-env", prepare_pack_env("numpy"), "--torch-env", prepare_pack_env("torch")]
    envs += ["--comfyui-dir", src]
    return subprocess.call([py, script, *envs, *rest], cwd=ROOT)


# ---- the opt-in compiled hot path (mypyc) ---------------------------------------------------

# The modules that carry every call: the call itself (``_exchange``), leasing, the gate and its
# table, the codec. Not ``_pool``: a ``Worker``'s calls enter ``_exchange`` with no frame of
# the pool's (when one short frame of it was still on the path, compiling it saved about 2,300
# of the host's ~50,000 instructions a call, measured with callgrind,
# ``benchmarks/count_instructions.py``: not worth a native ``Pool``, whose signatures mypyc's
# coercion widened and which could not be weakly referenced).
# The worker runtime is never compiled: it must run under any env's Python (3.8 and up) with
# nothing but the stdlib.
HOT_MODULES = ("_lifecycle", "_entry", "_lease", "_exchange", "_codec")
HOT_DIR = os.path.join(ROOT, "comfy_env")
# Written next to the compiled modules: the sha256 of each source they were built from.
HOT_STAMP = os.path.join(HOT_DIR, "_hotpath.sha256")

_BUILD = r"""
import sys
from setuptools import setup
from mypyc.build import mypycify
config, paths = sys.argv[1], sys.argv[2:]
setup(
    name="comfy-env-hotpath",
    py_modules=[],
    ext_modules=mypycify(["--config-file", config, *paths], group_name="comfy_env._hotpath"),
    script_args=["build_ext", "--inplace", "--build-temp", "build"],
)
"""


def _compiled_files() -> list[str]:
    """The build's extension modules: any of a module of the package (not only the current
    ``HOT_MODULES``: a module dropped from the list must not stay compiled) and the shared
    library of the group."""
    names = os.listdir(HOT_DIR)
    modules = {name[:-3] for name in names if name.endswith(".py")} | {"_hotpath__mypyc"}
    return sorted(
        os.path.join(HOT_DIR, name)
        for name in names
        if name.endswith((".so", ".pyd")) and name.split(".")[0] in modules
    )


def _source_digests() -> str:
    lines = []
    for name in HOT_MODULES:
        with open(os.path.join(HOT_DIR, name + ".py"), "rb") as fh:
            lines.append(f"{hashlib.sha256(fh.read()).hexdigest()}  {name}.py\n")
    return "".join(lines)


def clean_compiled(reason: str | None = None) -> None:
    """Remove the compiled hot path: the pure modules are imported again."""
    files = _compiled_files()
    for path in [*files, HOT_STAMP]:
        if os.path.exists(path):
            os.remove(path)
    if files and reason:
        print(f"dev.py: removed the compiled hot path ({reason})", flush=True)


def drop_stale_compiled() -> None:
    """A compiled module is imported before its ``.py`` (the import system prefers extension
    modules): once a source changed, its stale build must go, or the edit would be ignored."""
    if not _compiled_files():
        return
    stamp = ""
    if os.path.exists(HOT_STAMP):
        with open(HOT_STAMP) as fh:
            stamp = fh.read()
    if stamp != _source_digests():
        clean_compiled("its sources changed; run `python3 dev.py compile` again")


def compile_hot_path(argv: list[str]) -> int:
    """``dev.py compile``: build the hot-path modules with mypyc, in place (opt-in; needs a C
    compiler; installs the dev extra, which brings mypy and mypyc, into .venv).
    ``dev.py compile --clean``: remove them (the pure modules are used again)."""
    clean_compiled("rebuilding" if "--clean" not in argv else "--clean")
    if "--clean" in argv:
        return 0
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        print("dev.py: no C compiler found; the pure-Python modules stay in use", file=sys.stderr)
        return 1
    try:
        subprocess.check_call([PY, "-c", "import mypyc"], stderr=subprocess.DEVNULL)
    except subprocess.CalledProcessError:
        subprocess.check_call(
            [PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-e", ".[dev]"],
            cwd=ROOT,
        )
    with tempfile.TemporaryDirectory(prefix="comfy-env-mypyc-") as tmp:
        # Built from a copy: setuptools must not see the project's pyproject.toml, and the
        # build's C files and the mypy cache stay out of the checkout.
        shutil.copytree(
            HOT_DIR, os.path.join(tmp, "comfy_env"), ignore=shutil.ignore_patterns("__pycache__")
        )
        env = dict(os.environ, MYPYPATH=os.path.join(ROOT, "workers"))
        paths = [os.path.join("comfy_env", name + ".py") for name in HOT_MODULES]
        config = os.path.join(ROOT, "pyproject.toml")
        rc = subprocess.call([PY, "-c", _BUILD, config, *paths], cwd=tmp, env=env)
        if rc != 0:
            print("dev.py: mypyc failed; the pure-Python modules stay in use", file=sys.stderr)
            return rc
        built = os.path.join(tmp, "comfy_env")
        for name in os.listdir(built):
            if name.endswith((".so", ".pyd")):
                shutil.copy2(os.path.join(built, name), os.path.join(HOT_DIR, name))
    with open(HOT_STAMP, "w") as fh:
        fh.write(_source_digests())
    print("dev.py: compiled " + ", ".join(os.path.basename(p) for p in _compiled_files()))
    return 0


def main(argv: list[str]) -> int:
    commands = ("demo", "test", "test-comfyui", "bench", "bench-comfyui", "compile")
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    ensure_venv()
    command, rest = argv[0], argv[1:]
    if command == "compile":
        return compile_hot_path(rest)
    drop_stale_compiled()
    if command == "test-comfyui":
        return test_comfyui(rest)
    if command == "bench":
        return subprocess.call(
            [PY, os.path.join(ROOT, "benchmarks", "run_all.py"), *rest], cwd=ROOT
        )
    if command == "bench-comfyui":
        return bench_comfyui(rest)
    if command == "demo":
        return subprocess.call([os.path.join(BIN, "comfy-env"), "demo", *rest], cwd=ROOT)
    rc = subprocess.call([PY, "-m", "pytest", *rest], cwd=ROOT)
    if rc == 5:
        print("dev.py: pytest collected no tests; treating that as a failure", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
