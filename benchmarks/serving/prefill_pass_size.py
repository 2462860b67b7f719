"""Prefill throughput by pass size: the first 64 distinct six-mix prompts (int8 target) prefilled into a 64-slot cache
as one pass of 64 prompts, or passes of 16, 8 or 4 prompts (about 1900 / 960 / 480 tokens), alternating 4 times;
median seconds for all 64 and prompt tokens a second. What Engine(max_prefill_tokens=...) caps.

    python benchmarks/serving/prefill_pass_size.py
"""
import statistics, time

import torch

from adaflash.cli_args import set_threads

set_threads(None)
from adaflash.evaluation.serve_sweep import _fitting, prompt_pool  # noqa: E402
from adaflash.models.kv_cache import RaggedBatch  # noqa: E402
from adaflash.pipeline import Pipeline  # noqa: E402

p = Pipeline.load("smollm2-135m", None, "int8", None)
ids = [p.encode(messages=m) for m in _fitting(prompt_pool("six-mix"), "smollm2-135m", 384)[:64]]
model, cache = p.target, p.target.new_cache(64, 512)


def prefill(group: range) -> None:
    for i in group:
        cache.lengths[i] = 0
    batch = RaggedBatch.build(list(group), [0] * len(group), [len(ids[i]) for i in group])
    model(torch.tensor([t for i in group for t in ids[i]]), batch, cache, logit_indices=batch.last_token_indices())


sizes = (64, 16, 8, 4)
times = {size: [] for size in sizes}
for _ in range(4):
    for size in sizes:
        start = time.perf_counter()
        for g0 in range(0, 64, size):
            prefill(range(g0, g0 + size))
        times[size].append(time.perf_counter() - start)
tokens = sum(map(len, ids))
print(f"64 prompts, {tokens} tokens; int8 target, 2 threads")
for size in sizes:
    t = statistics.median(times[size])
    print(f"passes of {size:2d} prompts (~{tokens * size // 64} tokens): {t:.2f} s, {tokens / t:.0f} tok/s  "
          f"runs {[round(x, 2) for x in times[size]]}")
