"""The paged KV cache (blocks by need, rollback giving them back, shared prefixes) and the ragged batch that addresses
it, against plain attention."""

from __future__ import annotations

import pytest
import torch

from adaflash.models.kv_cache.cache import KVCache, KVPoolExhausted
from adaflash.models.kv_cache.ragged import RaggedAttention, RaggedBatch

LAYERS, SLOTS, MAX_LEN, KV_HEADS, HEADS, DIM = 1, 3, 64, 2, 4, 8


def _write(cache: KVCache, slot: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n new positions of random K/V appended to `slot` (as a pass writes them); returns them [n, kv_heads, d]."""
    batch = RaggedBatch.build([slot], [cache.lengths[slot]], [n])
    k, v = torch.randn(n, KV_HEADS, DIM, generator=g), torch.randn(n, KV_HEADS, DIM, generator=g)
    attention = RaggedAttention(batch, causal=True)
    attention.reserve(cache)
    attention.write(cache, 0, k, v)
    attention.commit_lengths(cache)
    return k, v


def test_blocks_are_taken_by_need_and_given_back_by_a_rollback_across_borders():
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32, pool_tokens=40, block_size=8)
    assert cache.num_blocks == 5 and cache.blocks_free() == 5 and cache.blocks_held() == 0
    g = torch.Generator().manual_seed(0)
    k, _ = _write(cache, 1, 11, g)  # two blocks
    assert cache.slot_blocks[1] == [0, 1] and cache.blocks_free() == 3
    cache.rollback(1, 9)  # still in the second block
    assert cache.slot_blocks[1] == [0, 1] and cache.lengths[1] == 9
    cache.rollback(1, 8)  # the second block is empty now: back to the pool
    assert cache.slot_blocks[1] == [0] and cache.blocks_free() == 4
    assert torch.equal(cache.contents(1)[0][0].transpose(0, 1), k[:8])  # what stays is untouched
    with pytest.raises(ValueError, match="cannot roll slot 1 back to 9"):
        cache.rollback(1, 9)
    _write(cache, 0, 17, g)  # three blocks: the lowest free ones
    assert cache.slot_blocks[0] == [1, 2, 3] and cache.tables[0, :3].tolist() == [1, 2, 3]
    with pytest.raises(KVPoolExhausted, match="needs 2 more KV blocks"):
        cache.ensure(2, 9)
    cache.reset(0)
    assert cache.lengths[0] == 0 and cache.blocks_free() == 4 and cache.num_slots == SLOTS
    with pytest.raises(ValueError, match="over the cache's 64"):
        cache.ensure(2, 65)


def test_a_pass_past_the_reserved_blocks_is_refused_before_the_kernels_write():
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32, block_size=8)
    attention = RaggedAttention(RaggedBatch.build([0], [0], [3]), causal=True)
    with pytest.raises(ValueError, match="exceed the blocks"):
        attention.token_slots(cache)


def test_the_pool_is_not_resident_until_its_blocks_are_written():
    """torch.empty: an untouched block costs address space, not memory (what lets a 32K-context pool start small)."""
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    before = process.memory_info().rss
    cache = KVCache(4, 8, 8192, 8, 128, torch.float32, block_size=32)  # 2 GiB of pool
    assert process.memory_info().rss - before < 64 * 2**20
    assert cache.num_blocks * cache.bytes_per_block == 2 * 4 * 8 * 8192 * 8 * 128 * 4


def test_a_released_prefix_is_adopted_by_a_later_prompt_and_shared_not_copied():
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32, pool_tokens=48, block_size=8)
    g = torch.Generator().manual_seed(1)
    tokens = list(range(100, 120))
    k, _ = _write(cache, 0, 20, g)
    cache.release(0, tokens)  # blocks of positions 0-7 and 8-15 kept under their tokens; 16-19's block freed
    assert cache.lengths[0] == 0 and cache.blocks_held() == 0 and cache.blocks_free() == 6
    # A prompt sharing 13 tokens: one whole block; the last prompt token is never adopted (limit).
    assert cache.adopt(1, tokens[:13] + [7, 7, 7], limit=15) == 8
    assert cache.slot_blocks[1] == [0] and torch.equal(cache.contents(1)[0][0].transpose(0, 1), k[:8])
    # The whole 16 on two slots at once: the same blocks, held twice.
    assert cache.adopt(2, tokens + [5], limit=20) == 16
    assert cache.slot_blocks[2] == [0, 1] and cache.blocks_held() == 2
    assert cache.adopt(0, [1] + tokens, limit=20) == 0  # keys cover everything before a block: no match shifted
    with pytest.raises(ValueError, match="must be empty"):
        cache.adopt(2, tokens, limit=20)
    cache.reset(1), cache.reset(2)
    assert cache.blocks_held() == 0


def test_cached_prefixes_live_only_in_memory_already_used():
    """A new block is a free one used before, else the least recently released cached block, and a never-used block
    only when no cached one is left: caching prefixes never grows the resident pages."""
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32, pool_tokens=48, block_size=8)
    g = torch.Generator().manual_seed(2)
    _write(cache, 0, 17, g)  # blocks 0, 1, 2
    cache.release(0, list(range(17)))  # 0 and 1 cached (released 1 then 0), 2 free
    _write(cache, 1, 8, g)  # the free block used before
    assert cache.slot_blocks[1] == [2]
    _write(cache, 1, 8, g)  # no such free block: the least recently released cached one, the prefix's deeper block
    assert cache.slot_blocks[1] == [2, 1]
    assert cache.adopt(2, list(range(17)), limit=16) == 8  # its head still shared
    cache.reset(2)
    _write(cache, 1, 8, g)  # the last cached block goes before block 3 is touched
    assert cache.slot_blocks[1] == [2, 1, 0] and cache.adopt(2, list(range(17)), limit=16) == 0
    _write(cache, 1, 8, g)  # nothing cached: a block never used
    assert cache.slot_blocks[1] == [2, 1, 0, 3]


def test_a_pool_larger_than_free_memory_is_refused_naming_its_sizes(monkeypatch):
    """Qwen3-8B's cache at --max-batch 64 --max-len 40960 (bf16, ~360 GiB) against a device with 80 GiB free: refused
    before any allocation, with the sizes; one that fits is made."""
    from adaflash.models.kv_cache import cache as kv_cache

    asked = []
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: asked.append(torch.device(device)) or 80 * 2**30)
    with pytest.raises(ValueError) as err:
        KVCache(36, 64, 40960, 8, 128, torch.bfloat16, "cpu")
    message = str(err.value)
    for part in ("360.00 GiB", str(2 * 36 * 64 * 8 * 40960 * 128 * 2), "2621440 positions", "36 layers",
                 "80.00 GiB", str(80 * 2**30), "--kv-memory"):
        assert part in message, (part, message)
    assert asked == [torch.device("cpu")]
    fits = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32, block_size=16)
    assert fits.k.shape == (LAYERS, SLOTS * 4, KV_HEADS, 16, DIM)


def test_free_memory_reads_the_cpus_available_memory(monkeypatch):
    """psutil's figure where installed, else /proc/meminfo's MemAvailable; both positive here."""
    import builtins

    from adaflash.models.device.memory import free_memory

    with_psutil = free_memory("cpu")
    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    from_proc = free_memory("cpu")
    assert with_psutil > 0 and from_proc > 0
    assert abs(with_psutil - from_proc) < 0.5 * max(with_psutil, from_proc)  # two reads of one moving figure


def test_ragged_batch_positions_ends_and_last_tokens():
    batch = RaggedBatch.build([2, 0], [5, 0], [3, 2])
    assert batch.positions.tolist() == [5, 6, 7, 0, 1] and batch.ends == (8, 2) and batch.num_tokens == 5
    assert batch.last_token_indices().tolist() == [2, 4]


@pytest.mark.parametrize("slots, starts, lens, message", [
    ([], [], [], "non-empty"),
    ([0, 0], [0, 0], [1, 1], "twice"),
    ([0, 1], [0, 0], [1, 0], "at least one"),
])
def test_ragged_batch_rejects(slots, starts, lens, message):
    with pytest.raises(ValueError, match=message):
        RaggedBatch.build(slots, starts, lens)


def _reference(q, k, v, causal_from: int | None):
    """softmax(q k^T / sqrt(d)) v for one sequence, q [T, H, D], k/v [S, KV, D]; causal_from = q's first position."""
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / DIM ** 0.5
    if causal_from is not None:
        qpos = torch.arange(q.shape[0]) + causal_from
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos[:, None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(q.shape[0], HEADS * DIM)


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_attention_equals_per_sequence_attention(causal):
    g = torch.Generator().manual_seed(0)
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32, block_size=8)
    history = {slot: _write(cache, slot, n, g) for slot, n in [(0, 4), (2, 7)]}  # what earlier steps left
    batch = RaggedBatch.build([2, 0], [7, 4], [3, 1])  # ragged: 3 new tokens in slot 2 (across a block), 1 in slot 0
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=g)
    k_new = torch.randn(batch.num_tokens, KV_HEADS, DIM, generator=g)
    v_new = torch.randn(batch.num_tokens, KV_HEADS, DIM, generator=g)
    attention = RaggedAttention(batch, causal=causal)
    attention.reserve(cache)
    attention.write(cache, 0, k_new, v_new)
    out = attention.attend(cache, 0, q)
    attention.commit_lengths(cache)
    assert cache.lengths == [5, 0, 10]
    for (slot, start, n), rows in zip([(2, 7, 3), (0, 4, 1)], [slice(0, 3), slice(3, 4)]):
        k = torch.cat([history[slot][0], k_new[rows]])
        v = torch.cat([history[slot][1], v_new[rows]])
        expected = _reference(q[rows], k, v, start if causal else None)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [[0, 1, 2], [2, 0, 1]])
def test_decode_attention_through_torch_reads_each_slots_blocks(slots, monkeypatch):
    """Torch's path (no kernels: a GPU's) gathers each slot's blocks: the same as attention over its own keys."""
    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
    g = torch.Generator().manual_seed(1)
    lengths = {0: 3, 1: 9, 2: 2}
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32, block_size=8)
    for slot, n in lengths.items():
        _write(cache, slot, n, g)
    batch = RaggedBatch.build(slots, [lengths[s] for s in slots], [1, 1, 1])
    q = torch.randn(3, HEADS, DIM, generator=g)
    k_new, v_new = torch.randn(3, KV_HEADS, DIM, generator=g), torch.randn(3, KV_HEADS, DIM, generator=g)
    attention = RaggedAttention(batch, causal=True)
    attention.reserve(cache)
    attention.write(cache, 0, k_new, v_new)
    out = attention.attend(cache, 0, q)
    attention.commit_lengths(cache)
    for row, slot in enumerate(slots):
        k, v = (x[0].transpose(0, 1) for x in cache.contents(slot))
        torch.testing.assert_close(out[row : row + 1], _reference(q[row : row + 1], k, v, lengths[slot]),
                                   atol=1e-5, rtol=1e-5)


def test_a_batched_prefill_attends_each_sequence_as_if_alone():
    """Prefill-length queries (past the ragged kernel's 16) run SDPA per sequence over its own keys: no padding to
    the longest prompt, and a sequence's rows are bitwise what it gets alone - from position 0 or after a prefix."""
    g = torch.Generator().manual_seed(2)
    max_len = 64
    cache = KVCache(LAYERS, SLOTS, max_len, KV_HEADS, DIM, torch.float32, block_size=8)
    _write(cache, 1, 5, g)  # slot 1 continues after a 5-token prefix
    spec = [(0, 0, 30), (1, 5, 20), (2, 0, 3)]  # (slot, start, new tokens)
    batch = RaggedBatch.build(*map(list, zip(*spec)))
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=g)
    k_new = torch.randn(batch.num_tokens, KV_HEADS, DIM, generator=g)
    v_new = torch.randn(batch.num_tokens, KV_HEADS, DIM, generator=g)
    attention = RaggedAttention(batch, causal=True)
    attention.reserve(cache)
    attention.write(cache, 0, k_new, v_new)
    out = attention.attend(cache, 0, q)
    attention.commit_lengths(cache)
    offset = 0
    for slot, start, n in spec:
        rows = slice(offset, offset + n)
        alone = RaggedAttention(RaggedBatch.build([slot], [start], [n]), causal=True).attend(cache, 0, q[rows])
        if n > 16:  # the short one runs the ragged kernel alone, SDPA in the batch: close, not bitwise
            assert torch.equal(out[rows], alone)
        keys, values = (x[0].transpose(0, 1) for x in cache.contents(slot))
        torch.testing.assert_close(out[rows], _reference(q[rows], keys, values, start), atol=1e-5, rtol=1e-5)
        offset += n
