"""The kernel library of an older commit against this checkout's, in one process on one model: the target loads
once (its weights packed by this checkout), then 1-token decode steps and 16-token verifies alternate between the two
libraries (every layer runs through the library's whole-stack call; only the LM head stays on this checkout's).
For kernel changes that keep the packed formats and the library's signatures. Prints medians and new / old, and
whether the logits are the same bits.

    python docs/results/session17/library_ab.py OLD_REV [DTYPE=int8] [CONTEXT=64] [STEPS=400] [MAX_LEN=CONTEXT+16]
        [SEQS=1]

SEQS > 1: batched decode steps instead - one new token for each of SEQS sequences at CONTEXT positions (their caches
filled with random keys and values, as a server's decode step at concurrency SEQS).
"""
import statistics, subprocess, sys, tempfile, time
from pathlib import Path

import torch

from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as

rev = sys.argv[1]
dtype = sys.argv[2] if len(sys.argv) > 2 else "int8"
context = int(sys.argv[3]) if len(sys.argv) > 3 else 64
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 400
max_len = int(sys.argv[5]) if len(sys.argv) > 5 else context + 16
seqs = int(sys.argv[6]) if len(sys.argv) > 6 else 1
torch.set_num_threads(2)
tmp = Path(tempfile.mkdtemp())
for src in (*packed.SOURCES, *packed.HEADERS):
    rel = src.relative_to(Path(packed.__file__).parents[3])
    (tmp / src.name).write_bytes(subprocess.run(["git", "show", f"{rev}:{rel}"], check=True, capture_output=True).stdout)
packed.build_library(tmp / "old.so", tuple(tmp / s.name for s in packed.SOURCES))
libs = {"old": packed.open_library(tmp / "old.so"), "new": packed.library()}
model = load_target_as(resolve_target("smollm2-135m"), dtype)
cache = model.new_cache(seqs, max_len)
if seqs == 1:
    model(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), cache)
else:
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.v.normal_(generator=torch.Generator().manual_seed(1))
shapes = (1, 16) if seqs == 1 else (1,)  # new tokens per sequence
times = {(name, q): [] for name in libs for q in shapes}
logits = {}
for i in range(steps):
    for q in shapes:
        if q == 16 and i % 4:
            continue
        for name, lib in libs.items():
            packed.library = lambda lib=lib: lib
            cache.lengths = [context] * seqs
            batch = RaggedBatch.build(list(range(seqs)), [context] * seqs, [q] * seqs)
            start = time.perf_counter()
            logits[name, q] = model(torch.arange(q * seqs) + 123, batch, cache).logits
            times[name, q].append(time.perf_counter() - start)
for q in shapes:
    old, new = (1e3 * statistics.median(times[name, q]) for name in ("old", "new"))
    print(f"{q:2d} token(s) a sequence: old {old:.3f} ms  new {new:.3f} ms  new/old {new / old:.3f}  "
          f"same logits: {torch.equal(logits['old', q], logits['new', q])}")
print(f"old = {rev}, new = this checkout; {dtype}, {seqs} sequence(s) at context {context}, cache of {max_len}, "
      f"2 threads, {steps} rounds")
