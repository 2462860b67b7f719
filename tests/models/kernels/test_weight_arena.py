"""Packed weights carved from huge-page chunks: aligned, disjoint, and marked for huge pages where Linux has them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from adaflash.models.kernels import weight_arena


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_weights_are_aligned_disjoint_and_keep_their_values():
    sizes = [(1000, torch.float32), (37, torch.uint8), (5000, torch.float32), (64, torch.uint8)]
    tensors = [weight_arena.empty(n, dtype) for n, dtype in sizes]
    for t, (n, dtype) in zip(tensors, sizes):
        assert t.numel() == n and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % weight_arena.ALIGN == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    assert all(bool((t == i + 1).all()) for i, t in enumerate(tensors))


def test_a_weight_past_half_a_chunk_gets_its_own_pages_and_freeing_it_leaves_the_others_intact():
    big = weight_arena.empty(weight_arena.CHUNK // 2 + 1, torch.uint8)
    assert big.numel() == weight_arena.CHUNK // 2 + 1
    if sys.platform.startswith("linux"):
        assert big.data_ptr() % weight_arena.PAGE == 0  # the 2 MB-aligned part of its allocation
    small = weight_arena.empty(16, torch.float32)
    small.copy_(torch.arange(16.0))
    del big
    assert torch.equal(small, torch.arange(16.0))  # its chunk lives while it does


def test_huge_pages_off_allocates_each_weight_alone(monkeypatch):
    monkeypatch.setenv("ADAFLASH_HUGE_PAGES", "0")
    a, b = weight_arena.empty(100, torch.float32), weight_arena.empty(100, torch.float32)
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes() == 400


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").is_dir() or not Path("/proc/self/smaps").exists(),
                    reason="no transparent huge pages in this kernel")
def test_chunks_are_marked_for_huge_pages():
    t = weight_arena.empty(1 << 20, torch.uint8)
    assert t.data_ptr() % weight_arena.ALIGN == 0
    # madvise(MADV_HUGEPAGE) sets the mapping's "hg" flag whatever pages the kernel then grants
    assert "hg" in _vm_flags(t.data_ptr())
