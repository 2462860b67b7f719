"""`adaflash bench simulate`: every variant at every concurrency in virtual time, with its step costs and acceptance
source picked from the command line (simulate.py runs them; replay.py replays a recorded trace)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from adaflash.simulation.replay import Trace, TraceSource
from adaflash.simulation.simulate import VARIANTS, SyntheticSource, Variant, Workload, markdown, report, simulate
from adaflash.simulation.step_cost import ProfileCost, RooflineCost, StepCost, TableCost
from adaflash.simulation.synthetic import Strength
from adaflash.speculative.config import SpeculativeConfig


def cost_of(spec: str, drafter_layers: int, model: str, dtype: str, concurrency: int) -> StepCost:
    """`--cost-model`: gpu:GPU:SHAPE (a roofline), profile (this machine's measured profile of `model` and its shipped
    drafter, the one the throughput policy reads: loaded or profiled once, `cost_model_for`) or a step-cost table
    FILE (`make gpu-check`'s JSON)."""
    if spec.startswith("gpu:"):
        gpu, _, shape = spec.removeprefix("gpu:").partition(":")
        return RooflineCost.of(gpu, shape, drafter_layers)
    if spec == "profile":
        import torch

        from adaflash.models.device.placement import describe
        from adaflash.models.targets.registry import resolve_drafter
        from adaflash.pipeline import Pipeline
        from adaflash.speculative.cost_model import cost_model_for

        pipeline = Pipeline.load(model, resolve_drafter(model, None), dtype)
        profile = cost_model_for(pipeline.target, pipeline.proposer, model,
                                 max_tokens=concurrency * pipeline.proposer.block_size)
        return ProfileCost(profile, f"{model} on {describe(pipeline.target.device)}, {torch.get_num_threads()} "
                                    f"threads, {pipeline.target.numerics}")
    return TableCost.load(spec)


def _cmd(args) -> int:
    try:
        variants = [VARIANTS[name] if name in VARIANTS else Variant(name, "dflash", name)
                    for name in args.variants.split(",")]
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        for variant in variants:
            SpeculativeConfig.of(variant.method, variant.policy)  # a bad policy fails before any run
        if args.drafter.startswith("trace:"):
            trace = Trace.load(args.drafter.removeprefix("trace:"))
            source = TraceSource(trace, args.requests or len(trace.records))
        else:
            workload = Workload(args.requests or Workload.requests, args.prompt_len, args.output_len, args.seed)
            source = SyntheticSource(Strength.parse(args.drafter.removeprefix("synthetic:")), workload)
        cost = cost_of(args.cost_model, args.drafter_layers, args.model, args.dtype, max(concurrencies))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = simulate(variants, concurrencies, cost, source)
    argv = sys.argv[1:]  # (after any top-level flags: --threads N bench simulate ...)
    argv = argv[argv.index("simulate") + 1:] if "simulate" in argv else argv
    result = report(rows, cost, source, "adaflash bench simulate " + " ".join(argv))
    text = markdown(result)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.json).with_suffix(".md").write_text(text)
    return 0 if all(r["lossless"] for r in rows) else 1


def register_cli(subparsers) -> None:
    from adaflash.cli_args import command_group
    from adaflash.models.targets.registry import DEFAULT_TARGET

    p = command_group(subparsers, "bench", help="benchmarks").add_parser(
        "simulate", help="the engine and its length policies on a GPU's step costs, in virtual time")
    p.add_argument("--cost-model", default="gpu:h100:qwen3-8b",
                   help="what a pass costs: gpu:GPU:SHAPE (a roofline; gpus h100, h200, b200; shapes qwen3-8b, "
                   "qwen3-coder-30b-a3b), profile (this machine's measured profile of --model and its shipped "
                   "drafter, as the throughput policy reads it) or FILE (a step-cost table as `make gpu-check` writes "
                   "it: verify_cost.json / gpu_check.json, interpolated in tokens and batch size)")
    p.add_argument("--drafter", default="synthetic:tau=6.5,block=16",
                   help="synthetic:tau=T[,block=B,spread=S,head_error=E]: a drafter of stated strength; or trace:DIR: "
                   "replay a recorded trace (`--record-trace DIR` on generate, serve, bench sweep): its prompts and "
                   "outputs are the workload, its recorded blocks the drafts (simulation/replay.py states the rule)")
    p.add_argument("--drafter-layers", type=int, default=5, help="the drafter's layers (its pass's cost; gpu: only)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated: {', '.join(VARIANTS)}, or a length policy (fixed:K, heuristic, ...)")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per cell (closed loop; default {Workload.requests}, or a trace's recorded requests; "
                   "a trace's are cycled to make more)")
    p.add_argument("--prompt-len", type=int, default=233, help="synthetic prompts' tokens (a trace's are recorded)")
    p.add_argument("--output-len", type=int, default=221, help="synthetic outputs' tokens (a trace's are recorded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=DEFAULT_TARGET, help="with --cost-model profile: the target whose profile prices "
                   "the passes (with its shipped drafter)")
    p.add_argument("--dtype", default="auto", help="with --cost-model profile: the target's dtype")
    p.add_argument("--json", help="write the rows here (and a markdown table beside it)")
    p.set_defaults(func=_cmd)
