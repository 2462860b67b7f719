"""A batch-1 target forward (--dtype int8) appending q tokens to a 256-token context, timed alternating with and
without logits and per int8 instruction set (best / AVX512-VNNI only), in one process: what the LM head and the
linears' path cost at each q.

    python docs/results/session19/verify_pieces.py [REPEATS] [CONTEXT]
"""
import statistics, sys, time

import torch

from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
context = int(sys.argv[2]) if len(sys.argv) > 2 else 256
model = load_target_as(resolve_target("smollm2-135m"), "int8")
cache = model.new_cache(1, context + 16)
model(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), cache)
best = packed.int8_isa()
paths = [best] + (["avx512-vnni"] if best == "amx" else [])
print(f"{packed.cpu_model() if hasattr(packed, 'cpu_model') else ''} threads {torch.get_num_threads()}, best int8 path "
      f"{best}, context {context}, medians of {repeats}")
times = {}
for _ in range(repeats):
    for q in (1, 2, 4, 8, 16):
        for isa in paths:
            for logits in (True, False):
                with packed.int8_isa_limit(isa):
                    t = time.perf_counter()
                    model(torch.arange(q) + 100, RaggedBatch.build([0], [context], [q]), cache, compute_logits=logits)
                    times.setdefault((q, isa, logits), []).append(time.perf_counter() - t)
                cache.rollback(0, context)
print("| q | " + " | ".join(f"{isa} forward ms | {isa} without logits ms" for isa in paths) + " |")
print("|---|" + "---|---|" * len(paths))
one = {isa: statistics.median(times[(1, isa, True)]) for isa in paths}
for q in (1, 2, 4, 8, 16):
    cells = []
    for isa in paths:
        full, bare = (1e3 * statistics.median(times[(q, isa, lg)]) for lg in (True, False))
        cells += [f"{full:.2f} ({full / 1e3 / one[isa]:.2f}x q=1)", f"{bare:.2f}"]
    print(f"| {q} | " + " | ".join(cells) + " |")
