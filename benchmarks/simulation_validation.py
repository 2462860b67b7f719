"""The simulator against this CPU: the same engine, policies and prompts run in wall time (measured) and in virtual
time priced by this machine's profile (predicted), both with live acceptance (the real target and shipped drafter run).

    python benchmarks/simulation_validation.py --dtype int8 --threads 2 --concurrency 1,8 --requests 16 \
        --max-tokens 64 --rounds 3 --out docs/results/simulation/validation_cpu_int8

Each round runs every (concurrency, variant) cell twice, measured then predicted or the reverse by turns, over the
same six-mix eval prompts in a closed loop (`simulate.closed_loop`). The prediction prices each target pass by its
tokens from the profile the throughput policy reads (`cost_model_for`: one sequence at 128 positions of context) and
each drafter pass per drafting request, as a CPU runs it; the engine's Python between passes is not priced. The error
table says how far that is from this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from adaflash.cli_args import configure_process
from adaflash.engine.request import Request
from adaflash.evaluation.serve_sweep import SIX_MIX, prompt_pool
from adaflash.models.device import describe
from adaflash.models.registry import DEFAULT_TARGET, resolve_drafter
from adaflash.pipeline import Pipeline
from adaflash.simulation.clock import CostedProposer, CostedTarget, VirtualClock
from adaflash.simulation.simulate import Variant, closed_loop, row_of, variant_engine
from adaflash.simulation.step_cost import ProfileCost
from adaflash.speculative.cost_model import cost_model_for


def cell(variant: Variant, pipeline: Pipeline, profile, prompts: list[list[int]], max_tokens: int, concurrency: int,
         predicted: bool) -> dict:
    target, proposer, clock = pipeline.target, pipeline.proposer, time.perf_counter
    if predicted:
        clock, cost = VirtualClock(), ProfileCost(profile)
        target, proposer = CostedTarget(target, cost, clock), CostedProposer(proposer, cost, clock)
    max_len = max(map(len, prompts)) + max_tokens + proposer.block_size + 1
    engine = variant_engine(variant, target, proposer, pipeline.length_head, profile, (), concurrency, len(prompts),
                            max_len, clock)
    requests = [Request(f"r{i}", p, max_tokens, stop_token_ids=pipeline.stop_token_ids) for i, p in enumerate(prompts)]
    start = clock()
    closed_loop(engine, requests, concurrency)
    return row_of(variant, concurrency, requests, clock() - start) | {"outputs": [r.output_ids for r in requests]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--variants", default="ar,fixed:3,throughput,adaflash")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True, help="path stem: STEM.json and STEM.md")
    args = p.parse_args(argv)
    configure_process(args.threads)
    pipeline = Pipeline.load(DEFAULT_TARGET, resolve_drafter(DEFAULT_TARGET, None), args.dtype)
    variants = [Variant(v, "ar") if v == "ar" else Variant(v, "adaflash" if v == "adaflash" else "dflash", v)
                for v in args.variants.split(",")]
    if pipeline.length_head is None:
        variants = [v for v in variants if v.method != "adaflash"]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prompts = [ids for ids in (pipeline.encode(messages=m) for m in prompt_pool(SIX_MIX))
               if len(ids) <= args.max_prompt_tokens][: args.requests]
    profile = cost_model_for(pipeline.target, pipeline.proposer, DEFAULT_TARGET,
                             max_tokens=max(concurrencies) * pipeline.proposer.block_size)
    cells: dict[str, dict] = {}
    for r in range(args.rounds):
        for c in concurrencies:
            for variant in variants:
                key = f"{c}/{variant.name}"
                for predicted in ((False, True) if (r + c) % 2 == 0 else (True, False)):
                    row = cell(variant, pipeline, profile, prompts, args.max_tokens, c, predicted)
                    got = cells.setdefault(key, {"concurrency": c, "variant": variant.name, "measured": [],
                                                 "predicted": [], "accept_len": {"measured": [], "predicted": []},
                                                 "same_outputs": True})
                    side = "predicted" if predicted else "measured"
                    got[side].append(row["tokens_per_s"])
                    got["accept_len"][side].append(row["accept_len"])
                    got.setdefault("outputs", row["outputs"])
                    got["same_outputs"] &= row["outputs"] == got["outputs"]
                print(key, f"round {r}", {k: [round(x, 1) for x in got[k]] for k in ("measured", "predicted")},
                      flush=True)
    rows = []
    for got in cells.values():
        got.pop("outputs")
        measured, predicted = statistics.median(got["measured"]), statistics.median(got["predicted"])
        rows.append(got | {"measured_tokens_per_s": measured, "predicted_tokens_per_s": predicted,
                           "error": predicted / measured - 1})
    errors = [abs(r["error"]) for r in rows]
    result = {"simulated": True, "command": "python benchmarks/simulation_validation.py " + " ".join(sys.argv[1:]),
              "machine": f"{describe('cpu')}, {args.threads} threads, {args.dtype}", "cost_model": "this machine's "
              "measured profile (cost_model_for)", "acceptance": "live: the shipped drafter on SmolLM2-135M-Instruct",
              "rows": rows, "summary": {"cells": len(rows), "median_abs_error": statistics.median(errors),
                                        "max_abs_error": max(errors),
                                        "within_15_percent": sum(e <= 0.15 for e in errors)}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"Predicted (virtual time, {result['cost_model']}, live acceptance) against measured (wall time) on "
             f"{result['machine']}; medians of {args.rounds} rounds.", "", f"`{result['command']}`", "",
             "| concurrency | variant | measured tok/s | predicted tok/s | error | accept length (measured) | "
             "same outputs |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['variant']} | {r['measured_tokens_per_s']:.1f} | "
                     f"{r['predicted_tokens_per_s']:.1f} | {100 * r['error']:+.1f}% | "
                     f"{statistics.median(r['accept_len']['measured']):.2f} | {'yes' if r['same_outputs'] else 'NO'} |")
    s = result["summary"]
    lines += ["", f"median |error| {100 * s['median_abs_error']:.1f}%, largest {100 * s['max_abs_error']:.1f}%, "
              f"{s['within_15_percent']} of {s['cells']} cells within 15%."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
