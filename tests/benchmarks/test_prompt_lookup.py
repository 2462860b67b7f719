"""`python benchmarks/serving/prompt_lookup.py`: ours (with and without our prompt lookup) vs transformers' PLD."""

from __future__ import annotations

import argparse

from adaflash.pipeline import Pipeline
from adaflash.speculative.reference import GenerationResult
from benchmarks.serving import prompt_lookup
from tests.evaluation.test_offline import make_prompt, random_drafter  # noqa: F401 (fixture)


def _tiny_run(checkpoint: str, drafter: str, monkeypatch) -> dict:
    """The benchmark over one prompt a domain (the second: --skip 1), six tokens, lookup 3 and 5 beside the drafter."""
    monkeypatch.setattr(prompt_lookup, "load_prompts",
                        lambda name, split, limit: [make_prompt(f"{name} {i} one two one two", name, "x")
                                                    for i in range(limit)])
    args = argparse.Namespace(model=checkpoint, drafter=drafter, dtype="fp32", skip=1,
                              length_policy="fixed:2", per_domain=1, max_new_tokens=6, lookup=3, ours_lookup=[3, 5])
    return prompt_lookup.run(args)


def _table(report: dict) -> str:
    return prompt_lookup.to_markdown({**report, "command": "cmd", "machine": {"cpu": "test cpu", "threads": 1}})


def test_tiny_run_reports_every_domain_losslessly(tiny_chat_checkpoint, random_drafter, monkeypatch):
    report = _tiny_run(tiny_chat_checkpoint, random_drafter, monkeypatch)
    assert set(report["by_domain"]) == set(prompt_lookup.DOMAINS) and len(report["rows"]) == 4
    assert all(" 1 " in r["prompt_id"] for r in report["rows"])  # --skip 1: the second prompt of each domain
    assert all(r["ours_lossless"] and r["hf_lossless"] for r in report["rows"])
    assert all(set(m["lookup"]) == {"3", "5"} for m in report["by_domain"].values())
    assert set(report["beats_on_every_domain"]) == {"dflash", "dflash + lookup 3", "dflash + lookup 5"}
    table = _table(report)
    assert "ours + lookup 3 / our AR" in table and "ours + lookup 5 / our AR" in table
    assert table.count("\n| ") == 5  # header + 4 domains
    assert "Our outputs identical to our AR on every prompt: yes." in table


def test_ours_lossless_is_false_where_one_of_our_outputs_differs(tiny_chat_checkpoint, random_drafter, monkeypatch):
    """The verdict is computed from the tokens, not assumed: one token changed in one of our runs (lookup 5, on the
    code prompt) makes that row's ours_lossless False, only that row's, and the summary says NO."""
    generate = Pipeline.generate_ids

    def one_token_changed(self, prompt_ids, method="ar", *args, **kwargs):
        result = generate(self, prompt_ids, method, *args, **kwargs)
        lookup = self.prompt_lookup.num_tokens if self.prompt_lookup is not None else None
        if (method, lookup) == ("dflash", 5) and "humaneval" in self.decode(prompt_ids):
            return GenerationResult(result.token_ids[:-1] + [result.token_ids[-1] ^ 1], result.stats)  # (even vocab)
        return result

    monkeypatch.setattr(Pipeline, "generate_ids", one_token_changed)
    report = _tiny_run(tiny_chat_checkpoint, random_drafter, monkeypatch)
    assert {r["domain"]: r["ours_lossless"] for r in report["rows"]} == {
        "math": True, "code": False, "chat": True, "multilingual": True}
    assert "Our outputs identical to our AR on every prompt: NO." in _table(report)
