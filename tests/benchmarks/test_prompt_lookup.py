"""`python benchmarks/prompt_lookup.py`: ours (with and without our prompt lookup) vs transformers' PLD."""

from __future__ import annotations

import argparse

from benchmarks import prompt_lookup
from tests.evaluation.test_offline import make_prompt, random_drafter  # noqa: F401 (fixture)


def test_tiny_run_reports_every_domain_losslessly(tiny_chat_checkpoint, random_drafter, monkeypatch):
    monkeypatch.setattr(prompt_lookup, "load_prompts",
                        lambda name, split, limit: [make_prompt(f"{name} {i} one two one two", name, "x")
                                                    for i in range(limit)])
    args = argparse.Namespace(model=tiny_chat_checkpoint, drafter=random_drafter, dtype="fp32", skip=1,
                              length_policy="fixed:2", per_domain=1, max_new_tokens=6, lookup=3, ours_lookup=[3, 5])
    report = prompt_lookup.run(args)
    assert set(report["by_domain"]) == set(prompt_lookup.DOMAINS) and len(report["rows"]) == 4
    assert all(" 1 " in r["prompt_id"] for r in report["rows"])  # --skip 1: the second prompt of each domain
    assert all(r["ours_lossless"] and r["hf_lossless"] for r in report["rows"])
    assert all(set(m["lookup"]) == {"3", "5"} for m in report["by_domain"].values())
    assert set(report["beats_on_every_domain"]) == {"dflash", "dflash + lookup 3", "dflash + lookup 5"}
    report.update(command="cmd", machine={"cpu": "test cpu", "threads": 1})
    table = prompt_lookup.to_markdown(report)
    assert "ours + lookup 3 / our AR" in table and "ours + lookup 5 / our AR" in table
    assert table.count("\n| ") == 5  # header + 4 domains
