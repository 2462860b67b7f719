"""Ragged attention over the paged KV cache (attention.cpp), for the few new queries per sequence of a decode step,
a verification or a draft block; prefill-sized query counts stay on torch's SDPA."""

from __future__ import annotations

import torch

from adaflash.models.kernels import packed

MAX_QUERIES = 16  # per sequence: decode, verify and draft blocks; longer (prefill) runs SDPA


def available(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    return dtype == torch.float32 and device.type == "cpu" and head_dim % 8 == 0 and packed.enabled_library() is not None


# The cache element types the kernels read (int8: rows with a scale each, the cache's k_scale / v_scale).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


def kv_type(dtype: torch.dtype) -> int:
    if dtype not in KV_TYPES:
        raise ValueError(f"the attention kernels read fp32, fp16, bf16 or int8 caches, not {dtype}")
    return KV_TYPES[dtype]


def ragged_attention(q: torch.Tensor, cache, layer: int, token_start: torch.Tensor, slots: torch.Tensor,
                     key_len: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, d] over one layer of a paged KV cache (models/kv_cache/cache.py), its blocks read in place through
    the slots' tables; sequence s owns tokens [token_start[s], token_start[s + 1]) and cache slot slots[s]; token t
    sees keys [0, key_len[t]). -> [T, H * d]."""
    t, heads, d = q.shape
    k, v = cache.k[layer], cache.v[layer]
    kv_heads = k.shape[1]
    if not (k.is_contiguous() and v.is_contiguous()) or heads % kv_heads or k.shape != v.shape or k.shape[-1] != d:
        raise ValueError(f"ragged attention needs contiguous [blocks, kv_heads, block, {d}] cache layers and heads "
                         f"divisible by KV heads, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype != torch.float32 or k.dtype != v.dtype or {token_start.dtype, slots.dtype, key_len.dtype} != {torch.long}:
        raise ValueError("ragged attention needs fp32 queries, one cache dtype for K and V and int64 index tensors")
    q = q.contiguous()
    out = torch.empty(t, heads * d, dtype=torch.float32)
    with packed.profiled("adaflash::ragged_attention"):
        packed.library().adaflash_ragged_attention(
            q.data_ptr(), heads, d, k.data_ptr(), v.data_ptr(), kv_heads, *cache.scales(layer), *cache.paging(),
            slots.numel(),
            token_start.data_ptr(), slots.data_ptr(), key_len.data_ptr(), scale, out.data_ptr(),
            torch.get_num_threads(), kv_type(k.dtype))
    return out
