"""Every draft-length policy by its spec, in one place: `build_length_policy` makes the one a `--length-policy` names,
from the rule-based and learned policies of length_policy.py and the batch-level ones of batch_length.py."""

from __future__ import annotations

from adaflash.speculative.batch_length import EmaBudgetLength, GatedLength
from adaflash.speculative.config import FIXED, LengthPolicySpec, length_policy_of
from adaflash.speculative.cost_model import CalibratedCost, CostModel
from adaflash.speculative.length_policy import (BlockHeadLength, FixedLength, HeuristicLength, LearnedThroughputLength,
                                                LengthPolicy, ThroughputLength)


def build_length_policy(spec: LengthPolicySpec | str, cost: CostModel | CalibratedCost | None = None,
                        head=None, max_running: int | None = None) -> LengthPolicy:
    """`fixed:K`, `heuristic`, `throughput` (needs the profiled cost model, corrected by measured step times),
    `throughput-profiled` (the profile alone: the calibration's ablation), `adaflash` (cost model + a per-position
    acceptance head), `block-head` (the paper's block-level head), `ema-budget` (SGLang's batch-level EMA length) or
    `adaflash-gated` (`adaflash` only above the release's 48 requests, batch_length.py); a string is parsed
    (`LengthPolicySpec`, where every spec is checked). `max_running`: the engine's most running requests (its
    `max_batch`), which `adaflash-gated` gates on. The engine runs every one but `fixed:K` behind the drafting check
    (engine/drafting.py)."""
    spec = length_policy_of(spec)
    if spec.name == FIXED:
        return FixedLength(spec.length)
    if spec.name == "heuristic":
        return HeuristicLength()
    if spec.name == "ema-budget":
        return EmaBudgetLength()
    if spec.needs_cost_model and cost is None:
        raise ValueError(f"the {spec} policy needs a cost model")
    if spec.name == "throughput":
        return ThroughputLength(cost)
    if spec.name == "throughput-profiled":
        return ThroughputLength(cost, calibrate=False, name=spec.name)
    from adaflash.models.drafters.length_head import BlockLengthHead, PositionAcceptanceHead

    want = BlockLengthHead if spec.name == "block-head" else PositionAcceptanceHead
    if not isinstance(head, want):
        raise ValueError(f"the {spec} length policy needs a drafter checkpoint carrying a length head, a "
                         f"{want.__name__} (train one with `adaflash train length-head`)")
    return BlockHeadLength(head) if spec.name == "block-head" else learned_policy(spec, cost, head, max_running)


def learned_policy(spec: LengthPolicySpec | str, cost: CostModel | CalibratedCost, head,
                   max_running: int | None = None) -> LengthPolicy:
    """`adaflash` or `adaflash-gated` over any head with a `survival(hidden)` (a checkpoint's, or the simulator's
    synthetic one): what `build_length_policy` builds once it has checked the head."""
    spec = length_policy_of(spec)
    policy = LearnedThroughputLength(cost, head)
    if spec.name == "adaflash":
        return policy
    if spec.name == "adaflash-gated":
        return GatedLength(policy, max_running=max_running)
    raise ValueError(f"{spec} is not a learned per-position policy (adaflash, adaflash-gated)")
