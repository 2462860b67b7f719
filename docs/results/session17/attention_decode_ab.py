"""Old vs new attention.cpp builds on a batch-1 decode step's attention: SmolLM2's 9 query / 3 KV heads of 64, all 30
layers one after another, with 2.2 MB of other memory (a layer's int8 weights) read between two layers as a step
does; a MAX_LEN-position slot cache (the server's --max-len). Prints the time of the 30 calls (median over repeats,
builds alternating) and whether both give the same bits.

    g++ -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -std=c++17 -shared -fPIC -o X.so attention.cpp  # each
    python docs/results/session17/attention_decode_ab.py OLD.so NEW.so [CONTEXTS=64,256,1024] [MAX_LEN=2048]
"""
import ctypes, statistics, sys, time

import numpy as np

libs = {"old": ctypes.CDLL(sys.argv[1]), "new": ctypes.CDLL(sys.argv[2])}
contexts = [int(c) for c in (sys.argv[3] if len(sys.argv) > 3 else "64,256,1024").split(",")]
max_len = int(sys.argv[4]) if len(sys.argv) > 4 else 2048
P, I64 = ctypes.c_void_p, ctypes.c_int64
for lib in libs.values():
    lib.adaflash_ragged_attention.argtypes = [P, I64, I64, P, P, I64, I64, I64, P, P, P, ctypes.c_float, P,
                                              ctypes.c_int32]
heads, kv_heads, d, layers = 9, 3, 64, 30
rng = np.random.default_rng(0)
k = rng.standard_normal((layers, 1, kv_heads, max_len, d)).astype(np.float32)
v = rng.standard_normal(k.shape).astype(np.float32)
q = rng.standard_normal((layers, 1, heads, d)).astype(np.float32)
other = np.ones(2_200_000 // 4, np.float32)
token_start, slots = np.array([0, 1], np.int64), np.array([0], np.int64)
for ctx in contexts:
    key_len = np.array([ctx], np.int64)
    outs = {name: np.zeros((layers, heads * d), np.float32) for name in libs}
    times = {name: [] for name in libs}
    for _ in range(40):
        for name, lib in libs.items():
            spent = 0.0
            for layer in range(layers):
                other.sum()  # what the layer's weights do to the caches
                start = time.perf_counter()
                lib.adaflash_ragged_attention(q[layer].ctypes.data, heads, d, k[layer].ctypes.data,
                                              v[layer].ctypes.data, kv_heads, max_len, 1, token_start.ctypes.data,
                                              slots.ctypes.data, key_len.ctypes.data, d ** -0.5,
                                              outs[name][layer].ctypes.data, 2)
                spent += time.perf_counter() - start
            times[name].append(spent)
    old, new = (1e3 * statistics.median(times[n]) for n in ("old", "new"))
    print(f"context {ctx:5d}: old {old:.3f} ms  new {new:.3f} ms (30 layers)  new/old {new / old:.3f}  "
          f"same bits: {np.array_equal(outs['old'], outs['new'])}")
