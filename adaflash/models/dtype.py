"""Pick the compute dtype the hardware runs fast."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them PyTorch emulates bf16 matmuls and they run several times slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str = "auto", device: str = "cpu") -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device != "cpu" or cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[name]
