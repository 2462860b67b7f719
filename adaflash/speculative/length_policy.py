"""Draft-length policies: how many drafted tokens each running request sends to verification this step.

The engine's drafter source (engine/draft_sources.py) calls `decide` once per step with every decoding request left
without a prompt-lookup match, `feedback` after verification, and `observe_step` with the step's wall time (a step of
the drafting check's plain arm gets only `observe_step`: the policy decided nothing in it). Each policy's name
(`fixed:K`, `heuristic`, `throughput`, `throughput-profiled`, `adaflash`, `block-head`, and the batch-level
`ema-budget` and `adaflash-gated` of batch_length.py) is what logs and metrics show; `policies.py`'s
`build_length_policy` makes one from its spec (`config.py`'s `LengthPolicySpec`, where a spec is checked); the engine
runs every adaptive one behind the drafting check (`drafting_check.py`: plain stretches wherever drafting commits
fewer tokens a second). The cost model the throughput policies read is in `cost_model.py`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from adaflash.speculative.cost_model import CalibratedCost, CostModel

if TYPE_CHECKING:  # the heads import torch.nn modules the rule-based policies never need
    from adaflash.models.drafters.length_head import BlockLengthHead, PositionAcceptanceHead


# hidden_of(indices) -> the drafter's block hidden states [len(indices), B, d] of those requests (one drafter
# pass for the ones not yet drafted this step): what a learned head reads before any LM head runs.
HiddenOf = Callable[[Sequence[int]], torch.Tensor]
# Where a learned per-position head leaves what it predicted for a request this step (its survival, one value a draft
# position): the engine's trace recorder reads it (engine/trace_recorder.py); nothing decides on it.
HEAD_SURVIVAL = "head_survival"


class PolicyRequest(Protocol):
    """What a policy reads of a request (the engine's `Request` is one): the state it keeps there."""

    policy_state: dict


class LengthPolicy(Protocol):
    name: str

    def decide(self, requests: Sequence[PolicyRequest], max_draft: int,
               hidden_of: HiddenOf | None = None) -> list[int]: ...

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None: ...

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        """The step that verified these draft lengths (one per request) took `seconds` of wall time. `priced`: False
        where that time is not what the lengths price (the drafter also caught up on a backlog, or read the blocks
        of requests that then drafted nothing): no cost model learns from it, but the drafting check counts it toward
        its arm, whose real cost it is. (A step whose verify prompt-lookup drafts widened is not reported.)"""


@dataclass
class FixedLength:
    length: int

    @property
    def name(self) -> str:
        return f"fixed:{self.length}"

    def decide(self, requests: Sequence[PolicyRequest], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        return [min(self.length, max_draft)] * len(requests)

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        pass

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        pass


@dataclass
class HeuristicLength:
    """transformers' assisted-generation schedule: +2 after a fully accepted draft, -1 after a rejection. As its
    `heuristic` schedule does (`heuristic_transient` resets), the length carries over: a new request starts where the
    last feedback left it (with several requests, the one heard last), not at `initial`, so a server's policy does not
    open every request at 8 drafts the text has already refused (each trial of the drafting check would pay for them
    again)."""

    initial: int = 8
    name: str = "heuristic"
    carried: int | None = field(default=None, init=False, repr=False, compare=False)  # None: no feedback yet

    def decide(self, requests: Sequence[PolicyRequest], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        for r in requests:  # kept within the cap, so full accepts at the cap do not carry a length past it
            r.policy_state["length"] = min(r.policy_state.get("length", self._start), max_draft)
        return [r.policy_state["length"] for r in requests]

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        length = request.policy_state.get("length", self._start)
        request.policy_state["length"] = self.carried = length + 2 if accepted == drafted else max(1, length - 1)

    @property
    def _start(self) -> int:
        return self.initial if self.carried is None else self.carried

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        pass


def allocate_drafts(survival: Sequence[Sequence[float]], cost: CostModel | CalibratedCost, max_draft: int,
                    free_drafts: bool = False) -> list[int]:
    """Draft lengths maximising expected committed tokens per second over the batch.

    survival[r][j-1] = P(request r's drafts 1..j all accepted), non-increasing in j: the expected gain of
    r's j-th draft position (a request with an empty list only verifies its own token). Starting from no drafts,
    repeatedly add the position with the largest gain while (expected tokens) / (verify cost(total tokens) + the
    drafter's cost of every request's draft length) rises. At batch 1 verification is nearly free and lengths grow;
    under load every token costs and they shrink. `free_drafts`: the drafts cost no drafter pass (prompt lookup).
    """
    lengths = [0] * len(survival)
    expected = float(len(survival))  # every request commits at least the target's own token
    tokens, drafter_s = len(survival), 0.0
    requests = len(survival)
    best = expected / cost.verify(tokens, requests)
    heap = [(-float(s[0]), i) for i, s in enumerate(survival) if max_draft > 0 and len(s)]
    heapq.heapify(heap)
    # A batched drafter (a GPU's) costs one pass for every drafting request: its first request pays the whole pass,
    # so no single position may pay while many do. There the greedy path runs to its end and its best prefix is kept.
    batched = not free_drafts and getattr(cost, "batched_drafter", False)
    drafting = widest = 0
    path, kept = [], 0  # the positions taken, in order; how many of them the best rate kept
    # Every gain still to take: the path's rate cannot beat (expected + these) / its cost now, as costs only grow.
    left = sum(float(x) for s in survival for x in s[:max_draft]) if batched else 0.0
    while heap:
        if batched and (expected + left) / (cost.verify(tokens, requests) + drafter_s) <= best:
            break
        neg_gain, i = heapq.heappop(heap)
        left += neg_gain
        if free_drafts:
            now_drafter_s = drafter_s
        elif batched:
            now_drafter_s = cost.draft_pass(drafting + (lengths[i] == 0), max(widest, lengths[i] + 1))
        else:  # a request's first draft position puts it into the drafter pass; later ones widen its block
            now_drafter_s = drafter_s + cost.draft(lengths[i] + 1) - cost.draft(lengths[i])
        rate = (expected - neg_gain) / (cost.verify(tokens + 1, requests) + now_drafter_s)
        if rate <= best and not batched:
            break
        drafting += lengths[i] == 0
        lengths[i] += 1
        widest = max(widest, lengths[i])
        expected, tokens, drafter_s = expected - neg_gain, tokens + 1, now_drafter_s
        path.append(i)
        if rate > best:
            best, kept = rate, len(path)
        if lengths[i] < min(max_draft, len(survival[i])):
            heapq.heappush(heap, (-float(survival[i][lengths[i]]), i))
    if not batched:
        return lengths
    lengths = [0] * len(survival)
    for i in path[:kept]:
        lengths[i] += 1
    return lengths


@dataclass
class AcceptanceEstimate:
    """A running per-position acceptance rate of one draft source, per request and pooled across requests.

    Request r's estimate is the posterior mean of its own per-position outcomes (successes / trials, fading by
    `forget` each step) under a prior centred on the pooled estimate (what earlier requests saw) worth `prior_trials`
    trials; `optimism` standard deviations above it give the bound that keeps an estimate from absorbing (see
    `ThroughputLength`). Several sources share one request's `policy_state`, each under its own key `prefix`.
    """

    prior: float = 0.6
    decay: float = 0.99  # per verified draft: how the pooled estimate (the next request's prior) forgets
    prior_trials: float = 2.0
    forget: float = 0.99  # per step: a request's evidence ages (~100 steps), its bound reopens
    prefix: str = ""

    def __post_init__(self) -> None:
        # Pooled (successes, trials), fading with `decay`; a new request's estimate is centred on their ratio. Pooled
        # counts, not an average of per-step ratios: a ratio's average is biased low (a step that drafts 2 and keeps 1
        # says 1/2 where the per-position truth may be 0.47).
        self.shared_successes, self.shared_trials = self.prior * self.prior_trials, self.prior_trials
        self.trials_key, self.successes_key = self.prefix + "trials", self.prefix + "successes"

    @property
    def shared_alpha(self) -> float:
        return self.shared_successes / self.shared_trials

    def age(self, requests: Sequence[PolicyRequest]) -> None:
        """One step passed for these requests: their own outcomes fade by `forget`."""
        for r in requests:
            state = r.policy_state
            state[self.trials_key] = state.get(self.trials_key, 0.0) * self.forget
            state[self.successes_key] = state.get(self.successes_key, 0.0) * self.forget

    def alpha(self, request: PolicyRequest, optimism: float = 0.0) -> float:
        """`request`'s per-position acceptance estimate: the posterior mean, plus `optimism` standard deviations."""
        trials = request.policy_state.get(self.trials_key, 0.0) + self.prior_trials
        mean = (request.policy_state.get(self.successes_key, 0.0) + self.prior_trials * self.shared_alpha) / trials
        return min(1.0, mean + optimism * math.sqrt(mean * (1.0 - mean) / (trials + 1.0)))

    def survival(self, requests: Sequence[PolicyRequest], widths: Sequence[int],
                 optimism: float = 0.0) -> list[list[float]]:
        """Per request, P(its drafts 1..j all accepted) for j = 1..its width: `allocate_drafts`' input."""
        alphas = [self.alpha(r, optimism) for r in requests]
        return [[a ** j for j in range(1, w + 1)] for a, w in zip(alphas, widths)]

    def expect(self, request: PolicyRequest, probability: float) -> None:
        """A look that drafted nothing: `probability` (a calibrated guess that the first draft would have been
        accepted) counts as one fractional trial of `request`'s own estimate. The pooled estimate learns from real
        outcomes only."""
        state = request.policy_state
        state[self.trials_key] = state.get(self.trials_key, 0.0) + 1.0
        state[self.successes_key] = state.get(self.successes_key, 0.0) + probability

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        # Positions 1..accepted succeeded; position accepted+1 (if drafted) failed: a per-position rate.
        trials = accepted + (1 if accepted < drafted else 0)
        state = request.policy_state
        state[self.trials_key] = state.get(self.trials_key, 0.0) + trials
        state[self.successes_key] = state.get(self.successes_key, 0.0) + accepted
        self.shared_successes = self.decay * self.shared_successes + accepted
        self.shared_trials = self.decay * self.shared_trials + trials


def allocate_with_optimism(estimate: AcceptanceEstimate, requests: Sequence[PolicyRequest], widths: Sequence[int],
                           cost: CostModel | CalibratedCost, optimism: float, free_drafts: bool = False
                           ) -> tuple[list[int], list[bool]]:
    """`allocate_drafts` on the estimate's means, and per request whether its optimistic bound would draft: the
    mean may leave a request at zero drafts where one probe token would settle the question."""
    most = max(widths, default=0)
    lengths = allocate_drafts(estimate.survival(requests, widths), cost, most, free_drafts)
    if 0 not in lengths or optimism <= 0:
        return lengths, [k > 0 for k in lengths]
    hopeful = allocate_drafts(estimate.survival(requests, widths, optimism), cost, most, free_drafts)
    return lengths, [k > 0 for k in hopeful]


@dataclass
class ThroughputLength:
    """Expected-throughput lengths (`allocate_drafts`) from a per-request acceptance estimate.

    Request r's draft position j is accepted with probability alpha_r^j (`AcceptanceEstimate`: r's own outcomes under
    a prior centred on what earlier requests saw). The lengths come from the posterior mean; a request the mean leaves
    at zero drafts still drafts one token when its mean raised by `optimism` posterior standard deviations says
    drafting may pay. That optimism is what keeps the estimate from absorbing: a request that starts below the bar
    (other domains pulled the shared estimate down) or stopped drafting long ago has few recent trials, so its bound
    sits high and it probes, one cheap token a step, until its own outcomes settle the question; a request whose own
    outcomes are many and poor stays at zero drafts. Optimism only ever buys that one token: sizing longer drafts on
    the bound measured slower than plain decoding (docs/notes.md, "Length policies").

    The costs are the start-up profile corrected by the measured step times (`CalibratedCost`; pass one to share what
    it learned across policies, e.g. a hot-swapped drafter's); `calibrate=False` (`throughput-profiled`) reads the
    profile alone.
    """

    cost: CostModel | CalibratedCost
    prior: float = 0.6
    decay: float = 0.99
    prior_trials: float = 2.0
    forget: float = 0.99
    optimism: float = 1.0
    # Steps without drafts after which a request drafts one token anyway: a floor on exploration for a request whose
    # optimistic bound stays below the bar. A probe costs a drafter pass plus feeding the context it skipped; at 16
    # that was ~15% of an AR step under load (docs/notes.md, "Length policies").
    probe_every: int = 64
    calibrate: bool = True
    name: str = "throughput"

    def __post_init__(self) -> None:
        shared = isinstance(self.cost, CalibratedCost)
        profile = self.cost.profile if shared else self.cost
        self.step_cost = (self.cost if shared else CalibratedCost(profile)) if self.calibrate else profile
        self.estimate = AcceptanceEstimate(self.prior, self.decay, self.prior_trials, self.forget)

    @property
    def shared_alpha(self) -> float:
        return self.estimate.shared_alpha

    def alpha(self, request: PolicyRequest, optimism: float = 0.0) -> float:
        return self.estimate.alpha(request, optimism)

    def decide(self, requests: Sequence[PolicyRequest], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        self.estimate.age(requests)
        lengths, hopeful = allocate_with_optimism(self.estimate, requests, [max_draft] * len(requests),
                                                  self.step_cost, self.optimism)
        for i, r in enumerate(requests):
            idle = r.policy_state.get("idle", 0)
            if lengths[i] == 0 and (hopeful[i] or idle >= self.probe_every) and max_draft > 0:
                lengths[i] = 1
        for k, r in zip(lengths, requests):
            r.policy_state["idle"] = 0 if k else r.policy_state.get("idle", 0) + 1
        return lengths

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        self.estimate.feedback(request, drafted, accepted)

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        if priced and isinstance(self.step_cost, CalibratedCost):
            self.step_cost.observe(lengths, seconds)


@dataclass
class LookupLength:
    """How many of each request's prompt-lookup drafts to verify this step: `allocate_drafts` over the lookups alone
    (no drafter cost; each request's own token is in the verify either way), with a per-request acceptance estimate
    of its lookups kept apart from the drafter's. A match is free to find but not to verify: under load, or where a
    request's lookups keep missing, the drafts shrink to what pays, down to one optimistic probe token.

    The engine's prompt-lookup draft source asks it before the drafter's length policy runs, which then sees only
    the requests left without a lookup (engine/draft_sources.py)."""

    cost: CostModel | CalibratedCost
    prior: float = 0.5
    optimism: float = 1.0
    name: str = "lookup-throughput"

    def __post_init__(self) -> None:
        self.estimate = AcceptanceEstimate(prior=self.prior, prefix="lookup_")

    def decide(self, requests: Sequence[PolicyRequest], proposals: Sequence[Sequence[int]]) -> list[int]:
        """Per request, how many of its proposed drafts (a prefix) to verify."""
        self.estimate.age(requests)
        widths = [len(p) for p in proposals]
        lengths, hopeful = allocate_with_optimism(self.estimate, requests, widths, self.cost, self.optimism,
                                                  free_drafts=True)
        return [k or int(h) for k, h in zip(lengths, hopeful)]

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        self.estimate.feedback(request, drafted, accepted)

@dataclass
class LearnedThroughputLength:
    """AdaFlash's policy: a per-position acceptance head reads a request's drafted block, and its survival
    products (expected accepted drafts for every length) feed the expected-throughput allocation under the
    profiled cost model. It runs at every concurrency (no hidden switch).

    Looking costs a drafter pass, which on a compute-bound machine is not free next to a decode step, so the
    head looks only at requests whose running acceptance estimate says drafting may pay under this load (the
    `throughput` policy's allocation on the estimate's mean, and its idle probe); the others decode plainly at no
    drafter cost. A look the head declines teaches that estimate what the head saw (its first-position probability,
    `AcceptanceEstimate.expect`): without it a declined look left no outcome, the estimate never moved, and a request
    the head kept declining paid a drafter pass every step for nothing (docs/notes.md). The look is
    the probe, so the screen needs no optimism: with it, a request whose head sits just below the bar looked at
    almost every step.
    """

    cost: CostModel | CalibratedCost
    head: PositionAcceptanceHead
    name: str = "adaflash"

    def __post_init__(self) -> None:
        self.screen = ThroughputLength(self.cost, optimism=0.0)

    @property
    def step_cost(self) -> CalibratedCost | CostModel:
        return self.screen.step_cost

    def decide(self, requests: Sequence[PolicyRequest], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        if hidden_of is None:
            raise ValueError("the adaflash length policy needs the drafter's hidden states")
        look = [i for i, k in enumerate(self.screen.decide(requests, max_draft)) if k > 0]
        survival: list[list[float]] = [[] for _ in requests]
        if look:
            for i, row in zip(look, self.head.survival(hidden_of(look))[:, :max_draft].tolist()):
                survival[i] = row
                requests[i].policy_state[HEAD_SURVIVAL] = row
        lengths = allocate_drafts(survival, self.screen.step_cost, max_draft)
        for i in look:
            if lengths[i] == 0 and survival[i]:
                self.screen.estimate.expect(requests[i], survival[i][0])
        return lengths

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        self.screen.feedback(request, drafted, accepted)

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        self.screen.observe_step(lengths, seconds, priced)


@dataclass
class BlockHeadLength:
    """The paper's block-level head alone: every request's block is read, draft = round(ratio x B x rate) - 1."""

    head: BlockLengthHead
    name: str = "block-head"

    def decide(self, requests: Sequence[PolicyRequest], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        if hidden_of is None:
            raise ValueError("the block-head length policy needs the drafter's hidden states")
        return self.head.draft_lengths(hidden_of(range(len(requests)))).clamp(max=max_draft).tolist()

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        pass

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        pass
