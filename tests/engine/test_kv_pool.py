"""The engine on a paged KV pool: requests wait for memory instead of running short, every output stays the target's
own (rejected drafts rolled back across block borders), prompt prefixes are shared between requests, and the pool is
whole again once the engine runs empty."""

from __future__ import annotations

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.models.kernels.selection import fast_linears_available
from adaflash.models.targets.model import load_target
from adaflash.speculative.length_policy import FixedLength, HeuristicLength
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate
from tests.engine.test_engine import proposer, target  # noqa: F401 (the engine tests' tiny target and drafter)

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32], [38, 46, 26], [43, 11, 7, 7, 7, 7, 7, 50, 51, 52, 23, 9, 40], [2, 60],
           [5, 6, 7, 8, 9, 10], [90, 91], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [33]]
BUDGETS = [30, 24, 40, 18, 27, 35, 22, 31]


def _drain(engine: Engine, requests: list[Request]) -> list[dict]:
    """Add every request at once and step until the engine is empty; what the pool looked like after each step."""
    for r in requests:
        engine.add_request(r)
    seen = []
    while engine.has_work():
        engine.step()
        s = engine.scheduler
        seen.append({**engine.kv_stats(), "waiting": len(s.waiting), "free_slots": len(s.free_slots)})
        assert len(seen) < 2000
    return seen


@pytest.mark.parametrize("policy", [FixedLength(7), HeuristicLength(7)], ids=["whole-block", "heuristic"])
def test_requests_wait_for_the_pool_and_every_output_is_the_targets(target, proposer, policy):
    """A pool of 96 positions in blocks of 8 for 8 slots: about two requests fit at once; the rest wait with slots
    free, none ever runs short, drafts rejected past a block border give their blocks back, and each output equals
    plain decoding alone."""
    engine = Engine(target, proposer, policy, max_batch=8, max_len=128, kv_pool_tokens=96, kv_block_size=8)
    requests = [Request(f"r{i}", p, n, stop_token_ids=(1,)) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))]
    seen = _drain(engine, requests)
    assert any(s["waiting"] and s["free_slots"] for s in seen)  # the pool, not the slots, held them back
    assert max(s["held"] for s in seen) <= engine.target_cache.num_blocks == 12
    assert all(s["reserved"] <= s["blocks"] for s in seen)
    for r, prompt, budget in zip(requests, PROMPTS, BUDGETS):
        assert r.output_ids == autoregressive_generate(target, prompt, budget, stop_token_ids=(1,)).token_ids
    assert sum(sum(r.draft_lengths) for r in requests) > 0
    assert engine.kv_stats()["held"] == 0 and engine.kv_stats()["reserved"] == 0  # the fp32 target shares nothing
    assert engine.draft_cache.blocks_held() == 0


def test_a_request_the_pool_can_never_hold_is_refused_at_once(target):
    engine = Engine(target, None, max_batch=2, max_len=128, kv_pool_tokens=32, kv_block_size=8)
    with pytest.raises(ValueError, match="exceeds the KV cache pool of 31 tokens"):
        engine.add_request(Request("big", [3] * 20, 20))
    engine.add_request(Request("fits", [3] * 10, 20))  # 10 + 20 + 1 positions: 4 blocks


@pytest.fixture(scope="module")
def int8_target(smollm2_dir):
    """SmolLM2 on --dtype int8 (a GGUF's blocks): every position computed alone, so shared blocks are exact."""
    probe = load_target(smollm2_dir, dtype=torch.float32)
    if not fast_linears_available(probe.lm_head):
        pytest.skip("our CPU kernels are unavailable here: no exact prefix sharing")
    target = load_target(smollm2_dir, dtype=torch.float32, int8_activations=True)
    assert target.rows_independent
    return target


@pytest.mark.parametrize("drafted, kv_dtype", [(False, None), (True, None), (False, torch.int8)],
                         ids=["ar", "dflash", "ar-int8-kv"])
def test_requests_share_the_blocks_of_a_common_prefix(int8_target, drafted, kv_dtype):
    """A system prompt of 27 tokens: the first request's 3 whole blocks of 8 are kept when it ends; two later requests
    starting with them map the same blocks in at once (held once) and prefill only the rest, and their outputs equal a
    fresh engine's."""
    system = list(range(400, 427))
    proposer = None
    if drafted:
        from adaflash.models.drafters.checkpoint import load_drafter
        from adaflash.models.targets.registry import shipped_drafter

        proposer = DFlashProposer(load_drafter(shipped_drafter("smollm2-135m"), dtype=torch.float32), int8_target)

    def engine() -> Engine:
        return Engine(int8_target, proposer, FixedLength(3) if drafted else None, max_batch=4, max_len=128,
                      kv_block_size=8, kv_dtype=kv_dtype)

    shared = engine()
    first = Request("first", system + [300, 40], 12, stop_token_ids=(1,))
    _drain(shared, [first])
    assert shared.prompt_tokens_reused == 0 and shared.kv_stats()["held"] == 0  # cached blocks are not held
    later = [Request(f"r{i}", system + tail, 16, stop_token_ids=(1,)) for i, tail in enumerate(([900, 80, 70], [50]))]
    for r in later:
        shared.add_request(r)
    shared.step()  # both admitted and prefilled
    assert shared.prompt_tokens_reused == 2 * 24
    slots = [shared.target_cache.slot_blocks[r.slot][:3] for r in later]
    assert slots[0] == slots[1] and shared.kv_stats()["held"] < 2 * len(shared.target_cache.slot_blocks[later[0].slot])
    while shared.has_work():
        shared.step()
    fresh = [Request(r.request_id, r.prompt_ids, 16, stop_token_ids=(1,)) for r in later]
    _drain(engine(), fresh)
    assert [r.output_ids for r in later] == [r.output_ids for r in fresh]
    if drafted:
        assert [r.accept_lengths for r in later] == [r.accept_lengths for r in fresh]  # the drafter's context too


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16, torch.int8])
def test_a_narrower_cache_is_lossless_against_plain_decoding_at_the_same_setting(target, proposer, kv_dtype):
    """--kv-dtype: speculative greedy output equals an AR engine's with the same cache dtype, whatever the batch."""
    def outputs(drafter) -> list[list[int]]:
        engine = Engine(target, drafter, FixedLength(7) if drafter else None, max_batch=4, max_len=128,
                        kv_block_size=8, kv_dtype=kv_dtype)
        assert engine.target_cache.k.dtype == kv_dtype
        requests = [Request(f"r{i}", p, n, stop_token_ids=(1,)) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))]
        _drain(engine, requests)
        return [r.output_ids for r in requests]

    assert outputs(proposer) == outputs(None)


def test_the_reuse_counter_follows_the_engines_running_total():
    from adaflash.engine.runner import StepStats
    from adaflash.server.metrics import ServerMetrics

    metrics = ServerMetrics("fixed:3", "ar", 2)
    for total in (0, 24, 24, 60):
        metrics.observe_step(StepStats(1, 0, 1, prompt_tokens_reused=total, kv={"blocks": 9, "held": 4,
                                                                                 "reserved": 6, "block_size": 8}))
    text = metrics.render()[0].decode()
    assert "adaflash_prompt_tokens_reused_total 60.0" in text
    assert "adaflash_kv_blocks_held 4.0" in text and "adaflash_kv_blocks_reserved 6.0" in text
