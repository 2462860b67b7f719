import ctypes, time, statistics, numpy as np, sys
import os
MS = [int(x) for x in os.environ.get("MS", "1,2,3,4,5,8,16,64").split(",")]
REPS = int(os.environ.get("REPS", "20"))
libs = {name: ctypes.CDLL(path) for name, path in zip(("old", "new"), sys.argv[1:3])}
fmt = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rng = np.random.default_rng(0)
for lib in libs.values(): lib.adaflash_int8_block_bytes.restype = ctypes.c_int64
src = 20 if fmt == 1 else 34
for (n, k) in ((960, 576), (576, 576), (3072, 576), (576, 1536)):
    nb = k // 32
    raw = rng.integers(0, 256, (n, nb, src), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.full(n * nb, 0.01, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
    if fmt == 1: raw[:, :, 2:4] = np.frombuffer(np.full(n * nb, -0.05, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
    packed = {}
    for name, lib in libs.items():
        buf = np.zeros((n // 16) * nb * lib.adaflash_int8_block_bytes(fmt), np.uint8)
        lib.adaflash_pack_int8(raw.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n), ctypes.c_int64(k), fmt, buf.ctypes.data_as(ctypes.c_void_p), 2)
        packed[name] = buf
    bias = rng.standard_normal(n).astype(np.float32)
    for m in MS:
        x = rng.standard_normal((m, k)).astype(np.float32)
        t = {name: [] for name in libs}; ys = {}
        for rep in range(REPS):
            for name, lib in libs.items():
                y = np.zeros((m, n), np.float32)
                s = time.perf_counter()
                for _ in range(5):
                    lib.adaflash_int8_linear(x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(m), ctypes.c_int64(k), packed[name].ctypes.data_as(ctypes.c_void_p), fmt, ctypes.c_int64(n), bias.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.c_void_p), 2)
                t[name].append((time.perf_counter() - s) / 5); ys[name] = y
        eq = np.array_equal(ys["old"], ys["new"])
        o, nw = statistics.median(t["old"]) * 1e6, statistics.median(t["new"]) * 1e6
        print(f"n={n} k={k} m={m}: old {o:.0f} us  new {nw:.0f} us  new/old {nw/o:.2f}  new {m*n*k/nw/1e3:.0f} GMAC/s  bitwise equal {eq}", flush=True)
