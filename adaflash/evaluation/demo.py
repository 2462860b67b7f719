"""`adaflash demo`: AR vs DFlash speculative decoding on a few chat, code and math prompts.

Checks that both methods produce identical tokens (greedy) and prints tokens/s, accept length and speedup.
"""

from __future__ import annotations

import statistics
import sys
from tqdm import tqdm

from adaflash.models.registry import shipped_drafter
from adaflash.pipeline import Pipeline

DEMO_PROMPTS = [
    ("chat", "Give me three tips for staying focused while working from home."),
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("math", "A shop sells pencils at 3 for $1. How much do 12 pencils cost? Explain step by step."),
]

def run_demo(model: str, drafter: str | None, dtype: str, max_new_tokens: int) -> int:
    shipped = shipped_drafter(model)
    if drafter is None and shipped is not None:
        drafter = str(shipped)
    pipeline = Pipeline.load(model, drafter, dtype)
    if pipeline.proposer is None:
        print(
            "NOTE: no trained drafter is available for this target yet; using an UNTRAINED (random) drafter.\n"
            "      Output stays identical to AR (lossless), but almost nothing is accepted, so expect a slowdown.",
            file=sys.stderr,
        )
        pipeline = pipeline.with_untrained_drafter()
    else:
        print(f"drafter: {drafter}", file=sys.stderr)
    print(f"target: {model} ({pipeline.target.dtype}), max_new_tokens={max_new_tokens}", file=sys.stderr)

    rows, all_identical = [], True
    with tqdm(total=2 * len(DEMO_PROMPTS), desc="demo", unit="run", file=sys.stderr) as bar:
        for domain, text in DEMO_PROMPTS:
            ids = pipeline.encode(messages=[{"role": "user", "content": text}])
            results = {}
            for method in ("ar", "dflash"):
                bar.set_postfix_str(f"{domain}/{method}")
                results[method] = pipeline.complete(ids, method=method, max_new_tokens=max_new_tokens)
                bar.update(1)
            identical = results["ar"].token_ids == results["dflash"].token_ids
            all_identical &= identical
            ar, spec = results["ar"].stats, results["dflash"].stats
            rows.append((domain, ar["tokens_per_s"], spec["tokens_per_s"], spec["accept_len_mean"], identical))

    print(f"\n{'domain':<7}{'AR tok/s':>10}{'DFlash tok/s':>14}{'accept len':>12}{'speedup':>9}  identical")
    for domain, ar_tps, spec_tps, accept, identical in rows:
        print(f"{domain:<7}{ar_tps:>10.1f}{spec_tps:>14.1f}{accept:>12.2f}{spec_tps / ar_tps:>8.2f}x  {'yes' if identical else 'NO'}")
    speedups = [r[2] / r[1] for r in rows]
    print(f"median speedup {statistics.median(speedups):.2f}x; outputs identical: {'yes' if all_identical else 'NO'}")
    return 0 if all_identical else 1
