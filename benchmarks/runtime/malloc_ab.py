"""Prefill passes (int8 target) with glibc's default malloc thresholds vs adaflash.models.allocator's (large freed
buffers kept in the heap), one process per setting: python malloc_ab.py {default|keep} B L N"""
import ctypes, statistics, sys, time, resource
mode = sys.argv[1]
if mode == "keep":
    from adaflash.models.allocator import keep_freed_buffers
    assert keep_freed_buffers()
import torch
from adaflash.models import registry
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.targets import load_target_as
model = load_target_as(registry.resolve_target("smollm2-135m"), "int8")
B, L, N = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cache = model.new_cache(B, L + 4)
wall, faults = [], []
for _ in range(N):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    model(torch.arange(B * L) % 1000 + 100, RaggedBatch.build(list(range(B)), [0] * B, [L] * B), cache, logit_indices=torch.arange(B) * L + L - 1)
    wall.append(time.perf_counter() - t)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    for s in range(B): cache.rollback(s, 0)
print(f"{mode} prefill {B}x{L}: median {1e3*statistics.median(wall[1:]):.0f} ms ({B*L/statistics.median(wall[1:]):.0f} tok/s), minor faults/pass {statistics.median(faults[1:])}, rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss//1024} MB", flush=True)
