"""What each piece of a batch-1 int8 decode forward costs as it runs in a real step (right after the previous step's
kernel call has streamed the weights through the caches): the body of TargetModel.forward -> LayerSteps.forward as
of session 18, copied here with a timestamp between the pieces; median us per piece over 350 steps.

    python docs/results/session18/python_pieces_in_situ.py
"""
import ctypes, statistics, time, torch
from adaflash.models.kernels import packed, layer_step as L
from adaflash.models.kernels import attention as attention_kernel
from adaflash.models.kernels.layer_step import StepHead, _Call, _batch_struct, _cache_ok, _linear_struct, _ptr
from adaflash.models.kv_cache import RaggedBatch, RaggedAttention
from adaflash.models.layers import rope_cos_sin
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as
torch.set_num_threads(2)
m = load_target_as(resolve_target("smollm2-135m"), "int8")
cfg = m.config; ls = m.layer_steps
ctx = 64
cache = m.new_cache(1, ctx + 1)
m(torch.arange(ctx) % 1000 + 100, RaggedBatch.build([0], [0], [ctx]), cache)
lib = packed.library()
T = {}
torch.set_grad_enabled(False)
for i in range(400):
    marks = [("start", time.perf_counter())]
    mk = lambda n: marks.append((n, time.perf_counter()))
    ids = torch.tensor([123]); mk("ids tensor")
    batch = RaggedBatch.build([0], [ctx], [1]); mk("build")
    attention = RaggedAttention(batch, causal=True, device=m.device, ragged_prefill=True); mk("RaggedAttention")
    cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, m.dtype, first=ctx); mk("rope")
    ok = L.enabled() and attention_kernel.available(torch.float32, m.device, 64); mk("enabled/available")
    structs = ls._layers_at(1); mk("_layers_at")
    _cache_ok(cache); cos, sin = cos.contiguous(), sin.contiguous(); mk("cache_ok/contiguous")
    index = attention.kernel_index(cache); mk("kernel_index")
    b = _batch_struct(attention, cache, cos, sin, index); mk("_batch_struct")
    scratch = torch.empty(lib.adaflash_layer_scratch_floats(ctypes.byref(ls.shape), 1), dtype=torch.float32); mk("scratch")
    rows = torch.arange(1); kernel = m.fast_lm_head.kernel_for(1); mk("rows + head kernel_for")
    tokens = ids.to(torch.long).contiguous(); h = torch.empty(1, 576); logits = torch.empty(1, kernel.n); mk("tokens/h/logits")
    hs = ctypes.byref(_linear_struct(kernel)); mk("head struct")
    st = lib.adaflash_decoder_forward(tokens.data_ptr(), m.embed_tokens.data_ptr(), m.embed_tokens.shape[0], h.data_ptr(),
        structs, len(structs), ctypes.byref(ls.shape), ctypes.byref(b), scratch.data_ptr(), ls._no_captures,
        m.final_norm.data_ptr(), rows.data_ptr(), 1, hs, logits.data_ptr(), 2); mk("kernel call")
    attention.commit_lengths(cache); mk("commit")
    cache.rollback(0, ctx)
    for (a, ta), (n, tb) in zip(marks, marks[1:]):
        T.setdefault(n, []).append(tb - ta)
    T.setdefault("total", []).append(marks[-1][1] - marks[0][1])
for k, v in T.items():
    print(f"{k:26s} {1e6*statistics.median(v[50:]):8.1f} us")
