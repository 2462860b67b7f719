"""A draft model as the engine's draft source: every request equals the target alone, whatever the batch, the length
policy or the draft model's acceptance; sampled drafts keep the target's law; its cache holds committed tokens only."""

from __future__ import annotations

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target
from adaflash.speculative.draft_model import DraftModelProposer
from adaflash.speculative.drafting_check import DraftingCheck, DraftingChecks
from adaflash.speculative.length_policy import CostModel, FixedLength, HeuristicLength, ThroughputLength
from adaflash.speculative.reference import autoregressive_generate
from adaflash.speculative.sampling import SamplingParams
from tests.helpers import PassClock, decode_batches, drafting_happened, exact_joint, engine_law_pvalue, run_engine

PROMPTS = [[3, 14, 15, 92], [65, 35], [89, 79, 32, 38, 46, 26, 43], [11], [7, 7, 7, 7, 7, 7], [50, 51, 52],
           [23, 9, 40, 2], [60]]
BUDGETS = [40, 34, 66, 44, 50, 36, 52, 42]
ARRIVALS = {0: slice(0, 3), 1: slice(3, 6), 2: slice(6, 8)}
COST = CostModel(total_tokens=(1, 8, 32, 128), verify_s=(0.01, 0.0101, 0.0105, 0.014), draft_s=0.002,
                 draft_widths=(2, 4, 5), draft_width_s=(0.001, 0.003, 0.004))


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)


@pytest.fixture(scope="module")
def drafts(tiny_checkpoints, target):
    """Two draft models of the target's vocabulary: its own weights in bf16 (accepts nearly everything), and with noise
    on its embedding (about half its greedy picks agree with the target's: every accept length happens)."""
    noisy = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)
    with torch.no_grad():
        noise = torch.randn(noisy.embed_tokens.shape, generator=torch.Generator().manual_seed(0))
        noisy.embed_tokens.add_(noise * noisy.embed_tokens.std() * 0.45)
    return {"close": load_target(tiny_checkpoints["qwen2"], dtype=torch.bfloat16), "noisy": noisy}


@pytest.fixture(scope="module")
def expected(target):
    return {f"r{i}": autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids
            for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))}


POLICIES = {
    "fixed:4": lambda: (FixedLength(4), None),
    "fixed:1": lambda: (FixedLength(1), None),
    "heuristic": lambda: (HeuristicLength(initial=2), None),
    "throughput": lambda: (ThroughputLength(COST), None),
    "throughput+checks": lambda: (ThroughputLength(COST), DraftingChecks(DraftingCheck(explore=4, first=4, settle=1))),
}


@pytest.mark.parametrize("which", ["close", "noisy"])
@pytest.mark.parametrize("max_batch", [1, 3, 8])
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_greedy_engine_with_a_draft_model_equals_the_target_alone(target, drafts, expected, which, max_batch,
                                                                   policy_name):
    policy, checks = POLICIES[policy_name]()
    clock = PassClock(base_s=0.01, token_s=3e-5)
    proposer = DraftModelProposer(drafts[which], target, max_draft=4)
    engine = Engine(target, proposer, policy, max_batch=max_batch, max_queue=8, max_len=128, drafting_checks=checks,
                    clock=clock)
    batches = decode_batches(engine)
    reqs = [Request(f"r{i}", p, n, stop_token_ids=(1,)) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))]
    with clock.driving(target):
        got = run_engine(engine, {step: reqs[part] for step, part in ARRIVALS.items()}, max_steps=2000)
    assert got == expected
    assert sorted(engine.scheduler.free_slots) == list(range(max_batch))
    assert max(batches) == max_batch
    drafting_happened(reqs)
    accepted = sum(a - 1 for r in reqs for a in r.accept_lengths)
    drafted = sum(sum(r.draft_lengths) for r in reqs)
    if which == "close":
        assert accepted > 0.8 * drafted
    else:
        assert accepted < drafted  # rejections happened
    cache = engine.draft_cache
    for slot in range(max_batch):  # only committed tokens ever stay in the draft model's cache
        assert cache.lengths[slot] <= max(len(p) + n for p, n in zip(PROMPTS, BUDGETS))


def test_the_draft_models_cache_holds_the_committed_tokens_after_each_step(target, drafts):
    """After every step a drafting request's draft-model cache holds a prefix of its committed tokens and its K/V are
    those of a fresh pass over them (no draft's position survives a rollback)."""
    proposer = DraftModelProposer(drafts["noisy"], target, max_draft=3)
    engine = Engine(target, proposer, FixedLength(3), max_batch=2, max_len=96)
    reqs = [Request("a", PROMPTS[0], 20), Request("b", PROMPTS[2], 20)]
    for r in reqs:
        engine.add_request(r)
    cache = engine.draft_cache
    while engine.has_work():
        engine.step()
        for r in engine.scheduler.running:
            held = cache.lengths[r.slot]
            assert held <= len(r.prompt_ids) + len(r.output_ids) - 1
            if held:
                fresh = drafts["noisy"].new_cache(1, held)
                tokens = (r.prompt_ids + r.output_ids)[:held]
                drafts["noisy"](torch.tensor(tokens), RaggedBatch.build([0], [0], [held]), fresh, ())
                torch.testing.assert_close(cache.contents(r.slot)[0], fresh.contents(0)[0])


def test_sampling_with_a_draft_model_preserves_the_target_law(target, drafts):
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = [3, 14, 15, 92, 65, 35]
    exact = exact_joint(target, prompt, params, 3)
    n = 900
    engine = Engine(target, DraftModelProposer(drafts["noisy"], target, max_draft=2), FixedLength(2), max_batch=16,
                    max_queue=n, max_len=64)
    pvalue, reqs = engine_law_pvalue(engine, prompt, params, exact, n)
    assert pvalue > 1e-3
    drafting_happened(reqs)
    assert any(a == 1 for r in reqs for a in r.accept_lengths)  # rejections too


def test_a_draft_model_asked_for_no_drafts_or_more_than_it_drafts_refuses(target, tiny_checkpoints):
    with pytest.raises(ValueError, match="at least 1"):
        DraftModelProposer(target, target, max_draft=0)
    proposer = DraftModelProposer(target, target, max_draft=2)
    with pytest.raises(ValueError, match="draft lengths"):
        proposer.propose(proposer.new_cache(1, 16), [0], [[3, 4]], [3], [SamplingParams()], [None])
