"""The engine in virtual time: the clock, the roofline against published figures, the synthetic models' stated
strength, and `bench simulate` end to end (deterministic, lossless, refusing bad input)."""

from __future__ import annotations

import json

import pytest

from adaflash.cli import main
from adaflash.simulation.clock import CostedTarget, VirtualClock
from adaflash.simulation.simulate import VARIANTS, Workload, profile_of, run_variant
from adaflash.simulation.step_cost import ProfileCost, RooflineCost
from adaflash.simulation.synthetic import Strength, SyntheticDrafter, SyntheticTarget, accept_length
from adaflash.speculative.cost_model import CalibratedCost, CostModel
from adaflash.speculative.length_policy import allocate_drafts


def test_the_clock_moves_only_by_the_passes_charged():
    from adaflash.models.kv_cache.ragged import RaggedBatch
    import torch

    clock, cost = VirtualClock(), ProfileCost(CostModel((1, 8), (0.01, 0.02), 0.005))
    target = CostedTarget(SyntheticTarget(), cost, clock)
    cache = target.new_cache(2, 16)
    target(torch.tensor([5, 6, 7, 9]), RaggedBatch.build([0, 1], [0, 0], [3, 1]), cache)
    assert clock() == pytest.approx(cost.profile.verify(4)) and cache.lengths == [3, 1] and target.passes == 1
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1.0)


@pytest.mark.parametrize("concurrency, tpot_ms", [(1, 7.28), (2, 7.37), (4, 7.38), (8, 7.71)])
def test_the_h100_roofline_decode_step_is_within_15_percent_of_vllm(concurrency, tpot_ms):
    """vLLM 0.11, Qwen3-8B bf16, one H100 SXM, ShareGPT (233 in / 221 out): TPOT at concurrency 1 / 2 / 4 / 8."""
    step = RooflineCost.of("h100", "qwen3-8b").target_s([1] * concurrency, [233 + 110] * concurrency, concurrency)
    assert step * 1e3 == pytest.approx(tpot_ms, rel=0.15)


def test_a_mixture_reads_more_experts_as_its_batch_grows():
    moe = RooflineCost.of("h100", "qwen3-coder-30b-a3b").target
    one, many = moe.model.layer_weights(1), moe.model.layer_weights(64)
    assert one < many < moe.model.attention_weights + moe.model.hidden * 128 + 128 * moe.model.expert_weights
    assert moe.pass_s([1], [100]) < moe.pass_s([1] * 64, [100] * 64)


def test_the_synthetic_drafter_has_its_stated_strength():
    strength = Strength(tau=6.5, block_size=16, spread=0.0)
    assert accept_length(strength.alpha, 16) == pytest.approx(6.5, rel=1e-6)
    row = run_variant(VARIANTS["fixed-block"], RooflineCost.of("h100", "qwen3-8b"), strength, 4, Workload(8, 40, 200))
    assert row["lossless"] and row["accept_len"] == pytest.approx(6.5, rel=0.08)
    with pytest.raises(ValueError, match="tau"):
        Strength.parse("block=16")
    with pytest.raises(ValueError, match="tau must be"):
        Strength(tau=20.0).alpha
    assert SyntheticDrafter(SyntheticTarget(), strength).block_size == 16


def test_a_batched_drafter_is_priced_as_one_pass():
    """Eight requests drafting together cost about one drafter pass on a GPU: priced per request (a CPU's profile),
    the allocation drafts nothing, priced as the batched pass it drafts; the greedy path's best prefix is kept."""
    profile = profile_of(RooflineCost.of("h100", "qwen3-8b"), 8, 16)
    per_request = CostModel(profile.total_tokens, profile.verify_s, profile.draft_s, profile.draft_widths,
                            profile.draft_width_s)
    survival = [[0.85 ** j for j in range(1, 16)]] * 8
    assert sum(allocate_drafts(survival, per_request, 15)) == 0
    batched = allocate_drafts(survival, CalibratedCost(profile), 15)
    assert min(batched) >= 4 and profile.draft_pass(8, 15) < 2 * profile.draft_pass(1, 15)
    assert CostModel.from_json(profile.to_json()) == profile


def test_bench_simulate_is_deterministic_lossless_and_labelled(tmp_path, capsys):
    out = tmp_path / "sim.json"
    args = ["bench", "simulate", "--cost-model", "gpu:h200:qwen3-8b", "--drafter", "synthetic:tau=6.5,block=16",
            "--concurrency", "1,8", "--requests", "8", "--output-len", "48", "--json", str(out)]
    assert main(args) == 0
    first = json.loads(out.read_text())
    assert first["simulated"] and "roofline H200" in first["cost_model"] and "synthetic" in first["acceptance"]
    assert "Simulated" in out.with_suffix(".md").read_text() and "Simulated" in capsys.readouterr().out
    rows = {(r["concurrency"], r["variant"]): r for r in first["rows"]}
    assert set(rows) == {(c, v) for c in (1, 8) for v in VARIANTS} and all(r["lossless"] for r in rows.values())
    assert rows[(1, "fixed-block")]["speedup_vs_ar"] > 2 and rows[(8, "ar")]["drafter_passes"] == 0
    assert main(args) == 0
    assert [r["tokens_per_s"] for r in json.loads(out.read_text())["rows"]] == [r["tokens_per_s"] for r in first["rows"]]


@pytest.mark.parametrize("bad, message", [(["--cost-model", "gpu:a100:qwen3-8b"], "unknown gpu"),
                                          (["--drafter", "synthetic:block=16"], "tau"),
                                          (["--variants", "ar,sometimes"], "length policy")])
def test_bench_simulate_refuses_bad_input(bad, message, capsys):
    assert main(["bench", "simulate", "--requests", "2", *bad]) == 2
    assert message in capsys.readouterr().err


def test_vllm_s_batch_size_schedule_drafts_one_length_a_step():
    from adaflash.simulation.simulate import ScheduleLength

    policy = ScheduleLength([[1, 3, 7], [4, 8, 2], [9, 64, 0]])
    assert policy.decide([None] * 2, 15) == [7, 7] and policy.decide([None] * 5, 15) == [2] * 5
    assert policy.decide([None] * 12, 15) == [0] * 12 and policy.decide([None], 4) == [4]
    row = run_variant(VARIANTS["vllm-schedule"], RooflineCost.of("h100", "qwen3-8b"), Strength(6.5), 8,
                      Workload(16, 40, 64))
    assert row["lossless"] and row["drafts_per_pass"] > 0


@pytest.mark.parametrize("variant", ["ema-budget", "adaflash-gated"])
def test_the_batch_level_variants_are_lossless_in_a_short_simulation(variant):
    """SGLang's EMA budget and the AdaFlash release's gated head on the simulated H100, with a weak drafter, below the
    release's gate of 48 running requests and above it: every output is the synthetic target's greedy one and
    drafting happened. The gate is the server's size: above it the gated head runs as `adaflash` does, below it
    drafts the whole block where `adaflash` shortens it."""
    cost, strength = RooflineCost.of("h100", "qwen3-8b"), Strength(3.4)
    for concurrency, requests in ((32, 48), (56, 64)):
        row = run_variant(VARIANTS[variant], cost, strength, concurrency, Workload(requests, 40, 64))
        assert row["variant"] == variant and row["lossless"]
        assert row["drafts_per_pass"] > 0 and row["accept_len"] > 1
        if variant == "adaflash-gated":
            ungated = run_variant(VARIANTS["adaflash"], cost, strength, concurrency, Workload(requests, 40, 64))
            if concurrency > 48:
                assert row["tokens_per_s"] == ungated["tokens_per_s"]
            else:
                assert row["drafts_per_pass"] > ungated["drafts_per_pass"]
