"""The benchmark suite runs end to end at tiny sizes, so it cannot rot (no timing asserted)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.mark.timeout(240)
def test_the_benchmark_suite_runs_at_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "results.md"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run_all.py"),
            "--quick",
            "--no-install",  # peers need their own venvs; the smoke test measures ours
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    for section in ("small call", "ayload", "irst call", "rash", "emory", "cale", "Ray backend"):
        assert section in text, f"section {section!r} missing from the results"
    assert "comfy_env" in text


def _in_benchmarks(code: str, *args: str) -> str:
    """Run ``code`` in a fresh interpreter with ``benchmarks/`` first on its path, as
    ``run_all.py`` has it, so the benchmark modules never enter the suite's own process;
    return what it printed."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT / "benchmarks",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _sections() -> Any:
    """benchmarks/sections.py, loaded from its file (the benchmarks are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_sections", BENCH / "sections.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _rewrite(out: Path, previous: str, new: str) -> str:
    """``run_all``'s writer putting the results text ``new`` into ``out``, which held
    ``previous``; returns the file's text afterwards."""
    out.write_text(previous)
    fresh = out.with_name("fresh.md")
    fresh.write_text(new)
    code = "import sys, run_all; run_all.write_results(sys.argv[1], open(sys.argv[2]).read())"
    _in_benchmarks(code, str(out), str(fresh))
    return out.read_text()


COMFYUI_BLOCK = (
    "<!-- bench_comfyui:begin -->\n## 7. ComfyUI: one isolated node on a 512x512 IMAGE\n\n"
    "node figures of its own run\n<!-- bench_comfyui:end -->"
)


def test_a_rewrite_of_the_results_keeps_the_comfyui_section_in_its_place(tmp_path: Path) -> None:
    """Section 7 comes from ``dev.py bench-comfyui``, not from run_all: a full run rewriting
    the results file must keep it, between sections 6 and 8, and replace everything else."""
    previous = (
        "# comfy-env benchmark results\n\n## 6. Scale: 1 to 64 envs\n\nold six\n\n"
        f"{COMFYUI_BLOCK}\n\n## 8. Ray backend beside the local backend\n\nold eight\n\n"
        "## Process hygiene\n\nold hygiene\n"
    )
    head = "# comfy-env benchmark results\n\n## 6. Scale: 1 to 64 envs\n\nnew six\n\n"
    tail = "## 8. Ray backend beside the local backend\n\nnew eight\n\n## Process hygiene\n\nnew\n"
    out = tmp_path / "results.md"
    assert _rewrite(out, previous, head + tail) == head + COMFYUI_BLOCK + "\n\n" + tail
    # A subset without section 8 (``--only scale``): the block goes before the hygiene check.
    tail = "## Process hygiene\n\nnew\n"
    assert _rewrite(out, previous, head + tail) == head + COMFYUI_BLOCK + "\n\n" + tail
    # No block in the old file: nothing is made up.
    assert _rewrite(out, "old results\n", head + tail) == head + tail


BUILD_BLOCK = (
    "<!-- bench_build:begin -->\n## 9. Declared envs: build, first call, list, shared pages\n\n"
    "build figures of its own run\n<!-- bench_build:end -->"
)


def test_a_rewrite_of_the_results_keeps_the_declared_envs_section_in_its_place(
    tmp_path: Path,
) -> None:
    """Section 9 comes from ``bench_build.py``, not from run_all: a full run rewriting the
    results file must keep it before the hygiene check, beside section 7 in its own place."""
    previous = (
        "# comfy-env benchmark results\n\n## 6. Scale: 1 to 64 envs\n\nold six\n\n"
        f"{COMFYUI_BLOCK}\n\n## 8. Ray backend beside the local backend\n\nold eight\n\n"
        f"{BUILD_BLOCK}\n\n## Process hygiene\n\nold hygiene\n"
    )
    head = "# comfy-env benchmark results\n\n## 6. Scale: 1 to 64 envs\n\nnew six\n\n"
    eight = "## 8. Ray backend beside the local backend\n\nnew eight\n\n"
    hygiene = "## Process hygiene\n\nnew\n"
    out = tmp_path / "results.md"
    assert _rewrite(out, previous, head + eight + hygiene) == (
        head + COMFYUI_BLOCK + "\n\n" + eight + BUILD_BLOCK + "\n\n" + hygiene
    )
    # Only section 9 in the old file: section 7 is not made up, 9 still lands before hygiene.
    only_build = f"# old\n\n{BUILD_BLOCK}\n\n## Process hygiene\n\nold\n"
    assert _rewrite(out, only_build, head + eight + hygiene) == (
        head + eight + BUILD_BLOCK + "\n\n" + hygiene
    )


def test_the_declared_envs_section_goes_in_place_of_its_old_block(tmp_path: Path) -> None:
    """``bench_build.py`` writes its block where the old one was, else before the hygiene
    check, and leaves the rest of the file (section 7 included) as it was."""
    results = tmp_path / "results.md"
    code = (
        "import sys, pathlib, sections\n"
        "sections.BUILD.write(pathlib.Path(sys.argv[1]), sys.argv[2])\n"
    )
    new_block = BUILD_BLOCK.replace("build figures of its own run", "new build figures")
    head = f"# results\n\n{COMFYUI_BLOCK}\n\n## 8. Ray\n\neight\n\n"
    results.write_text(head + "## Process hygiene\n\nclean\n")
    _in_benchmarks(code, str(results), BUILD_BLOCK)
    assert results.read_text() == head + BUILD_BLOCK + "\n\n## Process hygiene\n\nclean\n"
    _in_benchmarks(code, str(results), new_block)
    assert results.read_text() == head + new_block + "\n\n## Process hygiene\n\nclean\n"


def test_the_tracked_results_are_run_all_output_plus_the_kept_sections(tmp_path: Path) -> None:
    """``benchmarks/RESULTS.md`` holds no hand-written notes (they live in HISTORY.md): with
    its kept sections (7 ComfyUI, 9 declared envs, 10 warm starts, 11 Executor) taken out it
    is what run_all writes, and a rewrite puts them back exactly where they were."""
    tracked = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    generated = tracked
    names = ("bench_comfyui", "bench_build", "bench_start", "bench_executor")
    assert {section.name for section in _sections().KEPT} == set(names)
    for name in names:
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        assert generated.count(begin) == 1 and generated.count(end) == 1, name
        before, rest = generated.split(begin)
        _block, after = rest.split(end)
        generated = before + after.removeprefix("\n\n")
    # The last thing run_all writes is the hygiene check: round notes would come after it.
    assert "## Closing note" not in tracked
    assert generated.rstrip("\n").endswith(("left behind at the end of the run.", "unnoticed.)"))
    assert _rewrite(tmp_path / "results.md", tracked, generated) == tracked


def test_a_quick_run_or_a_subset_never_writes_the_tracked_results() -> None:
    """``--quick`` and ``--only`` default to git-ignored files; only a full run of every
    section updates RESULTS.md (``--only small_call`` replaced it with a partial file)."""
    code = (
        "import os, run_all\n"
        "print(os.path.relpath(run_all.parse_args(['--quick']).out, '..'))\n"
        "print(os.path.relpath(run_all.parse_args([]).out, '..'))\n"
        "print(os.path.relpath(run_all.parse_args(['--quick', '--out', 'x.md']).out, '..'))\n"
        "print(os.path.relpath(run_all.parse_args(['--only', 'small_call']).out, '..'))\n"
    )
    quick, full, chosen, subset = _in_benchmarks(code).split()
    assert full == os.path.join("benchmarks", "RESULTS.md")
    assert quick != full and subset not in (full, quick)
    assert chosen == os.path.join("benchmarks", "x.md")
    ignored = [
        line.strip().rstrip("/")
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for partial in (quick, subset):
        assert any(Path(partial).is_relative_to(pattern) for pattern in ignored), partial


@pytest.mark.timeout(180)
def test_the_instruction_counter_counts_a_raw_pipe_call(tmp_path: Path) -> None:
    # benchmarks/count_instructions.py end to end on its cheapest method (about 20 s): two
    # runs under callgrind, the caller told from its child, the difference per call.
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    out = tmp_path / "counts.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "count_instructions.py"),
            "--only",
            "raw pipe",
            "--base",
            "10",
            "--calls",
            "40",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counts = json.loads(out.read_text())["raw pipe"]
    # A length-prefixed pickle echo: thousands of instructions a call on each side (about
    # 16,000 and 20,000 on CPython 3.11), never nothing and never a start-up's millions.
    assert 2_000 < counts["caller"] < 200_000, counts
    assert 2_000 < counts["worker"] < 200_000, counts
    assert "| raw pipe |" in result.stdout


@pytest.mark.timeout(120)
def test_the_executor_benchmark_runs_at_tiny_size(tmp_path: Path) -> None:
    # benchmarks/bench_executor.py (not part of run_all): Executor.map and submit latency
    # against ProcessPoolExecutor, at tiny sizes, writing where it is told.
    out = tmp_path / "executor.md"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_executor.py"),
            "--quick",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = out.read_text()
    assert "| comfy_env.Executor | 1 |" in text
    assert "| ProcessPoolExecutor | 100 |" in text
    assert "target Executor.map faster than ProcessPoolExecutor" in text
    assert json.loads(out.with_suffix(".json").read_text())["items"] == 200
