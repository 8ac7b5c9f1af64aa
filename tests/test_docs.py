"""The docs cannot drift from the code: every name README.md and docs/*.md give must exist.

Data flow: each doc is read once (``_doc``), its fenced code blocks are set apart from its
prose, and each checker below takes a doc's name and text and returns the problems it finds,
one string each, naming the doc, the line and the missing thing. The tests run every checker
over every doc, and ``test_each_check_finds_a_deliberately_wrong_name`` feeds each checker a
doc with a wrong name, so a checker that silently stops matching (a regex broken by an edit)
fails too.

What is checked:
- a backticked test name (``test_x``, ``tests/test_y.py::test_x``, a ``test_x_*`` prefix) is
  a test function in ``tests/`` or ``tests_comfyui/`` (in the file named, if one is);
- a backticked repo path (``tests/...``, ``comfy_env/...``, ``benchmarks/...``, ``dev.py``,
  ``.ci/run``, ...) exists;
- docs/configuration.md's field table lists every ``PoolConfig`` field and nothing else, and
  every ``PoolConfig.<field>`` named anywhere is a field;
- every ``COMFY_ENV_*`` variable named is a field's variable or appears in the code;
- every ``comfy-env`` command and flag (docs/cli.md, and any backticked ``comfy-env ...``) is
  in the CLI's argparse parser, and every ``dev.py`` command is one dev.py has;
- every relative markdown link resolves, to a heading too when it names an anchor;
- README's first python example runs (the only check that starts a process).
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import subprocess
import sys
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

import pytest

import comfy_env
from comfy_env import _cli

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EXAMPLE_TIMEOUT = 60
# Spelled in two parts: tests/test_envs.py fails on any COMFY_ENV_* name the project uses
# that is no setting.
WRONG_VARIABLE = "COMFY_ENV" + "_NO_SUCH_VARIABLE"

# Where code lives: a COMFY_ENV_* variable named in the docs must appear in one of these.
CODE_PLACES = ("comfy_env", "workers", "tests", "tests_comfyui", "examples", "benchmarks")
CODE_FILES = ("dev.py", ".ci/run")
# A backticked span starting with one of these names a file or directory of the repository.
PATH_PREFIXES = (
    "tests/",
    "tests_comfyui/",
    "comfy_env/",
    "workers/",
    "benchmarks/",
    "examples/",
    "docs/",
    ".ci/",
)
PATH_FILES = ("dev.py", "pyproject.toml", "README.md", "CHANGELOG.md", "LICENSE")

FENCE = re.compile(r"^(```|~~~)")
SPAN = re.compile(r"`([^`]+)`")
TEST_NAME = re.compile(r"^(?:(tests(?:_comfyui)?/[\w/]+\.py)::)?(test_\w+\*?)$")
ENV_VAR = re.compile(r"(?<![A-Za-z0-9_])COMFY_ENV_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_])")
CONFIG_FIELD_REF = re.compile(r"\bPoolConfig\.([a-z_][a-z0-9_]*)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")
DEV_COMMAND = re.compile(r"\bdev\.py ([a-z][a-z-]*)")
CLI_COMMAND = re.compile(r"^comfy-env( .*)?$")

Problems = list[str]


# --- reading the docs --------------------------------------------------------------------


@functools.cache
def _doc(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _name(path: Path) -> str:
    return str(path.relative_to(REPO))


def _prose(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line numbers kept)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def _code_blocks(text: str, language: str | None = None) -> list[tuple[int, str]]:
    """The fenced blocks of ``text`` (of ``language`` if given): (first line, body)."""
    blocks, lines = [], text.split("\n")
    start: int | None = None
    lang = ""
    for number, line in enumerate(lines, 1):
        stripped = line.lstrip()
        if FENCE.match(stripped):
            if start is None:
                start, lang = number, stripped[3:].strip()
            else:
                if language is None or lang == language:
                    blocks.append((start + 1, "\n".join(lines[start : number - 1])))
                start = None
    return blocks


def _spans(text: str) -> list[tuple[int, str]]:
    """Backticked spans of the prose, with their line (a span may wrap onto the next line)."""
    prose = _prose(text)
    return [
        (prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
        for m in SPAN.finditer(prose)
    ]


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


# --- what exists -------------------------------------------------------------------------


@functools.cache
def _test_functions() -> dict[str, frozenset[str]]:
    """Every test function, by repo-relative file."""
    found: dict[str, frozenset[str]] = {}
    for folder in ("tests", "tests_comfyui"):
        for path in (REPO / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = {
                node.name
                for node in ast.walk(tree)
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name.startswith("test_")
            }
            found[_name(path)] = frozenset(names)
    return found


@functools.cache
def _code_text() -> str:
    parts = [(REPO / name).read_text(encoding="utf-8") for name in CODE_FILES]
    for folder in CODE_PLACES:
        for path in (REPO / folder).rglob("*"):
            rel = path.relative_to(REPO)
            if path.suffix in (".py", ".sh") and not any(p.startswith(".") for p in rel.parts):
                if rel != Path(__file__).relative_to(REPO):  # not the names quoted here
                    parts.append(path.read_text(encoding="utf-8"))
    return "\n".join(parts)


def _config_fields() -> set[str]:
    return set(comfy_env.PoolConfig.model_fields)


@functools.cache
def _cli_options() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """The CLI's top-level options and, per command, the options it takes."""
    parser = _cli.build_parser()
    top = {o for action in parser._actions for o in action.option_strings}
    commands: dict[str, frozenset[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                commands[name] = _options_of(sub)
    return frozenset(top), commands


def _options_of(parser: argparse.ArgumentParser) -> frozenset[str]:
    """A command's options, with those of its own subcommands (``comfy-env env build``)."""
    found = {o for a in parser._actions for o in a.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options_of(sub)
    return frozenset(found)


@functools.cache
def _dev_commands() -> frozenset[str]:
    found = re.search(r"commands = \(([^)]*)\)", (REPO / "dev.py").read_text(encoding="utf-8"))
    assert found, "dev.py no longer lists its commands as `commands = (...)`"
    return frozenset(re.findall(r'"([a-z-]+)"', found.group(1)))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())  # keeps letters, digits, _ and -
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {
        _slug(line.lstrip("#")) for line in _prose(text).split("\n") if re.match(r"^#{1,6} ", line)
    }


# --- the checks: (doc name, text) -> problems --------------------------------------------


def check_test_names(doc: str, text: str) -> Problems:
    problems = []
    tests = _test_functions()
    every = frozenset().union(*tests.values())
    for line, span in _spans(text):
        m = TEST_NAME.match(span)
        if not m:
            continue
        file, name = m.groups()
        if file is not None and file not in tests:
            problems.append(f"{doc}:{line}: `{span}`: no test file {file}")
            continue
        pool = tests[file] if file else every
        if not any(fnmatch(t, name) for t in pool):  # a trailing * names a family
            where = file or "tests/ or tests_comfyui/"
            problems.append(f"{doc}:{line}: `{span}`: no test named {name} in {where}")
    return problems


def check_paths(doc: str, text: str) -> Problems:
    problems = []
    for line, span in _spans(text):
        path = span.split("::")[0].split(" ")[0]
        if not (path.startswith(PATH_PREFIXES) or path in PATH_FILES):
            continue
        if any(c in path for c in "<>*{"):  # a pattern, not a path
            continue
        if not (REPO / path).exists():
            problems.append(f"{doc}:{line}: `{span}`: no such path {path} in the repository")
    return problems


def check_config_fields(doc: str, text: str) -> Problems:
    """``PoolConfig.<field>`` anywhere; the field table of docs/configuration.md both ways."""
    fields = _config_fields()
    problems = [
        f"{doc}:{_line_of(text, m.start())}: PoolConfig.{m.group(1)} is no PoolConfig field"
        for m in CONFIG_FIELD_REF.finditer(_prose(text))
        if m.group(1) not in fields
    ]
    if doc != "docs/configuration.md":
        return problems
    table: dict[str, int] = {}
    in_fields = False
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith("## "):
            in_fields = line.strip() == "## Fields"
        m = re.match(r"^\| `([a-z_][a-z0-9_]*)` \|", line)
        if in_fields and m:
            table[m.group(1)] = number
    if not table:
        return [*problems, f"{doc}: no field table (rows `| `field` | ...` under ## Fields)"]
    problems += [
        f"{doc}:{number}: `{name}` is in the field table but is no PoolConfig field"
        for name, number in table.items()
        if name not in fields
    ]
    problems += [
        f"{doc}: PoolConfig.{name} is missing from the field table under ## Fields"
        for name in sorted(fields - set(table))
    ]
    return problems


def check_env_vars(doc: str, text: str) -> Problems:
    settings = {"COMFY_ENV_" + name.upper() for name in _config_fields()}
    code = _code_text()
    problems = []
    for m in ENV_VAR.finditer(text):
        var = m.group(0)
        if var in settings or re.search(rf"(?<![A-Za-z0-9_]){var}(?![A-Za-z0-9_])", code):
            continue
        # A misspelling quoted on purpose, to show the warning it gets.
        if "is set but is not a comfy-env setting" in text[m.start() : m.start() + 80]:
            continue
        problems.append(f"{doc}:{_line_of(text, m.start())}: {var} is read nowhere in the code")
    return problems


def _check_command_line(doc: str, line: int, words: list[str]) -> Problems:
    """``words``: what follows ``comfy-env`` on one command line (or one usage line)."""
    top, commands = _cli_options()
    problems = []
    command = next((w for w in words if not w.startswith("-")), None)
    if command is not None and not re.fullmatch(r"[a-z][a-z-]*", command):
        command = None  # ENV, [ENV] (metavars), `comfy-env @ file:///...` (a requirement)
    if command is not None and command not in commands:
        return [f"{doc}:{line}: `comfy-env {command}`: no such command"]
    allowed = top | {"-h", "--help"} | (commands.get(command, frozenset()) if command else set())
    for word in words:
        for flag in FLAG.findall(word):
            if word.startswith(("-", "[-", "[--")) and flag not in allowed:
                which = f"comfy-env {command}" if command else "comfy-env"
                problems.append(f"{doc}:{line}: `{flag}`: {which} has no such option")
    return problems


def check_cli(doc: str, text: str) -> Problems:
    """Every ``comfy-env ...`` command line in code blocks and backticks; in docs/cli.md also
    every ``--flag`` named in the prose, which must belong to some command."""
    problems: Problems = []
    for start, body in _code_blocks(text):
        for offset, raw in enumerate(body.split("\n")):
            code = raw.split("#")[0].strip()
            if code.startswith("comfy-env"):
                problems += _check_command_line(doc, start + offset, code.split()[1:])
    for line, span in _spans(text):
        m = CLI_COMMAND.match(span)
        if m:
            problems += _check_command_line(doc, line, span.split()[1:])
    if doc == "docs/cli.md":
        top, commands = _cli_options()
        every = top | {"-h", "--help"} | frozenset().union(*commands.values())
        for line, span in _spans(text):
            for flag in FLAG.findall(span):
                if span.startswith(("-", "comfy-env", "doctor", "call", "sweep", "status")):
                    if flag.startswith("--") and flag not in every:
                        problems.append(f"{doc}:{line}: `{flag}`: no comfy-env command has it")
    for m in DEV_COMMAND.finditer(text):
        if m.group(1) not in _dev_commands():
            line = _line_of(text, m.start())
            problems.append(f"{doc}:{line}: `dev.py {m.group(1)}`: dev.py has no such command")
    return problems


def check_links(doc: str, text: str) -> Problems:
    problems = []
    base = (REPO / doc).parent
    for m in LINK.finditer(_prose(text)):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        line = _line_of(text, m.start())
        file, _, anchor = target.partition("#")
        dest = (base / file).resolve() if file else REPO / doc
        if not dest.exists():
            problems.append(f"{doc}:{line}: link ({target}): no such file {file}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(_doc(dest)):
            problems.append(f"{doc}:{line}: link ({target}): no heading #{anchor} there")
    return problems


CHECKS: list[Callable[[str, str], Problems]] = [
    check_test_names,
    check_paths,
    check_config_fields,
    check_env_vars,
    check_cli,
    check_links,
]


# --- the tests ---------------------------------------------------------------------------


def test_the_docs_exist() -> None:
    names = {_name(p) for p in DOCS}
    assert {"README.md", "docs/README.md", "docs/configuration.md", "docs/cli.md"} <= names


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_every_name_the_docs_give_exists(check: Callable[[str, str], Problems]) -> None:
    problems = [p for path in DOCS for p in check(_name(path), _doc(path))]
    assert not problems, "the docs name what does not exist:\n" + "\n".join(problems)


def test_the_changelogs_links_resolve() -> None:
    problems = check_links("CHANGELOG.md", _doc(REPO / "CHANGELOG.md"))
    assert not problems, "CHANGELOG.md links to what does not exist:\n" + "\n".join(problems)


def test_each_check_finds_a_deliberately_wrong_name() -> None:
    """Each checker reports a wrong name (so a checker that matches nothing cannot pass
    silently), and accepts the right one beside it."""
    cases: list[tuple[Callable[[str, str], Problems], str, str, str]] = [
        (check_test_names, "x.md", "`test_no_such_promise_is_proved`", "test_no_such"),
        (check_test_names, "x.md", "`tests/test_docs.py::test_no_such`", "test_no_such"),
        (check_test_names, "x.md", "`tests/test_nothing.py::test_x`", "no test file"),
        (check_paths, "x.md", "`comfy_env/_no_such_module.py`", "_no_such_module"),
        (check_paths, "x.md", "`benchmarks/no_such_bench.py --quick`", "no_such_bench"),
        (check_config_fields, "x.md", "`PoolConfig.call_timout`", "call_timout"),
        (
            check_config_fields,
            "docs/configuration.md",
            "## Fields\n\n| `call_timeout` | `None` | x |\n| `no_such_field` | 1 | x |\n",
            "no_such_field",
        ),
        (check_config_fields, "docs/configuration.md", "## Fields\n\n| `x` |\n", "missing"),
        (check_env_vars, "x.md", f"`{WRONG_VARIABLE}=1`", WRONG_VARIABLE),
        (check_cli, "x.md", "```bash\ncomfy-env sweep --no-such-flag\n```\n", "--no-such"),
        (check_cli, "x.md", "`comfy-env nosuchcommand`", "nosuchcommand"),
        (check_cli, "docs/cli.md", "`--no-such-option`", "--no-such-option"),
        (check_cli, "x.md", "`python3 dev.py no-such-command`", "no-such-command"),
        (check_links, "docs/x.md", "[a](no_such_page.md)", "no_such_page"),
        (check_links, "docs/x.md", "[a](calls.md#no-such-heading)", "no-such-heading"),
    ]
    for check, doc, text, wanted in cases:
        problems = check(doc, text)
        assert any(wanted in p for p in problems), (check.__name__, text, problems)
    good = [
        (check_test_names, "`tests/test_docs.py::test_each_check_finds_a_deliberately_wrong_name`"),
        (check_test_names, "`test_the_deadline_holds_while_*`"),
        (check_paths, "`tests/test_docs.py`, `dev.py`, `.ci/run`, `examples/comfyui/`"),
        (check_config_fields, "`PoolConfig.call_timeout`"),
        (check_env_vars, "`COMFY_ENV_CALL_TIMEOUT`, `COMFY_ENV_HOST_ID`"),
        (check_cli, "```bash\ncomfy-env sweep --dry-run --json\n```\n`comfy-env status`"),
        (check_links, "[a](calls.md#envs) [b](../README.md#install)"),
    ]
    for check, text in good:
        assert check("docs/x.md", text) == [], (check.__name__, text)


@pytest.mark.timeout(EXAMPLE_TIMEOUT + 30)
def test_the_readme_example_runs() -> None:
    """README's first python block runs as written, on this interpreter, in a fresh process."""
    blocks = _code_blocks(_doc(REPO / "README.md"), "python")
    assert blocks, "README.md has no ```python block"
    line, example = blocks[0]
    done = subprocess.run(
        [sys.executable, "-c", example],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT,
    )
    assert done.returncode == 0, (
        f"README.md:{line}: the example exits {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
