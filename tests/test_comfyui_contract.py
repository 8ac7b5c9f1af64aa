"""The surface ComfyUI touches on our proxies, read from each ComfyUI version's own source.

ComfyUI changes fast and users run many versions at once. ``WorkerModel`` (a worker-resident
model in ComfyUI's model manager) and the isolated node classes stand in for ComfyUI's own
objects, so every attribute ComfyUI reads from them must exist, every method it calls must take
the arguments it passes, and nothing may raise inside ComfyUI's loops. These tests read the
source of every ComfyUI tarball in ``../shared/comfyui/`` (0.3.64 and 0.8.0 today) with ``ast``,
without installing or running it, so a new ComfyUI that touches something new fails here
instead of in a user's prompt. They skip when no tarball lies beside the checkout.

What is read:

- ``comfy/model_management.py``: every ``<loaded model>.model.<name>`` (``LoadedModel`` holds our
  ``WorkerModel`` as ``.model``) with the arguments of each call, and every attribute
  ``LoadedModel.__init__``/``_set_model`` and ``load_models_gpu``'s loops read from the model
  they are given.
- ``server.py``, ``execution.py``, ``nodes.py``, ``comfy_execution/*.py``: every upper-case
  attribute (and ``getattr``/``hasattr`` name) read from a node class (``class_def``, ``obj``,
  ``obj_class``, ...): each must be one the env's scan forwards to the proxy
  (``comfy_env_worker.comfyui.scan``), or one listed below with the reason it need not be.
"""

from __future__ import annotations

import ast
import inspect
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from comfy_env.comfyui import _models
from comfy_env_worker.comfyui import scan

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "comfyui"
TARBALLS = sorted(SHARED.glob("ComfyUI-*-src.tar.gz"))

# Variable names ComfyUI's code gives a node class when it reads its attributes.
NODE_CLASS_NAMES = {"class_def", "obj", "obj_class", "class_", "type_obj", "node_cls", "class_type"}

# Node-class names ComfyUI reads that the scan does not forward, and why that is right.
NOT_FORWARDED = {
    # Set on every class by ComfyUI's own loader (``load_custom_node``), proxies included.
    "RELATIVE_PYTHON_MODULE": "set by ComfyUI's loader on every class it registers",
    # V3 (``comfy_api`` ``ComfyNode``) class methods: a V3 proxy subclasses ComfyNode and
    # inherits them; a V1 proxy is never asked (ComfyUI checks ``issubclass`` first).
    "GET_SCHEMA": "inherited by V3 proxies from ComfyNode",
    "GET_NODE_INFO_V1": "inherited by V3 proxies from ComfyNode",
    "VALIDATE_CLASS": "inherited by V3 proxies from ComfyNode",
    "PREPARE_CLASS_CLONE": "inherited by V3 proxies from ComfyNode",
}


def _version(tarball: Path) -> str:
    return tarball.name.removeprefix("ComfyUI-").removesuffix("-src.tar.gz")


@pytest.fixture(params=TARBALLS, ids=[_version(t) for t in TARBALLS] or None)
def comfyui_source(request: pytest.FixtureRequest) -> Iterator[dict[str, ast.Module]]:
    """The parsed modules of one ComfyUI version, by path inside ``ComfyUI/``."""
    wanted = ("comfy/model_management.py", "server.py", "execution.py", "nodes.py")
    modules: dict[str, ast.Module] = {}
    with tarfile.open(request.param) as tf:
        for member in tf.getmembers():
            path = member.name.removeprefix("ComfyUI/")
            if not member.isfile() or not path.endswith(".py"):
                continue
            if path in wanted or (path.startswith("comfy_execution/") and path.count("/") == 1):
                fh = tf.extractfile(member)
                assert fh is not None
                modules[path] = ast.parse(fh.read(), filename=path)
    assert set(wanted) <= set(modules), f"{request.param.name} lacks {set(wanted) - set(modules)}"
    yield modules


if not TARBALLS:
    pytestmark = pytest.mark.skip(reason=f"no ComfyUI source tarball in {SHARED}")


# ---- what ComfyUI's model manager asks of a loaded model -------------------------------------


def _model_uses(tree: ast.Module) -> dict[str, list[tuple[int, set[str]]]]:
    """``name -> [(positional count, keyword names), ...]`` for every use of an attribute of a
    model entry's model (``(n, set())`` with n = -1 for a plain read, not a call)."""
    uses: dict[str, list[tuple[int, set[str]]]] = {}
    calls: dict[int, ast.Call] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            calls[id(node.func)] = node
    model_vars = _model_variables(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr.startswith("__"):
            continue
        base = node.value
        on_entry_model = isinstance(base, ast.Attribute) and base.attr == "model"
        on_given_model = isinstance(base, ast.Name) and id(base) in model_vars
        if not (on_entry_model or on_given_model):
            continue
        call = calls.get(id(node))
        if call is None:
            uses.setdefault(node.attr, []).append((-1, set()))
        else:
            keywords = {k.arg for k in call.keywords if k.arg is not None}
            uses.setdefault(node.attr, []).append((len(call.args), keywords))
    return uses


def _model_variables(tree: ast.Module) -> set[int]:
    """Ids of the Name nodes that hold a model ComfyUI was given: ``model`` in
    ``LoadedModel.__init__``/``_set_model``, the loop variables over ``load_models_gpu``'s
    ``models``."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "LoadedModel":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name in ("__init__", "_set_model"):
                    found |= {id(n) for n in ast.walk(fn) if _is_name(n, "model")}
        if isinstance(node, ast.FunctionDef) and node.name == "load_models_gpu":
            loop_vars = {
                loop.target.id
                for loop in ast.walk(node)
                if isinstance(loop, ast.For)
                and _is_name(loop.iter, "models")
                and isinstance(loop.target, ast.Name)
            }
            found |= {id(n) for n in ast.walk(node) if _is_name(n, *loop_vars)}
    return found


def _is_name(node: ast.AST, *names: str) -> bool:
    return isinstance(node, ast.Name) and node.id in names


class _Ref:
    """A RemoteRef's surface for a model entry: alive until released or its generation dies."""

    env = "/envs/a"
    generation = 1

    def __init__(self) -> None:
        self.alive = True
        self.releases = 0

    def release(self) -> None:
        self.releases += 1
        self.alive = False

    def discard(self) -> None:
        self.alive = False


def _worker_models() -> dict[str, _models.WorkerModel]:
    """A live entry, one ComfyUI unloaded, one whose generation died."""
    registry = _models.ModelRegistry()
    made = {}
    for state in ("live", "unloaded", "dead"):
        model = _models.WorkerModel(registry, _Ref(), 256 << 20, "cpu", f"run-{state}")  # type: ignore[arg-type]
        made[state] = model
    made["unloaded"].detach()
    made["dead"].ref.discard()
    return made


def test_every_attribute_comfyui_reads_on_a_loaded_model_exists_on_worker_model(
    comfyui_source: dict[str, ast.Module],
) -> None:
    uses = _model_uses(comfyui_source["comfy/model_management.py"])
    # The reading itself must find what is known to be there, or it reads nothing.
    assert {"model_size", "loaded_size", "detach", "partially_unload", "load_device"} <= set(uses)
    models = _worker_models()
    missing: set[str] = set()
    unbindable: set[str] = set()
    for name, sites in sorted(uses.items()):
        # Every state: an unloaded or dead entry must not lose an attribute ComfyUI reads.
        missing |= {name for model in models.values() if not hasattr(model, name)}
        if name in missing:
            continue
        value = getattr(models["live"], name)
        for positional, keywords in sites:
            if positional < 0:
                continue
            try:
                inspect.signature(value).bind(*[None] * positional, **dict.fromkeys(keywords))
            except TypeError as exc:
                unbindable.add(f"{name}({positional} positional, {sorted(keywords)}): {exc}")
    assert not missing, f"ComfyUI reads these from a loaded model; WorkerModel lacks: {missing}"
    assert not unbindable, f"ComfyUI calls these with arguments WorkerModel refuses: {unbindable}"


def test_worker_model_reports_no_bytes_it_does_not_hold_and_never_raises_in_comfyuis_loops(
    comfyui_source: dict[str, ast.Module],
) -> None:
    uses = _model_uses(comfyui_source["comfy/model_management.py"])
    for state, model in _worker_models().items():
        held = 256 << 20 if state == "live" else 0
        assert model.model_size() == held, state
        assert model.loaded_size() == held, state
        assert model.loaded_size() <= model.model_size()
        for name, sites in sorted(uses.items()):
            value = getattr(model, name)
            if not callable(value) or name == "detach":
                continue
            for positional, keywords in sites:
                if positional >= 0:
                    # Whatever ComfyUI passes (a device, a byte count, a dtype), nothing raises.
                    value(*["cpu"] * positional, **dict.fromkeys(keywords, 0))
    # Unloading twice (a second eviction pass, /free after the cache dropped it) is a no-op.
    live = _worker_models()["live"]
    live.detach()
    live.detach(unpatch_all=False)
    assert live.ref.releases == 1  # type: ignore[attr-defined]
    assert live.model_size() == 0


# ---- what ComfyUI reads from a node class ------------------------------------------------------


def _node_class_reads(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """``NAME -> {module, ...}`` for every upper-case name (and ``check_lazy_status``) read from
    a variable holding a node class, directly or through ``getattr``/``hasattr``."""
    reads: dict[str, set[str]] = {}

    def wanted(name: str) -> bool:
        return name.isupper() or name == "check_lazy_status"

    for path, tree in modules.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in NODE_CLASS_NAMES
                and wanted(node.attr)
                and isinstance(node.ctx, ast.Load)
            ):
                reads.setdefault(node.attr, set()).add(path)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in NODE_CLASS_NAMES
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and wanted(node.args[1].value)
            ):
                reads.setdefault(node.args[1].value, set()).add(path)
    return reads


def test_every_node_class_attribute_comfyui_reads_is_forwarded_to_the_proxy(
    comfyui_source: dict[str, ast.Module],
) -> None:
    reads = _node_class_reads(comfyui_source)
    assert {"INPUT_TYPES", "RETURN_TYPES", "FUNCTION", "OUTPUT_NODE"} <= set(reads)
    forwarded = {"INPUT_TYPES", *scan.V1_ATTRS, *scan.V1_METHODS}
    unknown = {
        name: sorted(where)
        for name, where in reads.items()
        if name not in forwarded and name not in NOT_FORWARDED
    }
    assert not unknown, (
        "ComfyUI reads these from node classes, and an isolated node's proxy does not carry "
        f"them: {unknown}. Forward them (comfy_env_worker.comfyui.scan.V1_ATTRS / V1_METHODS) "
        "or add them to NOT_FORWARDED with the reason."
    )


def test_the_known_exceptions_are_still_read_by_some_comfyui_version() -> None:
    """NOT_FORWARDED lists no name that no ComfyUI version reads any more (a stale exception
    would hide a new use)."""
    if not TARBALLS:
        pytest.skip("no ComfyUI source")
    read_anywhere: set[str] = set()
    for tarball in TARBALLS:
        modules: dict[str, ast.Module] = {}
        with tarfile.open(tarball) as tf:
            for member in tf.getmembers():
                path = member.name.removeprefix("ComfyUI/")
                if member.isfile() and path in ("server.py", "execution.py", "nodes.py"):
                    fh = tf.extractfile(member)
                    assert fh is not None
                    modules[path] = ast.parse(fh.read())
        read_anywhere |= set(_node_class_reads(modules))
    stale = set(NOT_FORWARDED) - read_anywhere
    assert not stale, f"no ComfyUI version reads {sorted(stale)} any more: drop them"
