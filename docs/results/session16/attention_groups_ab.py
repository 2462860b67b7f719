"""Old vs new attention.cpp builds: bitwise-equal outputs on ragged batches, and the time of a batch-64 decode step's
attention (one layer) and a 16-token verify's."""
import ctypes, sys, time, statistics, numpy as np
libs = {"old": ctypes.CDLL(sys.argv[1]), "new": ctypes.CDLL(sys.argv[2])}
timing = len(sys.argv) > 3
rng = np.random.default_rng(0)
P = ctypes.c_void_p
def run(lib, q, k, v, token_start, slots, key_len, scale):
    t, heads, d = q.shape; _, kvh, max_len, _ = k.shape
    out = np.zeros((t, heads * d), np.float32)
    lib.adaflash_ragged_attention(q.ctypes.data_as(P), ctypes.c_int64(heads), ctypes.c_int64(d), k.ctypes.data_as(P), v.ctypes.data_as(P),
        ctypes.c_int64(kvh), ctypes.c_int64(max_len), ctypes.c_int64(len(slots)), token_start.ctypes.data_as(P), slots.ctypes.data_as(P),
        key_len.ctypes.data_as(P), ctypes.c_float(scale), out.ctypes.data_as(P), 2)
    return out
def case(heads, kvh, d, nseq, qlens, ctx, max_len):
    k = rng.standard_normal((nseq, kvh, max_len, d)).astype(np.float32); v = rng.standard_normal(k.shape).astype(np.float32)
    q = rng.standard_normal((sum(qlens), heads, d)).astype(np.float32)
    token_start = np.array([0, *np.cumsum(qlens)], np.int64); slots = rng.permutation(nseq).astype(np.int64)
    key_len = np.concatenate([np.arange(c - n + 1, c + 1) for c, n in zip(ctx, qlens)]).astype(np.int64)
    return q, k, v, token_start, slots, key_len, d ** -0.5
ok = True
for heads, kvh, d in ((9, 3, 64), (8, 2, 8), (4, 4, 40), (7, 1, 16), (12, 2, 72), (6, 3, 128)):
    nseq = 5; qlens = [1, 3, 16, 2, 1]; ctx = [1, 9, 300, 17, 64]
    args = case(heads, kvh, d, nseq, qlens, ctx, 320)
    same = np.array_equal(run(libs["old"], *args), run(libs["new"], *args))
    ok &= same
    print(f"heads {heads} kv {kvh} d {d}: bitwise equal {same}")
print("all bitwise equal:", ok)
if timing:
    for name, (nseq, qlens, ctx) in {"batch-64 decode, context 256": (64, [1] * 64, [256] * 64),
                                     "batch-32 decode, context 400": (32, [1] * 32, [400] * 32),
                                     "16-token verify, context 256": (1, [16], [256])}.items():
        args = case(9, 3, 64, nseq, qlens, ctx, 512)
        t = {n: [] for n in libs}
        for rep in range(30):
            for n, lib in libs.items():
                s = time.perf_counter(); run(lib, *args); t[n].append(time.perf_counter() - s)
        o, nw = statistics.median(t["old"]) * 1e3, statistics.median(t["new"]) * 1e3
        print(f"{name}: old {o:.3f} ms  new {nw:.3f} ms  new/old {nw / o:.2f}  (one layer, 2 threads)")
