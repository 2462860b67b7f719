"""Q5_0, Q4_K, Q5_K, Q6_K (kquant.cpp) and Q4_0 (run as Q8_0): the fp32 quantized kernel is bitwise the packed fp32
kernel on gguf's own dequantization, and the int8 kernel is the int8 arithmetic (checked in float64) and gives a row
the same bits at every row count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from adaflash.models.kernels import kquant, packed
from adaflash.models.kernels.quant import QUANT_FORMATS, runnable

pytestmark = pytest.mark.skipif(packed.library() is None, reason="our CPU kernels are unavailable (no AVX2 or compiler)")

KQUANTS = ("Q5_0", "Q4_K", "Q5_K", "Q6_K")
SCALE_BYTES = {"Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fp16 scales: where


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Valid GGUF blocks of an [n, k] weight: random quants and 6-bit / 8-bit scales, fp16 scales of weight size
    (gguf-py cannot quantize the K formats; any bytes are valid blocks once the fp16 scales are finite)."""
    rng = np.random.default_rng(seed)
    spec = QUANT_FORMATS[fmt]
    b = rng.integers(0, 256, size=(n * (k // spec.block_k), spec.block_bytes), dtype=np.uint8)
    for col in SCALE_BYTES[fmt]:
        d = (rng.standard_normal(b.shape[0]) * (0.01 if fmt == "Q5_0" else 0.002)).astype(np.float16)
        b[:, col:col + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(n, -1)


def int8_reference(x: np.ndarray, fmt: str, raw: np.ndarray, k: int) -> np.ndarray:
    """kquant.cpp's int8 arithmetic in float64: activations rounded per 32 (as int8_linear.cpp), then per block of
    32 k (16 for Q6_K) the exact integer dot scaled by S d_x, plus M d_x sum(q_x)."""
    m, n = x.shape[0], raw.shape[0]
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    d_x = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d_x > 0, np.float32(1) / np.where(d_x > 0, d_x, 1), 0).astype(np.float32)
    q_x = np.rint(xb * inv[..., None]).astype(np.int64).reshape(m, k)
    q, f = kquant.decode(fmt, raw, k)
    q = q.astype(np.int64)
    d = f["d"].view(np.float16).astype(np.float64)
    if fmt == "Q6_K":
        group, q = 16, q - 32
        s = np.repeat(d, 16, axis=1) * f["sc"].view(np.int8)
        mn = np.zeros_like(s)
    elif fmt == "Q5_0":
        group, s, mn = 32, d, -16 * d
    else:
        group = 32
        s = np.repeat(d, 8, axis=1) * f["sc"]
        mn = -np.repeat(f["dmin"].view(np.float16).astype(np.float64), 8, axis=1) * f["m"]
    g = k // group
    dots = np.einsum("rgi,ngi->rng", q_x.reshape(m, g, group), q.reshape(n, g, group)).astype(np.float64)
    sums = q_x.reshape(m, g, group).sum(-1).astype(np.float64)
    dx = np.repeat(d_x.astype(np.float64), 32 // group, axis=1)  # per group
    return (dots * s[None] * dx[:, None]).sum(-1) + (mn[None] * (dx * sums)[:, None]).sum(-1)


@pytest.mark.parametrize("fmt", KQUANTS)
def test_decoding_gives_ggufs_values_bitwise(fmt):
    raw = random_blocks(fmt, 32, 512, seed=1)
    ours = kquant.dequantize(fmt, raw, 512)
    theirs = quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(32, 512)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("n,k", [(16, 256), (48, 512), (32, 1280)])
def test_fp32_quantized_kernel_is_the_fp32_kernel_on_ggufs_values(fmt, n, k):
    raw = random_blocks(fmt, n, k, seed=n + k)
    weight = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(n, k).copy())
    g = torch.Generator().manual_seed(k)
    bias = torch.randn(n, generator=g)
    x = torch.randn(9, k, generator=g)
    fp32 = packed.PackedLinear(weight, bias)
    ours = packed.QuantizedLinear(torch.from_numpy(raw), fmt, k, bias)
    for m in (1, 2, 4, 5, 9):
        assert torch.equal(ours(x[:m]), fp32(x[:m])), m


@pytest.mark.parametrize("fmt", KQUANTS)
@pytest.mark.parametrize("n,k", [(16, 256), (80, 768)])
def test_int8_kernel_is_the_int8_arithmetic_and_row_independent(fmt, n, k):
    raw = random_blocks(fmt, n, k, seed=n * k)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(10, k, generator=g)
    x[2, :32] = 0  # an all-zero activation block
    x[6, 5] = 40.0  # an outlier
    bias = torch.randn(n, generator=g)
    kernel = packed.Int8Linear(torch.from_numpy(raw), fmt, k, bias)
    together = kernel(x)
    want = int8_reference(x.numpy(), fmt, raw, k) + bias.double().numpy()
    np.testing.assert_allclose(together.double().numpy(), want, rtol=1e-5, atol=1e-5 * abs(want).max())
    for start in range(10):
        for stop in (start + 1, min(start + 5, 10), 10):
            assert torch.equal(kernel(x[start:stop]), together[start:stop]), (start, stop)


def test_q4_0_runs_as_q8_0_with_the_same_values():
    w = np.random.default_rng(3).standard_normal((32, 96)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q4_0)
    as_q8_0 = runnable("Q4_0", torch.from_numpy(raw.copy()))
    assert as_q8_0.fmt == "Q8_0"
    theirs = quants.dequantize(raw, GGMLQuantizationType.Q4_0)
    ours = quants.dequantize(as_q8_0.blocks.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_a_split_weight_runs_each_part_into_its_outputs():
    """q / k in Q4_K and v in Q6_K (a Q4_K_M file's attention): one linear, each part its own kernel."""
    from adaflash.models.kernels.quant import QuantizedWeight, stacked
    from adaflash.models.kernels.selection import KernelChoice, FastLinear

    k = 256
    parts = [QuantizedWeight("Q4_K", torch.from_numpy(random_blocks("Q4_K", 32, k, seed=5))),
             QuantizedWeight("Q6_K", torch.from_numpy(random_blocks("Q6_K", 16, k, seed=6)))]
    weight = stacked(parts)
    assert weight.fmt == "Q4_K+Q6_K"
    bias = torch.randn(48)
    x = torch.randn(3, k)
    fast = FastLinear(torch.empty(48, k, device="meta"), bias, KernelChoice(int8_activations=True), weight)
    each = torch.cat([packed.Int8Linear(p.blocks, p.fmt, k, b)(x) for p, b in zip(parts, bias.split([32, 16]))], 1)
    assert torch.equal(fast(x), each)


def test_a_weight_of_more_rows_than_a_packing_slice_packs_as_its_parts():
    raw = torch.from_numpy(random_blocks("Q6_K", 4096 + 32, 256, seed=9))
    x = torch.randn(2, 256)
    whole = packed.Int8Linear(raw, "Q6_K", 256)(x)
    assert torch.equal(whole[:, 4096:], packed.Int8Linear(raw[4096:], "Q6_K", 256)(x))
    assert torch.equal(whole[:, :32], packed.Int8Linear(raw[:32], "Q6_K", 256)(x))
