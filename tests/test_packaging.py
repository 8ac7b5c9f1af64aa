"""What a user installs is what the checkout runs: the built distributions ship every module.

An editable install (``dev.py``) imports straight from the checkout, so it hides a package left
out of the build. These tests build the distributions the way ``python -m build`` does, the
sdist first and the wheel from the unpacked sdist, with the installed setuptools (the ``test``
extra brings one new enough: no build isolation, no network), from a copy of the files the
build reads (a stale ``build/`` of the checkout could otherwise hide a missing module). Then:

* every ``.py`` file under ``comfy_env/`` and ``workers/comfy_env_worker/`` is in the wheel, as
  its installed name, and so is ``comfy_env/py.typed``; a subpackage added later is covered
  without an edit here;
* the wheel holds nothing beyond the two packages and its metadata, the license included;
* installed into a fresh venv (``--no-deps --no-index``), the wheel imports both ``comfyui``
  subpackages from that venv, and a worker started from it answers a call (the runtime dir is
  filled from the installed ``comfy_env_worker`` tree, not the checkout's).

Each build and the install run in a child process, waited for, so nothing outlives the test.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import psutil
import pytest

import comfy_env

REPO = Path(__file__).resolve().parent.parent
# Import root on disk -> the name it is installed under.
ROOTS = {REPO / "comfy_env": "comfy_env", REPO / "workers" / "comfy_env_worker": "comfy_env_worker"}
# What the build reads besides the packages (pyproject's readme and license-files).
TOP_FILES = ("pyproject.toml", "README.md", "LICENSE")
BUILD_TIMEOUT = 120
DIST_INFO = f"comfy_env-{comfy_env.__version__}.dist-info"


def _required_setuptools() -> tuple[int, ...]:
    """The minimum version ``build-system.requires`` names for setuptools."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    found = re.search(r'"setuptools>=([0-9.]+)"', text)
    assert found, "build-system.requires names no minimum setuptools"
    return tuple(int(part) for part in found.group(1).split("."))


def _installed_setuptools() -> tuple[int, ...] | None:
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _module_files() -> set[str]:
    """Every file the wheel must hold, by installed name."""
    expected = {"comfy_env/py.typed"}
    for root, name in ROOTS.items():
        for path in root.rglob("*.py"):
            if "__pycache__" not in path.parts:
                expected.add(f"{name}/{path.relative_to(root).as_posix()}")
    return expected


def _copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.pyd")
    for name in TOP_FILES:
        if (REPO / name).exists():  # a missing one fails the sdist test, by name
            shutil.copy2(REPO / name, dest / name)
    for root in ROOTS:
        shutil.copytree(root, dest / root.relative_to(REPO), ignore=ignore)


def _backend(hook: str, source: Path, out: Path) -> Path:
    """Run one PEP 517 hook of setuptools in a child process; the file it built."""
    code = "import sys\nfrom setuptools import build_meta\n"
    code += f"print(build_meta.{hook}(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out / result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(sdist, wheel) built from a copy of the checkout; the wheel from the unpacked sdist."""
    installed, required = _installed_setuptools(), _required_setuptools()
    if installed is None or installed < required:
        pytest.skip(f"needs setuptools>={'.'.join(map(str, required))} (the test extra)")
    work = tmp_path_factory.mktemp("dist")
    source, out, unpacked = work / "src", work / "out", work / "unpacked"
    for folder in (source, out, unpacked):
        folder.mkdir()
    _copy_sources(source)
    sdist = _backend("build_sdist", source, out)
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # 3.10.12+: refuse links and paths out of the dir
            tar.extraction_filter = tarfile.data_filter
        tar.extractall(unpacked)
    (top,) = unpacked.iterdir()
    wheel = _backend("build_wheel", top, out)
    return sdist, wheel


def test_the_wheel_ships_every_module_and_py_typed(dists: tuple[Path, Path]) -> None:
    with zipfile.ZipFile(dists[1]) as whl:
        names = set(whl.namelist())
    missing = _module_files() - names
    assert not missing, f"left out of the wheel: {sorted(missing)}"


def test_the_wheel_holds_only_the_two_packages_and_the_license(dists: tuple[Path, Path]) -> None:
    with zipfile.ZipFile(dists[1]) as whl:
        names = set(whl.namelist())
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"comfy_env", "comfy_env_worker", DIST_INFO}, tops
    assert f"{DIST_INFO}/licenses/LICENSE" in names
    with zipfile.ZipFile(dists[1]) as whl:
        metadata = whl.read(f"{DIST_INFO}/METADATA").decode()
    assert "License-Expression: MIT" in metadata


def test_the_sdist_ships_every_module_and_the_license(dists: tuple[Path, Path]) -> None:
    with tarfile.open(dists[0]) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    # In the sdist the worker package keeps its place in the checkout.
    expected = {
        name.replace("comfy_env_worker/", "workers/comfy_env_worker/", 1)
        for name in _module_files()
    }
    missing = (expected | set(TOP_FILES)) - names
    assert not missing, f"left out of the sdist: {sorted(missing)}"


def test_the_installed_wheel_imports_comfyui_and_runs_a_worker(
    dists: tuple[Path, Path], tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = ["install", "--quiet", "--no-deps", "--no-index", "--no-cache-dir"]
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *install, str(dists[1])],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT,
    )
    # The dependencies come from this venv's site-packages, appended after the fresh venv's
    # own (no .pth runs from there, so this venv's editable comfy-env stays out of sight).
    deps = str(Path(psutil.__file__).resolve().parent.parent)
    code = textwrap.dedent(
        """
        import sys
        sys.path.append(sys.argv[1])
        import comfy_env, comfy_env.comfyui, comfy_env_worker.comfyui
        for module in (comfy_env, comfy_env.comfyui, comfy_env_worker.comfyui):
            assert module.__file__.startswith(sys.prefix), module.__file__
        with comfy_env.Pool() as pool:
            print(pool.get_worker().call("comfy_env_worker.tasks:echo", "installed"))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COMFY_ENV_"))}
    result = subprocess.run(
        [str(python), "-c", code, deps],
        cwd=tmp_path,  # not the checkout: its packages must not be found first
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "installed"
