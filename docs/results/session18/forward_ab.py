"""The forward before session 18's one-call forward (embedding, LayerSteps.run, then the final norm and LM head from
Python) against TargetModel.forward now (one kernel call for embedding, layers, norm and head), alternating in one
process on one loaded target; the same kernels, so the logits must be the same bits.

    python docs/results/session18/forward_ab.py [DTYPE=int8] [CONTEXT=64] [NEW_TOKENS=1]
"""
import statistics, sys, time, torch
from adaflash.models.kv_cache import RaggedBatch, RaggedAttention
from adaflash.models.layers import rope_cos_sin, rms_norm
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as
torch.set_num_threads(2)
dtype = sys.argv[1] if len(sys.argv) > 1 else "int8"
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 64
q = int(sys.argv[3]) if len(sys.argv) > 3 else 1
m = load_target_as(resolve_target("smollm2-135m"), dtype)
cfg = m.config

@torch.inference_mode()
def old_forward(token_ids, batch, cache):
    for slot, start in zip(batch.slots, batch.starts):
        if cache.lengths[slot] != start:
            raise ValueError
    if max(batch.ends) > cache.max_len:
        raise ValueError
    attention = RaggedAttention(batch, causal=True, device=m.device, ragged_prefill=m.int8_activations)
    cos, sin = rope_cos_sin(batch.positions.to(m.device), cfg.head_dim, cfg.rope_theta, m.dtype)
    h = m.embed(token_ids.to(m.device))
    h, captured = m.layer_steps.run(h, attention, cache, cos, sin, set())
    attention.commit_lengths(cache)
    return m.logits(rms_norm(h, m.final_norm, cfg.rms_norm_eps))

cache = m.new_cache(1, ctx + q)
m(torch.arange(ctx) % 1000 + 100, RaggedBatch.build([0], [0], [ctx]), cache)
fns = {"old": old_forward, "new": lambda ids, b, c: m(ids, b, c).logits}
ts = {n: [] for n in fns}; outs = {}
for i in range(300):
    ids = torch.arange(q) + 123 + i % 7
    for n, f in fns.items():
        t = time.perf_counter(); outs[n] = f(ids, RaggedBatch.build([0], [ctx], [q]), cache); ts[n].append(time.perf_counter() - t)
        cache.rollback(0, ctx)
o, nw = (1e3 * statistics.median(ts[n][30:]) for n in fns)
print(f"{dtype} ctx {ctx} q {q}: old {o:.3f} ms  new {nw:.3f} ms  new/old {nw / o:.3f}  same logits: {torch.equal(outs['old'], outs['new'])}")
