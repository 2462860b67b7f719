"""Greedy output must not depend on the run: every length policy x dtype in fresh processes, N runs each, against AR,
with the user cache's measured files present, absent or stale run by run; and each policy's server against the AR
server. adaflash/evaluation/determinism.py says what is varied and why.

    python benchmarks/runtime/determinism.py --runs 20 --dtypes int8 --out docs/results/runtime/determinism_int8
    python benchmarks/runtime/determinism.py --runs 5 --dtypes fp32 --served --out docs/results/runtime/determinism_fp32

The prompts: the held-out (eval split) prompts, --per-domain of each domain (math gsm8k, code humaneval, chat
mt-bench, multilingual mgsm), as the adaptive-vs-AR benchmark takes them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from adaflash.data import load_prompts
from adaflash.evaluation.determinism import SERVED_VARIANTS, VARIANTS, fresh_process_runs, served_runs
from adaflash.models.kernels import packed
from adaflash.models.device.cpu import cpu_model
from adaflash.report import markdown_table, write_report

DOMAINS = {"math": "gsm8k", "code": "humaneval", "chat": "mt-bench", "multilingual": "mgsm"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="fresh processes per variant and dtype")
    p.add_argument("--dtypes", nargs="+", default=["int8", "fp32"], choices=["int8", "fp32"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--per-domain", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--served", action="store_true", help="also each policy's server against the AR server")
    p.add_argument("--out", required=True, help="OUT.json and OUT.md")
    args = p.parse_args(argv)
    prompts = [q.messages for name in DOMAINS.values() for q in load_prompts(name, "eval", limit=args.per_domain)]
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="adaflash-determinism-") as tmp:
        work = Path(tmp)
        prompts_file = work / "prompts.jsonl"
        prompts_file.write_text("".join(json.dumps({"messages": m}) + "\n" for m in prompts))
        runs = fresh_process_runs(prompts_file, [v for v in args.variants if v != "ar"] + ["ar"], args.dtypes,
                                  args.runs, args.max_new_tokens, work, args.threads)
        served = (served_runs(prompts, list(SERVED_VARIANTS), args.dtypes, args.max_new_tokens, work,
                              threads=args.threads) if args.served else None)
    report = {
        "machine": {"cpu": cpu_model(), "int8_isa": packed.int8_isa(),
                    "int8_isa_supported": packed.int8_isa_supported(),
                    "threads": args.threads,
                    "torch": torch.__version__, "python": platform.python_version()},
        "command": "python benchmarks/runtime/determinism.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "runs": args.runs,
        "minutes": round((time.time() - started) / 60, 1), "fresh_process": runs, "served": served,
    }
    rows = []
    for dtype, r in runs.items():
        for variant, per_run in r["variants"].items():
            rows.append([dtype, variant, len(per_run), sum(bool(x["vs_ar"]) for x in per_run),
                         sum(len(x["vs_ar"]) for x in per_run), sum(bool(x["vs_first_run"]) for x in per_run),
                         statistics.median(x["draft_tokens"] for x in per_run),
                         round(statistics.median(x["tokens_per_pass"] for x in per_run), 3)])
    md = [f"# Greedy output across fresh processes ({report['machine']['cpu']}, int8 path "
          f"{report['machine']['int8_isa']}, {args.threads} threads)", "",
          f"`{report['command']}` - {len(prompts)} held-out prompts, {args.max_new_tokens} new tokens; each run its "
          "own process, the cache's cost models and kernel choices present / absent / stale in turn.", "",
          markdown_table(["dtype", "variant", "runs", "runs differing from AR", "prompts differing (all runs)",
                          "runs differing from run 0", "drafts a run (median)", "tokens a pass (median)"], rows,
                         "llrrrrrr")]
    if served:
        md += ["", "## Served (every prompt at once, two rounds; prompts differing from the AR server per round)", "",
               markdown_table(["dtype", "server", "differing prompts per round"],
                              [[d, name, rounds] for d, s in served.items() for name, rounds in s.items()])]
    write_report(args.out, report, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
