"""The int8 kernel's instruction sets timed alternating in one process, one library (this checkout's, or the build
given), over a model-sized set of weights (SmolLM2-135M's 30 layers x qkv / o / gate_up / down on random GGUF Q4_1
blocks, 66 MB; LAYERS=1: one layer's, 2.2 MB, cache-resident; HEAD=1: its LM head, 49152 x 576 Q8_0, 30 MB); prints the time of one pass over all of them per row count and path, and whether the paths give the
same bits.

    python docs/results/session19/int8_isa_ab.py [ROWS] [REPEATS] [THREADS] [PATHS] [LIB.so]
    PATHS: comma-separated of avx2, avx512-vnni, amx (default avx512-vnni,amx); the first is the baseline
"""
import os, statistics, sys, time

import numpy as np

from adaflash.models.kernels import packed

rows = [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16,64").split(",")]
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 15
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
paths = (sys.argv[4] if len(sys.argv) > 4 else "avx512-vnni,amx").split(",")
lib = packed.open_library(sys.argv[5]) if len(sys.argv) > 5 else packed.library()
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down (n x k)
LAYERS = int(os.environ.get("LAYERS", 30))  # 1: 2.2 MB, cache-resident (the paths' compute alone)
FORMAT = 1  # Q4_1, the layers' format
if os.environ.get("HEAD"):  # the LM head instead: the tied embedding, Q8_0 in the shipped GGUF (30 MB)
    SHAPES, LAYERS, FORMAT = [(49152, 576)], 1, 2
rng = np.random.default_rng(0)
weights = []  # (n, k, packed)
for layer in range(LAYERS):
    for n, k in SHAPES:
        nb = k // 32
        raw = rng.integers(0, 256, (n, nb, 20 if FORMAT == 1 else 34), dtype=np.uint8)
        raw[:, :, 0:2] = np.frombuffer(np.full(n * nb, 0.01, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
        if FORMAT == 1:
            raw[:, :, 2:4] = np.frombuffer(np.full(n * nb, -0.05, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
        buf = np.zeros((n // 16) * nb * lib.adaflash_int8_block_bytes(FORMAT), np.uint8)
        lib.adaflash_pack_int8(raw.ctypes.data, n, k, FORMAT, buf.ctypes.data, threads)
        weights.append((n, k, buf))
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
