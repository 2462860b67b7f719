"""Host and device memory: what a new allocation can take, and glibc's heap kept for large freed buffers.

`keep_freed_buffers`: a prefill pass allocates and frees ~25 MB activations per layer, and glibc's default hands each
back to the OS (munmap / heap trim) only to fault the pages in again, zeroed, at the next allocation - ~60k page
faults a 2048-token pass. With the thresholds raised the pages are reused: a prefill pass 0.91-0.98x the time, resident
memory the same (docs/results/runtime/malloc_ab.txt). `ADAFLASH_MALLOC=default` keeps glibc's defaults; elsewhere than
glibc this does nothing."""

from __future__ import annotations

import ctypes
import os

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 64 << 20  # allocations below this come from the heap, so their pages are reused
TRIM_THRESHOLD = 256 << 20  # the heap's free top returns to the OS only past this


def keep_freed_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; True where they were set."""
    if os.environ.get("ADAFLASH_MALLOC", "keep") == "default":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def free_memory(device: torch.device | str) -> int | None:
    """Bytes a new allocation on `device` can take now (None where it cannot be told): on CUDA the device's free
    memory plus what torch's allocator holds unused; on the CPU the kernel's MemAvailable (psutil's where installed)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None
    return int(psutil.virtual_memory().available)
