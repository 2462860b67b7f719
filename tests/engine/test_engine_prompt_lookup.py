"""Prompt-lookup drafts on the engine: alone (`ar` + lookup) or before the drafter, outputs stay the target's own."""

from __future__ import annotations

import pytest

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.speculative.cost_model import CostModel
from adaflash.speculative.length_policy import FixedLength, ThroughputLength
from adaflash.speculative.prompt_lookup import PromptLookup
from adaflash.speculative.reference import autoregressive_generate
from adaflash.speculative.sampling import SamplingParams
from tests.helpers import exact_joint, law_pvalue
from tests.engine.test_engine import COST, _run, proposer, target  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def prompts(target):
    """Prompts that repeat the target's own greedy continuation of them (so lookups hit), and two that do not."""
    out = []
    for seed in [[3, 14, 15], [65, 35, 89, 79], [7]]:
        ar = autoregressive_generate(target, seed, 12).token_ids
        out.append(seed + ar + seed + ar[:3])
    return out + [[89, 79, 32, 38, 46, 26, 43], [11, 12]]


@pytest.mark.parametrize("length", ["all", "throughput"])
@pytest.mark.parametrize("with_drafter", [False, True], ids=["lookup-only", "lookup+drafter"])
def test_greedy_lookup_engine_equals_reference(target, proposer, prompts, with_drafter, length):
    budgets = [24, 30, 17, 20, 26]
    expected = {f"r{i}": autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids
                for i, (p, n) in enumerate(zip(prompts, budgets))}
    reqs = [Request(f"r{i}", p, n, stop_token_ids=(1,)) for i, (p, n) in enumerate(zip(prompts, budgets))]
    engine = Engine(target, proposer if with_drafter else None, ThroughputLength(COST) if with_drafter else None,
                    max_batch=2, max_queue=8, max_len=128, prompt_lookup=PromptLookup(6, min_ngram=1, length=length),
                    lookup_cost=COST)
    assert _run(engine, {0: reqs[:2], 2: reqs[2:4], 5: reqs[4:]}) == expected
    # Not vacuous: lookups drafted, and the repeated continuations were accepted several tokens at a time.
    assert sum(sum(r.draft_lengths) for r in reqs) > 0
    assert max(max(r.accept_lengths) for r in reqs) >= 4
    assert sorted(engine.scheduler.free_slots) == [0, 1]


def test_sampling_with_lookup_drafts_preserves_the_target_law(target):
    """The prompt repeats its start after the target's greedy continuation of it, so a likely first token matches
    and the lookup drafts what followed it: a point mass on likely tokens. The law of the first 4 tokens of 900
    seeded, batched requests must still be the target's."""
    params = SamplingParams(temperature=1.0, top_k=3)
    base = [3, 14, 15, 92]
    prompt = base + autoregressive_generate(target, base, 16).token_ids + base
    exact = exact_joint(target, prompt, params, 4)
    n = 900
    engine = Engine(target, None, max_batch=16, max_queue=n, max_len=160,
                    prompt_lookup=PromptLookup(3, max_ngram=2, min_ngram=1, length="all"))
    reqs = [Request(f"s{i}", prompt, 4, sampling=params, seed=i) for i in range(n)]
    got = _run(engine, {0: reqs}, max_steps=10_000)
    # Blocks of 2 point-mass drafts were verified, some rejected part-way.
    assert sum(r.draft_lengths[0] == 2 for r in reqs) > n // 4
    assert any(r.draft_lengths[0] == 2 and r.accept_lengths[0] == 2 for r in reqs)
    counts = dict.fromkeys(exact, 0)
    for toks in got.values():
        counts[tuple(toks)] += 1
    assert law_pvalue(counts, exact) > 1e-3


def test_lookup_outcomes_do_not_teach_the_length_policy(target, proposer, prompts):
    seen = []

    class Recording(FixedLength):
        def feedback(self, request, num_draft, num_accepted):
            seen.append(num_draft)

    # The policy drafts nothing, so a step that verified drafts verified lookup drafts.
    engine = Engine(target, proposer, Recording(0), max_batch=1, max_len=128, prompt_lookup=PromptLookup(6, length="all"))
    req = Request("a", prompts[0], 20)
    _run(engine, {0: [req]})
    assert 0 < req.draft_lengths.count(0) < len(req.draft_lengths)
    assert seen == [0] * req.draft_lengths.count(0)  # feedback for exactly the policy's own steps


def test_the_context_leaves_room_for_the_widest_verify(target, proposer):
    engine = Engine(target, proposer, max_batch=1, max_len=64, prompt_lookup=PromptLookup(12), lookup_cost=COST)
    assert (engine.max_draft, engine.max_verified) == (7, 12)
    with pytest.raises(ValueError, match="exceeds the context of 51 tokens"):
        engine.add_request(Request("a", [3] * 40, 12))


def test_sized_lookups_shrink_where_they_miss_and_under_load(target, prompts):
    """Same prompts, same outputs; what changes is how many lookup drafts a step verifies. Where every extra verified
    token costs a full pass, lookups that keep missing drop to the one-token probe; where verification is free, every
    match is verified whole, as with length="all"."""
    linear = CostModel(total_tokens=(1, 64), verify_s=(0.01, 0.64), draft_s=0.0)
    free = CostModel(total_tokens=(1, 64), verify_s=(0.01, 0.01), draft_s=0.0)
    drafted = {}
    for name, length, cost in [("all", "all", None), ("free", "throughput", free), ("linear", "throughput", linear)]:
        engine = Engine(target, None, max_batch=4, max_queue=8, max_len=128,
                        prompt_lookup=PromptLookup(6, min_ngram=1, length=length), lookup_cost=cost)
        reqs = [Request(f"r{i}", p, 24, stop_token_ids=(1,)) for i, p in enumerate(prompts)]
        out = _run(engine, {0: reqs})
        assert out == {r.request_id: autoregressive_generate(target, r.prompt_ids, 24, stop_token_ids=(1,)).token_ids
                       for r in reqs}
        drafted[name] = [k for r in reqs for k in r.draft_lengths]
    assert drafted["free"] == drafted["all"]
    assert max(drafted["linear"]) <= 1 and sum(drafted["linear"]) < sum(drafted["all"]) / 2


def test_lookup_sized_by_throughput_needs_a_cost_model(target):
    with pytest.raises(ValueError, match="lookup_cost"):
        Engine(target, None, max_batch=1, max_len=64, prompt_lookup=PromptLookup(3))
    with pytest.raises(ValueError, match="throughput, all"):
        PromptLookup(3, length="some")
