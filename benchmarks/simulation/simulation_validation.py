"""The simulator against this CPU: the same engine, policies and prompts run in wall time (measured) and in virtual
time (predicted), both with live acceptance (the real target and shipped drafter run), so only the cost model differs.

    python benchmarks/simulation/simulation_validation.py --dtype int8 --threads 2 --concurrency 1,8,32,64 --rounds 3 \
        --out docs/results/simulation/validation_cpu_int8

Two cost models predict each cell:
- `table`: what the simulator is given for a machine it does not run on, measured here first - the target's forward
  over contexts x batch sizes x new tokens (`measure_step_table`), the drafter's pass by width and by drafting
  requests (`profile_cost_model`), and what the engine's own run adds (`fit_engine`: each kind of pass's seconds in
  place over the table's, and the engine's own time around a pass), fitted on calibration runs over other prompts
  than the cells', again at the start of every round (this VM's speed drifts). Written to STEM_table.json (the last
  round's fit, every round's beside it), which `adaflash bench simulate --cost-model FILE` reads.
- `profile`: the profile the throughput policy reads (`cost_model_for`: a pass by its total tokens, one sequence at
  128 positions of context; the drafter per drafting request; no host time) - the simulator's `--cost-model profile`.

Each round runs every (concurrency, variant) cell measured and predicted, in turns, over the same six-mix eval prompts
in a closed loop (`simulate.closed_loop`); a cell at concurrency c serves max(--requests, 2c) requests. The measured
runs also time every pass (`PassLog`), so each cell says how much of the wall time the engine's own work took and,
per kind of pass, how far the table's price of those very passes is from their measured seconds
(`measured_passes`: [measured, priced] seconds a round).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from adaflash.cli_args import configure_process
from adaflash.engine.request import Request
from adaflash.evaluation.serve_sweep import SIX_MIX, prompt_pool
from adaflash.models.device.placement import describe
from adaflash.models.targets.registry import DEFAULT_TARGET, resolve_drafter
from adaflash.pipeline import Pipeline
from adaflash.simulation.clock import CostedProposer, CostedTarget, VirtualClock
from adaflash.simulation.simulate import Variant, closed_loop, row_of, variant_engine
from adaflash.simulation.step_cost import ProfileCost, TableCost
from adaflash.simulation.step_table import PassLog, fit_engine, seconds_by_kind
from adaflash.speculative.cost_model import cost_model_for, measure_step_table, profile_cost_model

CONTEXTS = (128, 512)
NEW_TOKENS = (1, 2, 4, 8, 16)
PREFILL_BATCHES = (1, 2, 4, 8)  # the engine prefills up to 2048 tokens a pass
PREFILL_TOKENS = (32, 128, 384)  # the prompts' range (--max-prompt-tokens)


def cell(variant: Variant, pipeline: Pipeline, profile, prompts: list[list[int]], max_tokens: int, concurrency: int,
         cost=None, log: PassLog | None = None) -> dict:
    """One closed-loop run: in wall time (`cost` None; its passes timed into `log` if given) or priced by `cost`."""
    target, proposer, clock = pipeline.target, pipeline.proposer, time.perf_counter
    if cost is not None:
        clock = VirtualClock()
        target, proposer = CostedTarget(target, cost, clock), CostedProposer(proposer, cost, clock)
    elif log is not None:
        target, proposer = log.target(target), log.proposer(proposer)
    max_len = max(map(len, prompts)) + max_tokens + proposer.block_size + 1
    engine = variant_engine(variant, target, proposer, pipeline.length_head, profile, (), concurrency, len(prompts),
                            max_len, clock)
    requests = [Request(f"r{i}", p, max_tokens, stop_token_ids=pipeline.stop_token_ids) for i, p in enumerate(prompts)]
    start = clock()
    closed_loop(engine, requests, concurrency)
    return row_of(variant, concurrency, requests, clock() - start) | {"outputs": [r.output_ids for r in requests]}


def measure_table(pipeline: Pipeline, concurrencies: list[int], repeats: int, path: Path) -> TableCost:
    """This machine's standalone step-cost table (no in-engine fit yet), written to `path` (TableCost.load's format)
    and read back."""
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= max(concurrencies)} | {1, 2})
    table = measure_step_table(pipeline.target, batches, NEW_TOKENS, CONTEXTS, repeats, PREFILL_BATCHES,
                               PREFILL_TOKENS, burst=3)
    drafter = profile_cost_model(pipeline.target, pipeline.proposer, max(concurrencies) * pipeline.proposer.block_size,
                                 repeats=repeats, batched_drafter=True)
    path.write_text(json.dumps({"verify_cost": table, "cost_model": json.loads(drafter.to_json()),
                                "machine": describe(pipeline.target.device)}, indent=2) + "\n")
    return TableCost.load(path)


def refit(table: TableCost, pipeline: Pipeline, calibration: list[list[int]], max_tokens: int, variants: list[Variant],
          concurrencies: list[int], profile) -> TableCost:
    """`table` with its in-engine fit from timed runs of every variant over `calibration` prompts (never a cell's) at
    concurrency 1 (12 prompts), 8 (32) and the largest cell's (twice as many prompts) - taken again each round: this
    VM's speed drifts by a third over tens of minutes, and a fit from another stretch of time would price this
    round's runs at that stretch's speed."""
    logs = []
    for c, n in sorted({(1, 12), (min(8, max(concurrencies)), 32), (max(concurrencies), 2 * max(concurrencies))}):
        for variant in variants:
            logs.append(PassLog())
            cell(variant, pipeline, profile, calibration[:n], max_tokens, c, log=logs[-1])
    return dataclasses.replace(table, engine_fit=fit_engine(logs, table))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="int8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--variants", default="ar,fixed:3,throughput,adaflash")
    p.add_argument("--requests", type=int, default=16, help="requests a cell, at least twice its concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--repeats", type=int, default=5, help="timings a table cell")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True, help="path stem: STEM.json, STEM.md and STEM_table.json")
    args = p.parse_args(argv)
    configure_process(args.threads)
    pipeline = Pipeline.load(DEFAULT_TARGET, resolve_drafter(DEFAULT_TARGET, None), args.dtype)
    variants = [Variant(v, "ar") if v == "ar" else Variant(v, "adaflash" if v == "adaflash" else "dflash", v)
                for v in args.variants.split(",")]
    if pipeline.length_head is None:
        variants = [v for v in variants if v.method != "adaflash"]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    pool = [ids for ids in (pipeline.encode(messages=m) for m in prompt_pool(SIX_MIX))
            if len(ids) <= args.max_prompt_tokens]
    most, calibrating = max(args.requests, 2 * max(concurrencies)), max(32, 2 * max(concurrencies))
    if len(pool) < most + calibrating:
        raise SystemExit(f"{len(pool)} prompts fit; {most} cells' and {calibrating} calibration's needed")
    calibration = pool[-calibrating:]  # never a cell's
    profile = cost_model_for(pipeline.target, pipeline.proposer, DEFAULT_TARGET,
                             max_tokens=max(concurrencies) * pipeline.proposer.block_size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table_file = out.with_name(out.name + "_table.json")
    standalone = measure_table(pipeline, concurrencies, args.repeats, table_file)
    models = {"table": standalone, "profile": ProfileCost(profile)}
    sides = ["measured", *models]
    cells: dict[str, dict] = {}
    fits = []
    for r in range(args.rounds):
        table = models["table"] = refit(standalone, pipeline, calibration, args.max_tokens, variants, concurrencies,
                                        profile)
        fits.append(table.engine_fit.to_dict())
        print(f"round {r}: {table.engine_fit}", flush=True)
        for c in concurrencies:
            prompts = pool[:max(args.requests, 2 * c)]
            for variant in variants:
                got = cells.setdefault(f"{c}/{variant.name}", {"concurrency": c, "variant": variant.name,
                                                               "requests": len(prompts), "host_share": [],
                                                               "measured_passes": [],
                                                               "same_outputs": True} | {s: [] for s in sides})
                turn = sides[r % len(sides):] + sides[:r % len(sides)]  # who runs first moves round by round
                for side in turn:
                    log = PassLog() if side == "measured" else None
                    row = cell(variant, pipeline, profile, prompts, args.max_tokens, c, models.get(side), log)
                    got[side].append(row["tokens_per_s"])
                    got.setdefault("accept_len", row["accept_len"])
                    got.setdefault("outputs", row["outputs"])
                    got["same_outputs"] &= row["outputs"] == got["outputs"]
                    if log is not None:
                        # Where the table misses, apart from any run's own course: its price of the measured passes.
                        passes = seconds_by_kind([log], table)
                        got["measured_passes"].append(passes)
                        got["host_share"].append(passes["host"][0] / row["seconds"])
                print(f"{c}/{variant.name} round {r}", {s: round(got[s][-1], 1) for s in sides}, flush=True)
    rows = []
    for got in cells.values():
        got.pop("outputs")
        medians = {s: statistics.median(got[s]) for s in sides}
        rows.append(got | {f"{s}_tokens_per_s": medians[s] for s in sides}
                    | {f"error_{m}": medians[m] / medians["measured"] - 1 for m in models})
    summary = {m: {"median_abs_error": statistics.median(abs(r[f"error_{m}"]) for r in rows),
                   "max_abs_error": max(abs(r[f"error_{m}"]) for r in rows),
                   "within_5_percent": sum(abs(r[f"error_{m}"]) <= 0.05 for r in rows),
                   "within_10_percent": sum(abs(r[f"error_{m}"]) <= 0.10 for r in rows)} for m in models}
    # The file keeps the standalone table and the last round's fit, which `bench simulate --cost-model FILE` reads.
    report = json.loads(table_file.read_text())
    table_file.write_text(json.dumps(report | {"engine_fit": fits[-1], "engine_fits_by_round": fits, "calibration": {
        "prompts": len(calibration), "max_tokens": args.max_tokens, "variants": [v.name for v in variants]}},
        indent=2) + "\n")
    result = {"simulated": True, "command": "python benchmarks/simulation/simulation_validation.py " + " ".join(sys.argv[1:]),
              "machine": f"{describe('cpu')}, {args.threads} threads, {args.dtype}",
              "cost_models": {m: cost.describe() for m, cost in models.items()},
              "acceptance": "live: the shipped drafter on SmolLM2-135M-Instruct", "rows": rows, "summary": summary}
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result, args.rounds, table_file.name))
    print(markdown(result, args.rounds, table_file.name))
    return 0


def markdown(result: dict, rounds: int, table_name: str) -> str:
    lines = [f"Predicted (virtual time, live acceptance) against measured (wall time) served throughput on "
             f"{result['machine']}; medians of {rounds} rounds (measured spread: the measured rounds' range over their "
             "median, the machine's own run-to-run noise). Cost models: `table`, this machine's step-cost table "
             f"fitted to the engine's runs on other prompts ([{table_name}]({table_name})); `profile`, the throughput "
             "policy's own profile (a pass by its total tokens, no host time).", "", f"`{result['command']}`", "",
             "| concurrency | variant | requests | measured tok/s | measured spread | host share (measured) | "
             "table tok/s | error | profile tok/s | error | accept length | same outputs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        spread = (max(r["measured"]) - min(r["measured"])) / r["measured_tokens_per_s"]
        lines.append(f"| {r['concurrency']} | {r['variant']} | {r['requests']} | {r['measured_tokens_per_s']:.1f} | "
                     f"{100 * spread:.0f}% | {100 * statistics.median(r['host_share']):.0f}% | "
                     f"{r['table_tokens_per_s']:.1f} | "
                     f"{100 * r['error_table']:+.1f}% | {r['profile_tokens_per_s']:.1f} | "
                     f"{100 * r['error_profile']:+.1f}% | {r['accept_len']:.2f} | "
                     f"{'yes' if r['same_outputs'] else 'NO'} |")
    lines += ["", "The table's price of the measured runs' own passes, by kind (priced / measured - 1, medians over "
              "rounds; share: of the run's wall time):", "",
              "| concurrency | variant | decode / verify | prefill | drafter | context feed | host |",
              "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = []
        for kind in ("step", "prefill", "drafter", "feed", "host"):
            runs = [(m, p, row_s) for m, p, row_s in ((x[kind][0], x[kind][1], sum(v[0] for v in x.values()))
                                                       for x in r["measured_passes"]) if m > 0]
            cells.append("-" if not runs else f"{100 * statistics.median(p / m - 1 for m, p, _ in runs):+.0f}% "
                         f"(share {100 * statistics.median(m / t for m, _, t in runs):.0f}%)")
        lines.append(f"| {r['concurrency']} | {r['variant']} | " + " | ".join(cells) + " |")
    lines.append("")
    for m, s in result["summary"].items():
        lines.append(f"- `{m}`: median |error| {100 * s['median_abs_error']:.1f}%, largest "
                     f"{100 * s['max_abs_error']:.1f}%, {s['within_5_percent']} of {len(result['rows'])} cells within "
                     f"5%, {s['within_10_percent']} within 10%.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
