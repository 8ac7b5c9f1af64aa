"""The opt-in compiled hot path (``python3 dev.py compile``, issue 16 third round).

The same sources run pure or compiled by mypyc; these tests hold what that needs:

* mypyc ignores the ``from`` clause of ``raise``, so the compiled modules chain exceptions
  with ``_errors.chained``, which must do exactly what ``raise ... from`` does;
* a stale build (a source edited after compiling) is removed before the suite runs, since the
  import system prefers an extension module over its ``.py``;
* a compiled ``Pool`` cannot be weakly referenced, so the exit/fork registry holds
  registrations instead; a pool is listed while open and gone once closed.

Pure logic and AST reads, plus one pool that never starts a worker.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import comfy_env
from comfy_env import _shutdown
from comfy_env._errors import chained

ROOT = Path(comfy_env.__file__).resolve().parent.parent


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("comfy_env_dev_script", ROOT / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hot_path_modules_never_raise_with_from() -> None:
    dev = _dev()
    assert dev.HOT_MODULES  # the list the build compiles
    offenders = []
    for name in dev.HOT_MODULES:
        path = ROOT / "comfy_env" / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.cause is not None:
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == [], f"use raise chained(exc, cause) (mypyc drops 'from'): {offenders}"


def _raised(fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return exc
    raise AssertionError("nothing was raised")


@pytest.mark.parametrize("with_cause", [True, False])
def test_chained_does_what_raise_from_does(with_cause: bool) -> None:
    cause = KeyError("the cause") if with_cause else None

    def native() -> None:
        try:
            raise OSError("handled")
        except OSError:
            raise ValueError("new") from cause

    def spelled() -> None:
        try:
            raise OSError("handled")
        except OSError:
            raise chained(ValueError("new"), cause)  # noqa: B904

    a, b = _raised(native), _raised(spelled)
    assert type(a) is type(b) is ValueError
    assert a.__cause__ is b.__cause__ is cause
    assert a.__suppress_context__ is b.__suppress_context__ is True
    assert type(a.__context__) is type(b.__context__) is OSError


def test_a_stale_build_is_removed_and_a_current_one_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = _dev()
    monkeypatch.setattr(dev, "HOT_DIR", str(tmp_path))
    monkeypatch.setattr(dev, "HOT_STAMP", str(tmp_path / "_hotpath.sha256"))
    for name in dev.HOT_MODULES:
        (tmp_path / f"{name}.py").write_text(f"X = {name!r}\n")
        (tmp_path / f"{name}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\0")
    (tmp_path / "_hotpath__mypyc.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\0")
    (tmp_path / "other.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\0")  # not ours
    (tmp_path / "_hotpath.sha256").write_text(dev._source_digests())
    built = len(dev.HOT_MODULES) + 1

    dev.drop_stale_compiled()
    assert len(dev._compiled_files()) == built  # sources unchanged: the build stays

    first = dev.HOT_MODULES[0]
    (tmp_path / f"{first}.py").write_text("X = 'edited'\n")
    dev.drop_stale_compiled()
    assert dev._compiled_files() == []
    assert not (tmp_path / "_hotpath.sha256").exists()
    assert (tmp_path / "other.cpython-311-x86_64-linux-gnu.so").exists()


def test_the_exit_and_fork_registry_lists_a_pool_while_it_is_open() -> None:
    pool = comfy_env.Pool()
    try:
        assert any(r.pool is pool for r in list(_shutdown.live_pools))
    finally:
        pool.close()
    assert not any(r.pool is pool for r in list(_shutdown.live_pools))


def test_the_running_build_is_reported_consistently() -> None:
    """Either every hot-path module is compiled or none is (a partial build would mean a
    stale or failed ``dev.py compile``)."""
    dev = _dev()
    kinds = set()
    for name in dev.HOT_MODULES:
        module = sys.modules.get(f"comfy_env.{name}") or importlib.import_module(
            f"comfy_env.{name}"
        )
        kinds.add(str(module.__file__).endswith(".py"))
    assert len(kinds) == 1
