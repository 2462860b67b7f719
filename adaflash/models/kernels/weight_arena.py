"""The int8 kernel's packed weights laid out in 2 MB pages, in the order they are packed (the order a forward reads
them).

Why: a decode step streams every weight once from memory (~97 MB for SmolLM2 with `--dtype int8`, three times the
L3); with 4 KB pages that stream walks a TLB miss every 4 KB, with transparent huge pages (`madvise`, the default
setting of most kernels) one per 2 MB. Measured: 0.98-0.99x a decode step (docs/results/runtime/huge_pages_ab.txt)
- small. Weights are carved from 64 MB chunks in packing order, so a layer's four linears sit next to each other; a
chunk's memory is freed only when every weight carved from it is, so this suits weights kept for the model's life
(not the kernel choice's candidates, some of which are dropped). Where the kernel has no transparent huge pages the
pages stay 4 KB (still correct); ADAFLASH_HUGE_PAGES=0 (read at packing) allocates each weight on its own.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import torch

PAGE = 2 << 20  # x86-64's transparent huge page
CHUNK = 64 << 20
ALIGN = 64  # a cache line: every weight starts on one
_MADV_HUGEPAGE = 14


def _madvise_huge(t: torch.Tensor) -> torch.Tensor:
    """The 2 MB-aligned part of the fresh (untouched) uint8 buffer `t`, marked for huge pages; `t` itself where that
    is not possible. Untouched matters: the pages are chosen at the first write."""
    if not sys.platform.startswith("linux"):
        return t
    start = -t.data_ptr() % PAGE
    usable = (t.numel() - start) // PAGE * PAGE
    if usable <= 0:
        return t
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(t.data_ptr() + start, usable, _MADV_HUGEPAGE)  # a refusal (no THP) leaves 4 KB pages: still correct
    return t[start:]


class _Arena:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        nbytes = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            if nbytes > CHUNK // 2:  # a large weight (an LM head) gets pages of its own
                return _madvise_huge(torch.empty(nbytes + PAGE, dtype=torch.uint8))[:nbytes]
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = _madvise_huge(torch.empty(CHUNK + PAGE, dtype=torch.uint8)), 0
            out = self._chunk[self._used:self._used + nbytes]
            self._used += nbytes
            return out  # a view: its chunk lives as long as any weight carved from it


_ARENA = _Arena()


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements for packed weights, 64-byte aligned, in huge pages where
    the kernel gives them."""
    if os.environ.get("ADAFLASH_HUGE_PAGES") == "0":
        return torch.empty(numel, dtype=dtype)
    return _ARENA.take(numel * dtype.itemsize)[:numel * dtype.itemsize].view(dtype)
