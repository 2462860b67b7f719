"""`adaflash bench simulate`: the engine and its length policies on a GPU's step costs, in virtual time.

Each variant (a method and length policy, as `serve` takes them) runs the real engine built by `build_engine`, over a
synthetic target and drafter of stated strength (`synthetic.py`) or a replayed trace of a real run (`replay.py`), its
passes priced by a roofline of the named GPU and model shape, this machine's measured profile or a measured step-cost
table (`step_cost.py`) on a virtual clock (`clock.py`) that the policies and drafting checks read. `concurrency`
clients each send their next request when the last one ends (closed loop, as `bench sweep`'s load client) until the
workload's requests are done; a row's tokens a second are the generated tokens over the virtual seconds, and every
output is checked against the target it ran over (the synthetic target's greedy decoding, or the recorded output).
Every row says it is simulated and with what acceptance.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from adaflash.engine.engine_factory import EngineConfig, EngineModels, build_engine
from adaflash.engine.request import Request
from adaflash.export.vllm_schedule import batch_schedule
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.cost_model import (CalibratedCost, CostModel, profile_batches, profile_points,
                                             profile_widths)
from adaflash.speculative.drafting_check import DraftingChecks
from adaflash.speculative.policies import build_length_policy, learned_policy
from adaflash.simulation.clock import CostedProposer, CostedTarget, VirtualClock
from adaflash.simulation.step_cost import ProfileCost, StepCost
from adaflash.simulation.synthetic import (Strength, SyntheticDrafter, SyntheticHead, SyntheticTarget,
                                           synthetic_greedy, synthetic_prompt)


@dataclass(frozen=True)
class Variant:
    """`method` and `policy` as `serve --method --length-policy` take them (`policy` None: the method's default)."""

    name: str
    method: str
    policy: str | None = None


VARIANTS = {
    "ar": Variant("ar", "ar"),
    "fixed-block": Variant("fixed-block", "dflash", "fixed:15"),
    "vllm-schedule": Variant("vllm-schedule", "dflash", "fixed:15"),  # its lengths: ScheduleLength
    "ema-budget": Variant("ema-budget", "dflash", "ema-budget"),  # SGLang's batch-level EMA length
    "throughput": Variant("throughput", "dflash", "throughput"),
    "adaflash": Variant("adaflash", "adaflash", "adaflash"),
    "adaflash-gated": Variant("adaflash-gated", "adaflash", "adaflash-gated"),  # the release's >48 gate
}


@dataclass(frozen=True)
class Workload:
    """`requests` requests of `prompt_len` prompt tokens and `output_len` generated ones (ShareGPT's means in the H100
    figures: 233 / 221)."""

    requests: int = 64
    prompt_len: int = 233
    output_len: int = 221
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        return [synthetic_prompt(self.prompt_len, self.seed * 1_000_003 + i) for i in range(self.requests)]


def profile_of(cost: StepCost, max_batch: int, block_size: int, context: int = 128) -> CostModel:
    """The profile the throughput policies would measure on the simulated GPU (`profile_cost_model`'s points, priced
    instead of timed; as on CUDA, the drafter's pass by its requests and the verify by requests x new tokens too)."""
    points, widths = profile_points(max_batch * block_size), profile_widths(block_size)
    batches = profile_batches(max_batch)
    grid_batches = tuple(b for b in profile_batches(max_batch) if b <= 32)
    grid_widths = tuple(w for w in (1, 2, 4, 8, 16) if w <= block_size)
    grid = tuple(tuple(cost.target_s([w] * b, [context] * b, b * w) for w in grid_widths) for b in grid_batches)
    if len(grid_batches) < 2:
        grid_batches, grid_widths, grid = (), (), ()
    return CostModel(tuple(points), tuple(cost.target_s([n], [context], n) for n in points),
                     cost.drafter_s(block_size, [context], block_size - 1), tuple(widths),
                     tuple(cost.drafter_s(w, [context], w - 1) for w in widths), tuple(batches),
                     tuple(cost.drafter_s(block_size, [context] * n, n * (block_size - 1)) for n in batches),
                     grid_batches, grid_widths, grid)


@dataclass
class ScheduleLength:
    """vLLM's dynamic speculative decoding (`num_speculative_tokens_per_batch_size`): one draft length for every
    request of a step, by the step's batch size; the schedule is our throughput policy's for a known survival curve
    (`adaflash export vllm-schedule`'s `batch_schedule`)."""

    schedule: list[list[int]]
    name: str = "vllm-schedule"

    def decide(self, requests, max_draft, hidden_of=None) -> list[int]:
        n = len(requests)
        k = next((k for start, end, k in self.schedule if start <= n <= end), 0)
        return [min(k, max_draft)] * n

    def feedback(self, request, drafted, accepted) -> None:
        pass

    def observe_step(self, lengths, seconds, priced=True) -> None:
        pass


def variant_engine(variant: Variant, target, proposer, head, profile: CostModel | None, survival: Sequence[float],
                   concurrency: int, max_queue: int, max_len: int, clock):
    """The engine `serve --method --length-policy` would build for this variant, its policy priced by `profile`
    (the vLLM schedule's drafts sized from `survival`), reading time from `clock`."""
    speculative = SpeculativeConfig.of(variant.method, variant.policy)
    policy = checks = None
    if speculative.uses_drafter:
        cost, spec = CalibratedCost(profile), speculative.engine_policy
        if variant.name == "vllm-schedule":
            policy = ScheduleLength(batch_schedule(survival, profile, proposer.block_size - 1, concurrency))
        elif spec.name in ("adaflash", "adaflash-gated"):  # (a synthetic head is not a checkpoint's: built here)
            policy = learned_policy(spec, cost, head, max_running=concurrency)
        else:
            policy = build_length_policy(spec, cost)
        checks = DraftingChecks()
    config = EngineConfig(speculative, max_batch=concurrency, max_queue=max_queue, max_len=max_len)
    return build_engine(config, EngineModels(target, proposer if speculative.uses_drafter else None), policy, checks,
                        clock=clock)


def closed_loop(engine, requests: Sequence[Request], concurrency: int) -> int:
    """`concurrency` clients, each sending its next request when its last one ends; the engine steps it ran."""
    waiting, running, steps = deque(requests), 0, 0
    while waiting or engine.has_work():
        while waiting and running < concurrency:
            engine.add_request(waiting.popleft())
            running += 1
        running -= sum(out.finish_reason is not None for out in engine.step())
        steps += 1
    return steps


def row_of(variant: Variant, concurrency: int, requests: Sequence[Request], seconds: float) -> dict:
    generated = sum(len(r.output_ids) for r in requests)
    passes = [a for r in requests for a in r.accept_lengths[1:]]  # after each request's prefill
    drafted = [k for r in requests for k in r.draft_lengths[1:]]
    return {"concurrency": concurrency, "variant": variant.name, "method": variant.method, "policy": variant.policy,
            "tokens_per_s": generated / seconds, "seconds": seconds, "generated_tokens": generated,
            "accept_len": statistics.fmean(passes) if passes else 0.0,
            "drafts_per_pass": statistics.fmean(drafted) if drafted else 0.0}


def policy_profile(cost: StepCost, concurrency: int, block_size: int) -> CostModel:
    """The cost profile the policies read: this machine's own where it prices the passes (as `serve` reads it), else
    the one they would measure on the priced machine (`profile_of`)."""
    return cost.profile if isinstance(cost, ProfileCost) else profile_of(cost, concurrency, block_size)


def run_engine(variant: Variant, cost: StepCost, clock: VirtualClock, target: CostedTarget, proposer: CostedProposer,
               head, survival: Sequence[float], concurrency: int, requests: Sequence[Request],
               expected: Sequence[Sequence[int]]) -> dict:
    """One variant at one concurrency over costed models (synthetic or replayed): the closed loop over `requests`,
    each output checked against `expected`; the row of the results table."""
    max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in requests) + proposer.block_size + 1
    engine = variant_engine(variant, target, proposer, head, policy_profile(cost, concurrency, proposer.block_size),
                            survival, concurrency, len(requests), max_len, clock)
    steps = closed_loop(engine, requests, concurrency)
    row = row_of(variant, concurrency, requests, clock.now)
    row.update(engine_steps=steps, target_passes=target.passes,
               drafter_passes=proposer.passes if engine.proposer is not None else 0,
               lossless=all(r.output_ids == list(e) for r, e in zip(requests, expected)))
    return row


def run_variant(variant: Variant, cost: StepCost, strength: Strength, concurrency: int, workload: Workload) -> dict:
    """One variant at one concurrency over the synthetic models: the row of the results table."""
    clock = VirtualClock()
    target = CostedTarget(SyntheticTarget(), cost, clock)
    proposer = CostedProposer(SyntheticDrafter(target, strength, seed=workload.seed), cost, clock)
    survival = [strength.alpha ** j for j in range(1, strength.block_size)]
    prompts = workload.prompts()
    requests = [Request(f"r{i}", p, workload.output_len) for i, p in enumerate(prompts)]
    return run_engine(variant, cost, clock, target, proposer, SyntheticHead(), survival, concurrency, requests,
                      [synthetic_greedy(p, workload.output_len) for p in prompts])


@dataclass(frozen=True)
class SyntheticSource:
    """`bench simulate`'s acceptance from a synthetic drafter of stated strength, over a synthetic workload."""

    strength: Strength
    workload: Workload

    @property
    def label(self) -> str:
        return f"synthetic tau={self.strength.tau}"

    def describe(self) -> str:
        s = self.strength
        return (f"synthetic drafter: tau {s.tau} over a block of {s.block_size}, per-request rate spread {s.spread}, "
                f"head calibration error {s.head_error}")

    def workload_dict(self) -> dict:
        return vars(self.workload)

    def run(self, variant: Variant, cost: StepCost, concurrency: int) -> dict:
        return run_variant(variant, cost, self.strength, concurrency, self.workload)


def simulate(variants: Sequence[Variant], concurrencies: Sequence[int], cost: StepCost, source) -> list[dict]:
    """Every variant at every concurrency; `source`: the acceptance (`SyntheticSource`, `replay.TraceSource`)."""
    rows = [source.run(variant, cost, c) | {"acceptance": source.label} for c in concurrencies for variant in variants]
    for row in rows:  # (AR may be listed anywhere, or not at all)
        base = next((r["tokens_per_s"] for r in rows if r["method"] == "ar" and r["concurrency"] == row["concurrency"]),
                    None)
        row["speedup_vs_ar"] = row["tokens_per_s"] / base if base else None
    return rows


def report(rows: list[dict], cost: StepCost, source, command: str) -> dict:
    return {"simulated": True, "command": command, "machine": f"virtual time: {cost.describe()}",
            "cost_model": cost.describe(), "acceptance": source.describe(), "workload": source.workload_dict(),
            "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"Simulated (virtual time): {result['cost_model']}; {result['acceptance']}.", "",
             f"`{result['command']}`", "",
             "| concurrency | variant | tokens/s (simulated) | vs AR | accept length | drafts a pass | lossless | "
             "acceptance |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        vs = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        lines.append(f"| {r['concurrency']} | {r['variant']} | {r['tokens_per_s']:.0f} | {vs} | {r['accept_len']:.2f} "
                     f"| {r['drafts_per_pass']:.2f} | {'yes' if r['lossless'] else 'NO'} | {r['acceptance']} |")
    return "\n".join(lines) + "\n"
