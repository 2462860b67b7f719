"""What a batch-1 decode step costs besides its kernels: the int8 target's forward at a 64-token context with the
whole-layer kernel call and the LM head stubbed out (no arithmetic), so what remains is Python, ctypes and the small
torch ops around them. Median of 3000 steps, then a cProfile of the same loop.

    python docs/results/session17/python_overhead.py
"""
import cProfile, pstats, statistics, time

import torch

from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as

torch.set_num_threads(2)
model = load_target_as(resolve_target("smollm2-135m"), "int8")
context = 64
cache = model.new_cache(1, context + 1)
model(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), cache)
real = packed.library()


class StubbedLayers:
    """The kernel library, but the layer stack's call does nothing."""

    def __getattr__(self, name):
        return (lambda *args: None) if name == "adaflash_decoder_layers" else getattr(real, name)


packed.library = lambda stub=StubbedLayers(): stub
vocab = model.config.vocab_size
model.logits = lambda hidden: torch.empty(hidden.shape[0], vocab)
token = torch.tensor([123])


def steps(n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        model(token, RaggedBatch.build([0], [context], [1]), cache)
        times.append(time.perf_counter() - start)
        cache.rollback(0, context)
    return times


steps(200)
print(f"a decode step's forward without its kernels: {1e6 * statistics.median(steps(3000)):.0f} us (median of 3000; "
      f"int8 target, context {context}, 2 threads)")
profile = cProfile.Profile()
profile.runcall(steps, 3000)
pstats.Stats(profile).sort_stats("tottime").print_stats(12)
