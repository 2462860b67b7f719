"""The files a measurement leaves: its numbers as JSON beside a markdown page of them (STEM.json, STEM.md), and the
GitHub tables those pages are made of.

One writer for every command and benchmark script, so each report's ending is a call, not the same five lines.
It imports nothing of the package: training's summaries and evaluation's reports both write through it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence


def write_json(obj: Any, path: str | Path) -> Path:
    """`obj` as JSON (indent 2, a trailing newline) at `path`, its folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    return path


def beside(stem: str | Path, ext: str) -> Path:
    """STEM + `ext`; a report suffix on `stem` (`out.json`) is replaced, any other dot kept (`served_qwen2.5-0.5b`)."""
    stem = Path(stem)
    return stem.with_suffix(ext) if stem.suffix in (".json", ".md", ".png") else Path(f"{stem}{ext}")


def write_report(stem: str | Path, report: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """STEM.json (`report`) and STEM.md (`markdown`), the folder made (`beside`)."""
    md = beside(stem, ".md")
    json_path = write_json(report, beside(stem, ".json"))
    md.write_text(markdown, encoding="utf-8")
    return json_path, md


def markdown_table(headers: Sequence[Any], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub table, no trailing newline: the header, the rule, a line per row; cells are `str()`ed.

    `align` has one letter per column, `l` (`---`) or `r` (`---:`); left by default. An empty cell is written `| |`.
    """
    def line(cells: Sequence[Any]) -> str:
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    if align is not None and len(align) != len(headers):
        raise ValueError(f"align {align!r} names {len(align)} columns, the table has {len(headers)}")
    rule = "|" + "".join("---:|" if a == "r" else "---|" for a in (align or "l" * len(headers)))
    return "\n".join([line(headers), rule, *map(line, rows)])


def verdict_page(title: str, command: str, machine: str, results: dict[str, dict[str, Any]]) -> str:
    """A page of scenarios, each a dict with `fault`, `expected`, `observed`, `passed` and optional `details`: one
    table of verdicts, then each scenario's details as JSON."""
    rows = [[name, r["fault"], r["expected"], r["observed"], "pass" if r["passed"] else "**FAIL**"]
            for name, r in results.items()]
    lines = [f"# {title}", "", f"`{command}`", "", machine, "",
             markdown_table(["scenario", "fault", "expected", "observed", "verdict"], rows), ""]
    for name, r in results.items():
        if r.get("details"):
            lines += [f"## {name}", "", "```json", json.dumps(r["details"], indent=1), "```", ""]
    return "\n".join(lines)
