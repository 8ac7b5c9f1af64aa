"""The pool's shape, as promises about imports (issue 15, "The shape first").

* No module of ``comfy_env`` imports another in a circle. Every import counts: module level,
  under ``TYPE_CHECKING`` and inside functions (the project's before-stop hook computes the
  graph the same way).
* The public handles (``_worker``, ``_refs``, ``_acall``, ``_status``) never import ``_pool``:
  they depend on ``_callsite.CallSite`` and the core types of ``_entry``.
* The core and its policies are backend-agnostic: they import neither the pool nor the local
  backend's process code. Leasing (``_lease``) imports neither the pool, the spawner nor the
  process code; the spawner never imports the pool.
* The local backend's mechanism (``_channel``, ``_exitwatch``, ``_outputpipes``) reports
  facts: it reaches neither the gate (``_entry``), the lifecycle table, the pool nor the
  ``WorkerProcess`` facade over it, directly or through another module.
* One writer per piece of call and slot state, as the gate is for a slot's lifecycle state
  (``tests/test_lifecycle.py``): a call's stage and the call counters in ``_lease``, the
  breaker's state in ``EnvEntry.set_env_state``, a slot's process and an env's generation in
  ``_spawner``.
* Sizes a reader can hold: no class over 400 lines, no function over 80, at most five
  parameters (besides ``self``) but for the public constructors and options named below.

Pure AST reads of the source: no import runs, no process starts.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import comfy_env

PACKAGE = Path(comfy_env.__file__).resolve().parent
NAME = "comfy_env"


def _modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the package (subpackages included)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = (NAME, *path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports anywhere in its file (any scope, any branch)."""
    base = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{alias.name}" for alias in node.names]
            candidates = subs if node.module is None else [target, *subs]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        out.update(c for c in candidates if c in known and c != module)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imported(m, p, known) for m, p in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first walk, as the circle it closes."""
    seen: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        seen[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if seen.get(w) == 1:
                out.append([*stack[stack.index(w) :], w])
            elif w not in seen:
                visit(w)
        stack.pop()
        seen[v] = 2

    for v in sorted(graph):
        if v not in seen:
            visit(v)
    return out


def test_the_circle_finder_sees_a_circle() -> None:
    # The finder itself can fail: a made-up graph with one circle (and a TYPE_CHECKING-only
    # edge, which counts like any other) is reported.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_imports_inside_functions_and_type_checking_count(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ._pool import Pool\n"
        "def f():\n"
        "    from . import _refs\n"
        "    import comfy_env._status\n",
        encoding="utf-8",
    )
    known = {"comfy_env._pool", "comfy_env._refs", "comfy_env._status"}
    assert _imported("comfy_env.mod", source, known) == known


def test_comfy_env_has_no_import_circles() -> None:
    circles = _circles(_graph())
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


@pytest.mark.parametrize("handle", ["_worker", "_refs", "_acall", "_status"])
def test_public_handles_never_import_the_pool(handle: str) -> None:
    graph = _graph()
    assert f"{NAME}._pool" not in graph[f"{NAME}.{handle}"]


@pytest.mark.parametrize("core", ["_entry", "_callsite", "_policies", "_failures", "_shutdown"])
def test_the_core_and_its_policies_know_no_backend(core: str) -> None:
    imports = _graph()[f"{NAME}.{core}"]
    assert not imports & {f"{NAME}._pool", f"{NAME}._process", f"{NAME}._worker"}, imports


def test_no_module_reaches_into_another_modules_private_names() -> None:
    # ``from ._pool import _EnvEntry`` was the smell: a name with a leading underscore is
    # private to its module. Modules themselves are private by their file name, so importing
    # the module ``_lifecycle`` is fine; importing ``_lifecycle._x`` is not. (The host's
    # modules: the ``comfyui`` subpackage shares its own ``_Pack`` between its files.)
    modules = _modules()
    offenders = []
    for module, path in modules.items():
        if path.parent != PACKAGE:
            continue
        base = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != NAME and not target.startswith(NAME + "."):
                continue  # another package's names are its own business
            for alias in node.names:
                name = alias.name
                private = name.startswith("_") and not name.startswith("__")
                if private and f"{target}.{name}" not in modules:
                    offenders.append(f"{module}: from {target} import {name}")
    assert not offenders, offenders


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every package module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for imported in graph.get(todo.pop(), set()):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


@pytest.mark.parametrize("part", ["_channel", "_exitwatch", "_outputpipes"])
def test_the_mechanism_reports_facts_and_imports_no_policy(part: str) -> None:
    # The local backend's mechanism (the channel's host end, the exit watch, the output
    # pipes) only reports what it sees: it never reaches the gate, the lifecycle table or
    # the pool that decide what those facts mean, not even through another module.
    graph = _graph()
    assert f"{NAME}.{part}" in graph
    reached = _reachable(graph, f"{NAME}.{part}")
    policy = {f"{NAME}._entry", f"{NAME}._lifecycle", f"{NAME}._pool", f"{NAME}._process"}
    assert not reached & policy, sorted(reached & policy)


# ---- one writer per piece of call and slot state (the gate's rule, for what is not a state) ----


def _attribute_writes(attrs: set[str]) -> list[tuple[str, str, str, str]]:
    """Every assignment (plain, augmented, annotated, in a tuple) to ``<name>.<attr>`` for an
    ``attr`` of ``attrs`` in the package: (file, enclosing class.function, name, attr)."""
    found: list[tuple[str, str, str, str]] = []

    def targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            out: list[ast.expr] = []
            for target in node.targets:
                out.extend(target.elts if isinstance(target, ast.Tuple) else [target])
            return out
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            return [node.target]
        return []

    def visit(node: ast.AST, scope: str, file: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            for target in targets(child):
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr in attrs
                    and isinstance(target.value, ast.Name)
                ):
                    found.append((file, inner, target.value.id, target.attr))
            visit(child, inner, file)

    for path in sorted(PACKAGE.glob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), "", path.name)
    return found


CALL_COUNTERS = {"submitted", "ok", "raised", "crashed", "timed_out", "cancelled", "failed"}
CALL_COUNTERS |= {"in_flight", "queued"}


def test_a_calls_stage_and_the_call_counters_are_written_only_by_leasing() -> None:
    # A call is counted once whatever path it took: its stage and the env's counters change
    # in ``_lease`` only (their initial values aside). Other classes' own fields of the same
    # name (an error's ``stage``, a timer's ``cancelled``) are theirs.
    writes = _attribute_writes(CALL_COUNTERS | {"stage"})
    elsewhere = [
        w
        for w in writes
        if w[0] != "_lease.py"
        and not (w[2] == "self" and not w[1].startswith(("EnvEntry.", "Ticket.")))
        and w[1] != "EnvEntry.__init__"
    ]
    assert elsewhere == []
    assert {w[3] for w in writes if w[0] == "_lease.py"} == CALL_COUNTERS | {"stage"}


def test_the_breaker_state_has_one_writer() -> None:
    writes = _attribute_writes({"env_state"})
    assert sorted((w[0], w[1]) for w in writes) == [
        ("_entry.py", "EnvEntry.__init__"),
        ("_entry.py", "EnvEntry.set_env_state"),
    ]


def test_a_slots_process_and_an_envs_generation_are_written_only_by_the_spawner() -> None:
    # (``generation`` of other objects, a ticket's or a process's own, is theirs.)
    process = [
        w
        for w in _attribute_writes({"process"})
        if w[2] == "slot" or (w[2] == "self" and w[1].startswith("Slot."))
    ]
    assert sorted({(w[0], w[1]) for w in process}) == [
        ("_entry.py", "Slot.__init__"),
        ("_spawner.py", "Spawner._begin"),
    ]
    generation = [
        w
        for w in _attribute_writes({"generation"})
        if w[2] == "entry" or (w[2] == "self" and w[1].startswith("EnvEntry."))
    ]
    assert sorted({(w[0], w[1]) for w in generation}) == [
        ("_entry.py", "EnvEntry.__init__"),
        ("_spawner.py", "Spawner._begin"),
    ]


def test_a_generations_end_is_the_cores_written_by_the_gate_and_the_spawner() -> None:
    # Why a generation was retired and how a cancel killed it (the gate), whether its death
    # was reported (the spawner): the core's ``GenerationEnd``, never the backend's object.
    # The slot's record is written beside its process, by the spawner only.
    writes = _attribute_writes({"retire_reason", "cancel_kill", "death_reported"})
    assert sorted({(w[0], w[1], w[3]) for w in writes}) == [
        ("_entry.py", "EnvEntry.apply_locked", "cancel_kill"),
        ("_entry.py", "EnvEntry.apply_locked", "retire_reason"),
        ("_generation.py", "GenerationEnd.__init__", "cancel_kill"),
        ("_generation.py", "GenerationEnd.__init__", "death_reported"),
        ("_generation.py", "GenerationEnd.__init__", "retire_reason"),
        ("_spawner.py", "Spawner.report_death", "death_reported"),
    ]
    ending = [
        w
        for w in _attribute_writes({"ending"})
        if w[2] == "slot" or (w[2] == "self" and w[1].startswith("Slot."))
    ]
    assert sorted({(w[0], w[1]) for w in ending}) == [
        ("_entry.py", "Slot.__init__"),
        ("_spawner.py", "Spawner._begin"),
    ]


NEUTRAL = ["_acall", "_callsite", "_entry", "_exchange", "_failures", "_lease", "_policies"]
NEUTRAL += ["_pool", "_shutdown", "_spawner"]


@pytest.mark.parametrize("module", NEUTRAL)
def test_backend_neutral_code_never_reads_a_process_handle(module: str) -> None:
    # A backend is told apart by what its generation offers (the pid ``launch`` returns, its
    # ``channel``), never by whether it launched a ``subprocess.Popen`` (a Ray actor has none).
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "popen"]
    assert reads == [], reads


def _seam_members() -> set[str]:
    """The names ``_backend.WorkerGeneration`` declares: its fields, properties and methods."""
    tree = ast.parse((PACKAGE / "_backend.py").read_text(encoding="utf-8"))
    (seam,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "WorkerGeneration"]
    members = set()
    for node in seam.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, ast.FunctionDef):
            members.add(node.name)
    return members


def test_the_seam_carries_no_lifecycle_fact_and_no_process_handle() -> None:
    # The gate's and the spawner's facts about a generation are the core's (above); what a
    # backend must offer is in ``_backend.WorkerGeneration``.
    members = _seam_members()
    assert "read_frame" in members and "generation" in members  # (the reader reads it)
    assert not members & {"popen", "retire_reason", "cancel_kill", "death_reported"}, members


@pytest.mark.parametrize("part", ["_lease", "_exchange"])
def test_leasing_never_imports_the_pool_the_spawner_or_the_mechanism(part: str) -> None:
    imports = _graph()[f"{NAME}.{part}"]
    assert not imports & {f"{NAME}._pool", f"{NAME}._spawner", f"{NAME}._process"}, imports


def test_the_asyncio_path_never_imports_the_process_mechanism() -> None:
    # It waits on the generation's ``channel`` (None: a backend without one, on a thread);
    # every decision is the call's ``Exchange``'s.
    assert f"{NAME}._process" not in _graph()[f"{NAME}._acall"]


def test_the_spawner_never_imports_the_pool() -> None:
    assert f"{NAME}._pool" not in _graph()[f"{NAME}._spawner"]


# The public constructors and options that take more than five parameters: the exceptions'
# fields, a recipe's fields, ``comfyui.isolate``'s options and its pack's record.
MANY_PARAMETERS = {
    ("comfy_env._errors", "__init__"),
    ("comfy_env._recipe", "__init__"),
    ("comfy_env.comfyui", "isolate"),
    ("comfy_env.comfyui", "__init__"),
}
# Functions over 80 lines, each named: ``comfyui.isolate`` (its options' checks, one by one).
LONG_FUNCTIONS = {("comfy_env.comfyui", "isolate")}


def _definitions() -> list[tuple[str, ast.AST]]:
    return [
        (module, node)
        for module, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def _lines(node: ast.AST) -> int:
    return int(node.end_lineno or 0) - int(getattr(node, "lineno", 0)) + 1


def test_no_class_is_over_400_lines() -> None:
    big = [
        (module, node.name, _lines(node))
        for module, node in _definitions()
        if isinstance(node, ast.ClassDef) and _lines(node) > 400
    ]
    assert not big, big


def test_no_function_is_over_80_lines_but_those_named() -> None:
    long = [
        (module, node.name, _lines(node))
        for module, node in _definitions()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and _lines(node) > 80
        and (module, node.name) not in LONG_FUNCTIONS
    ]
    assert not long, long


def test_no_function_takes_more_than_five_parameters_but_those_named() -> None:
    many = []
    for module, node in _definitions():
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        if len(names) > 5 and (module, node.name) not in MANY_PARAMETERS:
            many.append((module, node.name, len(names)))
    assert not many, many
