"""The step profile times the engine's real parts, leaves the engine as it found it, and changes no token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.length_policy import FixedLength
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate
from benchmarks.runtime import step_profile
from benchmarks.runtime.step_profile import PARTS, instrumented, PartTimers, profile_generation, summarize, to_markdown


def test_parts_are_timed_and_tokens_are_the_targets(tiny_checkpoints):
    target = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=4)
    proposer = DFlashProposer(init_drafter(cfg, seed=2), target)
    prompt, n = [3, 14, 15, 92], 12
    want = autoregressive_generate(target, prompt, n).token_ids
    rows = {}
    for name, engine in {"ar": Engine(target, None, max_batch=1, max_len=64),
                         "fixed:2": Engine(target, proposer, FixedLength(2), max_batch=1, max_len=64)}.items():
        steps, out = profile_generation(engine, prompt, n, stop_ids=[])
        assert out == want  # timers only observe
        assert sum(s["tokens"] for s in steps) == n - 1  # every decode step; the prefill's token left out
        rows[name] = summarize(steps)
        # The timers are gone again: the engine's own methods run.
        assert "feed_context" not in vars(engine) and "forward" not in vars(target)
    ar, spec = rows["ar"], rows["fixed:2"]
    assert ar["ms"]["target_pass"] > 0 and ar["ms"]["draft_pass"] == 0 and ar["tokens_per_step"] == 1
    assert ar["drafts_per_step"] == 0 and 0 < spec["drafts_per_step"] <= 2
    # The draft head runs inside the block pass's one kernel call here (draft_logits): its time is the pass's.
    assert all(spec["ms"][p] > 0 for p in PARTS if p != "draft_head") and spec["ms"]["draft_head"] == 0
    assert abs(sum(spec["ms"].values()) - spec["step_ms"]) < 1e-2  # the parts and the rest add up to the step
    ar.update(vs_ar=1.0, identical_to_ar=True)
    spec.update(vs_ar=0.5, identical_to_ar=True, calibration={"scale": 1.1, "per_draft_ms": 2.5})
    md = to_markdown({"rows": rows, "dataset": "x", "prompts": 1, "repeats": 1, "max_new_tokens": n, "dtype": "float32",
                      "command": "c", "machine": {"cpu": "cpu", "threads": 1}})
    assert "| fixed:2 |" in md and "needs" in md and "fixed:2: the profile x 1.100, +2.50 ms per drafting request" in md


def test_timers_accumulate_per_step(monkeypatch):
    """An injected clock (each call of the timed function takes 0.25 virtual s): the sum per part, exactly."""
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(step_profile, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    def work(x):
        clock.now += 0.25
        return x + 1

    timers = PartTimers()
    f = timers.timed(work, "p")
    assert f(1) == 2 and f(2) == 3
    assert timers.take() == {"p": 500.0} and timers.take() == {}
    clock.now += 7.0  # time outside a timed call is no part's
    assert f(3) == 4 and timers.take() == {"p": 250.0}


def test_instrumented_restores_on_error(tiny_checkpoints):
    """The error raised inside passes through unchanged (the timers swallow nothing) and the methods are restored."""
    target = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)
    engine = Engine(target, None, max_batch=1, max_len=16)
    with pytest.raises(RuntimeError, match="^boom$"):
        with instrumented(engine, PartTimers()):
            assert "forward" in vars(target)
            raise RuntimeError("boom")
    assert "forward" not in vars(target) and "feed_context" not in vars(engine)
