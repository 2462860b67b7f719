"""The continuous-batching engine: every request equals the single-request reference, whatever the batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.engine.scheduler import QueueFullError
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.drafting_check import DraftingCheck, DraftingChecks, RequestRecord
from adaflash.speculative.length_policy import CostModel, FixedLength, HeuristicLength, ThroughputLength
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate
from adaflash.speculative.sampling import SamplingParams
from tests.helpers import (TINY_VOCAB, PassClock, decode_batches, drafting_happened, exact_joint,
                           scripted_dflash)
from tests.helpers import engine_law_pvalue, run_engine as _run

# Verify cost grows with total tokens past a knee, like a CPU under load.
COST = CostModel(total_tokens=(1, 8, 32, 128), verify_s=(0.01, 0.011, 0.03, 0.12), draft_s=0.002)
# A GPU's: nearly flat up to a hundred tokens, so drafting pays even with eight requests decoding.
FLAT_COST = CostModel(total_tokens=(1, 8, 32, 128), verify_s=(0.01, 0.0101, 0.0105, 0.014), draft_s=0.001)



PROMPTS = [[3, 14, 15, 92], [65, 35], [89, 79, 32, 38, 46, 26, 43], [11], [7, 7, 7, 7, 7, 7]]
BUDGETS = [20, 7, 33, 12, 25]


def _requests(sampling=SamplingParams(), seed_base=0):
    return [
        Request(f"r{i}", p, n, sampling=sampling, stop_token_ids=(1,), seed=seed_base + i)
        for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))
    ]


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)


@pytest.fixture(scope="module")
def proposer(target):
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=8)
    return DFlashProposer(init_drafter(cfg, seed=2), target)


# Eight requests: staggered arrivals, and a batch of up to eight decoding at once.
MORE_PROMPTS = PROMPTS + [[50, 51, 52], [23, 9, 40, 2], [60]]
MORE_BUDGETS = [40, 34, 66, 44, 50, 36, 52, 42]
ARRIVALS = {0: slice(0, 3), 1: slice(3, 6), 2: slice(6, 8)}


@pytest.fixture(scope="module")
def expected_more(target):
    return {f"r{i}": autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids
            for i, (p, n) in enumerate(zip(MORE_PROMPTS, MORE_BUDGETS))}


def _more_requests(sampling=SamplingParams(), seed_base=0):
    return [Request(f"r{i}", p, n, sampling=sampling, stop_token_ids=(1,), seed=seed_base + i)
            for i, (p, n) in enumerate(zip(MORE_PROMPTS, MORE_BUDGETS))]


def _policies():
    """(policy, drafting checks) makers: every length policy, and the adaptive regime (throughput behind checks)."""
    return {
        "fixed:7": lambda: (FixedLength(7), None),
        "fixed:3": lambda: (FixedLength(3), None),
        "fixed:0": lambda: (FixedLength(0), None),
        "heuristic": lambda: (HeuristicLength(initial=2), None),
        "throughput": lambda: (ThroughputLength(COST), None),
        "throughput+checks": lambda: (ThroughputLength(FLAT_COST), DraftingChecks(DraftingCheck(explore=4, first=4,
                                                                                                settle=1))),
    }



@pytest.mark.parametrize("max_batch", [2, 8])
@pytest.mark.parametrize("policy_name", list(_policies()))
def test_greedy_engine_equals_reference_with_staggered_arrivals(target, expected_more, policy_name, max_batch):
    """A mostly-right drafter (many tokens accepted a pass) under every policy, eight requests arriving in three
    waves, two or eight slots (the queue, admission and slot reuse; up to eight requests verified in one pass): every
    request is the target's own greedy output, and drafting really happened. Policies that read a step's cost read
    the target's passes on an injected clock, so what they decide does not depend on this machine's load."""
    policy, checks = _policies()[policy_name]()
    scripts = [p + expected_more[f"r{i}"] for i, p in enumerate(MORE_PROMPTS)]
    clock = PassClock(base_s=0.01, token_s=3e-5)
    engine = Engine(target, scripted_dflash(target, scripts), policy, max_batch=max_batch, max_queue=8, max_len=128,
                    drafting_checks=checks, clock=clock)
    batches = decode_batches(engine)
    reqs = _more_requests()
    with clock.driving(target):
        got = _run(engine, {step: reqs[part] for step, part in ARRIVALS.items()})
    assert got == expected_more
    assert all(r.finish_reason in ("stop", "length") for r in reqs)
    assert sorted(engine.scheduler.free_slots) == list(range(max_batch))  # every slot released
    assert max(batches) == max_batch
    if policy_name == "fixed:0":
        assert not any(k for r in reqs for k in r.draft_lengths)
    else:
        drafting_happened(reqs)


@dataclass
class StepTimesSeen(FixedLength):
    """A fixed length that keeps what the engine reports of each step a cost model may learn from."""

    steps: list[tuple[list[int], float]] = field(default_factory=list)

    def observe_step(self, lengths, seconds, priced=True) -> None:
        if priced:
            self.steps.append((list(lengths), seconds))


class CountedChecks(DraftingChecks):
    """Drafting checks that count the steps recorded to them."""

    recorded: int = 0

    def record(self, tokens: int, seconds: float) -> None:
        self.recorded += 1
        super().record(tokens, seconds)


def test_an_engine_behind_drafting_checks_equals_reference_and_its_checks_hear_every_decode_step(target, proposer):
    """Short plain stretches run as plain runs (their bookkeeping replayed at each run's end), and requests whose drafts
    do not pay are closed to the drafter: the outputs stay the target's, and once the engine runs empty its checks
    and policy have heard every decode step."""
    expected = {f"r{i}": autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids
                for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))}
    policy = StepTimesSeen(3)
    checks = CountedChecks(DraftingCheck(explore=3, first=4, settle=1, stretch=6),
                           request_template=RequestRecord(window=2, wait=3))
    engine = Engine(target, proposer, policy, max_batch=2, max_queue=8, max_len=128, drafting_checks=checks)
    decode_steps, closed = [], []  # closed: per step, to how many of its requests the drafter was closed
    propose = engine.drafting.propose

    def proposing(requests):
        closed.append(sum(checks.closed_for(r.drafting_records, len(r.accept_lengths), "drafter") > 0 for r in requests))
        decode_steps.append(propose(requests))
        return decode_steps[-1]

    engine.drafting.propose = proposing
    assert _run(engine, {0: _requests()[:2], 3: _requests()[2:4], 9: _requests()[4:]}) == expected
    in_run = sum(step.in_run for step in decode_steps)
    assert in_run > 0 and engine.drafting._run is None
    assert any(step.held and not step.decided for step in decode_steps)  # the drafter closed to every request
    assert checks.recorded == len(decode_steps)
    # The policy hears every plain step (each priced: no drafter work) but those with requests closed to the drafter
    # (all of them: the drafter answered for none; some, in its drafting arm: it answered for the others only).
    plain = [(step, c) for step, c in zip(decode_steps, closed) if not step.any]
    heard = len([lengths for lengths, _ in policy.steps if not any(lengths)])
    assert sum(c == 0 for _, c in plain) <= heard <= sum(c < len(step.requests) for step, c in plain)


def test_engine_reports_each_decode_steps_draft_lengths_and_wall_time(target, proposer):
    policy = StepTimesSeen(3)
    engine = Engine(target, proposer, policy, max_batch=2, max_queue=8, max_len=128)
    engine.add_request(Request("a", [3, 14, 15], 9))
    engine.add_request(Request("b", [65, 35], 3))
    engine.step()  # both prefilled: no decode step, nothing to report
    assert policy.steps == []
    engine.step()
    (lengths, seconds), = policy.steps
    assert lengths == [3, 1] and seconds > 0  # b has 2 tokens left: one draft at most (its last token is the target's)
    while engine.has_work():
        engine.step()
    assert [len(lengths) for lengths, _ in policy.steps][-1] == 1 and all(t > 0 for _, t in policy.steps)  # a alone



def test_a_step_whose_drafter_catches_up_on_a_backlog_teaches_no_step_cost(target, proposer):
    """The first decode step after a 12-token prompt feeds all 12 positions to the drafter (block 8): not what a
    drafting step costs, so the policy does not learn from it; the steps after it feed what the last one kept."""
    policy = StepTimesSeen(3)
    engine = Engine(target, proposer, policy, max_batch=1, max_queue=8, max_len=128)
    engine.add_request(Request("long", list(range(3, 15)), 6))
    engine.step()  # prefill
    engine.step()  # the first draft: the whole prompt's features fed
    assert policy.steps == []
    engine.step()
    assert len(policy.steps) == 1


def test_a_head_that_looks_and_drafts_nothing_reports_its_step_unpriced(target, proposer):
    """A learned head that reads the blocks (a drafter pass) and keeps every request at 0: the step is a plain decode,
    reported unpriced, so the drafting check charges the look to the drafting arm while no cost model learns it."""
    seen = []

    class LooksThenDeclines(FixedLength):
        def decide(self, requests, max_draft, hidden_of=None):
            hidden_of(range(len(requests)))
            return [0] * len(requests)

        def observe_step(self, lengths, seconds, priced=True):
            seen.append((list(lengths), priced))

    engine = Engine(target, proposer, LooksThenDeclines(0), max_batch=2, max_queue=8, max_len=128)
    engine.add_request(Request("a", [3, 14, 15], 4))
    engine.add_request(Request("b", [65, 35], 4))
    while engine.has_work():
        engine.step()
    assert seen and all(lengths == [0] * len(lengths) and not priced for lengths, priced in seen)


def test_a_policy_missing_part_of_the_protocol_is_refused_when_the_engine_is_made(target, proposer):
    class DecidesOnly:
        name = "partial"

        def decide(self, requests, max_draft, hidden_of=None):
            return [1] * len(requests)

        def feedback(self, request, drafted, accepted):
            pass

    with pytest.raises(TypeError, match="DecidesOnly lacks observe_step"):
        Engine(target, proposer, DecidesOnly(), max_batch=1, max_len=64)


def test_scripted_drafts_exercise_acceptance(target):
    """A mostly-right drafter: many tokens per pass, and still exactly the reference output."""
    from tests.helpers import ScriptedProposer

    prompt = PROMPTS[0]
    ar = autoregressive_generate(target, prompt, 30).token_ids
    scripted = ScriptedProposer(prompt + ar, TINY_VOCAB, corrupt_prob=0.2)
    engine = Engine(target, scripted, FixedLength(5), max_batch=1, max_len=128)
    req = Request("a", prompt, 30)
    assert _run(engine, {0: [req]})["a"] == ar
    assert sum(req.accept_lengths) / len(req.accept_lengths) > 2.0


def test_autoregressive_engine_equals_reference(target):
    expected = {f"r{i}": autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))}
    engine = Engine(target, None, max_batch=3, max_len=128)
    assert _run(engine, {0: _requests()}) == expected


@pytest.mark.parametrize("with_drafter", [False, True])
def test_admitted_prompts_prefill_in_passes_of_at_most_max_prefill_tokens(target, proposer, with_drafter):
    """Five prompts of 4 / 2 / 7 / 1 / 6 tokens admitted together, at most 8 prompt tokens a pass: passes of
    [4, 2], [7, 1], [6] tokens (a pass takes at least one prompt), and every request still equals the reference."""
    expected = {f"r{i}": autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids
                for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))}
    engine = Engine(target, proposer if with_drafter else None, max_batch=5, max_len=128, max_prefill_tokens=8)
    passes, forward = [], target.forward

    def spy(token_ids, batch, *args, **kwargs):
        if batch.query_lens != tuple([1] * len(batch.query_lens)) and 0 in batch.starts:
            passes.append(list(batch.query_lens))
        return forward(token_ids, batch, *args, **kwargs)

    target.forward = spy
    try:
        assert _run(engine, {0: _requests()}) == expected
    finally:
        del target.forward
    assert passes[:3] == [[4, 2], [7, 1], [6]]
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Engine(target, None, max_prefill_tokens=0)


def test_sampling_engine_preserves_the_target_law(target):
    """Many seeded sampling requests batched together, drafted by a drafter leaning on the likeliest continuation (so
    drafts are accepted and rejected, and residuals sampled): the law of their first 3 tokens equals the target's."""
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = [3, 14, 15, 92, 65, 35]
    exact = exact_joint(target, prompt, params, 3)
    likely = max(exact, key=exact.get)
    n = 900
    engine = Engine(target, scripted_dflash(target, [prompt + list(likely)]), FixedLength(2), max_batch=16,
                    max_queue=n, max_len=64)
    batches = decode_batches(engine)
    pvalue, reqs = engine_law_pvalue(engine, prompt, params, exact, n)
    assert pvalue > 1e-3
    drafting_happened(reqs)
    assert max(batches) == 16 and any(a == 1 for r in reqs for a in r.accept_lengths)  # rejections too


def test_abort_queue_bound_and_context_limit(target, proposer):
    engine = Engine(target, proposer, FixedLength(3), max_batch=1, max_queue=1, max_len=64)
    engine.add_request(Request("a", [3, 4], 20))
    engine.step()
    engine.add_request(Request("b", [3, 4], 20))
    with pytest.raises(QueueFullError):
        engine.add_request(Request("c", [3, 4], 20))
    assert engine.abort("a") and engine.scheduler.free_slots == [0]
    engine.step()  # b is admitted into the freed slot
    assert engine.scheduler.running[0].request_id == "b"
    with pytest.raises(ValueError, match="exceeds the context"):
        engine.add_request(Request("d", list(range(3, 50)), 20))


def test_throughput_policy_shrinks_drafts_under_load():
    policy = ThroughputLength(COST)
    make = lambda n: [Request(f"x{i}", [3], 50) for i in range(n)]
    one = policy.decide(make(1), 15)
    many = policy.decide(make(64), 15)
    assert one[0] >= 4  # verification is nearly free at batch 1
    assert sum(many) / 64 < one[0]  # every token costs under load
    weak = make(1)
    for _ in range(30):
        policy.feedback(weak[0], 5, 0)
    decisions = [policy.decide(weak, 15)[0] for _ in range(2 * policy.probe_every + 2)]
    # A drafter that is never right is not consulted, except for a one-token probe now and then.
    assert set(decisions) == {0, 1} and decisions.count(1) == 2
    assert make(1)[0].policy_state == {} and policy.shared_alpha < 0.1  # new requests start from what was learned


def test_speculative_steps_return_features_and_logprobs_of_committed_tokens_only(target):
    """Perfect drafts with a stop token inside an accepted block: every step returns exactly one feature row and one
    top-k row per committed token (a prefill: one feature row per prompt token), equal to a fresh target pass."""
    from adaflash.models.kv_cache.ragged import RaggedBatch
    from tests.helpers import ScriptedProposer

    prompt = PROMPTS[2]
    ar = autoregressive_generate(target, prompt, 30).token_ids
    stop = ar[7]  # reached inside a drafted block
    scripted = ScriptedProposer(prompt + ar, TINY_VOCAB, corrupt_prob=0.0)
    engine = Engine(target, scripted, FixedLength(5), max_batch=1, max_len=128)
    request = Request("a", prompt, 30, stop_token_ids=(stop,), top_logprobs=3, return_features=True)
    engine.add_request(request)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert request.output_ids == ar[: ar.index(stop) + 1] and max(request.accept_lengths) > 1
    assert outputs[0].features.shape[0] == len(prompt)
    for out in outputs[1:]:
        assert out.features.shape[0] == out.top_ids.shape[0] == len(out.new_token_ids)
    tokens = prompt + request.output_ids
    fresh = target(torch.tensor(tokens[:-1]), RaggedBatch.build([0], [0], [len(tokens) - 1]), target.new_cache(1, 64),
                   scripted.capture_layers)
    torch.testing.assert_close(torch.cat([o.features for o in outputs]), fresh.hidden, atol=1e-4, rtol=1e-4)
    top = torch.cat([o.top_ids for o in outputs])
    assert top[:, 0].tolist() == request.output_ids  # greedy: the committed token is the target's top-1
    torch.testing.assert_close(torch.cat([o.top_logprobs for o in outputs]),
                               torch.log_softmax(fresh.logits[len(prompt) - 1 :], -1).topk(3, -1).values, atol=1e-4, rtol=1e-4)
