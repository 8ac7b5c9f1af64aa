"""Arrays cross between numpy 1.x and 2.x, in both directions, inline and through shared memory.

Real envs: venvs with numpy 1.26.4 and numpy 2.0.2 (the first 2.x, with ``numpy._core``),
built once with ``uv`` (or venv + pip where uv is missing) into a cache outside the repository
keyed by the Python version and the pins, and reused by later sessions. The host here runs
numpy 2.x (the dev venv); the numpy-1 host direction runs a host subprocess from a numpy-1.26
venv that imports this checkout's comfy_env. Skipped, with the reason, where the package index
cannot be reached.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import TESTS_DIR, other_python
from tasks import numpy_skew as numpy_tasks

import comfy_env
from comfy_env import SerializationError

REPO = TESTS_DIR.parent
NUMPY1 = "numpy==1.26.4"
NUMPY2 = "numpy==2.0.2"
NUMPY_OLDEST = "numpy==1.21.6"
# What a numpy-1 host needs besides numpy: comfy_env's dependencies, at the dev venv's versions.
HOST_DEPS = tuple(
    f"{d}=={importlib.metadata.version(d)}" for d in ("psutil", "cloudpickle", "pydantic")
)

pytestmark = pytest.mark.timeout(300)


def _cache_root() -> Path:
    root = os.environ.get("COMFY_ENV_DEV_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "comfy-env-dev"
    )
    return Path(root) / "numpy-envs"


def _build(pins: tuple[str, ...], python: str = sys.executable) -> Path:
    """A venv on ``python`` with ``pins`` installed, built once (into a temporary directory,
    renamed into place) and reused; skips the test where the index cannot be reached."""
    py = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    key = hashlib.sha256("\0".join((python, py, *pins)).encode()).hexdigest()[:12]
    root = _cache_root()
    final = root / f"py{py}-{key}"
    if (final / "bin" / "python").exists() and (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    env = tmp / "env"
    try:
        try:
            import uv  # noqa: F401

            uv_cmd = [sys.executable, "-m", "uv"]
            subprocess.run([*uv_cmd, "venv", "-q", "-p", python, str(env)], check=True)
            install = [*uv_cmd, "pip", "install", "-q", "-p", str(env / "bin" / "python"), *pins]
        except ImportError:
            subprocess.run([python, "-m", "venv", str(env)], check=True)
            install = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", *pins]
        done = subprocess.run(install, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            pytest.skip(
                f"cannot install {' '.join(pins)} (no package index?): {done.stderr[-500:]}"
            )
        (env / ".complete").write_text(" ".join(pins) + "\n")
        try:
            env.rename(final)
        except OSError:  # another session built it first
            if not (final / ".complete").exists():
                raise
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def numpy1_env() -> Path:
    return _build((NUMPY1,))


@pytest.fixture(scope="session")
def numpy2_env() -> Path:
    return _build((NUMPY2,))


@pytest.fixture(scope="session")
def oldest_env() -> Path:
    """The oldest pair the runtime supports: Python 3.8 with numpy 1.21."""
    python = other_python(8)
    if python is None:
        pytest.skip("no Python 3.8 on this machine")
    return _build((NUMPY_OLDEST,), python)


@pytest.fixture(scope="session")
def numpy1_host() -> Path:
    return _build((NUMPY1, *HOST_DEPS))


@contextlib.contextmanager
def _pool(shared_memory: bool) -> Iterator[comfy_env.Pool]:
    config = comfy_env.PoolConfig(
        sys_path=(str(TESTS_DIR),), kill_grace=0.5, close_timeout=3.0, shared_memory=shared_memory
    )
    with comfy_env.Pool(config) as pool:
        yield pool


def _check_round_trips(worker: comfy_env.Worker, expect_env_numpy: str) -> None:
    assert worker.call("tasks.numpy_skew:numpy_version") == expect_env_numpy
    for which in ("cases", "containers", "scalars"):
        local = numpy_tasks.built(which)
        # Arguments: the env compares what it got with the same arrays built by its numpy.
        assert worker.call("tasks.numpy_skew:mismatches", local, which) == []
        # Results: built by the env's numpy, and the host's own arrays echoed back.
        assert numpy_tasks.mismatches(worker.call("tasks.numpy_skew:built", which), which) == []
        assert numpy_tasks.mismatches(worker.call("tasks.numpy_skew:echo", local), which) == []


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "inline"])
def test_arrays_cross_from_a_numpy2_host_to_a_numpy1_env_and_back(
    numpy1_env: Path, shared_memory: bool
) -> None:
    assert np.__version__.startswith("2.")
    with _pool(shared_memory) as pool:
        worker = pool.get_worker(numpy1_env)
        _check_round_trips(worker, "1.26.4")
        if shared_memory:
            assert worker.stats().shared_memory != "unavailable"


def test_arrays_cross_in_code_sent_by_value_and_in_cloudpickled_results(
    numpy1_env: Path,
) -> None:
    local = numpy_tasks.cases()
    captured = local["fortran"]
    with _pool(True) as pool:
        worker = pool.get_worker(numpy1_env)
        # A lambda travels by value (cloudpickle), with the array it closes over.
        assert worker.call(lambda: captured.tobytes(order="A")) == captured.tobytes(order="A")
        fn, fortran, large = worker.call("tasks.numpy_skew:with_code")
    assert fn() == 42
    assert numpy_tasks.same(local["fortran"], fortran) is None
    assert numpy_tasks.same(local["large"], large) is None


def test_arrays_cross_from_a_numpy2_host_to_python38_with_numpy_1_21(oldest_env: Path) -> None:
    with _pool(True) as pool:
        worker = pool.get_worker(oldest_env)
        _check_round_trips(worker, "1.21.6")
        with pytest.raises(SerializationError, match="StringDType"):
            worker.call("tasks.numpy_skew:echo", numpy_tasks.strings())


def test_arrays_cross_between_numpy2_versions(numpy2_env: Path) -> None:
    with _pool(True) as pool:
        _check_round_trips(pool.get_worker(numpy2_env), "2.0.2")


def test_a_numpy2_only_dtype_sent_to_numpy1_is_a_serialization_error_naming_it(
    numpy1_env: Path,
) -> None:
    with _pool(True) as pool:
        worker = pool.get_worker(numpy1_env)
        with pytest.raises(SerializationError, match="StringDType") as info:
            worker.call("tasks.numpy_skew:echo", numpy_tasks.strings())
        assert "numpy._core" not in str(info.value)
        assert "no such dtype" in str(info.value)
        # still fine
        assert worker.call("tasks.numpy_skew:echo", np.arange(3)).tolist() == [0, 1, 2]


def test_a_numpy2_only_dtype_still_crosses_between_numpy2_envs(numpy2_env: Path) -> None:
    with _pool(True) as pool:
        back = pool.get_worker(numpy2_env).call("tasks.numpy_skew:echo", numpy_tasks.strings())
    assert back.tolist() == ["a", "bb"]


_NUMPY1_HOST = """
import json, sys
import numpy as np
import comfy_env
from tasks import numpy_skew as numpy_tasks

env, tests, shared_memory = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
config = comfy_env.PoolConfig(sys_path=(tests,), close_timeout=3.0, shared_memory=shared_memory)
problems = []
with comfy_env.Pool(config) as pool:
    worker = pool.get_worker(env)
    for which in ("cases", "containers", "scalars"):
        local = numpy_tasks.built(which)
        problems += worker.call("tasks.numpy_skew:mismatches", local, which)
        problems += numpy_tasks.mismatches(worker.call("tasks.numpy_skew:built", which), which)
        problems += numpy_tasks.mismatches(worker.call("tasks.numpy_skew:echo", local), which)
    try:
        worker.call("tasks.numpy_skew:strings")
        problems.append("a StringDType result reached a numpy-1 host")
    except comfy_env.SerializationError as exc:
        if "StringDType" not in str(exc):
            problems.append("the error does not name the dtype: %s" % exc)
    env_numpy = worker.call("tasks.numpy_skew:numpy_version")
print(json.dumps({"host": np.__version__, "env": env_numpy, "problems": problems}))
"""


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "inline"])
def test_arrays_cross_from_a_numpy1_host_to_a_numpy2_env_and_back(
    numpy1_host: Path, numpy2_env: Path, shared_memory: bool
) -> None:
    path = os.pathsep.join((str(REPO), str(REPO / "workers"), str(TESTS_DIR)))
    done = subprocess.run(
        [
            str(numpy1_host / "bin" / "python"),
            "-c",
            textwrap.dedent(_NUMPY1_HOST),
            *(str(numpy2_env), str(TESTS_DIR), "1" if shared_memory else "0"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONPATH=path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["host"], report["env"]) == ("1.26.4", "2.0.2")
    assert report["problems"] == []


# ---- doctor ----------------------------------------------------------------------------------


def _doctor(capsys: pytest.CaptureFixture[str], env: Path) -> tuple[int, dict[str, Any]]:
    from comfy_env._cli import main

    code = main(["doctor", str(env), "--json"])
    out, _ = capsys.readouterr()
    doc = json.loads(out)
    return code, {step["name"]: step for step in doc["steps"]}


def test_doctor_tells_a_numpy_version_skew_and_what_crosses(
    capsys: pytest.CaptureFixture[str], numpy1_env: Path
) -> None:
    code, steps = _doctor(capsys, numpy1_env)
    assert code == 0
    numpy_step = steps["numpy"]
    assert numpy_step["status"] == "ok"
    assert numpy_step["facts"]["env_numpy"] == "1.26.4"
    assert numpy_step["facts"]["host_numpy"] == np.__version__
    assert numpy_step["facts"]["skew"] is True
    detail = numpy_step["detail"]
    assert "version skew (not a missing numpy)" in detail
    assert "plain arrays cross" in detail and "object arrays" in detail
    assert "StringDType" in detail
    # The probe array crossed the skew: sent as an array, not as bytes, and equal.
    shm = steps["shared memory"]["facts"]
    assert shm["kind"] == "numpy array" and shm["equal"] is True


def test_doctor_tells_a_missing_numpy_apart(
    capsys: pytest.CaptureFixture[str], foreign_venv: Path
) -> None:
    code, steps = _doctor(capsys, foreign_venv)
    assert code == 0
    facts = steps["numpy"]["facts"]
    assert facts["env_numpy"] is None and facts["skew"] is False
    assert "No module named 'numpy'" in facts["env_error"]
    assert "the env has no numpy" in steps["numpy"]["detail"]
    assert steps["shared memory"]["facts"]["kind"] == "bytes object"
