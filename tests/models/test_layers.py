"""models/layers.py: the RoPE table against the formula it caches."""

from __future__ import annotations

import pytest
import torch

from adaflash.models.layers import _inv_freq, rope_cos_sin


def _rope_formula(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    freqs = positions.float()[:, None] * _inv_freq(head_dim, theta, positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 1e6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_are_the_formulas_bits(head_dim, theta, dtype):
    """Decode, verify and prefill positions, and one past the table's first size (it grows): bitwise the formula."""
    for positions in (torch.tensor([0]), torch.arange(100, 102), torch.arange(5, 21),
                      torch.randint(0, 4000, (300,), generator=torch.Generator().manual_seed(0)),
                      torch.arange(4090, 4200)):
        ours = rope_cos_sin(positions, head_dim, theta, dtype)
        formula = _rope_formula(positions, head_dim, theta, dtype)
        assert ours[0].shape == (len(positions), 1, head_dim)
        assert torch.equal(ours[0], formula[0]) and torch.equal(ours[1], formula[1])
        if torch.equal(positions, torch.arange(int(positions[0]), int(positions[0]) + len(positions))):
            rows = rope_cos_sin(positions, head_dim, theta, dtype, first=int(positions[0]))  # views, no gather
            assert rows[0].is_contiguous() and torch.equal(rows[0], ours[0]) and torch.equal(rows[1], ours[1])


def test_rope_table_serves_training_passes():
    """Made outside inference mode, so a training pass can use a table first filled by an inference pass."""
    with torch.inference_mode():
        rope_cos_sin(torch.arange(8), 16, 10000.0, torch.float32)
    want_cos, want_sin = _rope_formula(torch.arange(8), 16, 10000.0, torch.float32)
    for first in (None, 0):  # a gather of the table's rows, and views of them (what forward_train takes)
        x = torch.randn(8, 2, 16, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(8), 16, 10000.0, torch.float32, first=first)
        assert not cos.is_inference() and not sin.is_inference()
        (x * cos + x * sin).sum().backward()
        # d/dx of sum(x * cos + x * sin) is cos + sin: the formula's values at these positions, for every head.
        torch.testing.assert_close(x.grad, (want_cos + want_sin).expand(8, 2, 16), atol=1e-6, rtol=1e-6)
