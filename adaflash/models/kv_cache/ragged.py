"""The ragged batch that addresses the paged KV cache (cache.py): sequences appending their own number of new tokens
at their own positions, written into their slots' blocks and attended over with our kernel (reading the blocks in
place) or torch's (over gathered copies), and the block masks a drafter's passes use."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Sequence

import torch

from adaflash.models.kernels import attention as attention_kernel
from adaflash.models.kernels import packed
from adaflash.models.kv_cache.cache import KVCache


@dataclass(frozen=True)
class RaggedBatch:
    """Sequences that each append their own number of new tokens at their own positions.

    Tokens are flattened to [T] so linear layers never compute on padding; attention pads only where neither the
    ragged kernel nor the per-sequence prefill path runs (non-causal long blocks, or short ones without the kernel).
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]  # first new position of each sequence (= its cache length before the step)
    query_lens: tuple[int, ...]
    positions: torch.Tensor  # [T] int64

    @classmethod
    def build(cls, slots: Sequence[int], starts: Sequence[int], query_lens: Sequence[int]) -> "RaggedBatch":
        if not (len(slots) == len(starts) == len(query_lens)) or not slots:
            raise ValueError("slots, starts and query_lens must be non-empty and of equal length")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one batch: {list(slots)}")
        if min(slots) < 0 or min(starts) < 0:
            raise ValueError(f"slots and starts must be >= 0, got {list(slots)} and {list(starts)}")
        if min(query_lens) < 1:
            raise ValueError(f"every sequence needs at least one new token, got {list(query_lens)}")
        # One tensor op either way (an arange per sequence then a cat cost ~2 us a sequence: ~0.1 ms a batched step).
        positions = (torch.arange(starts[0], starts[0] + query_lens[0]) if len(slots) == 1 else
                     torch.tensor([p for s, n in zip(starts, query_lens) for p in range(s, s + n)], dtype=torch.long))
        return cls(tuple(slots), tuple(starts), tuple(query_lens), positions)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def single_start(self) -> int | None:
        """The first position of a one-sequence batch (its positions then run on from it, contiguous), else None."""
        return self.starts[0] if len(self.slots) == 1 else None

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.starts, self.query_lens))

    def last_token_indices(self) -> torch.Tensor:
        """Flat index of each sequence's last new token (where next-token logits come from)."""
        return torch.tensor(self.query_lens).cumsum(0) - 1


class RaggedAttention:
    """Scatter new K/V into the cache, then attend each sequence's queries to its cached keys.

    Built once per forward and reused by every layer: index tensors and the mask depend only on the batch
    (each built on first use).
    `causal=False` lets every query see all keys of its own sequence up to the batch end (the drafter's
    non-causal block); `causal=True` is ordinary decoding.
    `ragged_prefill=True` runs the ragged kernel at every query count, prefills included (where it is available),
    so a position's attention is bitwise the same whether its sequence is prefilled, verified or decoded, and in
    whatever split: what makes a shared cache prefix exact (`KVCache.adopt`). Off, a prefill-length query
    runs SDPA (the fp32 target's path, as transformers computes it).
    """

    def __init__(self, batch: RaggedBatch, causal: bool, device: torch.device | str = "cpu",
                 ragged_prefill: bool = False) -> None:
        self.batch = batch
        self.causal = causal
        self.ragged_prefill = ragged_prefill
        self._indices: tuple[torch.Tensor, ...] | None = None  # _all_indices(), lazy
        self._write_rows: torch.Tensor | None = None  # write()'s rows of the cache, lazy
        self._fits: KVCache | None = None  # the cache token_slots() found holding the batch (asked once a layer)
        self.single = len(batch.slots) == 1
        self.key_len = max(batch.ends)
        n, qmax = len(batch.slots), max(batch.query_lens)
        self.qmax = qmax
        self._grouped_mask: torch.Tensor | None = None  # the mask tiled over the query heads of a KV head (lazy)
        self._device = device
        if self.single:
            self.slot = batch.slots[0]
            self.start = batch.starts[0]
            return
        # Equal query lengths (decode steps, fixed-size blocks): padding is a plain reshape, no scatter/gather.
        self.uniform = len(set(batch.query_lens)) == 1
        lens = torch.tensor(batch.query_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(n), lens)
        offsets = torch.cumsum(lens, 0) - lens
        within = torch.arange(batch.num_tokens) - offsets[seq_of_token]
        self.seq_of_token = seq_of_token.to(device)
        self.within = within.to(device)
        self.slot_of_token = torch.tensor(batch.slots, device=device)[self.seq_of_token]
        self.positions = batch.positions.to(device)

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """The SDPA mask of the padded paths, built on first use (the ragged kernel and the per-sequence prefill
        need none): [Q, key_len] for one sequence (None if it needs no mask), else [n, 1, qmax, key_len]."""
        b, device = self.batch, self._device
        key_pos = torch.arange(self.key_len, device=device)
        if self.single:
            return key_pos[None, :] <= b.positions.to(device)[:, None] if self.causal and b.query_lens[0] > 1 else None
        n = len(b.slots)
        # Padded query positions: padding rows get position 0 so they see one key and never produce NaN.
        qpos = torch.zeros(n, self.qmax, dtype=torch.long, device=device)
        qpos[self.seq_of_token, self.within] = self.positions
        if self.causal:
            allowed = key_pos[None, None, :] <= qpos[:, :, None]
        else:
            ends = torch.tensor(b.ends, device=device)
            allowed = (key_pos[None, :] < ends[:, None])[:, None, :].expand(n, self.qmax, self.key_len)
        return allowed[:, None]

    def reserve(self, cache: KVCache) -> None:
        """Blocks in `cache` for every position the batch writes (before its first layer)."""
        for slot, end in zip(self.batch.slots, self.batch.ends):
            cache.ensure(slot, end)

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] for the batch's new tokens (in the cache's dtype), scattered to their blocks'
        rows (the same in every layer)."""
        if self._write_rows is None:
            token_slots = self._all_indices()[0].to(cache.tables.device)
            self._write_rows = cache.rows(token_slots, self.batch.positions.to(cache.tables.device)).reshape(-1)
        cache.write_rows(layer, self._write_rows, k, v)

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads * head_dim]."""
        t, h, d = q.shape
        short = self.qmax <= attention_kernel.MAX_QUERIES or self.ragged_prefill
        if short and attention_kernel.available(q.dtype, q.device, d):
            return attention_kernel.ragged_attention(q, cache, layer, *self._index(), scale=d ** -0.5)
        if self.causal and self.qmax > attention_kernel.MAX_QUERIES:  # a prefill in the batch
            return self._attend_each(cache, layer, q)
        # Torch's attention over contiguous copies of each sequence's keys (the ragged kernel reads the blocks).
        if self.single:
            k, v = (x.unsqueeze(0).to(q.dtype) for x in cache.gather(layer, self.slot, self.key_len))
            out = self._grouped_attention(q.transpose(0, 1).unsqueeze(0), k, v)
            return out[0].transpose(0, 1).reshape(t, h * d)
        kv_heads = cache.k.shape[2]
        k = q.new_zeros(len(self.batch.slots), kv_heads, self.key_len, d)
        v = torch.zeros_like(k)
        for i, (slot, end) in enumerate(zip(self.batch.slots, self.batch.ends)):
            k[i, :, :end], v[i, :, :end] = cache.gather(layer, slot, end)
        n = len(self.batch.slots)
        if self.uniform:
            q_pad = q.view(n, self.qmax, h, d)
        else:
            q_pad = q.new_zeros(n, self.qmax, h, d)
            q_pad[self.seq_of_token, self.within] = q
        out = self._grouped_attention(q_pad.transpose(1, 2), k, v).transpose(1, 2)
        return (out if self.uniform else out[self.seq_of_token, self.within]).reshape(t, h * d)

    def rope_and_write(self, cache: KVCache, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       num_heads: int) -> torch.Tensor:
        """One kernel for what the unfused path does in ~25 ops: RoPE on q and k of the fused projection `qkv`
        [T, (H + 2 KVH) * d], k and v written into the cache's blocks (fp32, fp16, bf16 or int8); returns q [T, H, d]. fp32
        CPU, kernels available."""
        t = qkv.shape[0]
        kv_heads, d = cache.k.shape[2], cache.k.shape[4]
        token_slots = self.token_slots(cache)
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        q = torch.empty(t, num_heads, d, dtype=torch.float32)
        with packed.profiled("adaflash::rope_qkv"):
            packed.library().adaflash_rope_qkv(
                qkv.data_ptr(), t, num_heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(), cache.k[layer].data_ptr(),
                cache.v[layer].data_ptr(), *cache.scales(layer), *cache.paging(), token_slots.data_ptr(), self.batch.positions.data_ptr(),
                q.data_ptr(), attention_kernel.kv_type(cache.k.dtype))
        return q

    def token_slots(self, cache: KVCache) -> torch.Tensor:
        """Each token's cache slot, once the batch is known to fit the slots' blocks (the kernels write unchecked)."""
        b = self.batch
        if cache is not self._fits:
            if max(b.slots) >= cache.num_slots or any(
                    end > len(cache.slot_blocks[slot]) * cache.block_size for slot, end in zip(b.slots, b.ends)):
                raise ValueError(f"batch slots {b.slots} / ends {b.ends} exceed the blocks the cache gave them "
                                 "(RaggedAttention.reserve runs before a pass)")
            self._fits = cache
        return self._all_indices()[0]

    def kernel_index(self, cache: KVCache) -> tuple[torch.Tensor, ...]:
        """What the whole-layer step (kernels/layer_step.py) reads: each token's slot, then _index()'s three."""
        return (self.token_slots(cache), *self._index())

    def _index(self) -> tuple[torch.Tensor, ...]:
        """For the ragged kernel: each sequence's first token, its slot, and each token's key count (causal: up to
        its own position; non-causal: its sequence's end)."""
        return self._all_indices()[1:]

    def _all_indices(self) -> tuple[torch.Tensor, ...]:
        """(token slots, token starts, sequence slots, key lengths) as views of one tensor built from host ints: one
        tensor op where there were ~6 (each ~5-30 us in a decode step, run cold after the kernels)."""
        if self._indices is not None:
            return self._indices
        b = self.batch
        pairs = list(zip(b.starts, b.query_lens))
        token_slots = [slot for slot, n in zip(b.slots, b.query_lens) for _ in range(n)]
        starts = list(accumulate(b.query_lens, initial=0))
        if self.causal:  # each token up to its own position
            key_len = [p + 1 for s, n in pairs for p in range(s, s + n)]
        else:  # each token up to its sequence's end
            key_len = [s + n for s, n in pairs for _ in range(n)]
        flat = torch.tensor(token_slots + starts + list(b.slots) + key_len, dtype=torch.long)
        slots_at = len(token_slots) + len(starts)
        key_len_at = slots_at + len(b.slots)
        self._indices = (flat[: len(token_slots)], flat[len(token_slots) : slots_at], flat[slots_at:key_len_at],
                         flat[key_len_at:])
        return self._indices

    def _attend_each(self, cache: KVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Causal SDPA sequence by sequence over its own keys: a batched prefill pads no prompt to the longest (the
        padded batch spent ~3x the attention arithmetic on a mix of 30-384-token prompts), and a sequence's result
        is the same alone or in any batch."""
        t, heads, d = q.shape
        b = self.batch
        outs, offset = [], 0
        for slot, start, n in zip(b.slots, b.starts, b.query_lens):
            k, v = (x.to(q.dtype) for x in cache.gather(layer, slot, start + n))
            groups = heads // k.shape[0]
            if groups > 1:
                k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            # 4-D: torch's CPU flash kernel takes only [batch, heads, len, d]; 3-D inputs fall back to the math path
            # (a softmax over a materialised score matrix, ~20% of a batched prefill).
            qs, k, v = q[offset : offset + n].transpose(0, 1)[None], k[None], v[None]
            if start == 0:
                out = torch.nn.functional.scaled_dot_product_attention(qs, k, v, is_causal=True)
            else:  # queries at positions start.. see every earlier key (bottom-right aligned)
                mask = torch.arange(start + n, device=q.device)[None, :] <= torch.arange(start, start + n, device=q.device)[:, None]
                out = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask)
            outs.append(out[0].transpose(0, 1).reshape(n, heads * d))
            offset += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _grouped_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """SDPA of q [n, H, Q, d] over k, v [n, KVH, L, d] with the query heads that share a KV head folded into
        the query axis ([n, KVH, G*Q, d]): every KV head is read once, where `enable_gqa` reads it G times (the
        KV cache is what batched decode streams). Query head h uses KV head h // G, as HF's repeat_kv does."""
        n, heads, qlen, d = q.shape
        groups = heads // k.shape[1]
        if groups == 1:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        if self._grouped_mask is None and self.mask is not None:
            self._grouped_mask = self.mask.repeat(1, 1, groups, 1)  # row g*Q + i is query i's row, for every g
        folded = q.reshape(n, k.shape[1], groups * qlen, d)
        out = torch.nn.functional.scaled_dot_product_attention(folded, k, v, attn_mask=self._grouped_mask)
        return out.reshape(n, heads, qlen, d)

    def commit_lengths(self, cache: KVCache) -> None:
        for slot, end in zip(self.batch.slots, self.batch.ends):
            cache.lengths[slot] = end


def kind_mask(kind, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """Which keys a query sees under a draft layer's attention kind (`causal`, `window`: models/drafters/config.py),
    by absolute positions (broadcast): causal sees keys at or before it; a window sees keys fewer than `window`
    positions away (both ways when not causal), as the DFlash reference masks its sliding layers."""
    allowed = torch.ones(torch.broadcast_shapes(query_pos.shape, key_pos.shape), dtype=torch.bool,
                         device=query_pos.device)
    if kind.causal:
        allowed &= key_pos <= query_pos
    if kind.window is not None:
        allowed &= query_pos - key_pos < kind.window
        if not kind.causal:
            allowed &= key_pos - query_pos < kind.window
    return allowed


class BlockMasks:
    """Attention of draft blocks under each layer's kind: the plain non-causal `attention` itself, a causal one over
    the same batch (the ragged kernels) while no window cuts anything, else torch's SDPA one sequence at a time with
    the kind's mask (public drafters' sliding layers once the context outgrows the window)."""

    def __init__(self, attention: RaggedAttention, device: torch.device | str) -> None:
        self.attention = attention
        self.device = device
        self._causal: RaggedAttention | None = None

    def attend(self, kind, cache: KVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads * head_dim]; the block's K/V are already written."""
        if kind.window is None or self.attention.key_len <= kind.window:  # no window cuts: a ragged kernel
            if not kind.causal:
                return self.attention.attend(cache, layer, q)
            if self._causal is None:
                self._causal = RaggedAttention(self.attention.batch, causal=True, device=self.device)
            return self._causal.attend(cache, layer, q)
        return self._masked(kind, cache, layer, q)

    def _masked(self, kind, cache: KVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        batch, out, offset = self.attention.batch, [], 0
        rep = q.shape[1] // cache.k.shape[2]
        for slot, start, n in zip(batch.slots, batch.starts, batch.query_lens):
            end = start + n
            k, v = (x.to(q.dtype).repeat_interleave(rep, 0) for x in cache.gather(layer, slot, end))  # [heads, end, d]
            query_pos = torch.arange(start, end, device=q.device)[:, None]
            mask = kind_mask(kind, query_pos, torch.arange(end, device=q.device)[None, :])
            o = F.scaled_dot_product_attention(q[offset : offset + n].transpose(0, 1)[None], k[None], v[None],
                                               attn_mask=mask[None, None])
            out.append(o[0].transpose(0, 1).reshape(n, -1))
            offset += n
        return torch.cat(out)
