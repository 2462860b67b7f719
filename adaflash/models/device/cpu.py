"""What this CPU is: its model name (what results and kernel caches are keyed by) and its instruction-set flags.
Read from /proc/cpuinfo each time, never assumed: the same project runs on AVX2-only, AVX-512 and AMX machines."""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo lists them (avx2, avx512_vnni, amx_int8, ...); empty where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them PyTorch emulates bf16 matmuls and they run several times slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
