"""Calls: targets, arguments, results and remote exceptions, on real workers."""

from __future__ import annotations

import asyncio
import pickle
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest
from tasks import remote as remote_tasks

import comfy_env
from comfy_env import RemoteError, SerializationError


def test_get_worker_spawns_nothing(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    assert w.generation == 0
    assert w.pid is None
    assert pool.stats()[w.env].spawns == 0


def test_first_call_spawns_a_verified_worker(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    assert w.call("comfy_env_worker.tasks:echo", 7) == 7
    stats = w.stats()
    assert (w.generation, stats.spawns, stats.state) == (1, 1, "idle")
    assert w.pid == w.call("comfy_env_worker.tasks:getpid")
    assert stats.workers[0].startup_seconds is not None


def test_call_by_reference_string(pool: comfy_env.Pool) -> None:
    assert pool.get_worker().call("tasks.remote:add", 2, b=3) == 5


def test_importable_function_travels_by_reference(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    assert w.call(remote_tasks.add, 40, 2) == 42
    assert w.call(remote_tasks.getpid) == w.pid


def test_lambda_and_closure_travel_by_value(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    offset = 10
    assert w.call(lambda x: x * 2, 21) == 42
    assert w.call(lambda: offset + 1) == 11

    def nested(y: int) -> int:
        return y + offset

    assert w.call(nested, 5) == 15


def test_lambda_inside_arguments_falls_back_to_cloudpickle(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    assert w.call("comfy_env_worker.tasks:echo", {"f": 1})["f"] == 1
    fn = w.call(lambda: lambda v: v + 1)  # a function comes back by value too
    assert fn(1) == 2


def test_run_takes_args_kwargs_and_timeout(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    assert w.run("tasks.remote:add", (1,), {"b": 2}, timeout=30) == 3
    assert w.run(remote_tasks.add, [4]) == 4


def test_acall_returns_the_result(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()

    async def main() -> list[int]:
        return list(await asyncio.gather(*(w.acall("tasks.remote:add", i, 1) for i in range(4))))

    assert asyncio.run(main()) == [1, 2, 3, 4]


def test_remote_exception_is_reraised_as_its_class_with_the_remote_traceback(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    with pytest.raises(remote_tasks.CustomError) as info:
        w.call(remote_tasks.raise_custom, 5)
    assert info.value.code == 5
    cause = info.value.__cause__
    assert isinstance(cause, comfy_env.RemoteTraceback)
    assert "raise_custom" in cause.traceback_text
    assert w.generation == 1  # the worker survived


def test_builtin_remote_exception_keeps_its_class(pool: comfy_env.Pool) -> None:
    with pytest.raises(ValueError, match="invalid literal"):
        pool.get_worker().call(int, "x")


def test_exception_class_missing_in_host_becomes_remote_error(pool: comfy_env.Pool) -> None:
    with pytest.raises(RemoteError) as info:
        pool.get_worker().call(remote_tasks.raise_local_class)
    err = info.value
    assert err.type_name.endswith("LocalOnly")
    assert "cannot be unpickled" in err.message
    assert "raise_local_class" in err.traceback_text


def test_system_exit_in_a_call_is_a_remote_error_and_the_worker_survives(
    pool: comfy_env.Pool,
) -> None:
    w = pool.get_worker()
    w.call("comfy_env_worker.tasks:echo", 0)
    pid = w.pid
    with pytest.raises(RemoteError) as info:
        w.call(remote_tasks.system_exit, 3)
    assert info.value.type_name == "SystemExit"
    assert (w.pid, w.generation) == (pid, 1)


def test_unpicklable_argument_raises_before_anything_is_sent(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    with pytest.raises(SerializationError, match="cannot be pickled"):
        w.call("comfy_env_worker.tasks:echo", threading.Lock())
    stats = w.stats()
    assert (stats.spawns, stats.submitted) == (0, 0)  # nothing spawned, nothing submitted
    assert isinstance(SerializationError("x"), TypeError)


def test_an_argument_of_a_class_only_the_host_has_is_a_serialization_error_naming_the_call(
    pool: comfy_env.Pool, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It pickles in the host but its module is not in the env: the worker raised the bare
    ``ModuleNotFoundError: No module named 'host_only'``, naming neither the call nor that
    the arguments (not the target) failed."""
    (tmp_path / "host_only.py").write_text("class Mesh:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the host's path only
    host_only = __import__("host_only")
    w = pool.get_worker()
    with pytest.raises(SerializationError) as info:
        w.call("comfy_env_worker.tasks:echo", host_only.Mesh())
    assert str(info.value).startswith(
        "the call to comfy_env_worker.tasks:echo could not be unpickled in the worker, so it "
        "did not run: ModuleNotFoundError: No module named 'host_only'"
    )
    assert "No module named 'host_only'" in str(info.value.__cause__)  # the worker's traceback
    # Still the worker's error too, so code that caught it before still does.
    assert isinstance(info.value, ModuleNotFoundError) and info.value.name == "host_only"
    assert w.call("tasks.remote:add", 1) == 1  # the worker lives on
    assert (w.generation, w.stats().raised) == (1, 1)


def test_errors_of_a_ref_s_calls_name_the_user_s_call_not_the_runtime_s_helper(
    config: comfy_env.PoolConfig,
) -> None:
    """A ref's calls run as ``comfy_env_worker.refs:call_and_keep`` / ``refs:call_method``:
    their ``CallTimeout`` and ``WorkerCrashed`` named those as the target."""
    with comfy_env.Pool(config.model_copy(update={"call_timeout": 0.5})) as pool:
        w = pool.get_worker()
        with pytest.raises(comfy_env.CallTimeout) as timed_out:
            w.call_ref("comfy_env_worker.tasks:sleep", 30)
        assert timed_out.value.target == "comfy_env_worker.tasks:sleep"
        assert "refs:" not in str(timed_out.value), str(timed_out.value)
        ctypes_ref = w.call_ref("importlib:import_module", "ctypes")  # a kept module
        with pytest.raises(comfy_env.WorkerCrashed) as crashed:
            ctypes_ref.call_method("string_at", 0)
        assert crashed.value.target == f"RemoteRef {ctypes_ref.id}.string_at"
        assert f"to RemoteRef {ctypes_ref.id}.string_at" in str(crashed.value)
        assert "refs:" not in str(crashed.value).split("---")[0]


def test_unpicklable_result_is_a_remote_error_naming_the_type(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    with pytest.raises(TypeError, match="lock"):
        w.call(remote_tasks.return_unpicklable)
    assert w.call("tasks.remote:add", 1) == 1
    assert w.generation == 1


def test_missing_module_is_named(pool: comfy_env.Pool) -> None:
    with pytest.raises(ModuleNotFoundError, match="no_such_module_xyz"):
        pool.get_worker().call("no_such_module_xyz.sub:f")


def test_missing_function_is_named(pool: comfy_env.Pool) -> None:
    with pytest.raises(AttributeError, match="'nope'"):
        pool.get_worker().call("tasks.remote:nope")


def _every_entry_point(
    w: comfy_env.Worker, target: Any, args: Any = (), kwargs: Any = None
) -> dict[str, Callable[[], object]]:
    """Each public way to start a call, sync and asyncio, on ``target``; ``call``,
    ``call_ref`` and ``acall`` take their arguments spread (so only a good ``args``)."""

    async def arun() -> object:
        return await w.arun(target, args, kwargs)

    async def arun_ref() -> object:
        return await w.arun_ref(target, args, kwargs)

    async def acall() -> object:
        return await w.acall(target, *tuple(args), **dict(kwargs or {}))

    points: dict[str, Callable[[], object]] = {
        "run": lambda: w.run(target, args, kwargs),
        "submit": lambda: w.submit(target, args, kwargs).result(timeout=10),
        "arun": lambda: asyncio.run(arun()),
        "arun_ref": lambda: asyncio.run(arun_ref()),
    }
    if isinstance(args, tuple) and (kwargs is None or isinstance(kwargs, dict)):
        points["call"] = lambda: w.call(target, *args, **(kwargs or {}))
        points["call_ref"] = lambda: w.call_ref(target, *args, **(kwargs or {}))
        points["acall"] = lambda: asyncio.run(acall())
    return points


def _assert_refused_before_anything_runs(
    pool: comfy_env.Pool, points: dict[str, Callable[[], object]], match: str
) -> None:
    w = pool.get_worker()
    for name, start in points.items():
        with pytest.raises(comfy_env.ArgumentError, match=match) as info:
            start()
        assert isinstance(info.value, comfy_env.ComfyEnvError), name
        stats = w.stats()
        assert (stats.spawns, stats.submitted, stats.failed) == (0, 0, 0), name
    # Nothing was spawned or counted, and the pool keeps working.
    assert w.call("tasks.remote:add", 2, b=3) == 5
    stats = w.stats()
    assert (stats.spawns, stats.submitted, stats.ok, stats.failed) == (1, 1, 1, 0)


@pytest.mark.parametrize(
    ("target", "problem"),
    [
        ("no_colon", "no ':'"),
        ("", "no ':'"),
        (":f", "module part before ':' is empty"),
        ("mod:", "function part after ':' is empty"),
        ("a:b:c", "more than one ':'"),
        ("remote_tasks: add", "whitespace"),
        ("remote_tasks:add\n", "whitespace"),
        (".remote_tasks:add", "empty name"),
        ("pkg..mod:f", "empty name"),
        ("remote_tasks:add.", "'' in the function part"),
        ("remote_tasks:add-one", "not a Python identifier"),
    ],
)
def test_a_malformed_target_string_is_an_argument_error_before_anything_runs(
    pool: comfy_env.Pool, target: str, problem: str
) -> None:
    points = _every_entry_point(pool.get_worker(), target, (1,))
    _assert_refused_before_anything_runs(pool, points, f"module:function.*{problem}")
    # Code written against the built-in error of a malformed target still catches it.
    with pytest.raises(ValueError):
        pool.get_worker().call(target)


@pytest.mark.parametrize("target", [42, None, b"remote_tasks:add", ["remote_tasks:add"]])
def test_a_target_neither_string_nor_callable_is_an_argument_error(
    pool: comfy_env.Pool, target: object
) -> None:
    points = _every_entry_point(pool.get_worker(), target, (1,))
    _assert_refused_before_anything_runs(pool, points, "string .* or a callable, not")
    with pytest.raises(TypeError):  # what code written before the typed error caught
        pool.get_worker().call(target)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (1, None, "args must be a tuple or list .* not int"),
        ("ab", None, r"args must be .* not str \(for one argument write \(value,\)\)"),
        (b"ab", None, "args must be .* not bytes"),
        ({"b": 2}, None, "args must be .* not dict .*keyword arguments go in kwargs"),
        ((1,), [("b", 2)], "kwargs must be a mapping .* not list"),
        ((1,), "b", "kwargs must be a mapping .* not str"),
        ((1,), {1: 2}, "kwargs keys must be argument names .* not int"),
    ],
)
def test_args_and_kwargs_of_the_wrong_shape_are_an_argument_error(
    pool: comfy_env.Pool, args: Any, kwargs: Any, match: str
) -> None:
    points = _every_entry_point(pool.get_worker(), "tasks.remote:add", args, kwargs)
    for spread in ("call", "call_ref", "acall"):
        points.pop(spread, None)  # they spread their own arguments: they cannot get these
    _assert_refused_before_anything_runs(pool, points, match)


def test_args_are_any_iterable_but_a_string_and_kwargs_any_mapping(pool: comfy_env.Pool) -> None:
    w = pool.get_worker()
    with pytest.raises(comfy_env.ArgumentError, match="not str"):
        w.run("tasks.remote:add", "23")  # never the two characters it would have sent
    assert w.run("tasks.remote:add", [2], types.MappingProxyType({"b": 3})) == 5
    assert w.run("tasks.remote:add", (x for x in (2, 3))) == 5
    assert asyncio.run(w.arun("tasks.remote:add", [2, 3])) == 5
    assert w.stats().ok == 3


def test_large_argument_and_result_round_trip(pool: comfy_env.Pool) -> None:
    import numpy as np

    arr = np.arange(3_000_000, dtype=np.float32).reshape(1000, 3000)
    out = pool.get_worker().call("comfy_env_worker.tasks:echo", arr)
    assert out.dtype == arr.dtype and np.array_equal(out, arr)


def test_argument_over_the_frame_limit_is_refused_in_the_caller(
    config: comfy_env.PoolConfig,
) -> None:
    small = config.model_copy(update={"max_frame_bytes": 1024 * 1024, "shared_memory": False})
    with comfy_env.Pool(small) as pool:
        w = pool.get_worker()
        with pytest.raises(SerializationError, match="max_frame_bytes"):
            w.call("comfy_env_worker.tasks:echo", b"x" * (2 * 1024 * 1024))
        assert w.stats().spawns == 0


def test_result_over_the_frame_limit_is_an_error_and_the_worker_survives(
    config: comfy_env.PoolConfig,
) -> None:
    small = config.model_copy(update={"max_frame_bytes": 1024 * 1024, "shared_memory": False})
    with comfy_env.Pool(small) as pool:
        w = pool.get_worker()
        with pytest.raises(OverflowError, match="frame limit"):
            w.call(bytes, 2 * 1024 * 1024)
        assert w.call("tasks.remote:add", 1) == 1
        assert w.generation == 1


def test_shared_memory_carries_buffers_larger_than_a_frame(config: comfy_env.PoolConfig) -> None:
    small = config.model_copy(update={"max_frame_bytes": 1024 * 1024})
    with comfy_env.Pool(small) as pool:
        w = pool.get_worker()
        blob = bytes(range(256)) * (8 * 4096)  # 8 MiB
        assert w.call("comfy_env_worker.tasks:echo", blob) == blob
        assert len(w.call(bytes, 3 * 1024 * 1024)) == 3 * 1024 * 1024


def test_remote_error_pickles() -> None:
    err = RemoteError("mod.Err", "boom", "tb")
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.type_name, clone.message, clone.traceback_text) == ("mod.Err", "boom", "tb")


def test_default_pool_get_worker(default_pool_cleanup: None) -> None:
    w = comfy_env.get_worker()
    assert w.call("comfy_env_worker.tasks:echo", "hi") == "hi"
    assert comfy_env.get_worker().env == w.env
