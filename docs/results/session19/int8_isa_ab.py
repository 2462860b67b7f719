"""The int8 kernel's instruction sets timed alternating in one process, one library (this checkout's, or the build
given), over a model-sized set of weights (int8_weight_set.py: SmolLM2-135M's layers as random Q4_1 blocks, 66 MB;
LAYERS=N, HEAD=1); prints the time of one pass over all of them per row count and path, and whether the paths give
the same bits.

    python docs/results/session19/int8_isa_ab.py [ROWS] [REPEATS] [THREADS] [PATHS] [LIB.so]
    PATHS: comma-separated of avx2, avx512-vnni, amx (default avx512-vnni,amx); the first is the baseline
"""
import statistics, sys, time

import numpy as np

from adaflash.models.kernels import packed
from int8_weight_set import FORMAT, SHAPES, packed_weights

rows = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16,64").split(",")]
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 15
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
paths = (sys.argv[4] if len(sys.argv) > 4 else "avx512-vnni,amx").split(",")
lib = packed.open_library(sys.argv[5]) if len(sys.argv) > 5 else packed.library()
weights = [(n, k, bufs[0]) for n, k, bufs in packed_weights([lib], threads)]  # (n, k, packed)
rng = np.random.default_rng(1)  # the activations
total_bytes = sum(p.nbytes for _, _, p in weights)
print(f"{len(weights)} weights, {total_bytes / 1e6:.1f} MB packed, {threads} threads, best path here: "
      f"{packed.INT8_ISAS[lib.adaflash_int8_isa()]}")
for m in rows:
    xs = {k: rng.standard_normal((m, k)).astype(np.float32) for _, k in SHAPES}
    outs = {isa: [np.zeros((m, n), np.float32) for n, _, _ in weights] for isa in paths}
    t = {isa: [] for isa in paths}
    for _ in range(repeats):
        for isa in paths:
            lib.adaflash_int8_limit_isa(packed.INT8_ISAS.index(isa))
            calls = [(xs[k].ctypes.data, k, w.ctypes.data, n, y.ctypes.data) for (n, k, w), y in zip(weights, outs[isa])]
            start = time.perf_counter()
            for x, k, w, n, y in calls:
                lib.adaflash_int8_linear(x, m, k, w, FORMAT, n, None, y, threads)
            t[isa].append(time.perf_counter() - start)
    lib.adaflash_int8_limit_isa(len(packed.INT8_ISAS) - 1)
    base = statistics.median(t[paths[0]])
    line = "  ".join(f"{isa} {1e3 * statistics.median(t[isa]):.3f} ms ({total_bytes / statistics.median(t[isa]) / 1e9:.1f} GB/s,"
                     f" {statistics.median(t[isa]) / base:.3f}x)" for isa in paths)
    same = all(all(np.array_equal(a, b) for a, b in zip(outs[paths[0]], outs[isa])) for isa in paths[1:])
    print(f"rows {m:3d}: {line}  same bits: {same}")
