"""The profile splits a real step's time into buckets that add up to its wall time."""

from __future__ import annotations

import torch

from adaflash.models.target import load_target
from benchmarks.runtime_profile import _bucket, profile_step, to_markdown


def test_buckets_cover_the_step(tiny_checkpoints):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    r = profile_step(target, batch=2, query_len=3, context=8, repeats=2)
    assert r["ms"]["linears"] > 0 and r["ms"]["attention"] > 0 and r["ms"]["lm_head"] > 0
    assert all(v >= 0 for v in r["ms"].values()) and 0 < r["share"]["linears"] + r["share"]["lm_head"] <= 1.0
    # The tiny model's LM head (96 x 64) is smaller than its MLP weights (128 x 64 and back): linears cost more.
    assert r["ms"]["linears"] > r["ms"]["lm_head"]
    assert _bucket("aten::linear", [[4, 64], [96, 64]], vocab=96) == "lm_head"
    assert _bucket("aten::linear", [[4, 64], [128, 64]], vocab=96) == "linears"
    md = to_markdown({"command": "x", "machine": {"processor": "cpu", "threads": 1}, "dtype": "float32", "context": 8,
                      "steps": {"decode": r}})
    assert "| decode |" in md
