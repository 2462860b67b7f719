"""Large freed buffers stay in the heap: the next allocation of the size reuses their pages (no page faults)."""

from __future__ import annotations

import resource

import pytest
import torch

from adaflash.models.device.memory import keep_freed_buffers


def _faults_touching(numel: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(numel).fill_(1.0)  # allocated, every page written, freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_freed_25_mb_buffer_takes_the_next_smaller_one_without_faulting_its_pages_in_again():
    if not keep_freed_buffers():
        pytest.skip("not glibc")
    _faults_touching(25 << 18)  # 25 MB of fp32: a 2048-token prefill pass's gate/up activations
    # glibc's defaults: the 25 MB went back to the OS and 20 MB fresh from it fault ~5100 pages in (measured)
    assert _faults_touching(20 << 18) < 64


def test_the_environment_keeps_glibcs_defaults(monkeypatch):
    monkeypatch.setenv("ADAFLASH_MALLOC", "default")
    assert keep_freed_buffers() is False
