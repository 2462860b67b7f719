"""The ragged attention kernel against a float64 reference, its batch invariance, and RaggedAttention's use of it."""

from __future__ import annotations

import math

import pytest
import torch

from adaflash.models.device.cpu import cpu_flags
from adaflash.models.kernels import attention, packed
from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.kv_cache.ragged import RaggedAttention, RaggedBatch

pytestmark = pytest.mark.skipif(packed.library() is None, reason="kernels unavailable (no AVX2/FMA or compiler)")


def paged(k: torch.Tensor, v: torch.Tensor, block_size: int = 16) -> KVCache:
    """A one-layer paged cache holding per-slot keys and values k, v [slots, kv_heads, length, d] in their dtype, its
    slots' blocks interleaved (each grown one block at a time in turn), as a busy engine leaves them."""
    slots, kv_heads, length, d = k.shape
    cache = KVCache(1, slots, length, kv_heads, d, k.dtype, block_size=block_size)
    for end in range(block_size, length + block_size, block_size):
        for slot in range(slots):
            cache.ensure(slot, min(end, length))
    positions = torch.arange(length)
    for slot in range(slots):
        rows = cache.rows(torch.full((length,), slot), positions)  # [length, kv_heads]
        cache.k[0].view(-1, d)[rows] = k[slot].transpose(0, 1)
        cache.v[0].view(-1, d)[rows] = v[slot].transpose(0, 1)
        cache.lengths[slot] = length
    return cache


def attend(q, k, v, token_start, slots, key_len, scale, block_size: int = 16):
    return attention.ragged_attention(q, paged(k, v, block_size), 0, token_start, slots, key_len, scale=scale)


def _reference(q, k, v, slots, token_start, key_len):
    """softmax(q k^T / sqrt(d)) v per token over its own slot's first key_len keys, in float64."""
    heads, d = q.shape[1], q.shape[2]
    groups = heads // k.shape[1]
    out = torch.empty(q.shape[0], heads * d, dtype=torch.float64)
    for s, slot in enumerate(slots.tolist()):
        for t in range(int(token_start[s]), int(token_start[s + 1])):
            n = int(key_len[t])
            qq = q[t].double().view(k.shape[1], groups, d)
            scores = torch.einsum("hgd,hld->hgl", qq, k[slot, :, :n].double()) / math.sqrt(d)
            out[t] = torch.einsum("hgl,hld->hgd", scores.softmax(-1), v[slot, :, :n].double()).reshape(-1)
    return out.float()


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 40), (8, 2, 8)])
def test_matches_a_float64_reference_on_a_ragged_batch(heads, kv_heads, d):
    g = torch.Generator().manual_seed(heads * d)
    k, v = torch.randn(6, kv_heads, 300, d, generator=g), torch.randn(6, kv_heads, 300, d, generator=g)
    slots, query_lens = torch.tensor([4, 0, 2]), [1, 5, 3]
    token_start = torch.tensor([0, 1, 6, 9])
    key_len = torch.tensor([7, 101, 102, 103, 104, 8, 16, 298, 300])  # tails of 1..7 keys, none, all of max_len
    q = torch.randn(sum(query_lens), heads, d, generator=g)
    out = attend(q, k, v, token_start, slots, key_len, scale=d ** -0.5)
    torch.testing.assert_close(out, _reference(q, k, v, slots, token_start, key_len), atol=2e-6, rtol=1e-5)


def test_an_fp16_cache_is_read_as_the_same_values_widened():
    """The int8 target's fp16 cache: bitwise what the kernel computes over an fp32 cache of the same values."""
    g = torch.Generator().manual_seed(5)
    k, v = (torch.randn(3, 3, 200, 64, generator=g) * 4).half(), (torch.randn(3, 3, 200, 64, generator=g) * 4).half()
    q = torch.randn(6, 9, 64, generator=g)
    index = torch.tensor([0, 1, 5, 6]), torch.tensor([2, 0, 1]), torch.tensor([37, 120, 121, 122, 123, 200])
    half = attend(q, k, v, *index, scale=0.125)
    assert torch.equal(half, attend(q, k.float(), v.float(), *index, scale=0.125))
    bf16 = attend(q, k.bfloat16(), v.bfloat16(), *index, scale=0.125)
    assert torch.equal(bf16, attend(q, k.bfloat16().float(), v.bfloat16().float(), *index, scale=0.125))


def test_an_int8_cache_reads_each_row_times_its_scale():
    """--kv-dtype int8: rows of int8 with a scale each (max |x| / 127), written by the cache's torch path; the kernel's
    attention is attention over the dequantized rows, and a row is off by at most half its scale."""
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(3, 2, 100, 64, generator=g) * 4, torch.randn(3, 2, 100, 64, generator=g)
    cache = KVCache(1, 3, 100, 2, 64, torch.int8, block_size=16)
    for slot in range(3):
        cache.ensure(slot, 100)
        rows = cache.rows(torch.full((100,), slot), torch.arange(100)).reshape(-1)
        cache.write_rows(0, rows, k[slot].transpose(0, 1), v[slot].transpose(0, 1))
        cache.lengths[slot] = 100
    held = [cache.gather(0, slot, 100) for slot in range(3)]
    k8, v8 = torch.stack([h[0] for h in held]), torch.stack([h[1] for h in held])
    assert ((k8 - k).abs() <= k.abs().amax(-1, keepdim=True) / 127 / 2 * 1.001).all()
    q = torch.randn(6, 6, 64, generator=g)
    index = torch.tensor([0, 1, 5, 6]), torch.tensor([2, 0, 1]), torch.tensor([9, 31, 32, 33, 34, 100])
    out = attention.ragged_attention(q, cache, 0, *index, scale=0.125)
    torch.testing.assert_close(out, _reference(q, k8, v8, index[1], index[0], index[2]), atol=2e-6, rtol=1e-5)


def test_a_keys_bits_do_not_depend_on_the_block_size_or_the_blocks_order():
    """Blocks of 8 to 256 positions, interleaved between slots: every query gets the same bits (the kernel walks a
    sequence's keys in order whichever block holds them)."""
    g = torch.Generator().manual_seed(8)
    k, v = torch.randn(3, 2, 260, 64, generator=g), torch.randn(3, 2, 260, 64, generator=g)
    q = torch.randn(6, 6, 64, generator=g)
    index = torch.tensor([0, 1, 5, 6]), torch.tensor([2, 0, 1]), torch.tensor([9, 31, 32, 33, 34, 260])
    outs = [attend(q, k, v, *index, scale=0.125, block_size=b) for b in (8, 16, 64, 256)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.testing.assert_close(outs[0], _reference(q, k, v, index[1], index[0], index[2]), atol=2e-6, rtol=1e-5)


def test_a_tokens_attention_does_not_depend_on_the_rest_of_the_batch():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(4, 3, 128, 64, generator=g), torch.randn(4, 3, 128, 64, generator=g)
    q = torch.randn(6, 9, 64, generator=g)
    token_start, slots, key_len = torch.tensor([0, 2, 6]), torch.tensor([1, 3]), torch.tensor([50, 51, 90, 91, 92, 93])
    together = attend(q, k, v, token_start, slots, key_len, scale=0.125)
    for t in range(6):  # one token alone, as a decode step of its sequence
        slot = slots[0] if t < 2 else slots[1]
        alone = attend(q[t : t + 1], k, v, torch.tensor([0, 1]), slot.view(1), key_len[t : t + 1],
                                           scale=0.125)
        assert torch.equal(alone, together[t : t + 1])


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the CPU has no AVX-512: only the 8-lane path runs")
@pytest.mark.parametrize("d", [64, 40, 8, 24])  # 32-lane parts of 2 x 16, 16 + 8, 8 and 16 + 8 lanes
@pytest.mark.parametrize("half", [False, True])
def test_the_16_lane_output_pass_gives_the_8_lane_bits(d, half):
    g = torch.Generator().manual_seed(d)
    k, v = torch.randn(2, 2, 150, d, generator=g), torch.randn(2, 2, 150, d, generator=g)
    if half:
        k, v = k.half(), v.half()
    q = torch.randn(5, 6, d, generator=g)
    index = torch.tensor([0, 2, 5]), torch.tensor([1, 0]), torch.tensor([1, 149, 60, 61, 150])
    wide = attend(q, k, v, *index, scale=d ** -0.5)
    lib = packed.library()
    lib.adaflash_attention_allow_avx512(0)
    try:
        narrow = attend(q, k, v, *index, scale=d ** -0.5)
    finally:
        lib.adaflash_attention_allow_avx512(1)
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_attention_runs_the_kernel_for_short_queries_and_agrees_with_sdpa(causal, cache_dtype, monkeypatch):
    g = torch.Generator().manual_seed(4)
    cache = KVCache(num_layers=1, num_slots=3, max_len=64, num_kv_heads=2, head_dim=16, dtype=cache_dtype)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    batch = RaggedBatch.build([2, 0], [20, 33], [3, 1])
    q = torch.randn(4, 4, 16, generator=g)
    calls = []
    real = attention.ragged_attention
    monkeypatch.setattr(attention, "ragged_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("ADAFLASH_KERNELS", "auto")
    kernel = RaggedAttention(batch, causal=causal).attend(cache, 0, q)
    assert calls == [1]
    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")  # torch's SDPA over the padded batch
    sdpa = RaggedAttention(batch, causal=causal).attend(cache, 0, q)
    assert calls == [1]
    torch.testing.assert_close(kernel, sdpa, atol=1e-5, rtol=1e-5)
    long = RaggedBatch.build([1], [0], [attention.MAX_QUERIES + 1])  # a prefill-sized query count: SDPA
    monkeypatch.setenv("ADAFLASH_KERNELS", "auto")
    RaggedAttention(long, causal=causal).attend(cache, 0, torch.randn(attention.MAX_QUERIES + 1, 4, 16, generator=g))
    assert calls == [1]


@pytest.mark.parametrize("threads", [2, 3])
def test_token_parts_over_threads_give_the_bits_of_one_token_at_a_time(threads):
    """With several threads a verification's tokens are spread over them in parts, and few sequences' KV heads are
    split likewise: every token gets the bits it gets alone, or in a batch of many sequences (one task each)."""
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(6, 3, 1100, 64, generator=g)).half(), (torch.randn(6, 3, 1100, 64, generator=g)).half()
    q = torch.randn(5, 9, 64, generator=g)
    lens = torch.tensor([1037, 600, 1099, 770, 513])  # several 256-key tasks, tails of 5 / 0 / 3 / 2 / 1 keys
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Five sequences of one token each (15 groups: one pass per group) against each token alone (3 groups).
        batch = attend(q, k, v, torch.arange(6), torch.tensor([5, 1, 2, 3, 4]), lens, scale=0.125)
        for t in range(5):
            alone = attend(q[t : t + 1], k, v, torch.tensor([0, 1]), torch.tensor([[5, 1, 2, 3, 4][t]]),
                                               lens[t : t + 1], scale=0.125)
            assert torch.equal(alone, batch[t : t + 1])
        # One sequence's 5 tokens (a verification: its tokens in parts over the threads) against the same batch.
        verify = attend(q, k, v, torch.tensor([0, 5]), torch.tensor([1]), lens, scale=0.125)
        one_slot = attend(q, k, v, torch.arange(6), torch.ones(5, dtype=torch.long), lens,
                                              scale=0.125)
        assert torch.equal(verify, one_slot)
    finally:
        torch.set_num_threads(previous)
    reference = _reference(q, k.float(), v.float(), torch.ones(5, dtype=torch.long), torch.arange(6), lens)
    torch.testing.assert_close(one_slot, reference, atol=2e-6, rtol=1e-5)
