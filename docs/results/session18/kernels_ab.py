"""An older commit's kernel library against this checkout's, in one process on one loaded target, steps alternating:
batch-1 decode steps and 16-token verifies (SEQS = 1) or batched decode steps of SEQS sequences. Both run the forward
as it was before session 18's one-call forward (embedding, the layer-stack call, final norm and LM head from Python),
so only the kernels differ; prints medians, new / old, and whether the logits are the same bits.

    python docs/results/session18/kernels_ab.py OLD_REV [CONTEXT=64] [STEPS=300] [SEQS=1]
"""
import statistics, subprocess, sys, tempfile, time
from pathlib import Path

import torch

from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedAttention, RaggedBatch
from adaflash.models.layers import rms_norm, rope_cos_sin
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as

rev = sys.argv[1]
context = int(sys.argv[2]) if len(sys.argv) > 2 else 64
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 300
seqs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
torch.set_num_threads(2)
tmp = Path(tempfile.mkdtemp())
root = Path(packed.__file__).parents[3]
for src in (*packed.SOURCES, *packed.HEADERS):
    show = subprocess.run(["git", "show", f"{rev}:{src.relative_to(root)}"], check=True, capture_output=True)
    (tmp / src.name).write_bytes(show.stdout)
packed.build_library(tmp / "old.so", tuple(tmp / s.name for s in packed.SOURCES))
libs = {"old": packed.open_library(tmp / "old.so"), "new": packed.library()}
model = load_target_as(resolve_target("smollm2-135m"), "int8")
cfg = model.config


@torch.inference_mode()
def forward(ids, batch, cache):
    """TargetModel.forward before session 18 (the layer stack via LayerSteps.run, the head from Python)."""
    attention = RaggedAttention(batch, causal=True, ragged_prefill=True)
    cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, torch.float32)
    h, _ = model.layer_steps.run(model.embed(ids), attention, cache, cos, sin, set())
    attention.commit_lengths(cache)
    return model.logits(rms_norm(h, model.final_norm, cfg.rms_norm_eps))


cache = model.new_cache(seqs, context + 16)
if seqs == 1:
    model(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), cache)
else:  # a server's decode step at concurrency SEQS: caches filled with random keys and values
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
            logits[name, q] = forward(torch.arange(q * seqs) + 123, batch, cache)
            times[name, q].append(time.perf_counter() - start)
for q in shapes:
    old, new = (1e3 * statistics.median(times[name, q]) for name in ("old", "new"))
    print(f"{q:2d} token(s) a sequence: old {old:.3f} ms  new {new:.3f} ms  new/old {new / old:.3f}  "
          f"same logits: {torch.equal(logits['old', q], logits['new', q])}")
print(f"old = {rev}, new = this checkout; int8, {seqs} sequence(s) at context {context}, 2 threads, {steps} rounds")
