"""The ragged attention kernel of two builds of the kernel library, alternating call by call in one process, on
SmolLM2-135M's shapes (9 query heads, 3 KV heads, d = 64) over an fp16 cache (the int8 target's): T new tokens per
sequence (causal) over ctx cached keys, for `seqs` sequences. With LAYERS = 1 one K/V layer is called again and again
and stays cache-resident: the kernel's arithmetic and threading; LAYERS = 30 cycles over 30 layers as a model step
does, so long caches stream from memory. Prints each build's median time of one layer's call and whether both give
the same bits. CASES="T:ctx:seqs,..." picks cases.

    python docs/results/session18/build_library.py OLD.so REV   # e.g. ecd55d0 (before session 18)
    python docs/results/session18/build_library.py NEW.so       # this checkout
    python docs/results/session18/attention_ab.py OLD.so NEW.so [THREADS=2] [LAYERS=1]
"""
import ctypes, os, statistics, sys, time
from pathlib import Path
import torch
from adaflash.models.kernels import packed as pk
libs = {n: pk.open_library(Path(p)) for n, p in zip(("old", "new"), sys.argv[1:3])}
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
layers = int(sys.argv[4]) if len(sys.argv) > 4 else 1  # > 1: cycle over that many K/V layers (30: from memory)
H, KVH, d = 9, 3, 64
cases = [(1, 64, 1), (1, 256, 1), (1, 1024, 1), (1, 2048, 1), (2, 1024, 1), (4, 1024, 1), (16, 256, 1), (16, 1024, 1),
         (16, 2048, 1), (400, 0, 1), (1, 256, 4), (1, 400, 32), (1, 256, 64), (4, 400, 16)]
if os.environ.get("CASES"):
    cases = [tuple(int(x) for x in c.split(":")) for c in os.environ["CASES"].split(",")]
g = torch.Generator().manual_seed(0)
for T, ctx, seqs in cases:
    L = ctx + T
    kv = [(torch.randn(seqs, KVH, L, d, generator=g).half(), torch.randn(seqs, KVH, L, d, generator=g).half())
          for _ in range(layers)]
    q = torch.randn(seqs * T, H, d, generator=g)
    ts = torch.arange(seqs + 1) * T; slots = torch.arange(seqs)
    kl = torch.tensor([ctx + t + 1 for s in range(seqs) for t in range(T)])
    outs = {n: torch.empty(seqs * T, H * d) for n in libs}
    def call(n, layer=0):
        k, v = kv[layer]
        libs[n].adaflash_ragged_attention(q.data_ptr(), H, d, k.data_ptr(), v.data_ptr(), KVH, L, seqs, ts.data_ptr(),
            slots.data_ptr(), kl.data_ptr(), ctypes.c_float(d ** -0.5), outs[n].data_ptr(), threads, 1)
    times = {n: [] for n in libs}
    reps = 60 if T * ctx * seqs < 20000 else 20
    for _ in range(reps):
        for n in libs:  # one pass over the layers, timed per call
            for layer in range(layers):
                t0 = time.perf_counter(); call(n, layer); times[n].append(time.perf_counter() - t0)
    o, nw = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"T={T:3d} ctx={ctx:5d} seqs={seqs:2d}: old {o*1e6:8.1f} us  new {nw*1e6:8.1f} us  new/old {nw/o:.3f}  "
          f"same bits: {torch.equal(outs['old'], outs['new'])}", flush=True)
