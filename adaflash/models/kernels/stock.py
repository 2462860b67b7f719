"""torch's own linear, the baseline every kernel of ours is timed against and falls back to."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _onednn_linear_available() -> bool:
    try:
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        return bool(torch.allclose(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), F.linear(x, w)))
    except (AttributeError, RuntimeError):
        return False


# MKL's sgemm is several times slower than oneDNN for the skinny matmuls of decoding and verification on
# some CPUs (measured 2-4x at 4-16 rows on AVX2 EPYC); oneDNN's fp32 linear is the kernel inductor uses.
_ONEDNN_FP32_LINEAR = _onednn_linear_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Inference-only linear layer for 2-D inputs (no autograd through the oneDNN path)."""
    if _ONEDNN_FP32_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
