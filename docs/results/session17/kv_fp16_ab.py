"""The int8 target's KV cache in fp16 (now) or fp32 (before): one model, two caches holding the same random keys and
values (fp16 = the fp32 values rounded), decode steps alternating between them. Batch 1 at several contexts, and
batched steps of S sequences at once (a server's decode step at concurrency S). Prints medians and fp16 / fp32.

    python docs/results/session17/kv_fp16_ab.py [REPEATS=30]
"""
import statistics, sys, time

import torch

from adaflash.models.kv_cache import KVCache, RaggedBatch
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 30
torch.set_num_threads(2)
model = load_target_as(resolve_target("smollm2-135m"), "int8")
c = model.config
g = torch.Generator().manual_seed(0)
print(f"int8 target, 2 threads, {repeats} repeats; ms a step (median), fp16 / fp32")
for seqs, context in ((1, 64), (1, 256), (1, 1024), (32, 400), (64, 256)):
    caches = {}
    for dtype in (torch.float32, torch.float16):
        cache = KVCache(c.num_layers, seqs, context + 1, c.num_kv_heads, c.head_dim, dtype)
        caches[dtype] = cache
    for name in ("k", "v"):
        values = torch.randn(getattr(caches[torch.float32], name).shape, generator=g)
        getattr(caches[torch.float32], name).copy_(values.half().float())
        getattr(caches[torch.float16], name).copy_(values.half())
    batch = RaggedBatch.build(list(range(seqs)), [context] * seqs, [1] * seqs)
    tokens = torch.arange(seqs) + 100
    times = {dtype: [] for dtype in caches}
    for _ in range(repeats):
        for dtype, cache in caches.items():
            cache.lengths = [context] * seqs
            start = time.perf_counter()
            model(tokens, batch, cache)
            times[dtype].append(time.perf_counter() - start)
    f32, f16 = (1e3 * statistics.median(times[d]) for d in (torch.float32, torch.float16))
    print(f"{seqs:3d} sequence(s) x context {context:5d}: fp32 cache {f32:8.3f} ms  fp16 cache {f16:8.3f} ms  "
          f"fp16 / fp32 {f16 / f32:.3f}")
