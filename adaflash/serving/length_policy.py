"""Draft-length policies: how many drafted tokens each running request sends to verification this step.

The engine calls `decide` once per step with every running request, and `feedback` after verification.
Each policy's name (`fixed:K`, `heuristic`, `throughput`, `adaflash`, `block-head`) is what logs and metrics show;
`build_length_policy` makes one from its name. The cost model the throughput policies read is in `cost_model.py`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from adaflash.serving.cost_model import CostModel
from adaflash.serving.request import Request

if TYPE_CHECKING:  # the heads import torch.nn modules the rule-based policies never need
    from adaflash.models.length_head import BlockLengthHead, PositionAcceptanceHead


# hidden_of(indices) -> the drafter's block hidden states [len(indices), B, d] of those requests (one drafter
# pass for the ones not yet drafted this step): what a learned head reads before any LM head runs.
HiddenOf = Callable[[Sequence[int]], torch.Tensor]


class LengthPolicy(Protocol):
    name: str

    def decide(self, requests: Sequence[Request], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]: ...

    def feedback(self, request: Request, drafted: int, accepted: int) -> None: ...


@dataclass
class FixedLength:
    length: int

    @property
    def name(self) -> str:
        return f"fixed:{self.length}"

    def decide(self, requests: Sequence[Request], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        return [min(self.length, max_draft)] * len(requests)

    def feedback(self, request: Request, drafted: int, accepted: int) -> None:
        pass


@dataclass
class HeuristicLength:
    """transformers' assisted-generation schedule: +2 after a fully accepted draft, -1 after a rejection."""

    initial: int = 8
    name: str = "heuristic"

    def decide(self, requests: Sequence[Request], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        return [min(r.policy_state.setdefault("length", self.initial), max_draft) for r in requests]

    def feedback(self, request: Request, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        length = request.policy_state.get("length", self.initial)
        request.policy_state["length"] = length + 2 if accepted == drafted else max(1, length - 1)


def allocate_drafts(survival: Sequence[Sequence[float]], cost: CostModel, max_draft: int) -> list[int]:
    """Draft lengths maximising expected committed tokens per second over the batch.

    survival[r][j-1] = P(request r's drafts 1..j all accepted), non-increasing in j: the expected gain of
    r's j-th draft position. Starting from no drafts, repeatedly add the position with the largest gain while
    (expected tokens) / (verify cost(total tokens) + the drafter's cost of every request's draft length) rises. At batch 1
    verification is nearly free and lengths grow; under load every token costs and they shrink.
    """
    lengths = [0] * len(survival)
    expected = float(len(survival))  # every request commits at least the target's own token
    tokens, drafter_s = len(survival), 0.0
    best = expected / cost.verify(tokens)
    heap = [(-float(s[0]), i) for i, s in enumerate(survival) if max_draft > 0 and len(s)]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        # A request's first draft position puts it into the drafter pass; later ones widen its block.
        now_drafter_s = drafter_s + cost.draft(lengths[i] + 1) - cost.draft(lengths[i])
        rate = (expected - neg_gain) / (cost.verify(tokens + 1) + now_drafter_s)
        if rate <= best:
            break
        lengths[i] += 1
        expected, tokens, drafter_s, best = expected - neg_gain, tokens + 1, now_drafter_s, rate
        if lengths[i] < min(max_draft, len(survival[i])):
            heapq.heappush(heap, (-float(survival[i][lengths[i]]), i))
    return lengths


@dataclass
class ThroughputLength:
    """Expected-throughput lengths (`allocate_drafts`) from a running per-request acceptance estimate.

    Request r's draft position j is accepted with probability alpha_r^j, alpha_r a running estimate of its
    per-position acceptance, learned from verification feedback.
    """

    cost: CostModel
    prior: float = 0.6
    decay: float = 0.9  # weight of history in the acceptance estimate
    # Steps without drafts after which a request drafts one token to re-measure alpha. A probe costs a drafter
    # pass plus feeding the context it skipped; at 16 that was ~15% of an AR step under load (docs/results/serve_sweep).
    probe_every: int = 64
    name: str = "throughput"

    def __post_init__(self) -> None:
        self.shared_alpha = self.prior  # across requests: where a new request's estimate starts

    def _alpha(self, request: Request) -> float:
        return request.policy_state.get("alpha", self.shared_alpha)

    def decide(self, requests: Sequence[Request], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        survival = [[self._alpha(r) ** j for j in range(1, max_draft + 1)] for r in requests]
        lengths = allocate_drafts(survival, self.cost, max_draft)
        # Exploration: an estimate that never gets feedback never recovers, so requests that went
        # `probe_every` steps without drafting verify one draft (a cheap measurement).
        for i, r in enumerate(requests):
            idle = r.policy_state.get("idle", 0)
            if lengths[i] == 0 and idle >= self.probe_every and max_draft > 0:
                lengths[i] = 1
            r.policy_state["idle"] = 0 if lengths[i] else idle + 1
        return lengths

    def feedback(self, request: Request, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        # Positions 1..accepted succeeded; position accepted+1 (if drafted) failed: a per-position rate.
        trials = accepted + (1 if accepted < drafted else 0)
        observed = accepted / trials
        request.policy_state["alpha"] = self.decay * self._alpha(request) + (1 - self.decay) * observed
        self.shared_alpha = self.decay * self.shared_alpha + (1 - self.decay) * observed


@dataclass
class LearnedThroughputLength:
    """AdaFlash's policy: a per-position acceptance head reads a request's drafted block, and its survival
    products (expected accepted drafts for every length) feed the expected-throughput allocation under the
    profiled cost model. It runs at every concurrency (no hidden switch).

    Looking costs a drafter pass, which on a compute-bound machine is not free next to a decode step, so the
    head looks only at requests whose running acceptance estimate says drafting may pay under this load (the
    `throughput` policy's allocation, probes included); the others decode plainly at no drafter cost.
    """

    cost: CostModel
    head: PositionAcceptanceHead
    name: str = "adaflash"

    def __post_init__(self) -> None:
        self.screen = ThroughputLength(self.cost)

    def decide(self, requests: Sequence[Request], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        if hidden_of is None:
            raise ValueError("the adaflash length policy needs the drafter's hidden states")
        look = [i for i, k in enumerate(self.screen.decide(requests, max_draft)) if k > 0]
        survival: list[list[float]] = [[] for _ in requests]
        if look:
            for i, row in zip(look, self.head.survival(hidden_of(look))[:, :max_draft].tolist()):
                survival[i] = row
        return allocate_drafts(survival, self.cost, max_draft)

    def feedback(self, request: Request, drafted: int, accepted: int) -> None:
        self.screen.feedback(request, drafted, accepted)


@dataclass
class BlockHeadLength:
    """The paper's block-level head alone: every request's block is read, draft = round(ratio x B x rate) - 1."""

    head: BlockLengthHead
    name: str = "block-head"

    def decide(self, requests: Sequence[Request], max_draft: int, hidden_of: HiddenOf | None = None) -> list[int]:
        if hidden_of is None:
            raise ValueError("the block-head length policy needs the drafter's hidden states")
        return self.head.draft_lengths(hidden_of(range(len(requests)))).clamp(max=max_draft).tolist()

    def feedback(self, request: Request, drafted: int, accepted: int) -> None:
        pass


# The specs that need the profiled cost model, and those that need the drafter's learned length head.
COST_MODEL_POLICIES = ("throughput", "adaflash")
LENGTH_HEAD_POLICIES = ("adaflash", "block-head")


def needs_cost_model(spec: str) -> bool:
    return spec in COST_MODEL_POLICIES


def check_length_policy(spec: str) -> None:
    """Reject an unknown or malformed spec before any model loads (a policy that needs a cost model or a head is
    built later, from the loaded models)."""
    if spec not in COST_MODEL_POLICIES and spec not in LENGTH_HEAD_POLICIES:
        build_length_policy(spec)


def build_length_policy(spec: str, cost: CostModel | None = None, head=None) -> LengthPolicy:
    """`fixed:K`, `heuristic`, `throughput` (needs the profiled cost model), `adaflash` (cost model + a
    per-position acceptance head) or `block-head` (the paper's block-level head)."""
    if spec.startswith("fixed:"):
        k = int(spec.split(":", 1)[1])
        if k < 0:
            raise ValueError(f"fixed length must be >= 0, got {k}")
        return FixedLength(k)
    if spec == "heuristic":
        return HeuristicLength()
    if needs_cost_model(spec) and cost is None:
        raise ValueError(f"the {spec} policy needs a cost model")
    if spec == "throughput":
        return ThroughputLength(cost)
    if spec in LENGTH_HEAD_POLICIES:
        from adaflash.models.length_head import BlockLengthHead, PositionAcceptanceHead

        want = PositionAcceptanceHead if spec == "adaflash" else BlockLengthHead
        if not isinstance(head, want):
            raise ValueError(f"the {spec} policy needs a drafter checkpoint carrying a {want.__name__} "
                             "(train one with `adaflash train length-head`)")
        return LearnedThroughputLength(cost, head) if spec == "adaflash" else BlockHeadLength(head)
    raise ValueError(f"unknown length policy {spec!r}; expected fixed:K, heuristic, throughput, adaflash or block-head")
