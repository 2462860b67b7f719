"""The packed fp32 linear against torch, its batch-size independence, and the per-machine kernel choice."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

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
    kernel = packed.PackedLinear(w)
    buckets = selection.KernelChoice().buckets(w, kernel)
    assert len(buckets) == len(selection.ROW_BUCKETS)
    (cache,) = (tmp_path / "kernels").glob("choices-*.json")
    saved = json.loads(cache.read_text())
    assert set(saved["shapes"]["32x64"]) == {str(r) for r in selection.ROW_BUCKETS}
    # The cache decides from then on: make the stock kernel "faster" at every bucket and nothing is packed.
    for times in saved["shapes"]["32x64"].values():
        times["stock"], times["packed"] = 0.0, 1.0
    cache.write_text(json.dumps(saved))
    assert selection.KernelChoice().buckets(w, kernel) == (False,) * len(selection.ROW_BUCKETS)
    cache.write_text("{not json")  # damaged: measured again
    assert len(selection.KernelChoice().buckets(w, kernel)) == len(selection.ROW_BUCKETS)
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    assert selection.KernelChoice().buckets(w, kernel) == (True,) * len(selection.ROW_BUCKETS)
    monkeypatch.setenv("ADAFLASH_KERNELS", "fast")
    with pytest.raises(ValueError, match="auto, stock or packed"):
        selection.KernelChoice()


def test_fast_linear_runs_the_packed_kernel_only_in_its_buckets(monkeypatch):
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 32, generator=g), torch.randn(300, 32, generator=g)
    fast = selection.FastLinear(w, None, selection.KernelChoice())
    assert torch.equal(fast(x[:7]), fast.kernel(x[:7]))  # in a bucket: the packed kernel
    assert torch.equal(fast(x), selection.stock_linear(x, w))  # past the largest bucket: torch's


def test_target_model_uses_the_kernel_unless_told_not_to(tiny_checkpoints, monkeypatch):
    from adaflash.models.kv_cache import RaggedBatch
    from adaflash.models.target import load_target

    path = tiny_checkpoints["qwen2"]  # has q/k/v biases
    ids = torch.randint(0, 96, (12,))

    def logits(model):
        return model(ids, RaggedBatch.build([0], [0], [12]), model.new_cache(1, 32)).logits

    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    fast = load_target(path, dtype=torch.float32)
    assert fast.layers[0].fast and fast.fast_lm_head is not None
    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
    stock = load_target(path, dtype=torch.float32)
    assert not stock.layers[0].fast and stock.fast_lm_head is None
    torch.testing.assert_close(logits(fast), logits(stock), atol=1e-4, rtol=1e-4)
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
