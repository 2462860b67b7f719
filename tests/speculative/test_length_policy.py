"""Draft-length policies by themselves (no engine): their decisions, their feedback and what they need to be built
(the spec parser itself: test_config.py)."""

from __future__ import annotations

import pytest
import torch

from adaflash.engine.request import Request
from adaflash.speculative.cost_model import CostModel
from adaflash.speculative.batch_length import EmaBudgetLength, GatedLength
from adaflash.speculative.length_policy import (FixedLength, HeuristicLength, LearnedThroughputLength, LookupLength,
    ThroughputLength, allocate_drafts)
from adaflash.speculative.policies import build_length_policy, learned_policy

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


def test_heuristic_starts_a_new_request_where_the_last_feedback_left_the_length():
    policy, (a, b, c) = HeuristicLength(initial=8), _requests(3)
    assert policy.decide([a, b], 15) == [8, 8]
    policy.feedback(a, drafted=8, accepted=0)
    policy.feedback(a, drafted=7, accepted=1)
    assert policy.decide([a, b, c], 15) == [6, 8, 6]  # b keeps its own; c, new, starts at a's 6
    policy.feedback(b, drafted=8, accepted=8)
    assert policy.decide([Request("d", [1], 8)], 15) == [10]
    for _ in range(5):  # full accepts at the cap carry no length past it
        k = policy.decide([b], 12)[0]
        policy.feedback(b, drafted=k, accepted=k)
    assert policy.decide([Request("e", [1], 8)], 12) == [12] and policy.carried <= 14


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


def test_throughput_counts_per_position_outcomes_and_pools_them_across_requests():
    policy, (r,) = ThroughputLength(FREE_VERIFY, prior=0.6, prior_trials=2.0, decay=1.0, optimism=0.0), _requests(1)
    assert policy.alpha(r) == pytest.approx(0.6)  # no evidence: the prior
    policy.feedback(r, drafted=4, accepted=4)  # 4 successes in 4 trials
    policy.feedback(r, drafted=4, accepted=1)  # position 2 failed: 1 success in 2 trials
    assert r.policy_state["successes"] == 5 and r.policy_state["trials"] == 6
    # Pooled counts, not an average of per-step ratios: (1.2 + 5) / (2 + 6).
    assert policy.shared_alpha == pytest.approx(6.2 / 8)
    assert policy.alpha(r) == pytest.approx((5 + 2 * policy.shared_alpha) / 8)
    fresh = _requests(1)[0]
    assert policy.alpha(fresh) == pytest.approx(policy.shared_alpha)  # the prior of the next request


def test_throughput_bound_is_optimistic_while_unsure_and_reopens_as_evidence_ages():
    policy, (r,) = ThroughputLength(FREE_VERIFY, prior=0.4, forget=0.9), _requests(1)
    assert policy.alpha(r, policy.optimism) > policy.alpha(r) == pytest.approx(0.4)  # few trials: bound above mean
    for _ in range(20):
        policy.feedback(r, drafted=1, accepted=0)
    closed = policy.alpha(r, policy.optimism)
    assert closed < 0.1
    for _ in range(40):  # steps without new outcomes: the old ones fade
        policy.decide([r], 7)
    assert policy.alpha(r, policy.optimism) > closed + 0.1


def test_throughput_optimism_buys_one_probe_token_not_a_longer_draft():
    cost = CostModel(total_tokens=(1, 2, 3, 4), verify_s=(0.0048, 0.0058, 0.0069, 0.0081), draft_s=0.0009)
    policy, (r,) = ThroughputLength(cost, prior=0.3), _requests(1)
    assert allocate_drafts([[0.3 ** j for j in range(1, 8)]], cost, 7) == [0]  # the mean says: do not draft
    assert allocate_drafts([[policy.alpha(r, policy.optimism) ** j for j in range(1, 8)]], cost, 7)[0] > 1
    assert policy.decide([r], 7) == [1]


def test_throughput_does_not_absorb_a_request_whose_prior_other_domains_pulled_down():
    """The served failure this replaces: chat requests drag the shared estimate under the bar, and a math request
    that would gain from drafting never drafts, so never learns that it should."""
    cost = CostModel(total_tokens=(1, 2, 3, 4), verify_s=(0.0048, 0.0058, 0.0069, 0.0081), draft_s=0.0009)
    policy = ThroughputLength(cost)
    for i in range(200):  # earlier requests whose first draft was kept 30% of the time: below this machine's bar
        policy.feedback(_requests(1)[0], drafted=1, accepted=int(i % 10 < 3))
    assert policy.shared_alpha == pytest.approx(0.3, abs=0.02)
    assert allocate_drafts([[policy.shared_alpha]], cost, 1) == [0]
    math_request, drafted = _requests(1)[0], 0
    for step in range(60):
        (k,) = policy.decide([math_request], 15)
        policy.feedback(math_request, k, k)  # this request's drafts are always right
        drafted += k
    assert drafted > 60  # it learned to draft, within a 60-token request


def test_throughput_stops_drafting_long_once_measured_steps_say_drafting_costs_more():
    """The profile prices a one-draft step at +1 ms over decode; this machine's engine adds 6 ms per drafting request
    (its feed, verifier, rollback). The calibrated policy learns that from the step times and drafts longer only
    where the gain pays for it; the profile-only policy keeps drafting at the profile's length. (The policies alone, without
    the drafting check that would also stop them drafting: tests/engine/test_drafting.py.)"""
    cost = CostModel(total_tokens=(1, 2, 4, 8), verify_s=(0.010, 0.011, 0.012, 0.014), draft_s=0.001)
    calibrated = build_length_policy("throughput", cost)
    profiled = build_length_policy("throughput-profiled", cost)
    assert profiled.name == "throughput-profiled" and calibrated.name == "throughput"
    lengths = {}
    for policy in (calibrated, profiled):
        for _ in range(100):
            r = _requests(1)[0]
            (k,) = policy.decide([r], 7)
            policy.feedback(r, k, min(k, 1))  # the first draft is always kept, the second never: alpha ~ 0.5
            seconds = cost.verify(k + 1) + cost.draft(k) + (0.006 if k else 0.0)
            policy.observe_step([k], seconds)
        lengths[policy.name] = policy.decide(_requests(1), 7)[0]
    assert lengths["throughput-profiled"] >= 2  # the profile alone says drafting pays
    assert lengths["throughput"] <= 1  # at most the one-token probe: 6 ms a draft does not pay for ~0.5 token
    assert calibrated.step_cost.per_draft_s == pytest.approx(0.006, abs=0.001)


def test_throughput_probes_an_idle_request():
    policy, (r,) = ThroughputLength(LINEAR, probe_every=3), _requests(1)
    assert [policy.decide([r], 7)[0] for _ in range(5)] == [0, 0, 0, 1, 0]


@pytest.mark.parametrize("spec, message", [
    ("bogus", "unknown length policy"),
    ("fixed:-1", "must be >= 0"),
    ("throughput", "needs a cost model"),
    ("throughput-profiled", "needs a cost model"),
    ("adaflash", "needs a cost model"),
    ("adaflash-gated", "needs a cost model"),
    ("block-head", "BlockLengthHead"),
])
def test_build_length_policy_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        build_length_policy(spec)


def test_free_drafts_pay_no_drafter_pass():
    survival = [[0.8 ** j for j in range(1, 8)]]
    whole = CostModel((1, 64), (0.01, 0.01), draft_s=0.012)
    assert allocate_drafts(survival, whole, 7) == [0]  # a drafter pass would cost more than the drafts gain
    assert allocate_drafts(survival, whole, 7, free_drafts=True) == [7]  # lookups: verification alone, free here


def test_lookup_length_trims_by_cost_and_keeps_its_estimate_apart_from_the_drafters():
    cost = CostModel(total_tokens=(1, 2, 4, 8), verify_s=(0.010, 0.0115, 0.013, 0.016), draft_s=0.0)
    lookup, drafter = LookupLength(cost, optimism=0.0), ThroughputLength(cost)
    (r,) = _requests(1)
    proposals = [[5, 6, 7, 8, 9, 10, 11]]
    assert lookup.decide([r], proposals) == [3]  # at alpha 0.5 a 4-token verify pays, a 5-token one no longer
    for _ in range(30):  # this request's lookups are always right
        lookup.feedback(r, drafted=3, accepted=3)
    assert lookup.decide([r], proposals) == [7]
    assert lookup.decide([r], [[5, 6]]) == [2]  # never past the match
    assert "trials" not in r.policy_state and drafter.alpha(r) == pytest.approx(0.6)  # the drafter's prior untouched
    (miss,) = _requests(1)
    for _ in range(20):  # another request whose lookups always miss
        lookup.feedback(miss, drafted=1, accepted=0)
    assert lookup.decide([miss], proposals) == [0]
    # Under load the same estimate verifies fewer: 8 requests already fill the cheap part of the curve.
    many = _requests(8)
    for q in many:
        for _ in range(5):
            lookup.feedback(q, drafted=2, accepted=1)
    assert sum(lookup.decide(many, proposals * 8)) < 8 * lookup.decide(many[:1], proposals)[0]


def test_lookup_length_probes_one_token_while_unsure():
    cost = CostModel(total_tokens=(1, 2, 3, 4), verify_s=(0.0048, 0.0058, 0.0069, 0.0081), draft_s=0.0)
    lookup, (r,) = LookupLength(cost, prior=0.15), _requests(1)
    assert LookupLength(cost, prior=0.15, optimism=0.0).decide([r], [[1, 2, 3]]) == [0]  # the mean says no
    assert lookup.decide([r], [[1, 2, 3]]) == [1]  # its bound says one token may pay
    assert lookup.decide([r], [[]]) == [0]  # no match, nothing to verify


class _ConstantHead:
    """A position head that sees every block alike: each draft accepted with probability p."""

    def __init__(self, p: float) -> None:
        self.p = p

    def survival(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tensor([[self.p ** j for j in range(1, hidden.shape[1])]] * len(hidden))


def test_adaflash_stops_looking_where_its_head_keeps_declining():
    """A look costs a drafter pass: a request whose blocks the head keeps declining must not pay it every step, and
    one it keeps approving drafts every step."""
    cost = CostModel(total_tokens=(1, 2, 64), verify_s=(0.01, 0.012, 0.64), draft_s=0.0)  # 1 draft pays above ~0.2
    looks, drafting = {}, {}
    for p in (0.05, 0.15, 0.9):
        policy, (r,) = LearnedThroughputLength(cost, _ConstantHead(p)), _requests(1)
        looks[p] = drafting[p] = 0

        def hidden_of(indices):
            looks[p] += 1
            return torch.zeros(len(indices), 8, 4)

        for _ in range(300):
            (k,) = policy.decide([r], 7, hidden_of)
            drafting[p] += k > 0
            policy.feedback(r, drafted=k, accepted=k)
        assert drafting[p] == (300 if p == 0.9 else 0)
    assert looks[0.9] == drafting[0.9]
    assert 0 < looks[0.05] < looks[0.15] < 100  # it still looks now and then: the evidence fades, the request reopens


@pytest.mark.parametrize("spec", ["heuristic", "throughput", "throughput-profiled", "ema-budget"])
def test_every_adaptive_policy_is_built_by_its_name(spec):
    cost = CostModel(total_tokens=(1, 2, 64), verify_s=(0.01, 0.0101, 0.64), draft_s=0.0)
    policy = build_length_policy(spec, cost)
    assert policy.name == spec
    if spec not in ("heuristic", "ema-budget"):
        assert policy.step_cost is not None and policy.shared_alpha == pytest.approx(0.6)
    assert isinstance(build_length_policy("fixed:3"), FixedLength)


# ---- batch-level policies (speculative/batch_length.py) -------------------------------------------


def _ema_steps(policy: EmaBudgetLength, requests, steps: int, accepted_of) -> list[int]:
    """`steps` steps of `policy` over `requests` (a block of 16: 15 drafts at most), each request accepting
    `accepted_of(k)` of its k drafts; the length of every step."""
    lengths = []
    for _ in range(steps):
        ks = policy.decide(requests, 15)
        assert len(set(ks)) == 1  # one length for the whole batch
        lengths.append(ks[0])
        for r, k in zip(requests, ks):
            policy.feedback(r, drafted=k, accepted=accepted_of(k))
    return lengths


def test_ema_budget_moves_one_batch_length_down_when_drafts_fail_and_up_when_they_land():
    """SGLang's rule: starts at the whole block, holds through its warm-up, then steps down its candidates (3 / 7 /
    11 / 15 drafts of a 16 block) while the EMA of accepted drafts sits below the next lower one, and up while it
    exceeds the current one - never past the candidates' bounds."""
    policy = build_length_policy("ema-budget")
    assert isinstance(policy, EmaBudgetLength) and policy.name == "ema-budget"
    assert policy.candidates(15) == [3, 7, 11, 15] and policy.candidates(5) == [3, 5]
    requests = _requests(4)
    lengths = _ema_steps(policy, requests, 40, lambda k: 0)  # nothing accepted
    assert lengths[:11] == [15] * 11  # warm-up: 10 batches heard before any move
    assert lengths[-1] == 3 and min(lengths) == 3 and policy.ema < 0.1  # down to the floor, not below
    assert lengths == sorted(lengths, reverse=True)
    lengths = _ema_steps(policy, requests, 80, lambda k: k)  # every draft accepted
    assert lengths[-1] == 15 and max(lengths) == 15 and lengths == sorted(lengths)
    settled = _ema_steps(policy, requests, 120, lambda k: min(k, 5))  # five accepted a pass: it probes past them
    assert settled[-40:] == [7] * 40
    assert policy.decide(requests, 4) == [4] * 4  # a smaller block caps it
    policy.feedback(requests[0], drafted=0, accepted=0)  # no drafts: nothing heard
    assert policy._heard == []


def test_ema_budget_rejects_bad_settings():
    with pytest.raises(ValueError, match="verify lengths"):
        EmaBudgetLength(verify_lengths=(0, 4))
    with pytest.raises(ValueError, match="ema_alpha"):
        EmaBudgetLength(ema_alpha=0.0)


class _CountingHead(_ConstantHead):
    def __init__(self, p: float) -> None:
        super().__init__(p)
        self.looks = 0

    def survival(self, hidden: torch.Tensor) -> torch.Tensor:
        self.looks += 1
        return super().survival(hidden)


def test_adaflash_gated_drafts_the_block_up_to_the_gate_and_follows_the_head_above_it():
    """The AdaFlash release's gate: a server of at most 48 running requests drafts the whole block and never looks;
    above, the head's lengths (here a head that says one draft in two fails under a verify that prices every token: it
    drafts little), whatever the load of the moment. Built without the server's size, it counts each step's
    requests."""
    cost = CostModel(total_tokens=(1, 64, 1024), verify_s=(0.01, 0.012, 0.2), draft_s=0.0)

    def hidden_of(indices):
        return torch.zeros(len(indices), 16, 4)

    def ungated(n):
        return LearnedThroughputLength(cost, _ConstantHead(0.5)).decide(_requests(n), 15, hidden_of)

    head = _CountingHead(0.5)
    small = build_length_policy("adaflash-gated", cost, _position_head(), max_running=48)
    assert isinstance(small, GatedLength) and small.gate == 48 and small.name == "adaflash-gated"
    assert small.max_running == 48 and small.step_cost is small.policy.step_cost
    small = learned_policy("adaflash-gated", cost, head, max_running=48)
    assert small.decide(_requests(60), 15, hidden_of) == [15] * 60 and head.looks == 0
    large = learned_policy("adaflash-gated", cost, head, max_running=64)
    lengths = large.decide(_requests(10), 15, hidden_of)
    assert head.looks == 1 and lengths == ungated(10) and max(lengths) < 15
    counting, above = learned_policy("adaflash-gated", cost, head), _requests(49)
    assert counting.decide(_requests(48), 15, hidden_of) == [15] * 48 and head.looks == 1
    lengths = counting.decide(above, 15, hidden_of)
    assert head.looks == 2 and lengths == ungated(49)
    counting.feedback(above[0], drafted=lengths[0], accepted=0)  # the head's policy hears outcomes either way
    assert above[0].policy_state["trials"] > 0
    assert GatedLength(FixedLength(3), gate=1).decide(_requests(2), 15) == [3, 3]
    with pytest.raises(ValueError, match="gate"):
        GatedLength(FixedLength(3), gate=-1)
    with pytest.raises(ValueError, match="needs a cost model"):
        build_length_policy("adaflash-gated", head=head)
    with pytest.raises(ValueError, match="PositionAcceptanceHead"):
        build_length_policy("adaflash-gated", cost, head)


def _position_head():
    from adaflash.models.drafters.length_head import LengthHeadConfig, PositionAcceptanceHead

    return PositionAcceptanceHead(LengthHeadConfig(kind="position", hidden_size=4, block_size=16, head_dim=8))


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    from adaflash.models.targets.model import load_target

    return load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)


ENGINE_PROMPTS = [[3, 14, 15, 92], [65, 35], [89, 79, 32, 38, 46, 26, 43], [11], [7, 7, 7, 7, 7, 7], [50, 51, 52]]
ENGINE_BUDGETS = [40, 34, 66, 44, 50, 36]
FLAT = CostModel(total_tokens=(1, 8, 32, 128), verify_s=(0.01, 0.0101, 0.0105, 0.014), draft_s=0.001)


@pytest.mark.parametrize("name", ["ema-budget", "adaflash-gated"])
def test_batch_level_policies_are_lossless_in_the_engine(target, name):
    """Six greedy requests arriving in two waves through four slots, behind the drafting check as `serve` runs them:
    every output is the target's own greedy decoding, drafting happened, and each policy ran its regimes (the EMA
    moved its length; the gate, at 2 here, drafted the block with few requests and followed the head with more)."""
    from adaflash.engine.engine import Engine
    from adaflash.speculative.drafting_check import DraftingCheck, DraftingChecks
    from adaflash.speculative.reference import autoregressive_generate
    from tests.helpers import PassClock, decode_batches, drafting_happened, scripted_dflash

    expected = [autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids
                for p, n in zip(ENGINE_PROMPTS, ENGINE_BUDGETS)]
    head = _CountingHead(0.8)
    policy = (EmaBudgetLength(verify_lengths=(2, 4, 8), warmup=2, interval=1) if name == "ema-budget"
              else GatedLength(LearnedThroughputLength(FLAT, head), gate=2))
    seen = []
    decide = policy.decide

    def spied(requests, max_draft, hidden_of=None):
        ks = decide(requests, max_draft, hidden_of)
        seen.append((len(requests), tuple(ks)))
        return ks

    policy.decide = spied
    clock = PassClock(base_s=0.01, token_s=3e-5)
    engine = Engine(target, scripted_dflash(target, [p + e for p, e in zip(ENGINE_PROMPTS, expected)]), policy,
                    max_batch=4, max_queue=8, max_len=128,
                    drafting_checks=DraftingChecks(DraftingCheck(explore=4, first=4, settle=1)), clock=clock)
    decode_batches(engine)
    reqs = [Request(f"r{i}", p, n, stop_token_ids=(1,)) for i, (p, n) in enumerate(zip(ENGINE_PROMPTS, ENGINE_BUDGETS))]
    with clock.driving(target):
        for r in reqs[:3]:
            engine.add_request(r)
        for step in range(1000):
            if step == 2:
                for r in reqs[3:]:
                    engine.add_request(r)
            engine.step()
            if step > 2 and not engine.has_work():
                break
    assert [r.output_ids for r in reqs] == expected
    drafting_happened(reqs)
    if name == "ema-budget":
        assert all(len(set(ks)) == 1 for _, ks in seen) and len({ks[0] for _, ks in seen}) > 1
    else:
        assert any(n <= 2 and set(ks) == {7} for n, ks in seen) and head.looks > 0
