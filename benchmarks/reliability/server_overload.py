"""Overload: 4x the batch limit of concurrent clients against a real `adaflash serve` with --max-queue set, beside the
batch limit's own figure, the two loads alternating on one server:

    .venv/bin/python benchmarks/reliability/server_overload.py --max-batch 8 --max-queue 8 --seconds 90 --rounds 2 \
        --out docs/results/reliability/overload

At the batch limit every client has a slot; at 4x, max_batch run, max_queue wait and the rest are refused (429 / 503
with Retry-After; a refusal without it counts as lost) and wait what Retry-After says before asking again. Judged: no request
lost (none times out silently: every one is answered in full or refused), and the tokens a second of the completed
requests at 4x within 10% of the batch limit's (the median over rounds of each round's ratio).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

import httpx

from adaflash.evaluation.load_test import Traffic, run_load
from adaflash.evaluation.serve_sweep import SIX_MIX, fitting_prompts, launched_server
from adaflash.models.device.cpu import cpu_model
from adaflash.report import markdown_table, write_report

MODEL = "smollm2-135m"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--factor", type=int, default=4, help="clients at overload, as a multiple of --max-batch")
    p.add_argument("--seconds", type=float, default=90.0, help="each phase's length")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--method", default="dflash")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8451)
    p.add_argument("--out", type=Path, default=Path("docs/results/reliability/overload"))
    args = p.parse_args(argv)

    traffic = Traffic(tuple(tuple(m) for m in fitting_prompts(SIX_MIX, MODEL, 384)), args.max_tokens)
    serve_args = ["--model", MODEL, "--method", args.method, "--max-queue", str(args.max_queue), "--max-len", "512"]
    loads = {"batch limit": args.max_batch, f"{args.factor}x": args.factor * args.max_batch}
    phases: list[dict] = []
    with launched_server("overload", serve_args, args.port, args.max_batch, Path("runs/reliability"),
                         threads=args.threads) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(run_load(url, model, args.max_batch, 20.0, traffic))  # warm-up: shapes, caches
        for r in range(args.rounds):
            order = list(loads.items()) if r % 2 == 0 else list(reversed(loads.items()))
            for name, clients in order:
                report = asyncio.run(run_load(url, model, clients, args.seconds, traffic))
                phases.append({"round": r, "load": name, "clients": clients,
                               "tokens_per_s": report.completion_tokens / report.duration_s, **report.as_dict()})
                print(f"round {r} {name}: {phases[-1]['tokens_per_s']:.1f} tok/s, {report.completed} completed, "
                      f"{report.refused} refused, {report.failed} lost", flush=True)
    base, over = loads
    ratios = [next(q for q in phases if q["round"] == r and q["load"] == over)["tokens_per_s"] /
              next(q for q in phases if q["round"] == r and q["load"] == base)["tokens_per_s"] for r in range(args.rounds)]
    ratio = statistics.median(ratios)
    over_phases = [q for q in phases if q["load"] == over]
    lost = sum(q["failed"] for q in phases)
    passed = lost == 0 and all(q["refused"] > 0 for q in over_phases) and all(q["clean"] for q in phases) and ratio >= 0.9
    command = "python benchmarks/reliability/server_overload.py " + " ".join(sys.argv[1:] if argv is None else argv)
    serve = " ".join([f"OMP_NUM_THREADS={args.threads} adaflash serve", *serve_args, "--max-batch", str(args.max_batch)])
    machine = f"{cpu_model()}, {args.threads} threads, fp32 (serve's auto here); the clients on the same cores"
    rows = [[q["round"], q["load"], q["clients"], f"{q['tokens_per_s']:.1f}", q["completed"], q["refused"], q["failed"],
             ", ".join(f"{k} x{v}" for k, v in sorted(q["statuses"].items())), f"{q['leaked_slots']:g}"] for q in phases]
    md = "\n".join([
        "# Overload", "", f"`{command}`", "", f"Server: `{serve}`. Machine: {machine}.", "",
        markdown_table(["round", "load", "clients", "tok/s", "completed", "refused", "lost", "statuses",
                        "slots leaked"], rows, "rlrrrrrlr"), "",
        f"Tokens a second at {over} over the batch limit: **{ratio:.3f}x** (median of rounds: "
        f"{', '.join(f'{x:.3f}' for x in ratios)}; bound >= 0.9). Lost requests: **{lost}**. "
        f"Verdict: {'pass' if passed else '**FAIL**'}.", ""])
    write_report(args.out, {"command": command, "server": serve, "machine": machine, "ratio": ratio,
                            "ratios": ratios, "lost": lost, "passed": passed, "phases": phases}, md)
    print(md)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
