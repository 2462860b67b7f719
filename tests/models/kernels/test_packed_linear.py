"""The packed fp32 and quantized linears against torch and each other, their batch-size independence, and the
per-machine kernel choice."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gguf import GGMLQuantizationType, quants

from adaflash.models.device.cpu import cpu_flags
from adaflash.models.kernels.quant import QuantizedWeight
from adaflash.models.kernels import packed, selection

pytestmark = pytest.mark.skipif(packed.library() is None, reason="packed kernel unavailable (no AVX2/FMA or compiler)")


@pytest.mark.parametrize("n,k", [(16, 8), (96, 300), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 64])
def test_matches_torch_linear(n, k, rows):
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    ref = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(packed.PackedLinear(w, b)(x), ref, atol=1e-4 * k ** 0.5, rtol=1e-5)
    torch.testing.assert_close(packed.PackedLinear(w)(x), F.linear(x.double(), w.double()).float(),
                               atol=1e-4 * k ** 0.5, rtol=1e-5)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Decode (1 row) and verification (16 rows) see bitwise the same linear outputs."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(3072, 576, generator=g), torch.randn(16, 576, generator=g)
    kernel = packed.PackedLinear(w)
    together = kernel(x)
    for i in range(16):
        assert torch.equal(kernel(x[i : i + 1]), together[i : i + 1])
    assert torch.equal(kernel(x[3:10]), together[3:10])


def test_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="% 16"):
        packed.PackedLinear(torch.randn(10, 8))
    with pytest.raises(ValueError, match="fp32"):
        packed.PackedLinear(torch.randn(16, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[m, 8\]"):
        packed.PackedLinear(torch.randn(16, 8))(torch.randn(2, 9))
    assert packed.PackedLinear(torch.randn(16, 8))(torch.randn(0, 8)).shape == (0, 16)


def test_choice_is_timed_once_cached_and_forced_by_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    monkeypatch.setenv("ADAFLASH_KERNELS", "auto")
    w = torch.randn(32, 64)
    kernels = {selection.PACKED: packed.PackedLinear(w)}
    buckets = selection.KernelChoice().buckets(w, kernels)
    assert len(buckets) == len(selection.ROW_BUCKETS) and set(buckets) <= {"stock", "packed"}
    (cache,) = (tmp_path / "kernels").glob("choices-*.json")
    saved = json.loads(cache.read_text())
    assert set(saved["shapes"]["32x64"]) == {str(r) for r in selection.ROW_BUCKETS}
    # The cache decides from then on: make the stock kernel "faster" at every bucket and nothing is packed.
    for times in saved["shapes"]["32x64"].values():
        times["stock"], times["packed"] = 0.0, 1.0
    cache.write_text(json.dumps(saved))
    assert selection.KernelChoice().buckets(w, kernels) == ("stock",) * len(selection.ROW_BUCKETS)
    # A kernel the cache has no time for (a quantized copy) is timed: the entry is measured again.
    raw = torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    with_q = {**kernels, "Q8_0": packed.QuantizedLinear(raw, "Q8_0", 64)}
    assert set(selection.KernelChoice().buckets(w, with_q)) <= {"stock", "packed", "Q8_0"}
    assert all("Q8_0" in t for t in json.loads(cache.read_text())["shapes"]["32x64"].values())
    cache.write_text("{not json")  # damaged: measured again
    assert len(selection.KernelChoice().buckets(w, kernels)) == len(selection.ROW_BUCKETS)
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    assert selection.KernelChoice().buckets(w, with_q) == ("packed",) * len(selection.ROW_BUCKETS)
    monkeypatch.setenv("ADAFLASH_KERNELS", "quantized")
    assert selection.KernelChoice().buckets(w, with_q) == ("Q8_0",) * len(selection.ROW_BUCKETS)
    assert selection.KernelChoice().buckets(w, kernels) == ("packed",) * len(selection.ROW_BUCKETS)  # none: packed
    monkeypatch.setenv("ADAFLASH_KERNELS", "fast")
    with pytest.raises(ValueError, match="auto, stock, packed or quantized"):
        selection.KernelChoice()


def test_fast_linear_runs_the_chosen_kernel_only_in_its_buckets(monkeypatch):
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 32, generator=g), torch.randn(300, 32, generator=g)
    fast = selection.FastLinear(w, None, selection.KernelChoice())
    assert fast.choices == ("packed",) * len(selection.ROW_BUCKETS)
    assert torch.equal(fast(x[:7]), packed.PackedLinear(w)(x[:7]))  # in a bucket: the packed kernel
    assert torch.equal(fast(x), selection.stock_linear(x, w))  # past the largest bucket: torch's


def test_an_exact_choice_gives_a_row_the_same_bits_whatever_the_timing_said(tmp_path, monkeypatch):
    """The target's choice (exact=True): with a cached timing in which torch's kernel is fastest at every bucket, a
    free choice takes torch's - whose rows differ in bits from ours - while the exact one keeps ours at every row
    count, past the buckets too: a row computed alone (a decode step), in 16 (a verification) or in 300 (a prefill or a
    wide batch) has the same bits however the timing fell."""
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    monkeypatch.setenv("ADAFLASH_KERNELS", "auto")
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(64, 576, generator=g), torch.randn(300, 576, generator=g)
    raw = torch.from_numpy(quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    deq = torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType.Q8_0).copy())
    selection.KernelChoice().buckets(deq, {selection.PACKED: packed.PackedLinear(deq)})  # writes the cache entry
    (cache,) = (tmp_path / "kernels").glob("choices-*.json")
    saved = json.loads(cache.read_text())
    for times in saved["shapes"]["64x576"].values():
        times.update(stock=0.001, packed=1.0, Q8_0=1.0)
    cache.write_text(json.dumps(saved))
    free = selection.FastLinear(deq, None, selection.KernelChoice(), QuantizedWeight("Q8_0", raw))
    exact = selection.FastLinear(deq, None, selection.KernelChoice(exact=True), QuantizedWeight("Q8_0", raw))
    assert free.choices == ("stock",) * len(selection.ROW_BUCKETS)
    assert "stock" not in exact.choices
    whole = exact(x)
    for rows in (1, 16, 256, 300):
        assert torch.equal(exact(x[:rows]), whole[:rows]), rows
    # (torch's kernel sums in another order on most CPUs - the bits the exact choice avoids - but oneDNN's AVX2 path on
    # a Zen 3 gave our bits here, so that difference is not asserted)
    assert torch.equal(free(x[:1]), selection.stock_linear(x[:1], deq))


def _gguf_blocks(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized by gguf: (the blocks [n, k / 32 * bytes], gguf's own dequantization [n, k])."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qtype = getattr(GGMLQuantizationType, fmt)
    raw = quants.quantize(w, qtype)
    return torch.from_numpy(raw.copy()), torch.from_numpy(quants.dequantize(raw, qtype).copy())


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (80, 64), (576, 1536), (112, 288)])
def test_quantized_kernel_is_bitwise_the_fp32_kernel_on_the_dequantized_weights(fmt, n, k):
    """The quantized kernel streams the GGUF's blocks; its outputs are exactly the fp32 kernel's on gguf's
    dequantized values (so it is the same target), for every row count and row subset (decode = verify)."""
    raw, deq = _gguf_blocks(fmt, n, k, seed=n + k)
    g = torch.Generator().manual_seed(n * k)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        quantized, fp32 = packed.QuantizedLinear(raw, fmt, k, b), packed.PackedLinear(deq, b)
        x = torch.randn(9, k, generator=g)
        together = fp32(x)
        torch.testing.assert_close(together, F.linear(x.double(), deq.double(), None if b is None else b.double())
                                   .float(), atol=1e-4 * k ** 0.5, rtol=1e-5)
        for start in range(9):
            for stop in range(start + 1, min(9, start + 8) + 1):  # 1..8 rows: the few-rows and blocked paths
                assert torch.equal(quantized(x[start:stop]), together[start:stop]), (start, stop)
                assert torch.equal(fp32(x[start:stop]), together[start:stop]), (start, stop)
        assert torch.equal(quantized(x), together)


@pytest.mark.parametrize("n,k", [(16, 32), (80, 64), (576, 1536), (112, 288)])
def test_bf16_kernel_is_bitwise_the_fp32_kernel_on_bf16_valued_weights(n, k):
    """A drafter saved in bf16 and run in fp32: the BF16 kernel widens each weight exactly, so every row count gives
    the fp32 kernel's outputs bit for bit, from half the bytes."""
    from adaflash.models.kernels.quant import exact_bf16_blocks

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16).float()
    blocks = exact_bf16_blocks(w)
    assert blocks is not None and blocks.fmt == "BF16" and blocks.blocks.shape == (n, 2 * k)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        bf16, fp32 = packed.QuantizedLinear(blocks.blocks, "BF16", k, b), packed.PackedLinear(w, b)
        for rows in (1, 2, 3, 4, 5, 8, 16, 70):
            x = torch.randn(rows, k, generator=g)
            assert torch.equal(bf16(x), fp32(x)), rows
    assert bf16.packed.numel() == n * k * 2  # half the packed fp32 copy's bytes


@pytest.mark.skipif("avx512bw" not in cpu_flags(), reason="the CPU has no AVX-512: only the 8-lane path runs")
@pytest.mark.parametrize("fmt", ["fp32", "Q4_1", "Q8_0", "BF16"])
def test_the_16_lane_paths_give_the_8_lane_bits(fmt):
    """Where the CPU has AVX-512 a panel's 16 outputs run as one vector - 1-4 rows (a decode step, a short
    verification) and the blocked path of 5+ rows: each output's FMA chain and each weight's dequantisation
    unchanged, so the same bits."""
    from adaflash.models.kernels.quant import exact_bf16_blocks

    n, k = 96, 320
    raw, deq = _gguf_blocks(fmt if fmt in ("Q4_1", "Q8_0") else "Q8_0", n, k, seed=11)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(12))
    if fmt == "fp32":
        kernel = packed.PackedLinear(deq, bias)
    elif fmt == "BF16":
        kernel = packed.QuantizedLinear(exact_bf16_blocks(deq.bfloat16().float()).blocks, "BF16", k, bias)
    else:
        kernel = packed.QuantizedLinear(raw, fmt, k, bias)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(13))
    counts = (1, 2, 3, 4, 5, 13, 70)
    wide = [kernel(x[:rows]) for rows in counts]
    lib = packed.library()
    lib.adaflash_linear_allow_avx512(0)
    try:
        narrow = [kernel(x[:rows]) for rows in counts]
    finally:
        lib.adaflash_linear_allow_avx512(1)
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow))


def test_only_exactly_bf16_weights_get_bf16_blocks():
    from adaflash.models.kernels.quant import exact_bf16_blocks

    w = torch.randn(16, 64)
    assert exact_bf16_blocks(w) is None  # fp32 values: a bf16 copy would change the weights
    assert exact_bf16_blocks(w.to(torch.bfloat16).float()[:, :48]) is None  # k not a multiple of 32
    assert exact_bf16_blocks(w.to(torch.bfloat16)) is None  # the kernel reads fp32 activations of fp32 weights


def test_quantized_kernel_rejects_what_it_cannot_run():
    raw, _ = _gguf_blocks("Q4_1", 16, 64, seed=0)
    with pytest.raises(ValueError, match="no kernel for"):
        packed.QuantizedLinear(raw, "Q3_K", 64)
    with pytest.raises(ValueError, match=r"uint8 \[16, 40\]"):
        packed.QuantizedLinear(raw[:, :20], "Q4_1", 64)
    with pytest.raises(ValueError, match="k % 32"):
        packed.QuantizedLinear(raw, "Q4_1", 48)


def test_target_model_uses_the_kernel_unless_told_not_to(tiny_checkpoints, monkeypatch):
    from adaflash.models.kv_cache.ragged import RaggedBatch
    from adaflash.models.targets.model import load_target

    path = tiny_checkpoints["qwen2"]  # has q/k/v biases
    ids = torch.randint(0, 96, (12,))

    def logits(model):
        return model(ids, RaggedBatch.build([0], [0], [12]), model.new_cache(1, 32)).logits

    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    fast = load_target(path, dtype=torch.float32)
    assert fast.layers[0].fast and fast.fast_lm_head is not None
    ours = logits(fast)  # our linears, attention and fused steps
    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
    stock = load_target(path, dtype=torch.float32)
    assert not stock.layers[0].fast and stock.fast_lm_head is None
    torch.testing.assert_close(ours, logits(stock), atol=1e-4, rtol=1e-4)  # torch's throughout
    assert load_target(path, dtype=torch.bfloat16).fast_lm_head is None  # bf16: torch's kernels


def test_a_weight_changed_after_packing_runs_torchs_kernel_on_the_new_values(monkeypatch):
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(32, 16, generator=g), torch.randn(4, 16, generator=g)
    fast = selection.FastLinear(w, None, selection.KernelChoice())
    before = fast(x)
    w.mul_(2.0)  # in place: the packed copy is stale now
    torch.testing.assert_close(fast(x), 2 * before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast(x), selection.stock_linear(x, w))


def test_bias_and_device_checks():
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        packed.PackedLinear(torch.randn(16, 8), torch.randn(8))


def test_a_near_tie_goes_to_the_kernel_streaming_fewer_bytes():
    """Timings wobble ~10% on a shared machine: within NEAR_TIE of the fastest, fewer bytes win (and ours win over
    torch's at equal bytes); a clearly faster kernel still wins."""
    order = ["Q4_1", "packed", "stock"]
    assert selection._pick(order, {"Q4_1": 0.120, "packed": 0.115, "stock": 0.3}) == "Q4_1"
    assert selection._pick(order, {"Q4_1": 0.200, "packed": 0.115, "stock": 0.3}) == "packed"
    assert selection._pick(order, {"Q4_1": 0.5, "packed": 0.105, "stock": 0.1}) == "packed"
    assert selection._pick(order, {"Q4_1": 0.5, "packed": 0.2, "stock": 0.1}) == "stock"


def test_candidates_are_timed_round_robin_and_the_minimum_kept(monkeypatch):
    """Each repeat times every candidate once, so a slow stretch of a shared machine falls on all of them alike."""
    now, calls = [0.0], []
    scripted = {"a": iter([0.0, 5e-3, 1e-3, 2e-3]), "b": iter([0.0, 3e-3, 6e-3, 4e-3])}  # warm-up, then 3 timed calls

    def candidate(name):
        def run():
            calls.append(name)
            now[0] += next(scripted[name])
        return run

    monkeypatch.setattr(selection.time, "perf_counter", lambda: now[0])
    ms = selection._min_ms_each({"a": candidate("a"), "b": candidate("b")}, torch.ones(4), repeats=3)
    assert calls == ["a", "b"] + ["a", "b"] * 3
    assert ms == pytest.approx({"a": 1.0, "b": 3.0})
