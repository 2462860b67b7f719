"""The verify-cost model: interpolation, its file, and the on-disk cache that spares a second profile."""

from __future__ import annotations

import pytest
import torch

from adaflash.models.drafter import DrafterConfig
from adaflash.models.drafter_checkpoint import init_drafter
from adaflash.models.target import load_target
from adaflash.serving.cost_model import CostModel, cost_model_file, cost_model_for, load_or_profile_cost_model
from adaflash.speculative.proposer import DFlashProposer

COST = CostModel(total_tokens=(4, 8, 16), verify_s=(0.02, 0.03, 0.07), draft_s=0.005)


def test_verify_is_piecewise_linear_and_extrapolates():
    assert COST.verify(2) == pytest.approx(0.01)  # below the first point: proportional
    assert COST.verify(8) == pytest.approx(0.03)
    assert COST.verify(12) == pytest.approx(0.05)
    assert COST.verify(24) == pytest.approx(0.11)  # past the last point: the last segment's slope


def test_json_round_trip():
    assert CostModel.from_json(COST.to_json()) == COST


def test_a_cached_file_is_read_not_profiled(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(COST.to_json())
    assert load_or_profile_cost_model(None, None, 16, path) == COST  # no models needed: nothing is measured


def test_profile_once_then_cached(tiny_chat_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    target = load_target(tiny_chat_checkpoint, dtype=torch.float32)  # a real vocabulary: the profile feeds ids 100+
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=4)
    proposer = DFlashProposer(init_drafter(cfg, seed=2), target)
    path = cost_model_file(target, proposer, "tiny/qwen2", max_tokens=8)
    assert path.parent == tmp_path / "cost_models" and path.name.startswith("qwen2-float32-L1-B4-Vfull-T8-th")
    model = cost_model_for(target, proposer, "tiny/qwen2", max_tokens=8)
    assert model.total_tokens == (1, 2, 4, 8) and all(t > 0 for t in model.verify_s) and model.draft_s > 0
    assert path.is_file() and CostModel.from_json(path.read_text()) == model
    assert cost_model_for(target, proposer, "tiny/qwen2", max_tokens=8) == model  # the second call reads the file
    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")  # other kernels, other costs: another file
    assert cost_model_file(target, proposer, "tiny/qwen2", max_tokens=8) != path
