"""Builds of the kernel library timed alternating in one process on the int8 linear over a model-sized set of weights
(as int8_isa_ab.py: SmolLM2-135M's 30 layers of random Q4_1 blocks, 66 MB; LAYERS=N for N layers, HEAD=1 for its
Q8_0 LM head); each build on its best path. Prints one pass's time per build and row count, as a ratio to the first
build, and whether all give the same bits.

    python docs/results/session19/int8_build_ab.py ROWS REPEATS THREADS BASE.so OTHER.so [...]
"""
import statistics, sys, time

import numpy as np

from adaflash.models.kernels import packed
from int8_weight_set import FORMAT, SHAPES, packed_weights

rows = [int(m) for m in sys.argv[1].split(",")]
repeats, threads = int(sys.argv[2]), int(sys.argv[3])
paths = sys.argv[4:]
libs = [packed.open_library(p) for p in paths]
weights = packed_weights(libs, threads)  # (n, k, [packed per build])
rng = np.random.default_rng(1)  # the activations
total = sum(w[2][0].nbytes for w in weights)
print(f"{len(weights)} weights, {total / 1e6:.1f} MB packed, {threads} threads; builds: {', '.join(paths)}")
for m in rows:
    xs = {k: rng.standard_normal((m, k)).astype(np.float32) for _, k in SHAPES}
    outs = [[np.zeros((m, n), np.float32) for n, _, _ in weights] for _ in libs]
    t = [[] for _ in libs]
    for _ in range(repeats):
        for i, lib in enumerate(libs):
            calls = [(xs[k].ctypes.data, k, bufs[i].ctypes.data, n, y.ctypes.data)
                     for (n, k, bufs), y in zip(weights, outs[i])]
            start = time.perf_counter()
            for x, k, w, n, y in calls:
                lib.adaflash_int8_linear(x, m, k, w, FORMAT, n, None, y, threads)
            t[i].append(time.perf_counter() - start)
    med = [statistics.median(v) for v in t]
    same = all(all(np.array_equal(a, b) for a, b in zip(outs[0], o)) for o in outs[1:])
    print(f"rows {m:3d}: " + "  ".join(f"{1e3 * v:.3f} ms ({total / v / 1e9:.1f} GB/s, {v / med[0]:.3f}x)" for v in med)
          + f"  same bits: {same}")
