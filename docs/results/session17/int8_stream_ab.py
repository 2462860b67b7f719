"""Two builds of adaflash/models/kernels/int8_linear.cpp timed alternating in one process over a model-sized set of
weights (SmolLM2-135M's 30 layers x qkv / o / gate_up / down on random GGUF Q4_1 blocks, 66 MB: far past the L3, so
every call streams its weight from memory as in a decode step); prints the time of one pass over all of them per row
count and whether both builds give the same bits.

    g++ -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -std=c++17 -shared -fPIC -o OLD.so int8_linear.cpp  # each
    python docs/results/session17/int8_stream_ab.py OLD.so NEW.so [ROWS] [REPEATS] [THREADS]
"""
import ctypes, statistics, sys, time

import numpy as np

libs = {name: ctypes.CDLL(path) for name, path in zip(("old", "new"), sys.argv[1:3])}
rows = [int(m) for m in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4").split(",")]
repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 15
threads = int(sys.argv[5]) if len(sys.argv) > 5 else 2
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down (n x k)
LAYERS = 30
rng = np.random.default_rng(0)
P, I64 = ctypes.c_void_p, ctypes.c_int64
for lib in libs.values():
    lib.adaflash_int8_block_bytes.restype = I64
    lib.adaflash_int8_linear.argtypes = [P, I64, I64, P, ctypes.c_int32, I64, P, P, ctypes.c_int32]
weights = []  # (n, k, {build: packed})
for layer in range(LAYERS):
    for n, k in SHAPES:
        nb = k // 32
        raw = rng.integers(0, 256, (n, nb, 20), dtype=np.uint8)
        raw[:, :, 0:2] = np.frombuffer(np.full(n * nb, 0.01, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
        raw[:, :, 2:4] = np.frombuffer(np.full(n * nb, -0.05, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
        packed = {}
        for name, lib in libs.items():
            buf = np.zeros((n // 16) * nb * lib.adaflash_int8_block_bytes(1), np.uint8)
            lib.adaflash_pack_int8(raw.ctypes.data_as(P), I64(n), I64(k), 1, buf.ctypes.data_as(P), threads)
            packed[name] = buf
        weights.append((n, k, packed))
total_bytes = sum(p["new"].nbytes for _, _, p in weights)
print(f"{len(weights)} weights, {total_bytes / 1e6:.1f} MB packed, {threads} threads")
for m in rows:
    xs = {k: rng.standard_normal((m, k)).astype(np.float32) for _, k in SHAPES}
    outs = {name: [np.zeros((m, n), np.float32) for n, _, _ in weights] for name in libs}
    calls = {name: [(xs[k].ctypes.data, k, packed[name].ctypes.data, n, y.ctypes.data)
                    for (n, k, packed), y in zip(weights, outs[name])] for name in libs}
    t = {name: [] for name in libs}
    for _ in range(repeats):
        for name, lib in libs.items():
            start = time.perf_counter()
            for x, k, w, n, y in calls[name]:
                lib.adaflash_int8_linear(x, m, k, w, 1, n, None, y, threads)
            t[name].append(time.perf_counter() - start)
    same = all(np.array_equal(a, b) for a, b in zip(outs["old"], outs["new"]))
    old, new = statistics.median(t["old"]), statistics.median(t["new"])
    print(f"rows {m:3d}: old {1e3 * old:.3f} ms ({total_bytes / old / 1e9:.1f} GB/s)  new {1e3 * new:.3f} ms "
          f"({total_bytes / new / 1e9:.1f} GB/s)  new/old {new / old:.3f}  same bits: {same}")
