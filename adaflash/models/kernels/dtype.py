"""Pick the compute dtype the hardware runs fast."""

from __future__ import annotations

import torch

from adaflash.models.device.cpu import cpu_has_native_bf16
from adaflash.models.kernels import packed

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
# Not a torch dtype: fp32 everywhere, except that the target's GGUF-blocked linears round their inputs to int8
# (llama.cpp's arithmetic; load_target's int8_activations). Another model than fp32, chosen only when asked.
INT8 = "int8"


def own_cpu_kernels_available() -> bool:
    """Our fp32 CPU kernels (AVX2/FMA/F16C and a compiler; not ADAFLASH_KERNELS=stock) can run here."""
    return packed.enabled_library() is not None


def resolve_dtype(name: str = "auto", device: str = "cpu") -> torch.dtype:
    """auto: bf16 on accelerators; on a CPU fp32 wherever our kernels run - they need fp32, stream the GGUF's own
    blocks and ran batch-1 decoding ~3.5x faster than torch's bf16 even on a CPU with native bf16 (AMD EPYC with
    AVX512-BF16, 2 threads: 95 vs 28 tok/s; at batch 64 bf16 led by 12%, docs/runtime.md) - else bf16 only where
    the CPU has it natively (without it PyTorch emulates bf16 matmuls, several times slower than fp32)."""
    if name == "auto":
        if device != "cpu":
            return torch.bfloat16
        return torch.float32 if own_cpu_kernels_available() or not cpu_has_native_bf16() else torch.bfloat16
    if name == INT8:
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(DTYPES)}, {INT8}")
    return DTYPES[name]


# Formats the fp32 quantized kernel runs exactly but slowly (kquant.cpp dequantizes them into its chunked path): at
# speed only in the int8 kernel.
INT8_SPEED_FORMATS = frozenset({"Q5_0", "Q4_K", "Q5_K", "Q6_K"})


def auto_dtype_name(name: str, device: str, weight_formats: set[str]) -> str:
    """`name`, except that auto on a CPU runs a GGUF stored in INT8_SPEED_FORMATS (a Q4_K_M file, say) as int8, the
    arithmetic llama.cpp runs such a file with, where our kernels run here."""
    if name == "auto" and device == "cpu" and weight_formats & INT8_SPEED_FORMATS and own_cpu_kernels_available():
        return INT8
    return name


def int8_activations(name: str) -> bool:
    """Whether dtype `name` asks for the target's int8-activation linears (--dtype int8)."""
    return name == INT8
