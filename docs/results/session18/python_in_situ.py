"""Batch-1 int8 decode forwards at a 64-token context with the real kernels: the forward's wall time against the time
spent inside its one kernel call (adaflash_decoder_forward); the difference is the Python, ctypes and torch ops
around it as they run in a real step - after the call has streamed ~96 MB of weights through the caches.

    python docs/results/session18/python_in_situ.py
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
inner = []
class Timed:
    def __getattr__(self, n):
        f = getattr(real, n)
        if n == "adaflash_decoder_forward":
            def g(*a):
                t = time.perf_counter(); r = f(*a); inner.append(time.perf_counter() - t); return r
            return g
        return f
packed.library = lambda s=Timed(): s
total = []
for i in range(400):
    t = time.perf_counter()
    m(torch.tensor([123]), RaggedBatch.build([0], [ctx], [1]), cache)
    total.append(time.perf_counter() - t)
    cache.rollback(0, ctx)
T, I = statistics.median(total[50:]), statistics.median(inner[50:])
print(f"forward {1e3*T:.3f} ms, inside the kernel call {1e3*I:.3f} ms, outside {1e3*(T-I):.3f} ms")
