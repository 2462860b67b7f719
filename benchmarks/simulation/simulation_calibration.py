"""The simulator against published GPU figures: how far its roofline and its synthetic drafters are from each.

    python benchmarks/simulation/simulation_calibration.py --out docs/results/simulation/calibration

1. vLLM 0.11, Qwen3-8B bf16, one H100 SXM, ShareGPT 233 in / 221 out: TPOT at concurrency 1 / 2 / 4 / 8 (the roofline's
   decode step, at the mean context of the run).
2. The DFlash paper (arXiv 2602.06036), B200, SGLang, block 16: AR tokens a second and DFlash's speedup over AR at
   concurrency 1 / 4 / 8 / 16 / 32, Qwen3-8B Math500 (tau 8.01) and HumanEval (tau 6.50), Qwen3-Coder-30B-A3B HumanEval
   (tau 8.09): the simulator's AR and fixed-block (15 drafts) runs, its drafter the synthetic one at that tau.
   The paper's output lengths are not stated: 128 prompt and 1024 generated tokens are assumed here.
The fitted constants (H100's memory efficiency from its c = 1 TPOT; B200's pass overhead and a mixture layer's overhead
from its two c = 1 AR figures; a verify pass's own cost from the five Qwen3-8B Math500 speedups) are among the rows:
their error is the fit's, the others' are the model's (Qwen3-8B HumanEval and Qwen3-Coder-30B-A3B held out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from adaflash.simulation.simulate import VARIANTS, Workload, run_variant
from adaflash.simulation.step_cost import RooflineCost
from adaflash.simulation.synthetic import Strength

H100_TPOT_MS = {1: 7.28, 2: 7.37, 4: 7.38, 8: 7.71}
CONCURRENCY = (1, 4, 8, 16, 32)
DFLASH_B200 = {  # (shape, benchmark): (tau, AR tok/s or None, speedups)
    ("qwen3-8b", "math500"): (8.01, (230, 861, 1666, 3133, 5694), (5.1, 4.5, 4.5, 3.9, 2.8)),
    ("qwen3-8b", "humaneval"): (6.50, None, (4.2, 3.6, 3.6, 3.0, 2.4)),
    ("qwen3-coder-30b-a3b", "humaneval"): (8.09, (229, 686, 1068, 1681, 2713), (3.5, 3.0, 3.2, 3.2, 3.1)),
}


def _error(simulated: float, published: float) -> float:
    return simulated / published - 1


def h100_rows() -> list[dict]:
    cost = RooflineCost.of("h100", "qwen3-8b")
    rows = []
    for c, tpot in H100_TPOT_MS.items():
        step_ms = 1e3 * cost.target_s([1] * c, [233 + 221 // 2] * c, c)
        rows.append({"figure": "H100 vLLM Qwen3-8B TPOT ms", "concurrency": c, "published": tpot,
                     "simulated": round(step_ms, 3), "error": round(_error(step_ms, tpot), 4),
                     "fitted": c == 1})
    return rows


def b200_rows(requests_per_client: int, output_len: int) -> list[dict]:
    rows = []
    for (shape, bench), (tau, ar_published, speedups) in DFLASH_B200.items():
        cost = RooflineCost.of("b200", shape)
        strength = Strength(tau=tau, block_size=16, spread=0.0)  # (every request at the paper's mean: less noise)
        for c, speedup in zip(CONCURRENCY, speedups):
            workload = Workload(max(8, requests_per_client * c), 128, output_len)
            ar = run_variant(VARIANTS["ar"], cost, strength, c, workload)
            block = run_variant(VARIANTS["fixed-block"], cost, strength, c, workload)
            simulated = block["tokens_per_s"] / ar["tokens_per_s"]
            label = f"B200 SGLang {shape} {bench}"
            rows.append({"figure": f"{label} DFlash speedup (tau {tau})", "concurrency": c, "published": speedup,
                         "simulated": round(simulated, 3), "error": round(_error(simulated, speedup), 4),
                         "fitted": (shape, bench) == ("qwen3-8b", "math500"),
                         "accept_len": round(block["accept_len"], 3)})  # (the drawn tau: its noise)
            if ar_published is not None:
                published = ar_published[CONCURRENCY.index(c)]
                rows.append({"figure": f"{label} AR tok/s", "concurrency": c, "published": published,
                             "simulated": round(ar["tokens_per_s"], 1),
                             "error": round(_error(ar["tokens_per_s"], published), 4),
                             "fitted": c == 1})
    return rows


def markdown(result: dict) -> str:
    lines = ["Simulated figures (roofline + synthetic drafters) against published GPU measurements.", "",
             f"`{result['command']}`", "",
             "| figure | concurrency | published | simulated | error | fitted |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['figure']} | {r['concurrency']} | {r['published']} | {r['simulated']} | "
                     f"{100 * r['error']:+.1f}% | {'yes' if r['fitted'] else ''} |")
    s = result["summary"]
    lines += ["", f"Not fitted: median |error| {100 * s['median_abs_error']:.1f}%, largest {100 * s['max_abs_error']:.1f}%, "
              f"{s['within_15_percent']} of {s['cells']} cells within 15%."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.md")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--output-len", type=int, default=1024)
    args = p.parse_args(argv)
    rows = h100_rows() + b200_rows(args.requests_per_client, args.output_len)
    free = [abs(r["error"]) for r in rows if not r["fitted"]]
    result = {"simulated": True, "command": "python benchmarks/simulation/simulation_calibration.py " + " ".join(sys.argv[1:]),
              "machine": "virtual time (the simulator's roofline); computed on any CPU", "rows": rows,
              "summary": {"cells": len(free), "median_abs_error": statistics.median(free),
                          "max_abs_error": max(free), "within_15_percent": sum(e <= 0.15 for e in free)}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
