"""The static, slot-based KV cache.

One preallocated tensor per K and V: [layers, slots, kv_heads, max_len, head_dim], in the model's dtype or a narrower
one (the int8 target keeps fp16, as llama.cpp does: queries and attention stay fp32). A sequence owns a slot;
its length is a host-side integer, so rolling back after a rejected draft is a free integer store: the
stale entries past the length are never read (attention masks by position) and get overwritten later.
"""

from __future__ import annotations

import torch

from adaflash.models.device.memory import free_memory


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        check_fits(shape, dtype, device)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * num_slots
        # slot -> its captured decode step (models/targets/decode_graph.py), which holds no reference back to this cache
        self.decode_graphs: dict[int, object] = {}

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything at positions >= `length` in `slot` (free: only the length changes)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {self.lengths[slot]} positions")
        self.lengths[slot] = length

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0


def check_fits(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
    """Refuse a cache (K and V of `shape`) larger than the device's free memory, naming the sizes: the allocation
    would otherwise fail deep in torch, or the OOM killer end the process (`--max-batch 64 --max-len 40960` for
    Qwen3-8B asks ~360 GiB)."""
    layers, slots, kv_heads, max_len, head_dim = shape
    needed = 2 * layers * slots * kv_heads * max_len * head_dim * dtype.itemsize
    free = free_memory(device)
    if free is not None and needed > free:
        gib = 2 ** 30
        raise ValueError(
            f"the KV cache needs {needed / gib:.2f} GiB ({needed} bytes: K and V of max_batch {slots} x max_len "
            f"{max_len} x {layers} layers x {kv_heads} KV heads x head_dim {head_dim}, "
            f"{str(dtype).removeprefix('torch.')}) but {device} has {free / gib:.2f} GiB ({free} bytes) free: lower "
            "--max-batch or --max-len")
