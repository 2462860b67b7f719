"""The fused decoder-layer kernels (kernels/fused.cpp) against the torch ops they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adaflash.models.kernels import packed
from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.kv_cache.ragged import RaggedAttention, RaggedBatch
from adaflash.models.layers import apply_rope, argmax_rows, fused_kernels_available, rms_norm, rope_cos_sin

pytestmark = pytest.mark.skipif(packed.library() is None, reason="kernels unavailable (no AVX2/FMA or compiler)")


@torch.inference_mode()
@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (3, 9, 64), (70, 20)])
def test_rms_norm_matches_torch(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    assert fused_kernels_available(x)
    with torch.profiler.profile() as prof:  # the kernel ran (not torch's, which would pass the comparison too)
        ours = rms_norm(x, w, 1e-5)
    assert any(e.name == "adaflash::rms_norm" for e in prof.events())
    torch.testing.assert_close(ours, F.rms_norm(x, (shape[-1],), w, eps=1e-5), atol=1e-6, rtol=1e-6)


@torch.inference_mode()
@pytest.mark.parametrize("rows,cols", [(1, 49152), (2, 16384), (9, 13), (3, 7), (20, 1)])
def test_argmax_rows_is_torchs_argmax(rows, cols):
    """Random rows, then ties (the first largest wins), a NaN (it wins, the first NaN), +-0, -inf rows and a largest
    value in the scalar tail - each against torch.argmax."""
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g)
    cases = [x, x.round(), torch.zeros(rows, cols), torch.full((rows, cols), float("-inf"))]
    signed_zero = torch.zeros(rows, cols)
    signed_zero[:, ::2] = -0.0
    cases.append(signed_zero - 1.0 * (torch.arange(cols) > cols // 2))
    with_nan = x.clone()
    with_nan[0, cols // 2] = float("nan")
    with_nan[-1, cols - 1] = float("nan")
    cases.append(with_nan)
    tail = x.clone()
    tail[:, -1] = 100.0
    cases.append(tail)
    for case in cases:
        with torch.profiler.profile() as prof:
            ours = argmax_rows(case)
        assert any(e.name == "adaflash::argmax_rows" for e in prof.events())
        assert torch.equal(ours, case.argmax(-1)), case


def test_rms_norm_keeps_torchs_kernel_under_autograd():
    """Under autograd our kernel (no backward) must step aside: the gradients of x and w are those of the formula
    x / sqrt(mean(x^2) + eps) * w written out from plain ops."""
    g = torch.Generator().manual_seed(0)
    x0, w0, weights = torch.randn(2, 16, generator=g) * 3, torch.randn(16, generator=g), torch.randn(2, 16, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with torch.profiler.profile() as prof:
        (rms_norm(x, w, 1e-6) * weights).sum().backward()  # weighted: every output's gradient counts apart
    assert not any(e.name == "adaflash::rms_norm" for e in prof.events())
    rx, rw = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    (rx * torch.rsqrt(rx.pow(2).mean(-1, keepdim=True) + 1e-6) * rw * weights).sum().backward()
    assert x.grad.abs().sum() > 0 and w.grad.abs().sum() > 0
    torch.testing.assert_close(x.grad, rx.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, rw.grad, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("slots,starts,lens", [([1], [5], [1]), ([1], [0], [12]), ([2, 0, 3], [4, 9, 0], [1, 3, 5])])
def test_rope_and_write_is_bitwise_the_unfused_path(slots, starts, lens, cache_dtype):
    """16-bit caches too: the kernel rounds each value as torch's .to() does; an int8 cache's rows and scales as the
    cache's torch path quantizes them; writes cross 8-position blocks."""
    nq, nkv, d = 6, 2, 16
    g = torch.Generator().manual_seed(sum(lens))
    batch = RaggedBatch.build(slots, starts, lens)
    qkv = torch.randn(batch.num_tokens, (nq + 2 * nkv) * d, generator=g) * 300  # fp16 rounding at every magnitude
    cos, sin = rope_cos_sin(batch.positions, d, 10000.0, torch.float32)
    caches = [KVCache(2, 4, 32, nkv, d, cache_dtype, block_size=8) for _ in range(2)]
    for cache in caches:  # the whole pools compared below: the blocks never taken too
        for x in (cache.k, cache.v, cache.k_scale, cache.v_scale):
            if x is not None:
                x.zero_()
        RaggedAttention(batch, causal=True).reserve(cache)
    fused = RaggedAttention(batch, causal=True).rope_and_write(caches[0], 1, qkv, cos, sin, nq)
    t = batch.num_tokens
    q = apply_rope(qkv[:, : nq * d].view(t, nq, d), cos, sin)
    k = apply_rope(qkv[:, nq * d : (nq + nkv) * d].view(t, nkv, d), cos, sin)
    RaggedAttention(batch, causal=True).write(caches[1], 1, k, qkv[:, (nq + nkv) * d :].view(t, nkv, d))
    assert torch.equal(fused, q)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    if cache_dtype == torch.int8:
        assert torch.equal(caches[0].k_scale, caches[1].k_scale) and torch.equal(caches[0].v_scale, caches[1].v_scale)
        assert caches[0].k_scale.abs().sum() > 0


@pytest.mark.parametrize("threads", [1, 2])
def test_stream_read_reads_every_byte(threads):
    """The benchmarks' bandwidth probe: its checksum is the byte-lane sums of each thread's share (so no read can be
    optimised away), checked against numpy."""
    lib = packed.library()
    data = torch.randint(0, 256, (128 * 1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))

    def share_checksum(share: np.ndarray) -> int:
        lanes = share.reshape(-1, 4, 32).astype(np.uint64).sum(axis=(0, 1)) % 256  # 32 byte lanes, wrapping adds
        words = lanes.astype(np.uint8).view(np.uint64)
        return int(words[0] ^ words[1] ^ words[2] ^ words[3])

    lines = data.numel() // 128
    shares = [data.numpy()[lines * t // threads * 128: lines * (t + 1) // threads * 128] for t in range(threads)]
    expected = sum(share_checksum(s) for s in shares) % 2**64
    assert lib.adaflash_stream_read(data.data_ptr(), data.numel(), threads) == expected
    data[777] += 1
    assert lib.adaflash_stream_read(data.data_ptr(), data.numel(), threads) != expected
