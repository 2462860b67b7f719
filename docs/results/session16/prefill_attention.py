"""int8 prefills on the ragged attention kernel instead of per-sequence SDPA: the attention alone, timed side by side
(one layer's worth, SmolLM2's 9 query / 3 KV heads, d 64), and what each does to the int8 target's logits - a
prompt's last 8 positions from one prefill against the same positions from decode steps.

    python docs/results/session16/prefill_attention.py
"""
import statistics
import time

import torch

import adaflash.models.kv_cache as kv
from adaflash.cli_args import set_threads
from adaflash.models.kernels import attention
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target

set_threads(None)
g = torch.Generator().manual_seed(0)
for lens in ([114] * 32, [30, 60, 120, 250, 384], [1000]):
    n, heads, kv_heads, d = len(lens), 9, 3, 64
    k = torch.randn(n, kv_heads, max(lens), d, generator=g)
    v = torch.randn(n, kv_heads, max(lens), d, generator=g)
    q = torch.randn(sum(lens), heads, d, generator=g)
    token_start = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    key_len = torch.cat([torch.arange(1, x + 1) for x in lens])

    def ragged():
        return attention.ragged_attention(q, k, v, token_start, torch.arange(n), key_len, scale=d ** -0.5)

    def sdpa():  # what RaggedAttention._attend_each runs
        outs = []
        for s, x in enumerate(lens):
            ks, vs = k[s, :, :x].repeat_interleave(3, 0)[None], v[s, :, :x].repeat_interleave(3, 0)[None]
            qs = q[token_start[s]:token_start[s + 1]].transpose(0, 1)[None]
            out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            outs.append(out[0].transpose(0, 1).reshape(x, heads * d))
        return torch.cat(outs)

    diff = (ragged() - sdpa()).abs().max().item()
    t = {"ragged": [], "sdpa": []}
    for _ in range(10):
        for name, fn in (("ragged", ragged), ("sdpa", sdpa)):
            s = time.perf_counter()
            fn()
            t[name].append(time.perf_counter() - s)
    r, s = statistics.median(t["ragged"]) * 1e3, statistics.median(t["sdpa"]) * 1e3
    print(f"prompts {lens[:5]}{'...' if n > 5 else ''}: ragged {r:.2f} ms, SDPA {s:.2f} ms (SDPA / ragged {s / r:.2f}x); "
          f"max |difference| {diff:.1e}")

int8 = load_target(str(resolve_target("smollm2-135m")), dtype=torch.float32, int8_activations=True)
ids = list(range(100, 160))
sdpa_init = kv.RaggedAttention.__init__
for mode in ("ragged kernel", "SDPA"):
    if mode == "SDPA":  # the int8 target as it was: prefill-length queries on SDPA
        kv.RaggedAttention.__init__ = lambda self, b, causal, device="cpu", ragged_prefill=False: sdpa_init(
            self, b, causal, device, False)
    whole = int8(torch.tensor(ids), kv.RaggedBatch.build([0], [0], [60]), int8.new_cache(1, 60)).logits
    cache = int8.new_cache(1, 60)
    int8(torch.tensor(ids[:-8]), kv.RaggedBatch.build([0], [0], [52]), cache)
    steps = torch.stack([int8(torch.tensor([ids[i]]), kv.RaggedBatch.build([0], [i], [1]), cache).logits[0]
                         for i in range(52, 60)])
    print(f"int8 prefill on the {mode}: last 8 positions' logits equal to decode steps': "
          f"{torch.equal(whole[-8:], steps)}, max |difference| {(whole[-8:] - steps).abs().max().item():.3g}")
kv.RaggedAttention.__init__ = sdpa_init
