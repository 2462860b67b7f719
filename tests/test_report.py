"""The report writer: STEM.json beside STEM.md, and the GitHub tables the pages are made of."""

from __future__ import annotations

import json

import pytest

from adaflash.report import markdown_table, write_json, write_report


def test_write_report_makes_the_folder_and_writes_both_files(tmp_path):
    report = {"command": "python benchmarks/x.py", "rows": [1.5, "τ"]}
    json_path, md_path = write_report(tmp_path / "new" / "deeper" / "x.json", report, "# X\n")
    assert (json_path, md_path) == (tmp_path / "new" / "deeper" / "x.json", tmp_path / "new" / "deeper" / "x.md")
    assert json_path.read_text(encoding="utf-8") == json.dumps(report, indent=2) + "\n"
    assert md_path.read_text(encoding="utf-8") == "# X\n"
    # A bare stem gets the suffixes too.
    assert write_report(tmp_path / "y", {}, "")[0].name == "y.json" and (tmp_path / "y.md").exists()


def test_write_json_returns_its_path(tmp_path):
    assert write_json([1], tmp_path / "a" / "b.json").read_text() == "[\n  1\n]\n"


def test_markdown_table():
    assert markdown_table(["", "value"], [["loss", 1.5], ["empty", ""]]) == (
        "| | value |\n|---|---|\n| loss | 1.5 |\n| empty | |")
    assert markdown_table(["a", "n"], [], align="lr") == "| a | n |\n|---|---:|"
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [], align="l")
