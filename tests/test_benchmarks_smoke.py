"""The benchmark suite runs end to end at tiny sizes, so it cannot rot (no timing asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
