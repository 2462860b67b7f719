"""The paged KV cache: fixed-size blocks from one pool, a block table per sequence slot (vLLM's PagedAttention layout).

One tensor per K and V: [layers, blocks, kv_heads, block_size, head_dim], in the model's dtype or a narrower one
(the int8 target keeps fp16, as llama.cpp does; `--kv-dtype`: fp32, fp16, bf16, or int8 rows with one fp32 scale each
in `k_scale` / `v_scale` [layers, blocks, kv_heads, block_size], llama.cpp's q8_0 with a head's row as the block). A slot's position p lives in block
`table[slot][p // block_size]` at row `p % block_size`; the kernels read the blocks in place through the table.
Blocks are taken when a pass is about to write past a slot's last one (`ensure`), handed back when a rollback or a
reset leaves them empty, and the pool's memory is reserved but never written until a block is first used (the pages
of an untouched block are not resident), lowest-numbered blocks first: resident memory follows the most tokens held
at once, not the slots times their maximum length.

Full blocks of a finished sequence can stay in the pool under the token ids they hold (`release(slot, tokens)`), and a
new sequence whose prompt starts with the same tokens maps them into its table instead of recomputing them (`adopt`,
vLLM's automatic prefix caching): shared blocks are never written (a sequence writes only past its adopted prefix).
Cached blocks live only in memory already resident: a sequence that needs a block takes a free one that has been used
before, else evicts the least recently released cached block, and touches a block never used only when no cached one
is left - so caching prefixes never grows resident memory (on a GPU, whose pool is resident from the start, it is
vLLM's policy).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Sequence

import torch

from adaflash.models.device.memory import free_memory

DEFAULT_BLOCK_SIZE = 32


class KVPoolExhausted(RuntimeError):
    """The pool has no free or evictable block: the engine's admission keeps running sequences from ever seeing this."""


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
        pool_tokens: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        """`max_len`: the most positions one slot holds; `pool_tokens`: the positions all slots hold together (rounded
        up to whole blocks; default every slot's max_len, which can never run short)."""
        if block_size < 8 or block_size & (block_size - 1):
            raise ValueError(f"the KV block size must be a power of two >= 8, got {block_size}")
        self.block_size, self.block_shift = block_size, block_size.bit_length() - 1
        self.max_len = max_len
        self.blocks_per_slot = -(-max_len // block_size)
        self.num_blocks = (num_slots * self.blocks_per_slot if pool_tokens is None
                           else max(1, -(-pool_tokens // block_size)))
        shape = (num_layers, self.num_blocks, num_kv_heads, block_size, head_dim)
        check_fits(shape, dtype, device)
        # empty, not zeros: a block's pages become resident only when it is first taken (and zeroed then, `ensure`).
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        scaled = dtype == torch.int8
        self.k_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device) if scaled else None
        self.v_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device) if scaled else None
        # Per slot its blocks, padded with block 0 (never read: attention stops at the slot's length); the kernels read
        # this tensor, the host list is the truth.
        self.tables = torch.zeros(num_slots, self.blocks_per_slot, dtype=torch.long, device=device)
        self.slot_blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self.lengths = [0] * num_slots
        self._free = list(range(self.num_blocks))  # a min-heap: low blocks first keeps the resident pages few
        self._touched = 0  # blocks below this have been taken at some time (their pages are resident)
        self._refs = [0] * self.num_blocks
        self._prefix_of: dict[int, tuple] = {}  # a published block -> its key (prefix_key of the tokens up to its end)
        self._published: dict[tuple, int] = {}  # key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # published blocks no slot holds, oldest first
        # slot -> its captured decode step (models/targets/decode_graph.py), which holds no reference back to this cache
        self.decode_graphs: dict[int, object] = {}

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @property
    def bytes_per_block(self) -> int:
        scales = 0 if self.k_scale is None else self.k_scale[:, 0].numel() * 4
        return 2 * (self.k[:, 0].numel() * self.k.element_size() + scales)

    def scales(self, layer: int) -> tuple[int | None, int | None]:
        """The kernels' pointers to one layer's K and V row scales (None, None: not an int8 cache)."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer].data_ptr(), self.v_scale[layer].data_ptr()

    def paging(self) -> tuple[int, int, int]:
        """What the kernels address the blocks with: log2 of the block size, a table row's length, the tables."""
        return self.block_shift, self.blocks_per_slot, self.tables.data_ptr()

    def blocks_free(self) -> int:
        """Blocks a sequence could take now: free ones and cached prefixes no slot holds."""
        return len(self._free) + len(self._evictable)

    def blocks_held(self) -> int:
        """Blocks some slot holds (a shared one once)."""
        return self.num_blocks - self.blocks_free()

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    # ---- growing and shrinking ----------------------------------------------------------------------

    def ensure(self, slot: int, end: int) -> None:
        """Give `slot` blocks for every position below `end` (before a pass writes there)."""
        if end > self.max_len:
            raise ValueError(f"slot {slot} would hold {end} positions, over the cache's {self.max_len}")
        blocks = self.slot_blocks[slot]
        need = self.blocks_for(end) - len(blocks)
        if need <= 0:
            return
        if need > self.blocks_free():
            raise KVPoolExhausted(f"slot {slot} needs {need} more KV blocks for {end} positions; the pool of "
                                  f"{self.num_blocks} has {self.blocks_free()} free")
        first = len(blocks)
        for _ in range(need):
            blocks.append(self._take())
        # Zeroed when taken: a block's unwritten rows are never read by the kernels, but torch's static decode step
        # (decode_graph.py) weighs every row of the slot's table by a masked 0, and 0 x an uninitialised NaN is NaN.
        taken = torch.tensor(blocks[first:], device=self.k.device)
        for x in (self.k, self.v, self.k_scale, self.v_scale):
            if x is not None:
                x.index_fill_(1, taken, 0)
        self._set_table(slot, first)

    def grow(self, slot: int, length: int) -> None:
        """Hold `length` positions in `slot` without writing them (timing runs measure a context of that length)."""
        self.ensure(slot, length)
        self.lengths[slot] = length

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything at positions >= `length` in `slot`; blocks left empty go back to the pool."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {self.lengths[slot]} positions")
        self.lengths[slot] = length
        blocks = self.slot_blocks[slot]
        while len(blocks) > self.blocks_for(length):
            self._drop(blocks.pop())

    def reset(self, slot: int) -> None:
        self.rollback(slot, 0)

    # ---- reading and writing outside the kernels (torch's attention: GPUs, prefills, masked draft layers) ----------

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, kv_heads] rows of a layer viewed as [blocks * kv_heads * block_size, head_dim] where each token's K
        (or V) heads live (`slots`, `positions`: [T] on the cache's device)."""
        heads = self.k.shape[2]
        blocks = self.tables[slots, positions >> self.block_shift]
        within = positions & (self.block_size - 1)
        return (blocks[:, None] * heads + torch.arange(heads, device=blocks.device)) * self.block_size + within[:, None]

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] into one layer's `rows` ([T * kv_heads], `rows()`'s), rounded to the cache's
        dtype; int8: each row divided by its scale, max |x| / 127, and rounded to nearest even (the kernels' way)."""
        _, blocks, heads, size, d = self.k.shape
        for x, cache, scales in ((k, self.k, self.k_scale), (v, self.v, self.v_scale)):
            x = x.reshape(-1, d)
            if scales is not None:
                scale = x.abs().amax(-1) / 127
                x = torch.where(scale[:, None] > 0, x / scale[:, None], 0).round()
                scales[layer].view(-1).index_copy_(0, rows, scale)
            cache[layer].view(blocks * heads * size, d).index_copy_(0, rows, x.to(cache.dtype))

    def gather(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slot`'s positions below `length` in one layer, as contiguous [kv_heads, length, head_dim]
        copies (an int8 cache's dequantized to fp32)."""
        blocks = self.tables[slot, : self.blocks_for(length)]
        out = []
        for x, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            rows = x[layer].index_select(0, blocks)
            if scales is not None:
                rows = rows.float() * scales[layer].index_select(0, blocks)[..., None]
            out.append(rows.transpose(0, 1).flatten(1, 2)[:, :length])
        return tuple(out)

    def contents(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every position `slot` holds, every layer: [layers, kv_heads, length, head_dim] copies."""
        pairs = [self.gather(layer, slot, self.lengths[slot]) for layer in range(self.k.shape[0])]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])

    # ---- prefix sharing -------------------------------------------------------------------------------

    def release(self, slot: int, tokens: Sequence[int]) -> None:
        """Empty `slot`, keeping its full blocks of committed `tokens` (positions 0..) in the pool for a later prompt
        that starts with them (`adopt`). Only where a position's K/V do not depend on the pass that computed them."""
        held = min(self.lengths[slot], len(tokens))
        key: tuple = ()
        for i, block in enumerate(self.slot_blocks[slot][: held // self.block_size]):
            key = prefix_key(key, tokens[i * self.block_size : (i + 1) * self.block_size])
            if block not in self._prefix_of and key not in self._published:
                self._published[key] = block
                self._prefix_of[block] = key
        self.reset(slot)

    def adopt(self, slot: int, tokens: Sequence[int], limit: int) -> int:
        """Map into the empty `slot` the published blocks that hold the longest run of `tokens`' leading whole blocks,
        up to `limit` positions; returns the positions adopted (a multiple of the block size)."""
        if self.lengths[slot] or self.slot_blocks[slot]:
            raise ValueError(f"slot {slot} must be empty to adopt a prefix; it holds {self.lengths[slot]} positions")
        key: tuple = ()
        blocks = self.slot_blocks[slot]
        for i in range(min(limit, len(tokens)) // self.block_size):
            key = prefix_key(key, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self._published.get(key)
            if block is None:
                break
            self._evictable.pop(block, None)
            self._refs[block] += 1
            blocks.append(block)
        self.lengths[slot] = len(blocks) * self.block_size
        self._set_table(slot, 0)
        return self.lengths[slot]

    # ---- blocks ------------------------------------------------------------------------------------

    def _take(self) -> int:
        if self._evictable and (not self._free or self._free[0] >= self._touched):
            # rather than touch fresh memory, the least recently released cached block (the deepest of its prefix:
            # a release drops its blocks last first, so the prefix's head stays usable longest)
            block, _ = self._evictable.popitem(last=False)
            del self._published[self._prefix_of.pop(block)]
        else:
            block = heapq.heappop(self._free)
        self._touched = max(self._touched, block + 1)
        self._refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if block in self._prefix_of:
            self._evictable[block] = None
        else:
            heapq.heappush(self._free, block)

    def _set_table(self, slot: int, first: int) -> None:
        blocks = self.slot_blocks[slot][first:]
        if blocks:
            self.tables[slot, first : first + len(blocks)] = torch.tensor(blocks, dtype=torch.long)


def drafter_pool(pool_tokens: int | None, num_slots: int, ahead: int, block_size: int) -> int | None:
    """A drafter cache's pool beside a target's of `pool_tokens`: the drafter holds what the target holds and writes up
    to `ahead` positions past it in every slot (a draft block, drafts in flight), each in at most one more block."""
    return None if pool_tokens is None else pool_tokens + num_slots * (ahead + block_size)


def prefix_key(parent: tuple, block_tokens: Sequence[int]) -> tuple:
    """The key of a block: its tokens and, through `parent`, every token before them (a block's K/V depend on all)."""
    return (hash(parent), *block_tokens)


def check_fits(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
    """Refuse a pool (K and V of `shape`) larger than the device's free memory, naming the sizes: the allocation would
    otherwise fail deep in torch, or the OOM killer end the process once its blocks fill."""
    layers, blocks, kv_heads, block_size, head_dim = shape
    row_bytes = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)  # an int8 row's scale
    needed = 2 * layers * blocks * kv_heads * block_size * row_bytes
    free = free_memory(device)
    if free is not None and needed > free:
        gib = 2 ** 30
        raise ValueError(
            f"the KV cache needs {needed / gib:.2f} GiB ({needed} bytes: K and V of {blocks * block_size} positions x "
            f"{layers} layers x {kv_heads} KV heads x head_dim {head_dim}, {str(dtype).removeprefix('torch.')}) but "
            f"{device} has {free / gib:.2f} GiB ({free} bytes) free: lower --kv-memory, --max-batch or --max-len")
