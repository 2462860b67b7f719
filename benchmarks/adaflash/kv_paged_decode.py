"""Batch-1 decode on the paged KV cache against the contiguous slot cache it replaced, one run, alternating.

    python benchmarks/adaflash/kv_paged_decode.py --baseline-rev d41080e~1 --rounds 3 \
        --out docs/results/adaflash/kv_paged_decode

The baseline is a checkout of `--baseline-rev` (a git worktree under runs/), each arm a fresh Python process on its
own tree (PYTHONPATH), the arms alternating, so both see the same machine drift. An arm loads the model, prefills a
real prompt, then times `--tokens` greedy decode steps (autoregressive_generate's loop: one target pass a token,
prefill excluded) and reports tokens a second; the outputs of both arms must be the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run inside each arm's tree: the same code, whichever cache that tree has.
ARM = r"""
import json, sys, time, torch
from adaflash.pipeline import Pipeline
from adaflash.models.kv_cache.ragged import RaggedBatch
model, dtype, tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
p = Pipeline.load(model, None, dtype)
target = p.target
ids = p.encode(messages=[{"role": "user", "content": "Write a Python function that parses an ISO 8601 date and "
                          "explain each step of it."}])
with torch.inference_mode():
    best = None
    for _ in range(2):  # the first run warms the kernels' buffers
        cache = target.new_cache(1, len(ids) + tokens + 1)
        out = target(torch.tensor(ids), RaggedBatch.build([0], [0], [len(ids)]), cache,
                     logit_indices=torch.tensor([len(ids) - 1]))
        token, produced = int(out.logits[-1].argmax()), []
        start = time.perf_counter()
        for i in range(tokens):
            produced.append(token)
            logits = target(torch.tensor([token]), RaggedBatch.build([0], [len(ids) + i], [1]), cache).logits
            token = int(logits[-1].argmax())
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
print(json.dumps({"tok_s": tokens / best, "tokens": produced, "prompt": len(ids)}))
"""


WHAT = "batch-1 decode on the paged KV cache against the contiguous slot cache it replaced (one run, alternating)"


def headline(rows: list[dict]) -> str:
    return "; ".join(f"{r['model']} ({r['dtype']}) {r['paged_over_contiguous']:.3f}x the contiguous cache's tok/s, "
                     f"{'same' if r['same_tokens'] else 'DIFFERENT'} tokens" for r in rows)


def run_arm(tree: Path, model: str, dtype: str, tokens: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", ARM, model, dtype, str(tokens), str(threads)], env=env, cwd=tree,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_tree(rev: str) -> Path:
    tree = ROOT / "runs" / "baseline-tree"
    if tree.exists():
        subprocess.run(["git", "-C", str(tree), "checkout", "-q", "--detach", rev], check=True)
    else:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    return tree


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-rev", required=True, help="the commit with the contiguous slot cache")
    p.add_argument("--models", default="smollm2-135m:auto,qwen2.5-coder-1.5b:int8", help="MODEL:DTYPE,...")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    from adaflash.models.device.cpu import cpu_model
    from adaflash.report import markdown_table, write_json

    trees = {"contiguous": baseline_tree(args.baseline_rev), "paged": ROOT}
    rows, runs = [], {}
    for spec in args.models.split(","):
        model, dtype = spec.split(":")
        seen = {arm: [] for arm in trees}
        outputs = {}
        for _ in range(args.rounds):
            for arm, tree in trees.items():  # alternating
                result = run_arm(tree, model, dtype, args.tokens, args.threads)
                seen[arm].append(result["tok_s"])
                outputs[arm] = result["tokens"]
                print(f"{model} {arm}: {result['tok_s']:.2f} tok/s", flush=True)
        medians = {arm: statistics.median(v) for arm, v in seen.items()}
        runs[spec] = seen
        rows.append({"model": model, "dtype": dtype, "contiguous_tok_s": round(medians["contiguous"], 2),
                     "paged_tok_s": round(medians["paged"], 2),
                     "paged_over_contiguous": round(medians["paged"] / medians["contiguous"], 4),
                     "same_tokens": outputs["paged"] == outputs["contiguous"]})
    command = "python benchmarks/adaflash/kv_paged_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = f"{cpu_model()}, {args.threads} threads"
    write_json({"what": WHAT, "headline": headline(rows), "command": command, "machine": machine,
                "tokens": args.tokens, "rounds": args.rounds, "rows": rows, "runs": runs}, args.out.with_suffix(".json"))
    table = markdown_table(["model", "dtype", "contiguous tok/s", "paged tok/s", "paged / contiguous", "same tokens"],
                           [[r["model"], r["dtype"], r["contiguous_tok_s"], r["paged_tok_s"],
                             f"{r['paged_over_contiguous']:.3f}x", r["same_tokens"]] for r in rows])
    args.out.with_suffix(".md").write_text(
        f"# Batch-1 decode: paged KV cache vs the contiguous slot cache\n\n`{command}`\n\nMachine: {machine}. "
        f"{args.tokens} greedy decode steps after a chat prompt (prefill excluded), best of two runs in each process, "
        f"median of {args.rounds} processes an arm, arms alternating.\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
