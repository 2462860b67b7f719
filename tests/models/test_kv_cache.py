"""The slot KV cache (free rollback) and the ragged batch that addresses it, against plain attention."""

from __future__ import annotations

import pytest
import torch

from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.kv_cache.ragged import RaggedAttention, RaggedBatch

LAYERS, SLOTS, MAX_LEN, KV_HEADS, HEADS, DIM = 1, 3, 16, 2, 4, 8


def test_rollback_only_moves_the_length():
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32)
    cache.lengths[1] = 7
    cache.k[0, 1, :, :7] = 1.0
    cache.rollback(1, 3)
    assert cache.lengths == [0, 3, 0] and bool((cache.k[0, 1, :, :7] == 1.0).all())  # stale entries stay, unread
    with pytest.raises(ValueError, match="cannot roll slot 1 back to 5"):
        cache.rollback(1, 5)
    cache.reset(1)
    assert cache.lengths[1] == 0 and cache.num_slots == SLOTS


def test_a_cache_larger_than_free_memory_is_refused_naming_its_sizes(monkeypatch):
    """Qwen3-8B's cache at --max-batch 64 --max-len 40960 (bf16, ~360 GiB) against a device with 80 GiB free: refused
    before any allocation, with the sizes; one that fits is made."""
    from adaflash.models.kv_cache import cache as kv_cache

    asked = []
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: asked.append(torch.device(device)) or 80 * 2**30)
    with pytest.raises(ValueError) as err:
        KVCache(36, 64, 40960, 8, 128, torch.bfloat16, "cpu")
    message = str(err.value)
    for part in ("360.00 GiB", str(2 * 36 * 64 * 8 * 40960 * 128 * 2), "max_batch 64", "max_len 40960", "36 layers",
                 "80.00 GiB", str(80 * 2**30), "--max-batch"):
        assert part in message, (part, message)
    assert asked == [torch.device("cpu")]
    fits = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32)
    assert fits.k.shape == (LAYERS, SLOTS, KV_HEADS, MAX_LEN, DIM)


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
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32)
    history = {slot: (torch.randn(n, KV_HEADS, DIM, generator=g), torch.randn(n, KV_HEADS, DIM, generator=g))
               for slot, n in [(0, 4), (2, 2)]}
    for slot, (k, v) in history.items():  # what earlier steps left in the cache
        cache.k[0, slot, :, : len(k)], cache.v[0, slot, :, : len(v)] = k.transpose(0, 1), v.transpose(0, 1)
        cache.lengths[slot] = len(k)
    batch = RaggedBatch.build([2, 0], [2, 4], [3, 1])  # ragged: 3 new tokens in slot 2, 1 in slot 0
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=g)
    k_new = torch.randn(batch.num_tokens, KV_HEADS, DIM, generator=g)
    v_new = torch.randn(batch.num_tokens, KV_HEADS, DIM, generator=g)
    attention = RaggedAttention(batch, causal=causal)
    attention.write(cache, 0, k_new, v_new)
    out = attention.attend(cache, 0, q)
    attention.commit_lengths(cache)
    assert cache.lengths == [5, 0, 5]
    for (slot, start, n), rows in zip([(2, 2, 3), (0, 4, 1)], [slice(0, 3), slice(3, 4)]):
        k = torch.cat([history[slot][0], k_new[rows]])
        v = torch.cat([history[slot][1], v_new[rows]])
        expected = _reference(q[rows], k, v, start if causal else None)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [[0, 1, 2], [2, 0, 1]], ids=["contiguous-view", "gathered"])
def test_decode_attention_is_the_same_through_views_and_gathers(slots):
    """Contiguous slots are read as cache views (the engine sorts by slot for that), others gathered: same result."""
    g = torch.Generator().manual_seed(1)
    lengths = {0: 3, 1: 5, 2: 2}
    cache = KVCache(LAYERS, SLOTS, MAX_LEN, KV_HEADS, DIM, torch.float32)
    for slot, n in lengths.items():
        cache.k[0, slot, :, :n] = torch.randn(KV_HEADS, n, DIM, generator=g)
        cache.v[0, slot, :, :n] = torch.randn(KV_HEADS, n, DIM, generator=g)
        cache.lengths[slot] = n
    batch = RaggedBatch.build(slots, [lengths[s] for s in slots], [1, 1, 1])
    q = torch.randn(3, HEADS, DIM, generator=g)
    k_new, v_new = torch.randn(3, KV_HEADS, DIM, generator=g), torch.randn(3, KV_HEADS, DIM, generator=g)
    attention = RaggedAttention(batch, causal=True)
    assert isinstance(attention.slot_range, slice) == (slots == [0, 1, 2])
    attention.write(cache, 0, k_new, v_new)
    out = attention.attend(cache, 0, q)
    for row, slot in enumerate(slots):
        n = lengths[slot] + 1
        expected = _reference(q[row : row + 1], cache.k[0, slot, :, :n].transpose(0, 1), cache.v[0, slot, :, :n].transpose(0, 1),
                              lengths[slot])
        torch.testing.assert_close(out[row : row + 1], expected, atol=1e-5, rtol=1e-5)


def test_a_batched_prefill_attends_each_sequence_as_if_alone():
    """Prefill-length queries (past the ragged kernel's 16) run SDPA per sequence over its own keys: no padding to
    the longest prompt, and a sequence's rows are bitwise what it gets alone - from position 0 or after a prefix."""
    g = torch.Generator().manual_seed(2)
    max_len = 64
    cache = KVCache(LAYERS, SLOTS, max_len, KV_HEADS, DIM, torch.float32)
    cache.k[0, 1, :, :5] = torch.randn(KV_HEADS, 5, DIM, generator=g)  # slot 1 continues after a 5-token prefix
    cache.v[0, 1, :, :5] = torch.randn(KV_HEADS, 5, DIM, generator=g)
    cache.lengths[1] = 5
    spec = [(0, 0, 30), (1, 5, 20), (2, 0, 3)]  # (slot, start, new tokens)
    batch = RaggedBatch.build(*map(list, zip(*spec)))
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=g)
    k_new = torch.randn(batch.num_tokens, KV_HEADS, DIM, generator=g)
    v_new = torch.randn(batch.num_tokens, KV_HEADS, DIM, generator=g)
    attention = RaggedAttention(batch, causal=True)
    attention.write(cache, 0, k_new, v_new)
    out = attention.attend(cache, 0, q)
    offset = 0
    for slot, start, n in spec:
        rows = slice(offset, offset + n)
        alone = RaggedAttention(RaggedBatch.build([slot], [start], [n]), causal=True).attend(cache, 0, q[rows])
        if n > 16:  # the short one runs the ragged kernel alone, SDPA in the batch: close, not bitwise
            assert torch.equal(out[rows], alone)
        keys = cache.k[0, slot, :, : start + n].transpose(0, 1)
        values = cache.v[0, slot, :, : start + n].transpose(0, 1)
        torch.testing.assert_close(out[rows], _reference(q[rows], keys, values, start), atol=1e-5, rtol=1e-5)
        offset += n
