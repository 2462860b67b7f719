"""`adaflash bench simulate`: the engine and its length policies on a GPU's step costs, in virtual time.

Each variant (a method and length policy, as `serve` takes them) runs the real engine built by `build_engine`, over a
synthetic target and drafter of stated strength, its passes priced by a roofline of the named GPU and model shape
(`step_cost.py`) on a virtual clock (`clock.py`) that the policies and drafting checks read. `concurrency` clients
each send their next request when the last one ends (closed loop, as `bench sweep`'s load client) until the workload's
requests are done; a row's tokens a second are the generated tokens over the virtual seconds, and every output is
checked against the synthetic target's own greedy decoding. Every row says it is simulated and with what.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from adaflash.engine.engine_factory import EngineConfig, EngineModels, build_engine
from adaflash.engine.request import Request
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.cost_model import CalibratedCost, CostModel
from adaflash.speculative.drafting_check import DraftingChecks
from adaflash.speculative.length_policy import LearnedThroughputLength, build_length_policy
from adaflash.simulation.clock import CostedProposer, CostedTarget, VirtualClock
from adaflash.simulation.step_cost import RooflineCost, StepCost
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
    "throughput": Variant("throughput", "dflash", "throughput"),
    "adaflash": Variant("adaflash", "adaflash", "adaflash"),
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
    instead of timed; the drafter's pass by its requests too, as it is profiled on CUDA)."""
    max_tokens = max_batch * block_size
    points = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, max_tokens} & set(range(1, max_tokens + 1)))
    widths = sorted({w for w in (2, 4, 8, block_size) if w <= block_size})
    batches = sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch} & set(range(1, max_batch + 1)))
    return CostModel(tuple(points), tuple(cost.target_s([n], [context], n) for n in points),
                     cost.drafter_s(block_size, [context], block_size - 1), tuple(widths),
                     tuple(cost.drafter_s(w, [context], w - 1) for w in widths), tuple(batches),
                     tuple(cost.drafter_s(block_size, [context] * n, n * (block_size - 1)) for n in batches))


def run_variant(variant: Variant, cost: StepCost, strength: Strength, concurrency: int, workload: Workload) -> dict:
    """One variant at one concurrency: the row of the results table."""
    clock = VirtualClock()
    target = CostedTarget(SyntheticTarget(), cost, clock)
    speculative = SpeculativeConfig.of(variant.method, variant.policy)
    proposer = policy = checks = None
    if speculative.uses_drafter:
        proposer = CostedProposer(SyntheticDrafter(target, strength, seed=workload.seed), cost, clock)
        profile = CalibratedCost(profile_of(cost, concurrency, strength.block_size))
        spec = speculative.engine_policy
        policy = (LearnedThroughputLength(profile, SyntheticHead()) if spec.name == "adaflash"
                  else build_length_policy(spec, profile))
        checks = DraftingChecks()
    max_len = workload.prompt_len + workload.output_len + strength.block_size + 1
    config = EngineConfig(speculative, max_batch=concurrency, max_queue=workload.requests, max_len=max_len)
    engine = build_engine(config, EngineModels(target, proposer), policy, checks, clock=clock)
    prompts = workload.prompts()
    waiting = deque(Request(f"r{i}", p, workload.output_len) for i, p in enumerate(prompts))
    requests, running = list(waiting), 0
    steps = 0
    while waiting or engine.has_work():
        while waiting and running < concurrency:
            engine.add_request(waiting.popleft())
            running += 1
        running -= sum(out.finish_reason is not None for out in engine.step())
        steps += 1
    generated = sum(len(r.output_ids) for r in requests)
    lossless = all(r.output_ids == synthetic_greedy(p, workload.output_len) for r, p in zip(requests, prompts))
    passes = [a for r in requests for a in r.accept_lengths[1:]]  # after each request's prefill
    drafted = [k for r in requests for k in r.draft_lengths[1:]]
    return {"concurrency": concurrency, "variant": variant.name, "method": variant.method,
            "policy": str(speculative.engine_policy) if speculative.engine_policy else None,
            "tokens_per_s": generated / clock.now, "seconds": clock.now, "generated_tokens": generated,
            "engine_steps": steps, "target_passes": target.passes,
            "drafter_passes": proposer.passes if proposer is not None else 0,
            "accept_len": statistics.fmean(passes) if passes else 0.0,
            "drafts_per_pass": statistics.fmean(drafted) if drafted else 0.0, "lossless": lossless}


def simulate(variants: Sequence[Variant], concurrencies: Sequence[int], cost: StepCost, strength: Strength,
             workload: Workload) -> list[dict]:
    rows = []
    for c in concurrencies:
        base = None
        for variant in variants:
            row = run_variant(variant, cost, strength, c, workload)
            base = row["tokens_per_s"] if variant.method == "ar" else base
            row["speedup_vs_ar"] = row["tokens_per_s"] / base if base else None
            rows.append(row)
    return rows


def report(rows: list[dict], cost: StepCost, strength: Strength, workload: Workload, command: str) -> dict:
    return {"simulated": True, "command": command, "cost_model": cost.describe(),
            "acceptance": f"synthetic drafter: tau {strength.tau} over a block of {strength.block_size}, per-request "
                          f"rate spread {strength.spread}, head calibration error {strength.head_error}",
            "workload": vars(workload), "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"Simulated (virtual time): {result['cost_model']}; {result['acceptance']}.", "",
             f"`{result['command']}`", "",
             "| concurrency | variant | tokens/s (simulated) | vs AR | accept length | drafts a pass | lossless |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        vs = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        lines.append(f"| {r['concurrency']} | {r['variant']} | {r['tokens_per_s']:.0f} | {vs} | {r['accept_len']:.2f} "
                     f"| {r['drafts_per_pass']:.2f} | {'yes' if r['lossless'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def _cmd(args) -> int:
    import sys

    try:
        gpu, _, shape = args.cost_model.removeprefix("gpu:").partition(":")
        cost = RooflineCost.of(gpu, shape, args.drafter_layers)
        strength = Strength.parse(args.drafter.removeprefix("synthetic:"))
        variants = [VARIANTS[name] if name in VARIANTS else Variant(name, "dflash", name)
                    for name in args.variants.split(",")]
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        for variant in variants:
            SpeculativeConfig.of(variant.method, variant.policy)  # a bad policy fails before any run
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    workload = Workload(args.requests, args.prompt_len, args.output_len, args.seed)
    rows = simulate(variants, concurrencies, cost, strength, workload)
    result = report(rows, cost, strength, workload, "adaflash bench simulate " + " ".join(sys.argv[3:]))
    text = markdown(result)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.json).with_suffix(".md").write_text(text)
    return 0 if all(r["lossless"] for r in rows) else 1


def register_cli(subparsers) -> None:
    from adaflash.cli_args import command_group

    p = command_group(subparsers, "bench", help="benchmarks").add_parser(
        "simulate", help="the engine and its length policies on a GPU's step costs, in virtual time")
    p.add_argument("--cost-model", default="gpu:h100:qwen3-8b", help="gpu:GPU:SHAPE (gpus h100, h200, b200; shapes "
                   "qwen3-8b, qwen3-coder-30b-a3b)")
    p.add_argument("--drafter", default="synthetic:tau=6.5,block=16",
                   help="synthetic:tau=T[,block=B,spread=S,head_error=E]: a drafter of stated strength")
    p.add_argument("--drafter-layers", type=int, default=5, help="the drafter's layers (its pass's cost)")
    p.add_argument("--variants", default="ar,fixed-block,throughput,adaflash",
                   help=f"comma-separated: {', '.join(VARIANTS)}, or a length policy (fixed:K, heuristic, ...)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--requests", type=int, default=64, help="requests per cell (closed loop)")
    p.add_argument("--prompt-len", type=int, default=233)
    p.add_argument("--output-len", type=int, default=221)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here (and a markdown table beside it)")
    p.set_defaults(func=_cmd)
