"""Two builds of adaflash/models/kernels/int8_linear.cpp timed alternating in one process on random GGUF blocks of
SmolLM2's linear shapes; asserts nothing but prints whether both give the same bits.

    g++ -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -std=c++17 -shared -fPIC -o OLD.so int8_linear.cpp  # each
    python docs/results/session16/int8_tile_ab.py OLD.so NEW.so FORMAT [ROWS] [SHAPES] [REPEATS]
    FORMAT 1 = Q4_1, 2 = Q8_0; ROWS e.g. 1,2,4,64; SHAPES e.g. 3072x576,576x1536 (n x k)
"""
import ctypes, statistics, sys, time

import numpy as np

libs = {name: ctypes.CDLL(path) for name, path in zip(("old", "new"), sys.argv[1:3])}
fmt = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rows = [int(m) for m in (sys.argv[4] if len(sys.argv) > 4 else "1,2,3,4,5,8,16,64").split(",")]
shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[5] if len(sys.argv) > 5 else "3072x576,576x1536").split(",")]
repeats = int(sys.argv[6]) if len(sys.argv) > 6 else 20
rng = np.random.default_rng(0)
P = ctypes.c_void_p
for lib in libs.values():
    lib.adaflash_int8_block_bytes.restype = ctypes.c_int64
src = 20 if fmt == 1 else 34  # bytes of one GGUF block: Q4_1 d, m, 16 bytes of nibbles; Q8_0 d, 32 int8
for n, k in shapes:
    nb = k // 32
    raw = rng.integers(0, 256, (n, nb, src), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.full(n * nb, 0.01, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
    if fmt == 1:
        raw[:, :, 2:4] = np.frombuffer(np.full(n * nb, -0.05, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
    packed = {}
    for name, lib in libs.items():
        buf = np.zeros((n // 16) * nb * lib.adaflash_int8_block_bytes(fmt), np.uint8)
        lib.adaflash_pack_int8(raw.ctypes.data_as(P), ctypes.c_int64(n), ctypes.c_int64(k), fmt, buf.ctypes.data_as(P), 2)
        packed[name] = buf
    bias = rng.standard_normal(n).astype(np.float32)
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        t = {name: [] for name in libs}
        ys = {}
        for _ in range(repeats):
            for name, lib in libs.items():
                y = np.zeros((m, n), np.float32)
                s = time.perf_counter()
                for _ in range(5):
                    lib.adaflash_int8_linear(x.ctypes.data_as(P), ctypes.c_int64(m), ctypes.c_int64(k),
                                             packed[name].ctypes.data_as(P), fmt, ctypes.c_int64(n),
                                             bias.ctypes.data_as(P), y.ctypes.data_as(P), 2)
                t[name].append((time.perf_counter() - s) / 5)
                ys[name] = y
        o, nw = statistics.median(t["old"]) * 1e6, statistics.median(t["new"]) * 1e6
        print(f"n={n} k={k} m={m}: old {o:.0f} us  new {nw:.0f} us  new/old {nw / o:.2f}  new {m * n * k / nw / 1e3:.0f} "
              f"GMAC/s  bitwise equal {np.array_equal(ys['old'], ys['new'])}", flush=True)
