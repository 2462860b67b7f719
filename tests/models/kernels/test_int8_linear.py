"""The int8-activation linear (`--dtype int8`): llama.cpp's arithmetic over a GGUF's Q4_1 / Q8_0 blocks, checked
against a float64 reference of that arithmetic, row-independent (decode = verify), the same bits on its AVX2 and
AVX512-VNNI / AMX paths, and what the kernel choice runs with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adaflash.models.kernels.quant import QuantizedWeight
from adaflash.models.kernels import packed, selection
from tests.models.kernels.test_packed_linear import _gguf_blocks

pytestmark = pytest.mark.skipif(packed.library() is None, reason="our CPU kernels are unavailable (no AVX2 or compiler)")


def _reference(x: np.ndarray, raw: np.ndarray, fmt: str) -> np.ndarray:
    """The kernel's arithmetic in float64: each 32-value activation block rounded to int8 (d = max|x| / 127 and
    q = rint(x * (1 / d)) in fp32), each block's integer dot scaled by d_w d_x (+ m_w d_x sum(q_x) for Q4_1)."""
    m, k = x.shape
    n = raw.shape[0]
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    d_x = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d_x > 0, np.float32(1) / np.where(d_x > 0, d_x, 1), 0).astype(np.float32)
    q_x = np.rint(xb * inv[..., None]).astype(np.int64)
    blocks = raw.reshape(n, k // 32, -1)
    d_w = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    if fmt == "Q4_1":
        m_w = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        qs = blocks[..., 4:]
        q_w = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)
    else:
        q_w = blocks[..., 2:].view(np.int8).astype(np.int64)
    y = (np.einsum("rbi,nbi->rnb", q_x, q_w) * d_w[None] * d_x[:, None, :].astype(np.float64)).sum(-1)
    if fmt == "Q4_1":
        y += (m_w[None] * (d_x * q_x.sum(-1))[:, None, :]).sum(-1)
    return y


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (80, 64), (576, 1536), (112, 288)])
def test_int8_kernel_is_the_int8_arithmetic_and_row_independent(fmt, n, k):
    raw, deq = _gguf_blocks(fmt, n, k, seed=n + k + 1)
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(11, k, generator=g)
    x[3, :32] = 0  # an all-zero activation block (d = 0)
    x[5, 40 % k] = 50.0  # an outlier: its block's other values round to few levels
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        kernel = packed.Int8Linear(raw, fmt, k, b)
        together = kernel(x)
        want = _reference(x.numpy(), raw.numpy(), fmt) + (0 if b is None else b.double().numpy())
        np.testing.assert_allclose(together.double().numpy(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
        exact = F.linear(x, deq, b)  # close to the fp32 linear on the same weights, never equal
        assert (together - exact).abs().max() < 0.05 * exact.abs().max()
        assert not torch.equal(together, exact)
        for start in range(11):  # every tile shape (1..4 rows, 1 / 2 / 4 panels) gives a row the same bits
            for stop in range(start + 1, 12):
                assert torch.equal(kernel(x[start:stop]), together[start:stop]), (start, stop)


@pytest.mark.skipif(packed.int8_isa() == "avx2", reason="the CPU has no AVX512-VNNI: only the AVX2 path runs here")
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [320, 288])  # an even and an odd number of blocks (AMX multiplies two at a time)
def test_every_instruction_set_gives_the_same_bits(fmt, k):
    """AVX2, AVX512-VNNI and (where the CPU has it) AMX, which runs Q8_0 from 8 rows: the same bits at every row count -
    AMX's 16-row tiles full, partial and several, in one 128-row chunk and across two."""
    raw, _ = _gguf_blocks(fmt, 96, k, seed=7)
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(3))
    kernel = packed.Int8Linear(raw, fmt, k)
    best, default = packed.int8_isa_supported(), packed.int8_isa()
    paths = packed.INT8_ISAS[: packed.INT8_ISAS.index(best) + 1]
    for rows in (1, 2, 5, 8, 16, 17, 40, 150):
        results = {}
        for isa in paths:
            with packed.int8_isa_limit(isa):
                results[isa] = kernel(x[:rows])
        assert packed.int8_isa() == default  # each limit restores the process's own path
        for isa in paths[1:]:
            assert torch.equal(results[isa], results["avx2"]), (isa, rows)


def test_int8_runs_every_row_count_where_blocks_exist_and_nothing_else_changes():
    raw, deq = _gguf_blocks("Q4_1", 32, 64, seed=5)
    fast = selection.FastLinear(deq, None, selection.KernelChoice(int8_activations=True), QuantizedWeight("Q4_1", raw))
    x = torch.randn(300, 64)  # past the largest row bucket too: prefill is the same model
    assert torch.equal(fast(x), packed.Int8Linear(raw, "Q4_1", 64)(x))
    assert fast.choices == ("Q4_1xint8",) * len(selection.ROW_BUCKETS)
    assert fast.streamed_bytes(1) == 2 * 2 * 20 * 16  # 2 panels x 2 blocks x the Q4_1 packed block
    bf16 = selection.FastLinear(deq.bfloat16().float(), None, selection.KernelChoice(int8_activations=True),
                                QuantizedWeight("BF16", deq.bfloat16().view(torch.uint8)))
    assert "xint8" not in bf16.choices[0]  # no int8 kernel for BF16 blocks: chosen as fp32 would be
    with pytest.raises(ValueError, match="no kernel for 'BF16'"):
        packed.Int8Linear(raw, "BF16", 64)


def test_amx_runs_only_where_asked(monkeypatch):
    """A process runs AMX only with ADAFLASH_INT8_AMX=1 (packed._int8_default_limit says why); VNNI is its best
    otherwise, and the CPU's own best is still reported."""
    assert packed._int8_default_limit() == packed.INT8_ISAS.index("avx512-vnni")
    supported = packed.int8_isa_supported()
    assert packed.int8_isa() == ("avx2" if supported == "avx2" else "avx512-vnni")
    monkeypatch.setenv("ADAFLASH_INT8_AMX", "1")
    assert packed._int8_default_limit() == packed.INT8_ISAS.index("amx")
    with packed.int8_isa_limit("amx"):
        pass  # the limit's exit restores the default, which now allows AMX
    assert packed.int8_isa() == supported
    monkeypatch.delenv("ADAFLASH_INT8_AMX")
    with packed.int8_isa_limit("amx"):
        pass
    assert packed.int8_isa() == ("avx2" if supported == "avx2" else "avx512-vnni")


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_round_and_multiply_to_the_bits_of_one_thread(threads):
    """From 128 blocks of activations the threads round them in parallel, and 200 rows run as two row chunks in one
    threaded region: the same bits as one thread, and as each row alone."""
    raw, _ = _gguf_blocks("Q4_1", 96, 576, seed=9)
    kernel = packed.Int8Linear(raw, "Q4_1", 576, None)
    g = torch.Generator().manual_seed(9)
    x, other = torch.randn(200, 576, generator=g), torch.randn(200, 576, generator=g)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel(other)  # the rounding scratch now holds other rows: a block no thread rounds would keep them
        threaded = kernel(x)
        rows = [kernel(x[i : i + 1]) for i in (0, 127, 128, 199)]
    finally:
        torch.set_num_threads(previous)
    one = kernel(x)
    assert torch.equal(threaded, one)
    assert all(torch.equal(row, one[i : i + 1]) for row, i in zip(rows, (0, 127, 128, 199)))
