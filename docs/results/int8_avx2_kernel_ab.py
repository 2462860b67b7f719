"""Two builds of adaflash/models/kernels (OLD.so NEW.so, from ~/.cache/adaflash/kernels/) timed on the int8 kernel,
alternating in one process, on random Q4_1 blocks of SmolLM2 shapes; asserts both give the same bits."""
import ctypes, time, statistics, numpy as np, sys, glob, os

old, new = ctypes.CDLL(sys.argv[1]), ctypes.CDLL(sys.argv[2])  # two builds of kernels/*.cpp
rng = np.random.default_rng(0)
def q4_1_blocks(n, k):
    nb = k // 32
    raw = np.zeros((n, nb, 20), np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.full(n * nb, 0.01, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
    raw[:, :, 2:4] = np.frombuffer(np.full(n * nb, -0.05, np.float16).tobytes(), np.uint8).reshape(n, nb, 2)
    raw[:, :, 4:] = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    return raw
res = {}
for (n, k) in ((1536 * 2, 576), (576, 1536)):
    raw = q4_1_blocks(n, k)
    for lib in (old, new):
        pass
    packed = {}
    for name, lib in (("old", old), ("new", new)):
        lib.adaflash_int8_block_bytes.restype = ctypes.c_int64
        bb = lib.adaflash_int8_block_bytes(1)
        buf = np.zeros((n // 16) * (k // 32) * bb, np.uint8)
        lib.adaflash_pack_int8(raw.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n), ctypes.c_int64(k), 1, buf.ctypes.data_as(ctypes.c_void_p), 2)
        packed[name] = buf
    for m in (1, 2, 4, 16, 64):
        x = rng.standard_normal((m, k)).astype(np.float32)
        ys = {}
        t = {"old": [], "new": []}
        for rep in range(30):
            for name, lib in (("old", old), ("new", new)):
                y = np.zeros((m, n), np.float32)
                s = time.perf_counter()
                for _ in range(5):
                    lib.adaflash_int8_linear(x.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(m), ctypes.c_int64(k), packed[name].ctypes.data_as(ctypes.c_void_p), 1, ctypes.c_int64(n), None, y.ctypes.data_as(ctypes.c_void_p), 2)
                t[name].append((time.perf_counter() - s) / 5)
                ys[name] = y
        assert np.array_equal(ys["old"], ys["new"])
        o, nw = statistics.median(t["old"]) * 1e6, statistics.median(t["new"]) * 1e6
        print(f"n={n} k={k} m={m}: old {o:.0f} us  new {nw:.0f} us  new/old {nw/o:.2f}  (outputs bitwise equal)")
