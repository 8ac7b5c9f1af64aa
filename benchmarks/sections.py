"""Sections of ``benchmarks/RESULTS.md`` that scripts outside ``run_all.py`` write.

``run_all.py`` writes the whole results file; two other scripts measure what it does not and
each writes its own section into that file, between markers of its own name:

- ``bench_comfyui.py`` (``python3 dev.py bench-comfyui``): section 7, a ComfyUI node;
- ``bench_build.py``: section 9, declared envs (build, first call, list, shared pages);
- ``bench_start.py``: section 10, warm starts (the first call after ``start(preload=...)``);
- ``bench_executor.py``: section 11, ``comfy_env.Executor`` against ``ProcessPoolExecutor``.

Data flow: a script's section is a block ``<!-- NAME:begin -->`` ... ``<!-- NAME:end -->``;
``Section.write`` puts it in place of the block already in the file, else where the
sections' order puts it (before the first heading that comes after it). When ``run_all.py``
rewrites the file it calls ``keep_sections(previous, text)``, which carries every block of
the old file over into the new text, so neither command ever erases the other's figures.
Stdlib only: ``bench_comfyui.py`` runs under ComfyUI's interpreter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Section:
    """One script's block in the results file: its marker name and the headings that come
    after it (where a missing block goes)."""

    name: str
    later: re.Pattern[str]

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def block(self, results: str) -> str | None:
        """This section's block of a results file's text, markers included; None when it has
        none (or only half of its markers)."""
        if self.begin not in results:
            return None
        inner, end, _ = results.split(self.begin, 1)[1].partition(self.end)
        return self.begin + inner + self.end if end else None

    def place(self, results: str, block: str) -> str:
        """``results`` with ``block`` (markers included) as this section: in place of the
        block already there; else before the first later heading; else appended."""
        old = self.block(results)
        if old is not None:
            return results.replace(old, block, 1)
        lines = results.split("\n")
        for i, line in enumerate(lines):
            if self.later.match(line):
                return "\n".join([*lines[:i], block, "", *lines[i:]])
        return results.rstrip("\n") + "\n\n" + block + "\n"

    def write(self, path: Path, block: str) -> None:
        """Put ``block`` into the results file at ``path`` (made if missing)."""
        current = path.read_text() if path.exists() else ""
        path.write_text(self.place(current, block))


# Section 7 goes before section 8 (or any later one) or the closing hygiene check.
COMFYUI = Section("bench_comfyui", re.compile(r"## (?:(?:[89]|[1-9][0-9]+)\. |Process hygiene$)"))
# Section 9 goes before section 10 on, or the closing hygiene check.
BUILD = Section("bench_build", re.compile(r"## (?:[1-9][0-9]+\. |Process hygiene$)"))
# Section 10 goes before section 11 on, or the closing hygiene check.
START = Section("bench_start", re.compile(r"## (?:1[1-9]\. |[2-9][0-9]\. |Process hygiene$)"))
# Section 11 goes before section 12 on, or the closing hygiene check.
EXECUTOR = Section("bench_executor", re.compile(r"## (?:1[2-9]\. |[2-9][0-9]\. |Process hygiene$)"))
KEPT = (COMFYUI, BUILD, START, EXECUTOR)


def keep_sections(previous: str, text: str) -> str:
    """``text`` (a results file ``run_all.py`` just made) with every kept section's block of
    ``previous`` (the file it replaces) put in its place."""
    for section in KEPT:
        block = section.block(previous)
        if block is not None:
            text = section.place(text, block)
    return text
