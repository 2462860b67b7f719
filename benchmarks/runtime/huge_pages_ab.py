"""Packed weights in huge pages (kernels/weight_arena.py) or each in its own 4 KB-paged allocation
(ADAFLASH_HUGE_PAGES=0 while packing): two copies of the target in one process, 1-token decode steps at a CONTEXT-token
cache alternating between them; prints median ms a step and whether their logits are the same bits.

    python benchmarks/runtime/huge_pages_ab.py [DTYPE=int8] [CONTEXT=64] [STEPS=300]
"""
import os, statistics, sys, time

import torch

from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.registry import resolve_target
from adaflash.models.targets import load_target_as

dtype = sys.argv[1] if len(sys.argv) > 1 else "int8"
context = int(sys.argv[2]) if len(sys.argv) > 2 else 64
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
torch.set_num_threads(2)
models = {}
for name, flag in (("4k", "0"), ("huge", "1")):
    os.environ["ADAFLASH_HUGE_PAGES"] = flag
    models[name] = load_target_as(resolve_target("smollm2-135m"), dtype)
with open("/proc/meminfo") as f:
    print(next(line.strip() for line in f if line.startswith("AnonHugePages")))
caches, times, logits = {}, {name: [] for name in models}, {}
for name, m in models.items():
    caches[name] = m.new_cache(1, context + 1)
    m(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), caches[name])
tok = torch.tensor([123])
for i in range(steps):
    for name, m in models.items():
        start = time.perf_counter()
        logits[name] = m(tok, RaggedBatch.build([0], [context], [1]), caches[name]).logits
        times[name].append(time.perf_counter() - start)
        caches[name].rollback(0, context)
b = models["huge"].streamed_weight_bytes(1)
for name, t in times.items():
    ms = 1000 * statistics.median(t)
    print(f"{name:5s}: {ms:.3f} ms a step, {b / ms / 1e6:.1f} GB/s of weights")
print(f"huge / 4k: {statistics.median(times['huge']) / statistics.median(times['4k']):.3f}; "
      f"same logits: {torch.equal(logits['huge'], logits['4k'])}; {dtype}, context {context}, 2 threads")
