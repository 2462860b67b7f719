"""The profile splits a real step's time into buckets that add up to its wall time."""

from __future__ import annotations

import torch

from adaflash.models.targets.model import load_target
from benchmarks.runtime import runtime_profile
from benchmarks.runtime.runtime_profile import _bucket, profile_step, to_markdown


def test_buckets_cover_the_step(tiny_checkpoints, monkeypatch):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    # Which bucket each profiled op of the real step went to (the times are the machine's: no claim rests on them).
    sorted_ops = []

    def spy(name, shapes, vocab):
        sorted_ops.append((name, shapes, _bucket(name, shapes, vocab)))
        return sorted_ops[-1][2]

    monkeypatch.setattr(runtime_profile, "_bucket", spy)
    r = profile_step(target, batch=2, query_len=3, context=8, repeats=2)
    assert {"linears", "lm_head", "attention", "python_dispatch"} <= set(r["ms"]) and set(r["ms"]) == set(r["share"])
    assert all(v >= 0 for v in r["ms"].values()) and 0 < r["share"]["linears"] + r["share"]["lm_head"] <= 1.0
    # The LM head (96 x 64, the vocabulary-wide weight) and only it is lm_head; the decoder's projections are linears.

    def vocab_wide(name, shapes):
        return "[96x" in name or any(s and 96 in s for s in shapes)
    head = [(n, s) for n, s, b in sorted_ops if b == "lm_head"]
    linears = [(n, s) for n, s, b in sorted_ops if b == "linears"]
    assert head and all(vocab_wide(n, s) for n, s in head)
    assert linears and not any(vocab_wide(n, s) for n, s in linears)
    assert _bucket("aten::linear", [[4, 64], [96, 64]], vocab=96) == "lm_head"
    assert _bucket("aten::linear", [[4, 64], [128, 64]], vocab=96) == "linears"
    md = to_markdown({"command": "x", "machine": {"processor": "cpu", "threads": 1}, "dtype": "float32", "context": 8,
                      "steps": {"decode": r}})
    assert "| decode |" in md
