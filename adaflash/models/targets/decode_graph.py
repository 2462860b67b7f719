"""One sequence's one-token decode step replayed from a captured CUDA graph.

On a GPU a batch-1 decode step is launch-bound: ~40 small kernels a layer, each costing more host time than device
time. A CUDA graph replays them with one launch, but needs fixed shapes and addresses: the token and its position are
device buffers the replay reads, and attention reads every block of the slot's table (a device buffer the cache
updates in place) under a mask built from that position (`StaticDecodeAttention`), so nothing depends on the host-side
cache length. A graph is captured once per (cache, slot)
on the first step that can use it. On a CPU the same static step runs eagerly: what the tests compare with the ragged
path, so the code a graph captures is the code the CPU checks.

The cache owns its graphs (`KVCache.decode_graphs`) and a graph holds no reference back to the cache (the cache is an
argument of each call): in a reference cycle, the cache, its graph and the graph's memory pool would outlive `del`
until the cyclic collector happened to run, so `empty_cache()` after a generation would free none of it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.layers import rms_norm, rope_cos_sin


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs for decode steps: on CUDA unless ADAFLASH_CUDA_GRAPHS=0."""
    return device.type == "cuda" and os.environ.get("ADAFLASH_CUDA_GRAPHS", "1") != "0"


class StaticDecodeAttention:
    """`RaggedAttention`'s write / attend for one sequence's one-token step at a device-side position: every key of the
    slot is read under a mask, so the kernels' shapes never change between steps."""

    def __init__(self, slot: int, position: torch.Tensor, max_len: int) -> None:
        self.slot, self.position = slot, position
        self.slot_index = torch.tensor([slot], device=position.device)
        self.key_positions = torch.arange(max_len, device=position.device)

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [1, kv_heads, head_dim], written at the position's row of its block (index_copy_: no host-side
        index)."""
        cache.write_rows(layer, cache.rows(self.slot_index, self.position).reshape(-1), k, v)

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [1, heads, head_dim] -> [1, heads * head_dim]; query head h reads KV head h // groups (HF's repeat_kv)."""
        _, heads, d = q.shape
        k, v = (x.to(q.dtype) for x in cache.gather(layer, self.slot, len(self.key_positions)))  # [kv_heads, L, d]
        folded = q.view(k.shape[0], heads // k.shape[0], d)  # the query heads of each KV head as its queries
        mask = (self.key_positions <= self.position)[None, None, :]
        out = F.scaled_dot_product_attention(folded[None], k[None], v[None], attn_mask=mask[None])
        return out.reshape(1, heads * d)


class DecodeGraph:
    """The static decode step of `slot` in a cache: called with the cache, a token id and its position, returns the
    logits [1, V] (fp32), the K/V written at the position. The target's `forward` routes a one-token, one-sequence step
    here. Captured against one cache's tensors: only ever called with that cache (the one holding it)."""

    def __init__(self, target, cache: KVCache, slot: int) -> None:
        device, cfg = target.device, target.config
        self.target = target  # no reference to `cache`: it holds this graph (see the module's docstring)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        span = cache.blocks_per_slot * cache.block_size  # every position the slot's table can address
        self.attention = StaticDecodeAttention(slot, self.position, span)
        self.cos, self.sin = rope_cos_sin(torch.arange(span), cfg.head_dim, cfg.rope_theta, target.dtype,
                                          first=0, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _step(self, cache: KVCache) -> torch.Tensor:
        target, cfg = self.target, self.target.config
        h = target.embed(self.token)
        h, _ = target._layer_loop(h, self.attention, cache, self.cos[self.position], self.sin[self.position], set())
        return target.logits(rms_norm(h, target.final_norm, cfg.rms_norm_eps))

    def __call__(self, cache: KVCache, token_ids: torch.Tensor, position: int) -> torch.Tensor:
        device = self.token.device
        if not graphs_enabled(device):
            self.token.copy_(token_ids.reshape(1))
            self.position.fill_(position)
            return self._step(cache)
        # The tensors' device made current: replay launches on the current device's stream, and the caller's thread
        # may have another current device (`--device cuda:N`, a server's worker thread starts on cuda:0).
        with torch.cuda.device(device):
            self.token.copy_(token_ids.reshape(1), non_blocking=True)
            self.position.fill_(position)
            if self.graph is None:
                self._capture(cache, device)
            self.graph.replay()
            return self.logits.clone()  # the graph's own buffer is overwritten by the next replay

    def _capture(self, cache: KVCache, device: torch.device) -> None:
        """Warm up on a side stream (allocations, lazy inits), then record one step on that stream; each run rewrites
        the same K/V. The stream is made on the tensors' device and named to `torch.cuda.graph`: its default capture
        stream is one per process, made on whichever device was current at its first use, and a capture on a stream
        of another device than its kernels' records none of them (replays then return stale logits)."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(cache)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            self.logits = self._step(cache)
        self.graph = graph
