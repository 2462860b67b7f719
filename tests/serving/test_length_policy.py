"""Draft-length policies by themselves (no engine): their decisions, their feedback and the spec parser."""

from __future__ import annotations

import pytest

from adaflash.serving.cost_model import CostModel
from adaflash.serving.length_policy import (
    FixedLength,
    HeuristicLength,
    ThroughputLength,
    allocate_drafts,
    build_length_policy,
    check_length_policy,
    needs_cost_model,
)
from adaflash.serving.request import Request

FREE_VERIFY = CostModel(total_tokens=(1, 64), verify_s=(0.01, 0.01), draft_s=0.0)  # batch-1 machine: tokens are free
LINEAR = CostModel(total_tokens=(1, 64), verify_s=(0.01, 0.64), draft_s=0.0)  # every token costs a full pass


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2], 8) for i in range(n)]


def test_fixed_length_is_capped_by_max_draft():
    policy = build_length_policy("fixed:5")
    assert isinstance(policy, FixedLength) and policy.name == "fixed:5"
    assert policy.decide(_requests(2), max_draft=3) == [3, 3]


def test_heuristic_grows_after_a_full_accept_and_shrinks_after_a_rejection():
    policy, (r,) = HeuristicLength(initial=4), _requests(1)
    assert policy.decide([r], 15) == [4]
    policy.feedback(r, drafted=4, accepted=4)
    assert policy.decide([r], 15) == [6]
    policy.feedback(r, drafted=6, accepted=2)
    assert policy.decide([r], 15) == [5]
    policy.feedback(r, drafted=0, accepted=0)  # no drafts: nothing learned
    assert policy.decide([r], 15) == [5]


def test_allocate_drafts_long_when_verification_is_free_and_none_when_it_is_not():
    survival = [[0.9 ** j for j in range(1, 8)]] * 2
    assert allocate_drafts(survival, FREE_VERIFY, max_draft=7) == [7, 7]
    assert allocate_drafts(survival, LINEAR, max_draft=7) == [0, 0]
    assert allocate_drafts(survival, FREE_VERIFY, max_draft=3) == [3, 3]


def test_allocate_drafts_gives_the_likelier_request_more():
    survival = [[0.95 ** j for j in range(1, 8)], [0.3 ** j for j in range(1, 8)]]
    cost = CostModel(total_tokens=(1, 2, 16), verify_s=(0.01, 0.0102, 0.016), draft_s=0.0)
    high, low = allocate_drafts(survival, cost, max_draft=7)
    assert high > low


def test_allocate_drafts_prices_the_draft_block_by_its_width():
    survival = [[0.8 ** j for j in range(1, 8)]]
    whole = CostModel((1, 64), (0.01, 0.01), draft_s=0.012)  # any draft pays a whole block: not worth it here
    by_width = CostModel((1, 64), (0.01, 0.01), draft_s=0.012, draft_widths=(2, 8), draft_width_s=(0.0005, 0.012))
    assert allocate_drafts(survival, whole, 7) == [0]
    assert allocate_drafts(survival, by_width, 7) == [4]  # short blocks pay; past 4 the widening costs more


def test_throughput_learns_alpha_from_feedback():
    policy, (r,) = ThroughputLength(FREE_VERIFY, prior=0.6), _requests(1)
    policy.feedback(r, drafted=4, accepted=4)
    assert r.policy_state["alpha"] == pytest.approx(0.9 * 0.6 + 0.1 * 1.0)
    policy.feedback(r, drafted=4, accepted=1)  # position 2 failed: 1 success in 2 trials
    assert r.policy_state["alpha"] == pytest.approx(0.9 * 0.64 + 0.1 * 0.5)
    assert policy.shared_alpha == pytest.approx(r.policy_state["alpha"])  # the prior of the next request


def test_throughput_probes_an_idle_request():
    policy, (r,) = ThroughputLength(LINEAR, probe_every=3), _requests(1)
    assert [policy.decide([r], 7)[0] for _ in range(5)] == [0, 0, 0, 1, 0]


@pytest.mark.parametrize("spec, message", [
    ("bogus", "unknown length policy"),
    ("fixed:-1", "must be >= 0"),
    ("throughput", "needs a cost model"),
    ("adaflash", "needs a cost model"),
    ("block-head", "BlockLengthHead"),
])
def test_build_length_policy_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        build_length_policy(spec)


def test_check_length_policy_parses_without_models():
    for spec in ("fixed:3", "heuristic", "throughput", "adaflash", "block-head"):
        check_length_policy(spec)
    with pytest.raises(ValueError, match="unknown length policy"):
        check_length_policy("fastest")
    assert needs_cost_model("throughput") and needs_cost_model("adaflash")
    assert not needs_cost_model("fixed:3") and not needs_cost_model("block-head")
