import time, torch, statistics
from adaflash.pipeline import Pipeline
from adaflash.models.kv_cache import RaggedBatch
p = Pipeline.load('smollm2-135m', None, 'fp32')
t = p.target
ctx = 256
cache = t.new_cache(1, ctx + 32)
t(torch.arange(ctx) + 100, RaggedBatch.build([0], [0], [ctx]), cache)
res = {q: [] for q in (1, 2, 4)}
for rep in range(40):
    for q in res:
        s = time.perf_counter()
        t(torch.arange(q) + 100, RaggedBatch.build([0], [ctx], [q]), cache, (1, 14, 27))
        res[q].append(time.perf_counter() - s)
        cache.rollback(0, ctx)
for q, xs in res.items():
    print(q, f"median {1e3*statistics.median(xs):.2f} ms  min {1e3*min(xs):.2f}  max {1e3*max(xs):.2f}")
