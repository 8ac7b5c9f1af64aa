"""``comfy_env.comfyui`` without ComfyUI: the scan in a real worker, its cache, the loud
failures, the proxies' attributes and hooks, tensors as numpy, and objects kept in the worker.

The env is the test interpreter itself (``env=None``), which has numpy and no ComfyUI, so the
pack's imports of ``folder_paths`` and ``comfy.*`` are served by the worker's stand-ins. The
end-to-end behaviour inside a real ComfyUI server is in ``tests_comfyui/``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import comfy_env
from comfy_env.comfyui import KeptOutput, NodePackError, isolate
from comfy_env_worker.comfyui import values

NODES = '''
import os
import ctypes
import folder_paths
import comfy.model_management
from comfy.utils import ProgressBar
from server import PromptServer
from .helpers import double


class Box:
    def __init__(self, v):
        self.v = v
        self.pid = os.getpid()


class Scale:
    CATEGORY = "t"
    DESCRIPTION = "doubles"
    RETURN_TYPES = ("IMAGE", "STRING")
    RETURN_NAMES = ("image", "where")
    OUTPUT_TOOLTIPS = ("doubled", "module")
    FUNCTION = "go"
    NOT_IDEMPOTENT = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",), "n": ("INT", {"default": 1, "min": 0})}}

    @classmethod
    def VALIDATE_INPUTS(cls, n):
        return True if n < 10 else "n too big"

    def go(self, image, n):
        ProgressBar(2).update(1)
        comfy.model_management.throw_exception_if_processing_interrupted()
        return (double(image) * n, type(image).__module__)


class MakeBox:
    RETURN_TYPES = ("BOX", "INT")
    FUNCTION = "make"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"v": ("INT", {})}}

    def make(self, v):
        return (Box(v), os.getpid())


class OpenBox:
    RETURN_TYPES = ("INT", "INT")
    FUNCTION = "open"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"box": ("BOX",)}}

    def open(self, box):
        return (box.v, box.pid)


class Crash:
    RETURN_TYPES = ("INT",)
    FUNCTION = "crash"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def crash(self):
        ctypes.string_at(0)


class Counter:
    """One node object per proxy object (ComfyUI keeps one per node id)."""
    RETURN_TYPES = ("INT",)
    FUNCTION = "count"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def __init__(self):
        self.n = 0

    def count(self):
        self.n += 1
        return (self.n,)


class Sleep:
    RETURN_TYPES = ("INT",)
    FUNCTION = "sleep"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seconds": ("FLOAT", {})}}

    def sleep(self, seconds):
        import time
        time.sleep(seconds)
        return (os.getpid(),)


class MakeBoxes:
    RETURN_TYPES = ("BOX",)
    OUTPUT_IS_LIST = (True,)
    FUNCTION = "make"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"n": ("INT", {})}}

    def make(self, n):
        return ([Box(v) for v in range(n)],)


NODE_CLASS_MAPPINGS = {"Scale": Scale, "MakeBox": MakeBox, "OpenBox": OpenBox,
                       "Crash": Crash, "Counter": Counter, "Sleep": Sleep,
                       "MakeBoxes": MakeBoxes}
NODE_DISPLAY_NAME_MAPPINGS = {"Scale": "Scale it"}
'''


@pytest.fixture
def pack(tmp_path: Path) -> Path:
    root = tmp_path / "pack"
    root.mkdir()
    (root / "__init__.py").write_text("raise RuntimeError('the pack init must not run')\n")
    (root / "nodes.py").write_text(NODES)
    (root / "helpers.py").write_text("def double(x):\n    return x * 2\n")
    return root


def _isolate(pack: Path, pool: comfy_env.Pool, cache: Path, **kw: object):  # type: ignore[no-untyped-def]
    return isolate(str(pack / "__init__.py"), None, "nodes", pool=pool, cache_dir=str(cache), **kw)  # type: ignore[arg-type]


def test_the_scan_runs_in_the_env_and_carries_every_attribute(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, display = _isolate(pack, pool, tmp_path / "cache")
    assert pool.stats()[sys.prefix].spawns == 1  # scanned in a worker, not here
    assert "folder_paths" not in sys.modules and "comfy" not in sys.modules
    assert display == {"Scale": "Scale it"}
    scale = mappings["Scale"]
    assert scale.INPUT_TYPES() == {
        "required": {"image": ("IMAGE",), "n": ("INT", {"default": 1, "min": 0})}
    }
    assert scale.RETURN_TYPES == ("IMAGE", "STRING")
    assert scale.RETURN_NAMES == ("image", "where")
    assert scale.OUTPUT_TOOLTIPS == ("doubled", "module")
    assert (scale.CATEGORY, scale.DESCRIPTION, scale.NOT_IDEMPOTENT) == ("t", "doubles", True)
    assert scale.FUNCTION == "go" and inspect.iscoroutinefunction(scale.go)
    # ComfyUI reads VALIDATE_INPUTS' argument names: the proxy keeps the author's
    assert inspect.getfullargspec(scale.VALIDATE_INPUTS).args == ["cls", "n"]
    assert asyncio.run(scale.VALIDATE_INPUTS(n=20)) == "n too big"
    assert not hasattr(scale, "IS_CHANGED")


def test_a_warm_start_spawns_no_worker_and_a_code_change_rescans(
    pack: Path, tmp_path: Path, config: comfy_env.PoolConfig
) -> None:
    cache = tmp_path / "cache"
    with comfy_env.Pool(config) as first:
        _isolate(pack, first, cache)
    with comfy_env.Pool(config) as warm:
        mappings, _ = _isolate(pack, warm, cache)
        assert "Scale" in mappings
        assert warm.stats() == {}  # nothing spawned, not even an entry
    (pack / "helpers.py").write_text("def double(x):\n    return x * 3\n")
    with comfy_env.Pool(config) as changed:
        _isolate(pack, changed, cache)
        assert changed.stats()[sys.prefix].spawns == 1


def test_a_pack_that_fails_to_import_raises_with_the_worker_traceback_and_output(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    (pack / "nodes.py").write_text("print('loading the mesh library')\nimport no_such_mesh_lib\n")
    with pytest.raises(NodePackError) as info:
        _isolate(pack, pool, tmp_path / "cache")
    message = str(info.value)
    assert "ModuleNotFoundError" in message and "no_such_mesh_lib" in message
    assert "worker traceback" in message and "nodes.py" in message
    assert "loading the mesh library" in message  # what the worker printed
    assert "not imported into the server" in message
    assert not list((tmp_path / "cache").glob("*.json"))  # failures are never cached


def test_a_missing_env_raises_naming_the_paths_tried(pack: Path, tmp_path: Path) -> None:
    import traceback

    with pytest.raises(NodePackError) as info:
        isolate(str(pack / "__init__.py"), ".venv", "nodes", cache_dir=str(tmp_path))
    assert str(pack / ".venv") in str(info.value)
    # The EnvError's text is in the message: ComfyUI's log of the formatted exception shows
    # it once (it was chained, so the server log showed it a third time).
    logged = "".join(traceback.format_exception(info.value))
    assert logged.count(str(pack / ".venv")) == str(info.value).count(str(pack / ".venv"))


def test_the_prompt_server_stand_in_says_what_it_lacks() -> None:
    from comfy_env_worker.comfyui import standins

    with pytest.raises(AttributeError, match="'app': it is comfy-env's stand-in"):
        standins.PromptServer.instance.app  # noqa: B018 - the lookup is the test
    assert not hasattr(standins.PromptServer.instance, "loop")
    assert hasattr(standins.PromptServer.instance, "routes")  # recorded, served by the host


def test_a_pack_needing_more_of_comfyui_than_the_stand_ins_is_told_so(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    """``mm.get_torch_device()`` at import (many packs do it) failed the scan with a bare
    "module 'comfy.model_management' has no attribute 'get_torch_device'"."""
    (pack / "nodes.py").write_text(
        "import comfy.model_management as mm\nDEVICE = mm.get_torch_device()\n"
    )
    with pytest.raises(NodePackError) as info:
        _isolate(pack, pool, tmp_path / "cache")
    message = str(info.value)
    assert "has no attribute 'get_torch_device': it is comfy-env's stand-in for ComfyUI's" in (
        message
    )
    assert "which offers only InterruptProcessingException, interrupt_current_processing" in (
        message
    )


def test_images_cross_as_numpy_with_exact_values_and_node_objects_persist(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = _isolate(pack, pool, tmp_path / "cache")
    image = np.random.default_rng(1).random((2, 512, 512, 3), dtype=np.float32)  # out of band
    out, where = asyncio.run(mappings["Scale"]().go(image=image, n=3))
    assert where == "numpy" and out.dtype == np.float32
    assert np.array_equal(out, image * 2 * 3)
    a, b = mappings["Counter"](), mappings["Counter"]()
    assert [asyncio.run(a.count())[0] for _ in range(3)] == [1, 2, 3]
    assert asyncio.run(b.count()) == (1,)  # another node id, another node object


def test_a_kept_object_is_reused_and_after_a_crash_its_producer_is_marked_changed(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = _isolate(pack, pool, tmp_path / "cache")
    make, open_ = mappings["MakeBox"], mappings["OpenBox"]
    assert "comfy_env_unique_id" in make.INPUT_TYPES()["hidden"]
    token = asyncio.run(make.IS_CHANGED(v=5, comfy_env_unique_id="7"))
    box, pid = asyncio.run(make().make(v=5, comfy_env_unique_id="7"))
    assert isinstance(box, KeptOutput) and box.alive and box.type_name == "BOX"
    assert asyncio.run(open_().open(box=box)) == (5, pid)  # the live object, same worker
    assert asyncio.run(make.IS_CHANGED(v=5, comfy_env_unique_id="7")) == token
    with pytest.raises(comfy_env.WorkerCrashed):
        asyncio.run(mappings["Crash"]().crash())
    assert not box.alive
    assert asyncio.run(make.IS_CHANGED(v=5, comfy_env_unique_id="7")) != token
    with pytest.raises(comfy_env.StaleGenerationError):
        asyncio.run(open_().open(box=box))


def test_the_pack_timeout_bounds_each_node_call(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = _isolate(pack, pool, tmp_path / "cache", timeout=0.5)
    with pytest.raises(comfy_env.CallTimeout):
        asyncio.run(mappings["Sleep"]().sleep(seconds=30.0))
    assert asyncio.run(mappings["Sleep"]().sleep(seconds=0.0))[0] > 0  # a fresh worker


def test_a_crash_loop_says_how_to_reset(
    pack: Path, tmp_path: Path, config: comfy_env.PoolConfig
) -> None:
    with comfy_env.Pool(config.model_copy(update={"max_restarts": 1})) as pool:
        mappings, _ = _isolate(pack, pool, tmp_path / "cache")
        crash = mappings["Crash"]()
        for _ in range(2):
            with pytest.raises(comfy_env.WorkerCrashed):
                asyncio.run(crash.crash())
        with pytest.raises(comfy_env.EnvAbandonedError) as info:
            asyncio.run(crash.crash())
        assert "To reset" in str(info.value) and "restart ComfyUI" in str(info.value)
        pool.reset(None)
        assert asyncio.run(mappings["Counter"]().count()) == (1,)


LOUD = """
import ctypes
import logging

import numpy


class Loud:
    RETURN_TYPES = ("INT",)
    FUNCTION = "go"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"crash": ("BOOLEAN", {})}}

    def go(self, crash):
        logging.getLogger(__name__).warning("said by the pack")
        if crash:
            ctypes.memset(0, 0, 1)  # a C function: this method is the innermost frame
        return (1,)


NODE_CLASS_MAPPINGS = {"Loud": Loud}
"""


def test_a_pack_s_breaker_settings_lift_a_crash_loop_by_themselves(
    pack: Path, tmp_path: Path, config: comfy_env.PoolConfig
) -> None:
    (pack / "loud.py").write_text(LOUD)
    offset = [0.0]
    clock = lambda: time.monotonic() + offset[0]  # noqa: E731
    # The pool's own breaker would allow 100 deaths and block until reset; the pack's wins.
    with comfy_env.Pool(config.model_copy(update={"max_restarts": 100}), clock=clock) as pool:
        mappings, _ = isolate(
            str(pack / "__init__.py"),
            None,
            "loud",
            pool=pool,
            cache_dir=str(tmp_path / "cache"),
            max_restarts=1,
            restart_window=10.0,
            abandon_for=120.0,
        )
        loud = mappings["Loud"]()
        for _ in range(2):
            with pytest.raises(comfy_env.WorkerCrashed) as crashed:
                asyncio.run(loud.go(crash=True))
        assert crashed.value.stderr_tail.splitlines()[-1].startswith("Extension modules")
        with pytest.raises(comfy_env.EnvAbandonedError) as info:
            asyncio.run(loud.go(crash=False))
        message = str(info.value)
        assert "abandon_for=120s" in message and "To reset" in message
        deaths = message.split("Recent deaths:\n", 1)[1].splitlines()[:2]
        for line in deaths:  # the frame in the pack's file, not "Extension modules: numpy..."
            assert "crashed in File " in line and line.endswith('loud.py", line 20 in go'), line
        offset[0] += 121.0
        assert asyncio.run(loud.go(crash=False)) == (1,)


def test_a_pack_s_bad_breaker_setting_fails_the_import(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    with pytest.raises(comfy_env.ArgumentError, match="abandon_for"):
        _isolate(pack, pool, tmp_path / "cache", abandon_for=-1.0)


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("timeout", -1, "timeout"),
        ("timeout", float("inf"), "timeout"),
        ("timeout", float("nan"), "timeout"),
        ("timeout", "abc", "timeout"),
        ("interrupt_grace", -5, "interrupt_grace"),
        ("interrupt_grace", float("nan"), "interrupt_grace"),
        ("interrupt_grace", True, "interrupt_grace"),
        ("scan_timeout", -1, "scan_timeout"),
        ("scan_timeout", None, "scan_timeout"),
        ("pool", "notapool", "pool"),
        ("crossing_types", "IMAGE", "crossing_types"),
        ("extra_crossing_types", [1], "extra_crossing_types"),
        ("module", "../../etc/passwd", "module"),
        ("module", "nodes.", "module"),
        ("module", "nodes.py", "module"),
    ],
)
def test_a_bad_option_fails_the_import_before_anything_runs(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path, option: str, value: object, named: str
) -> None:
    """They were accepted (a cached scan skipped even ``scan_timeout``), then every prompt
    failed with ``ArgumentError`` (``timeout``), ``AttributeError`` (``pool``), or never
    (``interrupt_grace``); a bad module string came back as "No module named 'pack.'"."""
    options: dict[str, object] = {"pool": pool, option: value}
    module = options.pop("module", "nodes")
    with pytest.raises(comfy_env.ArgumentError, match=rf"isolate\({named}=\.\.\.\)"):
        isolate(str(pack / "__init__.py"), None, module, cache_dir=str(tmp_path), **options)  # type: ignore[arg-type]
    assert pool.stats() == {}  # nothing was started


def test_an_interrupt_grace_of_zero_is_kill_at_once_not_refused(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = _isolate(pack, pool, tmp_path / "cache", interrupt_grace=0)
    assert mappings


def test_pack_modules_log_under_the_pack_directory_s_name(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (pack / "loud.py").write_text(LOUD)
    caplog.set_level(logging.INFO, logger="comfy_env.worker")
    mappings, _ = isolate(
        str(pack / "__init__.py"), None, "loud", pool=pool, cache_dir=str(tmp_path / "cache")
    )
    assert asyncio.run(mappings["Loud"]().go(crash=False)) == (1,)
    said = [r for r in caplog.records if r.getMessage() == "said by the pack"]
    assert len(said) == 1
    assert said[0].worker_logger == "pack.loud"  # type: ignore[attr-defined]
    # Other envs' records, and this env's other loggers, keep their names.
    pool.get_worker().call("tasks.remote:log_things", 1)
    assert any(getattr(r, "worker_logger", None) == "mylib.sub" for r in caplog.records)


def test_importing_comfy_env_does_not_import_the_comfyui_layer_nor_comfyui_or_torch() -> None:
    import subprocess

    code = (
        "import sys, comfy_env\n"
        "assert 'comfy_env.comfyui' not in sys.modules\n"
        "import comfy_env.comfyui\n"
        "bad = [m for m in ('torch', 'folder_paths', 'comfy', 'comfy_api', 'server')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_progress_bars_in_node_code_become_call_events(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = _isolate(pack, pool, tmp_path / "cache")
    node = mappings["Scale"]._comfy_env_node
    events: list[comfy_env.CallEvent] = []
    image = np.zeros((1, 2, 2, 3), np.float32)
    skeleton, tensors = values.split({"image": image, "n": 1}, values.to_wire)
    pool.get_worker(None).run(
        "comfy_env_worker.comfyui.runner:run_node",
        (node.spec, 1, "go", skeleton, tensors, [], {}),
        on_event=events.append,
    )
    assert [(e.kind, e.data["done"], e.data["total"]) for e in events] == [("progress", 1, 2)]


def test_interrupt_checks_in_node_code_follow_the_call_s_cancellation(
    pack: Path, config: comfy_env.PoolConfig, tmp_path: Path
) -> None:
    (pack / "nodes.py").write_text(
        NODES
        + """

class Loop:
    RETURN_TYPES = ("INT",)
    FUNCTION = "loop"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def loop(self):
        import time
        while True:
            comfy.model_management.throw_exception_if_processing_interrupted()
            time.sleep(0.01)


NODE_CLASS_MAPPINGS["Loop"] = Loop
"""
    )
    with comfy_env.Pool(config.model_copy(update={"cancel_grace": 30.0})) as pool:
        mappings, _ = _isolate(pack, pool, tmp_path / "cache")
        w = pool.get_worker(None)
        generation = w.generation

        async def main() -> None:
            task = asyncio.ensure_future(mappings["Loop"]().loop())
            while w.stats().in_flight == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        # the node stopped itself at its check (long before the 30 s grace): same worker
        assert w.generation == generation and w.stats().cancelled == 1


def test_a_package_installed_into_the_env_invalidates_the_scan(
    pack: Path, tmp_path: Path, config: comfy_env.PoolConfig, foreign_venv: Path
) -> None:
    """A bare venv without comfy-env, numpy or ComfyUI scans the pack; changing its
    site-packages (what ``pip install`` does) makes the next start scan again."""
    cache = tmp_path / "cache"

    def spawns() -> int:
        with comfy_env.Pool(config) as pool:
            isolate(str(pack), str(foreign_venv), "nodes", pool=pool, cache_dir=str(cache))
            return sum(s.spawns for s in pool.stats().values())

    assert spawns() == 1
    assert spawns() == 0
    (site,) = foreign_venv.glob("lib/python*/site-packages")
    (site / "newly_installed.py").write_text("")
    assert spawns() == 1


def test_a_pack_runs_in_a_python_3_8_env(pack: Path, pool: comfy_env.Pool, tmp_path: Path) -> None:
    from conftest import other_python

    py38 = other_python(8)
    if py38 is None:
        pytest.skip("no Python 3.8 on this machine")
    mappings, _ = isolate(str(pack), py38, "nodes", pool=pool, cache_dir=str(tmp_path))
    counter = mappings["Counter"]()
    assert [asyncio.run(counter.count())[0] for _ in range(2)] == [1, 2]
    box, _ = asyncio.run(mappings["MakeBox"]().make(v=3, comfy_env_unique_id="1"))
    assert asyncio.run(mappings["OpenBox"]().open(box=box))[0] == 3


def test_a_list_output_that_stays_in_the_worker_is_kept_item_by_item(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = _isolate(pack, pool, tmp_path / "cache")
    (boxes,) = asyncio.run(mappings["MakeBoxes"]().make(n=3, comfy_env_unique_id="2"))
    assert [type(b) for b in boxes] == [KeptOutput] * 3  # ComfyUI iterates over the list
    opened = [asyncio.run(mappings["OpenBox"]().open(box=b))[0] for b in boxes]
    assert opened == [0, 1, 2]


FAILING = """
from tasks.remote import CustomError, FieldError
from .impl.helpers import AuditError


class Fail:
    RETURN_TYPES = ("INT",)
    FUNCTION = "fail"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"how": ("STRING", {})}}

    def fail(self, how):
        if how == "key":
            raise KeyError("audit missing key")
        if how == "args":
            raise CustomError(7, "custom failure")
        if how == "str":
            raise FieldError("width")
        if how == "file":
            open("/nonexistent-comfy-env/x")
        if how == "decode":
            b"ab\\xffcd".decode("utf-8")
        if how == "import":
            raise ImportError("no mesh backend", name="mesh_backend", path="/opt/mesh")
        if how == "syntax":
            compile("x = (", "<node expr>", "exec")
        raise AuditError("audit says no")


NODE_CLASS_MAPPINGS = {"Fail": Fail}
"""


@pytest.fixture
def failing_pack(pack: Path) -> Path:
    (pack / "nodes.py").write_text(FAILING)
    (pack / "impl").mkdir()
    (pack / "impl" / "__init__.py").write_text("")
    (pack / "impl" / "helpers.py").write_text("class AuditError(Exception):\n    pass\n")
    return pack


def _node_error(mappings: dict[str, type], how: str) -> Exception:
    with pytest.raises(Exception) as info:
        asyncio.run(mappings["Fail"]().fail(how=how))
    return info.value


def _readable_with_traceback(exc: Exception, first_line: str) -> None:
    """What ComfyUI shows as the error's message (``str(exc)``, execution.py's
    ``exception_message``): the node's text, then the worker's traceback, on real lines."""
    shown = str(exc)
    assert shown.startswith(f"{first_line}\n\nworker traceback:\nTraceback (most recent call")
    assert "\\n" not in shown
    assert 'nodes.py", line' in shown and "in fail" in shown


def test_a_key_error_shows_its_message_and_the_worker_traceback_on_real_lines(
    failing_pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = _isolate(failing_pack, pool, tmp_path / "cache")
    key = _node_error(mappings, "key")
    assert type(key) is KeyError  # str(KeyError) is the repr of its argument: not quoted here
    _readable_with_traceback(key, "'audit missing key'")


def test_an_exception_with_several_args_keeps_its_type_and_gets_the_worker_traceback(
    failing_pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    from tasks.remote import CustomError

    mappings, _ = _isolate(failing_pack, pool, tmp_path / "cache")
    several = _node_error(mappings, "args")
    assert type(several) is CustomError and several.code == 7
    _readable_with_traceback(several, "(7, 'custom failure')")


def test_an_exception_with_its_own_str_keeps_its_name_and_gets_the_worker_traceback(
    failing_pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    import pickle

    from tasks.remote import FieldError

    mappings, _ = _isolate(failing_pack, pool, tmp_path / "cache")
    own_str = _node_error(mappings, "str")
    # A subclass under the same name: ComfyUI's exception_type (module + qualname) is unchanged
    assert isinstance(own_str, FieldError) and own_str.field == "width"
    assert (type(own_str).__module__, type(own_str).__qualname__) == ("tasks.remote", "FieldError")
    _readable_with_traceback(own_str, "audit failed on field width")
    assert type(pickle.loads(pickle.dumps(own_str))) is FieldError  # pickles as the original
    missing = _node_error(mappings, "file")  # OSError's text comes from its fields
    assert isinstance(missing, FileNotFoundError) and missing.errno == 2
    assert missing.filename == "/nonexistent-comfy-env/x"
    _readable_with_traceback(
        missing, "[Errno 2] No such file or directory: '/nonexistent-comfy-env/x'"
    )


def test_an_exception_with_fields_keeps_them_on_the_node_s_copy(
    failing_pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    # Built-in exceptions whose text comes from fields set by their __init__ (not in .args
    # or __dict__): the copy that shows the worker traceback has those fields too.
    mappings, _ = _isolate(failing_pack, pool, tmp_path / "cache")
    decode = _node_error(mappings, "decode")
    assert isinstance(decode, UnicodeDecodeError)
    assert (decode.encoding, decode.object, decode.start, decode.end) == (
        "utf-8",
        b"ab\xffcd",
        2,
        3,
    )
    assert decode.reason == "invalid start byte"
    _readable_with_traceback(
        decode, "'utf-8' codec can't decode byte 0xff in position 2: invalid start byte"
    )
    missing = _node_error(mappings, "import")
    assert isinstance(missing, ImportError)
    assert (missing.name, missing.path) == ("mesh_backend", "/opt/mesh")
    _readable_with_traceback(missing, "no mesh backend")
    syntax = _node_error(mappings, "syntax")
    assert isinstance(syntax, SyntaxError)
    assert (syntax.filename, syntax.lineno) == ("<node expr>", 1) and syntax.msg


def test_a_pack_s_own_exception_is_named_after_the_pack_directory(
    failing_pack: Path, pool: comfy_env.Pool, tmp_path: Path, config: comfy_env.PoolConfig
) -> None:
    mappings, _ = _isolate(failing_pack, pool, tmp_path / "cache")
    error = _node_error(mappings, "own")
    assert isinstance(error, comfy_env.RemoteError)  # the pack's classes exist only in its env
    assert error.type_name == "pack.impl.helpers.AuditError"
    _readable_with_traceback(error, "pack.impl.helpers.AuditError: audit says no")
    assert "\npack.impl.helpers.AuditError: audit says no" in error.traceback_text
    assert isinstance(error.__cause__, comfy_env.RemoteTraceback)
    for text in (str(error), error.traceback_text, error.__cause__.traceback_text):
        assert "comfy_env_pack_" not in text
    (failing_pack / "nodes.py").write_text(
        "from .impl.helpers import AuditError\nraise AuditError('at import')\n"
    )
    with comfy_env.Pool(config) as fresh, pytest.raises(NodePackError) as info:
        _isolate(failing_pack, fresh, tmp_path / "cache")  # a worker that never imported it
    assert "pack.impl.helpers.AuditError: at import" in str(info.value)
    assert "comfy_env_pack_" not in str(info.value)


def test_a_pack_that_fails_to_scan_leaves_no_worker_behind(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    from conftest import alive, wait_until

    events: list[object] = []
    pool.subscribe(events.append)
    (pack / "nodes.py").write_text("import no_such_mesh_lib\n")
    with pytest.raises(NodePackError):
        _isolate(pack, pool, tmp_path / "cache")
    stats = pool.stats()[sys.prefix]
    assert [(w.state, w.retire_reason) for w in stats.workers] == [("retired", "idle")]
    assert stats.reaped == 1
    assert wait_until(lambda: any(isinstance(e, comfy_env.WorkerRetired) for e in events))
    (spawned,) = [e for e in events if isinstance(e, comfy_env.WorkerSpawned)]
    assert not alive(spawned.pid)


def test_a_failed_scan_carries_the_worker_traceback_once(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path
) -> None:
    import traceback

    (pack / "nodes.py").write_text("import no_such_mesh_lib\n")
    with pytest.raises(NodePackError) as info:
        _isolate(pack, pool, tmp_path / "cache")
    # ComfyUI logs the formatted exception, then "Cannot import ...: <message>": the worker's
    # traceback is in the message, so the exception carries it once (no chained copy).
    logged = "".join(traceback.format_exception(info.value))
    assert logged.count("worker traceback:") == 1 and "no_such_mesh_lib" in logged
    assert info.value.__cause__ is None and info.value.__context__ is not None
