"""The fp32 target's forward (q tokens at a 256-token context) with kernel library builds alternating in one process:
python fp32_build_ab.py QS REPEATS A.so B.so [...] - each build's library() swapped in turn; ratios to the first."""
import statistics, sys, time
import torch
from adaflash.models import registry
from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.target import load_target_as
qs = [int(q) for q in sys.argv[1].split(",")]
repeats = int(sys.argv[2])
libs = [packed.open_library(p) for p in sys.argv[3:]]
model = load_target_as(registry.resolve_target("smollm2-135m"), "fp32")
ctx = 256
cache = model.new_cache(1, ctx + 16)
model(torch.arange(ctx) % 1000 + 100, RaggedBatch.build([0], [0], [ctx]), cache)
orig = packed.library
t = {(q, i): [] for q in qs for i in range(len(libs))}
outs = {}
for _ in range(repeats):
    for q in qs:
        for i, lib in enumerate(libs):
            packed.library = lambda lib=lib: lib
            s = time.perf_counter()
            out = model(torch.arange(q) + 100, RaggedBatch.build([0], [ctx], [q]), cache)
            t[(q, i)].append(time.perf_counter() - s)
            outs[(q, i)] = out.logits
            cache.rollback(0, ctx)
packed.library = orig
for q in qs:
    med = [statistics.median(t[(q, i)]) for i in range(len(libs))]
    same = all(torch.equal(outs[(q, 0)], outs[(q, i)]) for i in range(len(libs)))
    print(f"q={q:2d}: " + "  ".join(f"{1e3 * m:.2f} ms ({m / med[0]:.3f}x)" for m in med) + f"  same logits: {same}", flush=True)
