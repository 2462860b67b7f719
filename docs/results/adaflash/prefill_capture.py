"""The engine's path against the reference AR loop on code prompts at batch 1 (int8, 1 thread): the same generation
timed both ways, alternating, prefill alone (1 new token) and 96 new tokens. The engine (`fixed:0`: a drafter loaded,
never drafting) also captures the drafter's target features at every prompt position.

    .venv/bin/python docs/results/adaflash/prefill_capture.py > docs/results/adaflash/prefill_capture.txt
"""

import statistics

from adaflash.cli_args import configure_process
from adaflash.data import load_prompts
from adaflash.models.kernels.selection import cpu_model
from adaflash.models.registry import shipped_drafter
from adaflash.pipeline import Pipeline

configure_process(1, "cpu")
ar = Pipeline.load("smollm2-135m", shipped_drafter("smollm2-135m", "dflash"), "int8")
engine = ar.with_length_policy("fixed:0")
prompts = [ar.encode(messages=q.messages) for q in load_prompts("humaneval", "eval", limit=6)]
print(f"{cpu_model()}, 1 thread, int8; humaneval eval prompts of {[len(p) for p in prompts]} tokens, 3 rounds")
for new_tokens in (1, 96):
    times = {"ar": [], "engine fixed:0": []}
    for _ in range(3):
        for ids in prompts:
            times["ar"].append(ar.generate_ids(ids, "ar", max_new_tokens=new_tokens).stats.elapsed_s)
            times["engine fixed:0"].append(engine.generate_ids(ids, "dflash", max_new_tokens=new_tokens).stats.elapsed_s)
    ratio = statistics.median(e / a for e, a in zip(times["engine fixed:0"], times["ar"]))
    medians = ", ".join(f"{k} {1e3 * statistics.median(v):.1f} ms" for k, v in times.items())
    print(f"{new_tokens:>3} new tokens: {medians}; engine / ar time (median of per-prompt ratios) {ratio:.3f}")
