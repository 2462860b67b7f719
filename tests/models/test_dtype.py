"""`--dtype auto`: fp32 wherever our CPU kernels run, bf16 on accelerators or a native-bf16 CPU without them."""

from __future__ import annotations

import pytest
import torch

from adaflash.models.kernels import dtype


@pytest.mark.parametrize("kernels,native,want", [(True, True, torch.float32), (True, False, torch.float32),
                                                  (False, True, torch.bfloat16), (False, False, torch.float32)])
def test_auto_on_a_cpu(monkeypatch, kernels, native, want):
    monkeypatch.setattr(dtype, "own_cpu_kernels_available", lambda: kernels)
    monkeypatch.setattr(dtype, "cpu_has_native_bf16", lambda: native)
    assert dtype.resolve_dtype("auto") == want
    assert dtype.resolve_dtype("auto", device="cuda") == torch.bfloat16
    assert dtype.resolve_dtype("bf16") == torch.bfloat16 and dtype.resolve_dtype("fp32") == torch.float32


def test_stock_kernels_switch_turns_ours_off(monkeypatch):
    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
    assert not dtype.own_cpu_kernels_available()


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dtype.resolve_dtype("fp8")


def test_int8_is_fp32_with_the_targets_int8_linears():
    """--dtype int8 is not a torch dtype: everything is fp32 except the target's GGUF-blocked linears."""
    assert dtype.resolve_dtype("int8") == torch.float32
    assert dtype.int8_activations("int8") and not dtype.int8_activations("fp32") and not dtype.int8_activations("auto")
