"""``isolate(..., comfyui="server")``: the worker imports the server's own ComfyUI.

The server is played by this process: a small ComfyUI source tree written per test (the
modules and names a pack and comfy-env's set-up touch: ``comfy.options`` / ``comfy.cli_args``
parsing ``--cpu``, ``folder_paths``, ``comfy.utils``' progress hook, ``comfy.model_management``
choosing its device from the arguments, ``server.PromptServer``, ``nodes``, ``utils``), and
``folder_paths`` / ``comfy.options`` modules in ``sys.modules`` as ComfyUI's would be, with
``sys.argv`` as the server's command line. The real ComfyUI (both versions) and the real
third-party pack are tested in ``tests_comfyui/test_server_comfyui.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import comfy_env
from comfy_env import ArgumentError
from comfy_env.comfyui import NodePackError, _server, isolate

TREE = {
    "comfy/__init__.py": "",
    "comfy/options.py": (
        "args_parsing = False\n"
        "def enable_args_parsing(enable=True):\n"
        "    global args_parsing\n"
        "    args_parsing = enable\n"
    ),
    "comfy/cli_args.py": (
        "import argparse\n"
        "import comfy.options\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--cpu', action='store_true')\n"
        "parser.add_argument('--base-directory', default=None)\n"
        "parser.add_argument('--listen', nargs='?', const='0.0.0.0', default='127.0.0.1')\n"
        "parser.add_argument('--port', type=int, default=8188)\n"
        "args = parser.parse_args() if comfy.options.args_parsing else parser.parse_args([])\n"
    ),
    "comfy/utils.py": (
        "PROGRESS_BAR_HOOK = None\n"
        "def set_progress_bar_global_hook(function):\n"
        "    global PROGRESS_BAR_HOOK\n"
        "    PROGRESS_BAR_HOOK = function\n"
        "class ProgressBar:\n"
        "    def __init__(self, total, node_id=None):\n"
        "        self.total, self.current, self.hook = total, 0, PROGRESS_BAR_HOOK\n"
        "        self.node_id = node_id\n"
        "    def update(self, value):\n"
        "        self.current += value\n"
        "        if self.hook is not None:\n"
        "            self.hook(self.current, self.total, None, node_id=self.node_id)\n"
    ),
    "comfy/model_management.py": (
        "from comfy.cli_args import args\n"
        "if not args.cpu:\n"
        "    raise RuntimeError('Found no NVIDIA driver on your system')\n"
        "class InterruptProcessingException(Exception):\n"
        "    pass\n"
        "interrupt_processing = False\n"
        "def interrupt_current_processing(value=True):\n"
        "    global interrupt_processing\n"
        "    interrupt_processing = value\n"
        "def processing_interrupted():\n"
        "    return interrupt_processing\n"
        "def throw_exception_if_processing_interrupted():\n"
        "    global interrupt_processing\n"
        "    if interrupt_processing:\n"
        "        interrupt_processing = False\n"
        "        raise InterruptProcessingException()\n"
        "def get_torch_device():\n"
        "    return 'cpu'\n"
    ),
    "folder_paths.py": (
        "import os\n"
        "from comfy.cli_args import args\n"
        "base_path = args.base_directory or os.path.dirname(os.path.realpath(__file__))\n"
        "models_dir = os.path.join(base_path, 'models')\n"
        "folder_names_and_paths = {\n"
        "    'checkpoints': ([os.path.join(models_dir, 'checkpoints')], {'.safetensors'})}\n"
        "output_directory = os.path.join(base_path, 'output')\n"
        "temp_directory = os.path.join(base_path, 'temp')\n"
        "input_directory = os.path.join(base_path, 'input')\n"
        "def set_output_directory(d):\n"
        "    global output_directory\n"
        "    output_directory = d\n"
        "def set_temp_directory(d):\n"
        "    global temp_directory\n"
        "    temp_directory = d\n"
        "def set_input_directory(d):\n"
        "    global input_directory\n"
        "    input_directory = d\n"
        "def get_output_directory():\n"
        "    return output_directory\n"
        "def get_temp_directory():\n"
        "    return temp_directory\n"
        "def get_input_directory():\n"
        "    return input_directory\n"
        "def get_folder_paths(name):\n"
        "    return folder_names_and_paths[name][0][:]\n"
        "def add_model_folder_path(name, path):\n"
        "    folder_names_and_paths.setdefault(name, ([], set()))[0].append(path)\n"
    ),
    "utils/__init__.py": "",
    "utils/extra_config.py": "",
    "execution.py": "import comfy.utils\n",
    "server.py": (
        "import execution\nimport utils.extra_config\nclass PromptServer:\n    instance = None\n"
    ),
    "nodes.py": "import comfy.utils\nMAX_RESOLUTION = 16384\n",
    "node_helpers.py": "",
}

NODES = """
import json
import os
import sys

import comfy.model_management as mm
import comfy.utils
import folder_paths
import node_helpers
import nodes
from comfy.cli_args import args
from server import PromptServer

folder_paths.add_model_folder_path("luts", os.path.join(os.path.dirname(__file__), "luts"))


class Report:
    RETURN_TYPES = ("STRING",)
    FUNCTION = "run"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"size": ("INT", {"max": nodes.MAX_RESOLUTION})}}

    def run(self, size):
        comfy.utils.ProgressBar(2).update(1)
        PromptServer.instance.send_sync("probe", {"size": size})
        return (json.dumps({
            "pid": os.getpid(),
            "cpu": args.cpu,
            "device": mm.get_torch_device(),
            "output": folder_paths.get_output_directory(),
            "checkpoints": folder_paths.get_folder_paths("checkpoints"),
            "luts": folder_paths.get_folder_paths("luts"),
            "nodes": nodes.__file__,
            "server": type(PromptServer.instance).__name__,
        }),)


class Interrupted:
    RETURN_TYPES = ("INT",)
    FUNCTION = "run"
    CATEGORY = "t"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def run(self):
        mm.interrupt_current_processing(True)
        mm.throw_exception_if_processing_interrupted()
        return (1,)


NODE_CLASS_MAPPINGS = {"Report": Report, "Interrupted": Interrupted}
"""


@pytest.fixture
def comfy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "ComfyUI"
    for name, text in TREE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def server(comfy_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """This process plays a ComfyUI server started with ``--cpu`` and its own base
    directory: ComfyUI's ``folder_paths`` and ``comfy.options`` as it would hold them."""
    base = tmp_path / "base"
    state: dict[str, Any] = {
        "base": base,
        "output": str(base / "out"),
        "checkpoints": [str(base / "models" / "checkpoints"), str(tmp_path / "more")],
    }
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.__file__ = str(comfy_tree / "folder_paths.py")
    folder_paths.folder_names_and_paths = {  # type: ignore[attr-defined]
        "checkpoints": (state["checkpoints"], {".safetensors"})
    }
    folder_paths.models_dir = str(base / "models")  # type: ignore[attr-defined]
    folder_paths.base_path = str(base)  # type: ignore[attr-defined]
    folder_paths.get_output_directory = lambda: state["output"]  # type: ignore[attr-defined]
    folder_paths.get_input_directory = lambda: str(base / "input")  # type: ignore[attr-defined]
    folder_paths.get_temp_directory = lambda: str(base / "temp")  # type: ignore[attr-defined]
    options = types.ModuleType("comfy.options")
    options.args_parsing = True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    monkeypatch.setitem(sys.modules, "comfy.options", options)
    monkeypatch.setattr(sys, "argv", ["main.py", "--cpu", "--base-directory", str(base)])
    monkeypatch.setattr(_server, "_DESCRIBED", [])
    return state


@pytest.fixture
def pack(tmp_path: Path) -> Path:
    root = tmp_path / "pack"
    root.mkdir()
    (root / "__init__.py").write_text("raise RuntimeError('the pack init must not run')\n")
    (root / "nodes_impl.py").write_text(NODES)
    return root


def _report(mappings: dict[str, type], size: int = 7) -> dict[str, Any]:
    node = mappings["Report"]()
    out = asyncio.run(node.run(size=size))  # type: ignore[attr-defined]
    report: dict[str, Any] = json.loads(out[0])
    return report


def test_the_worker_imports_the_servers_comfyui_with_its_arguments_and_folders(
    pack: Path, comfy_tree: Path, server: dict[str, Any], pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = isolate(
        str(pack), None, "nodes_impl", pool=pool, cache_dir=str(tmp_path / "c"), comfyui="server"
    )
    assert mappings["Report"].INPUT_TYPES()["required"]["size"][1]["max"] == 16384  # type: ignore[attr-defined]
    report = _report(mappings)
    assert report["pid"] != os.getpid()
    # --cpu reached comfy.cli_args before comfy.model_management chose its device
    assert report["cpu"] is True and report["device"] == "cpu"
    assert report["nodes"] == str(comfy_tree / "nodes.py")  # the server's tree, in place
    assert report["output"] == server["output"]
    assert report["checkpoints"] == server["checkpoints"]  # the server's, not the defaults
    assert report["luts"] == [str(pack / "luts")]  # what the pack added in the worker stays
    assert report["server"] == "_PromptServerInstance"  # send_sync reaches the host
    # The server's folders change while it runs: the next call sees them.
    server["checkpoints"].append(str(tmp_path / "added"))
    server["output"] = str(tmp_path / "moved-output")
    again = _report(mappings)
    assert again["pid"] == report["pid"]
    assert again["checkpoints"] == server["checkpoints"] and again["output"] == server["output"]
    assert again["luts"] == [str(pack / "luts")]


def test_comfyuis_own_interrupt_raised_in_the_worker_arrives_as_an_interrupt(
    pack: Path, server: dict[str, Any], pool: comfy_env.Pool, tmp_path: Path
) -> None:
    mappings, _ = isolate(
        str(pack), None, "nodes_impl", pool=pool, cache_dir=str(tmp_path / "c"), comfyui="server"
    )
    # This process has no comfy.model_management: the proxy's interrupt is a cancellation
    # (in a server, ComfyUI's own InterruptProcessingException; tests_comfyui).
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(mappings["Interrupted"]().run())  # type: ignore[attr-defined]


def test_a_server_comfyui_that_refuses_the_arguments_fails_the_scan_loudly(
    pack: Path,
    server: dict[str, Any],
    pool: comfy_env.Pool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ["main.py", "--no-such-flag"])
    with pytest.raises(NodePackError, match="refused the server's arguments"):
        isolate(
            str(pack),
            None,
            "nodes_impl",
            pool=pool,
            cache_dir=str(tmp_path / "c"),
            comfyui="server",
        )


def test_the_stand_ins_cannot_run_such_a_pack_and_the_error_names_the_option(
    pack: Path, server: dict[str, Any], pool: comfy_env.Pool, tmp_path: Path
) -> None:
    with pytest.raises(NodePackError, match='comfyui="server"'):
        isolate(str(pack), None, "nodes_impl", pool=pool, cache_dir=str(tmp_path / "c"))


def test_comfyui_server_outside_a_comfyui_server_and_a_bad_mode_are_refused(
    pack: Path, pool: comfy_env.Pool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    monkeypatch.setattr(_server, "_DESCRIBED", [])
    with pytest.raises(NodePackError, match="no ComfyUI server"):
        isolate(str(pack), None, "nodes_impl", pool=pool, comfyui="server")
    with pytest.raises(ArgumentError, match="comfyui"):
        isolate(str(pack), None, "nodes_impl", pool=pool, comfyui="real")
    assert pool.stats() == {}


def test_module_init_isolates_another_packs_unchanged_directory_with_its_own_str_types(
    tmp_path: Path, pool: comfy_env.Pool
) -> None:
    """A shim pack points isolate() at another pack whose own ``__init__.py`` builds the
    mappings from its submodules with relative imports (as ComfyUI_essentials does)."""
    other = tmp_path / "OtherPack"
    other.mkdir()
    (other / "image.py").write_text(
        "class Twice:\n"
        "    RETURN_TYPES = ('INT',)\n"
        "    FUNCTION = 'run'\n"
        "    CATEGORY = 't'\n"
        "    @classmethod\n"
        "    def INPUT_TYPES(cls):\n"
        "        return {'required': {'n': ('INT',)}}\n"
        "    def run(self, n):\n"
        "        return (2 * n,)\n"
        "class AnyType(str):\n"
        "    def __ne__(self, other):\n"
        "        return False\n"
        "class Anything:\n"
        "    RETURN_TYPES = (AnyType('*'),)\n"
        "    FUNCTION = 'run'\n"
        "    CATEGORY = 't'\n"
        "    @classmethod\n"
        "    def INPUT_TYPES(cls):\n"
        "        return {'required': {'value': (AnyType('*'), {})}}\n"
        "    def run(self, value):\n"
        "        return (value,)\n"
        "IMAGE_CLASS_MAPPINGS = {'Twice+': Twice, 'Anything+': Anything}\n"
    )
    (other / "__init__.py").write_text(
        "from .image import IMAGE_CLASS_MAPPINGS\n"
        "NODE_CLASS_MAPPINGS = {}\n"
        "NODE_CLASS_MAPPINGS.update(IMAGE_CLASS_MAPPINGS)\n"
        "NODE_DISPLAY_NAME_MAPPINGS = {'Twice+': 'Twice'}\n"
    )
    mappings, display = isolate(
        str(other), None, "__init__", pool=pool, cache_dir=str(tmp_path / "c")
    )
    assert display == {"Twice+": "Twice"}
    assert asyncio.run(mappings["Twice+"]().run(n=21)) == (42,)  # type: ignore[attr-defined]
    # The pack's own str subclass for "any" sockets (ComfyUI_essentials' AnyType) crosses as
    # its plain value: the host cannot import the pack's module to unpickle it.
    anything: Any = mappings["Anything+"]
    assert anything.RETURN_TYPES == ("*",) and type(anything.RETURN_TYPES[0]) is str
    assert anything.INPUT_TYPES()["required"]["value"][0] == "*"


def test_a_v3_pack_with_comfyui_server_fails_its_scan_saying_why(
    tmp_path: Path, server: dict[str, Any], pool: comfy_env.Pool
) -> None:
    pack = tmp_path / "v3pack"
    pack.mkdir()
    (pack / "v3_nodes.py").write_text(
        "from comfy_api.latest import ComfyExtension, io\n"
        "class Node(io.ComfyNode):\n"
        "    @classmethod\n"
        "    def define_schema(cls):\n"
        "        return io.Schema(node_id='V3Node', inputs=[], outputs=[])\n"
        "class Extension(ComfyExtension):\n"
        "    async def get_node_list(self):\n"
        "        return [Node]\n"
        "async def comfy_entrypoint():\n"
        "    return Extension()\n"
    )
    with pytest.raises(NodePackError, match="does not support V3 packs"):
        isolate(
            str(pack), None, "v3_nodes", pool=pool, cache_dir=str(tmp_path / "c"), comfyui="server"
        )


def test_the_scan_cache_survives_a_new_port_but_not_other_arguments(
    pack: Path,
    server: dict[str, Any],
    config: comfy_env.PoolConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = str(tmp_path / "c")
    base = str(server["base"])

    def scans(argv: list[str]) -> int:
        monkeypatch.setattr(sys, "argv", ["main.py", *argv])
        monkeypatch.setattr(_server, "_DESCRIBED", [])
        with comfy_env.Pool(config) as pool:
            isolate(str(pack), None, "nodes_impl", pool=pool, cache_dir=cache, comfyui="server")
            return sum(s.spawns for s in pool.stats().values())

    assert scans(["--cpu", "--base-directory", base, "--port", "8188"]) == 1
    assert scans(["--cpu", "--base-directory", base, "--port=8190", "--listen"]) == 0
    assert scans(["--base-directory", base, "--cpu", "--port", "8190"]) == 1  # order: a new key
    assert _server.key_arguments(["--listen", "--port", "1", "--cpu", "--verbose", "DEBUG"]) == [
        "--cpu"
    ]


def test_a_stand_ins_pack_and_a_server_pack_share_the_servers_interpreter(
    pack: Path, server: dict[str, Any], pool: comfy_env.Pool, tmp_path: Path
) -> None:
    """``env=None`` packs of both modes share one worker: the stand-ins pack imported first
    keeps its stand-ins, the server pack imported after gets ComfyUI's real modules."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "nodes.py").write_text(
        "import folder_paths\n"
        "class Where:\n"
        "    RETURN_TYPES = ('STRING',)\n"
        "    FUNCTION = 'run'\n"
        "    CATEGORY = 't'\n"
        "    @classmethod\n"
        "    def INPUT_TYPES(cls):\n"
        "        return {'required': {}}\n"
        "    def run(self):\n"
        "        return (folder_paths.get_output_directory(),)\n"
        "NODE_CLASS_MAPPINGS = {'Where': Where}\n"
    )
    cache = str(tmp_path / "c")
    first, _ = isolate(str(plain), None, "nodes", pool=pool, cache_dir=cache)
    assert asyncio.run(first["Where"]().run()) == (server["output"],)  # type: ignore[attr-defined]
    second, _ = isolate(str(pack), None, "nodes_impl", pool=pool, cache_dir=cache, comfyui="server")
    report = _report(second)
    assert report["device"] == "cpu" and report["checkpoints"] == server["checkpoints"]
    assert asyncio.run(first["Where"]().run()) == (server["output"],)  # type: ignore[attr-defined]
    assert len(pool.stats()) == 1  # one env, one worker
