"""The int8 target's batch-1 forward with its kernel calls stubbed out (what is left: Python, ctypes and small torch
ops), warm (steps back to back) against cold (each step after a 96 MB streaming read, as a real step's weights pass
through the caches), alternating in one process.

    python docs/results/session18/python_cold.py
"""
import statistics, time, torch
from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as
torch.set_num_threads(2)
m = load_target_as(resolve_target("smollm2-135m"), "int8")
ctx = 64
cache = m.new_cache(1, ctx + 1)
m(torch.arange(ctx) % 1000 + 100, RaggedBatch.build([0], [0], [ctx]), cache)
real = packed.library()
class Stub:
    def __getattr__(self, n):
        if n in ("adaflash_decoder_forward",):
            return lambda *a: 0
        if n == "adaflash_int8_linear":
            return lambda *a: None
        return getattr(real, n)
packed.library = lambda s=Stub(): s
buf = torch.ones(96 * 2**20 // 4)
lib = real
res = {"warm": [], "cold": []}
for i in range(600):
    for mode in ("warm", "cold"):
        if mode == "cold":
            lib.adaflash_stream_read(buf.data_ptr(), buf.numel() * 4, 2)
        t = time.perf_counter()
        m(torch.tensor([123]), RaggedBatch.build([0], [ctx], [1]), cache)
        res[mode].append(time.perf_counter() - t)
        cache.rollback(0, ctx)
for k, v in res.items():
    print(f"{k}: {1e6 * statistics.median(v[50:]):.0f} us")
