"""Timers around model work read the clock only after synchronising the model's device (models/device/placement.py): a GPU's
kernels run after their launch returns, so an unsynchronised clock times the launches. On the CPU `synchronize` is a
no-op; here it is recorded, and every clock read must come right after one, for the model's device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.evaluation import vocab_coverage
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.targets.model import random_target
from adaflash.speculative.length_policy import FixedLength
from adaflash.speculative.proposer import DFlashProposer
from benchmarks.runtime import draft_width, runtime_speed, step_profile


@pytest.fixture
def events(monkeypatch):
    """Patches `synchronize` and the clock of every module under test; returns the events they record."""
    log: list[tuple] = []
    clock = SimpleNamespace(perf_counter=lambda: log.append(("clock",)) or float(len(log)))
    for module in (draft_width, runtime_speed, step_profile, vocab_coverage):
        monkeypatch.setattr(module, "synchronize", lambda device: log.append(("sync", torch.device(device))))
        monkeypatch.setattr(module, "time", clock)
    return log


def _every_clock_read_after_a_sync(log: list[tuple], device: torch.device) -> None:
    clocks = [i for i, e in enumerate(log) if e == ("clock",)]
    assert clocks, "nothing was timed"
    assert all(i > 0 and log[i - 1] == ("sync", device) for i in clocks), log


@pytest.fixture
def target():
    """Random weights of a vocabulary the benchmarks' token ids (100 and up) fit."""
    cfg = TransformerConfig(
        family="qwen3", vocab_size=1200, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        qkv_bias=False, o_bias=False, qk_norm=True, max_position_embeddings=512)
    return random_target(cfg, torch.float32, "cpu")


def _proposer(target, block: int = 4) -> DFlashProposer:
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=block)
    return DFlashProposer(init_drafter(cfg, seed=2), target)


def test_runtime_speed_forward_cost(target, events):
    runtime_speed.forward_cost_ms(target, 8, query_lens=(1, 2), repeats=1)
    _every_clock_read_after_a_sync(events, target.device)


def test_draft_width_pass(target, events):
    draft_width._draft_pass_ms(_proposer(target), 3, context=8, repeats=1)
    _every_clock_read_after_a_sync(events, target.device)


def test_vocab_coverage_draft_step(target, events):
    vocab_coverage.draft_step_ms(target, [16], batch=1, context=8, repeats=1)
    _every_clock_read_after_a_sync(events, target.device)


def test_step_profile_steps_and_parts(target, events):
    engine = Engine(target, _proposer(target), FixedLength(2), max_batch=1, max_len=64)
    steps, _ = step_profile.profile_generation(engine, [3, 14, 15, 92], 6, stop_ids=[])
    assert steps
    _every_clock_read_after_a_sync(events, target.device)
