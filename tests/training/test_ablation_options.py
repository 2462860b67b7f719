"""Issue 52's ablation options: anchors everywhere (anchors_per_sequence = 0) and D-PACE position weighting."""

from __future__ import annotations

import math

import pytest
import torch

from adaflash.training.dataset import TrainSample, first_anchor, sample_anchors
from adaflash.training.losses import IGNORE, MISS, BlockCrossEntropy, build_loss, dpace_weights
from adaflash.training.trainer import TrainConfig


def _sample(length: int = 40, prompt_len: int = 10) -> TrainSample:
    return TrainSample(tokens=torch.arange(length), prompt_len=prompt_len, features=None)


def test_zero_anchors_means_every_valid_position():
    sample = _sample()
    every = sample_anchors(sample, 0, torch.Generator().manual_seed(0))
    assert every.tolist() == list(range(first_anchor(sample), len(sample.tokens) - 1))
    # a positive count still samples that many (the v9 recipe's 32 of the 31 here: all; 8: a subset)
    assert len(sample_anchors(sample, 8, torch.Generator().manual_seed(0))) == 8


def test_dpace_weights_match_hand_computation():
    ce = torch.tensor([[0.0, math.log(2.0), math.log(4.0)]])  # q = 1, 1/2, 1/4
    labels = torch.tensor([[3, 4, 5]])
    alpha = 0.5
    qs = [1.0, 0.75, 0.625]  # alpha + (1 - alpha) q
    c = [qs[0], qs[0] * qs[1], qs[0] * qs[1] * qs[2]]
    expected = torch.tensor([[c[0] + c[1] + c[2], c[1] + c[2], c[2]]])
    torch.testing.assert_close(dpace_weights(ce, labels, alpha), expected)
    # alpha = 1: every smoothed confidence 1, the weight counts the valid positions from j on
    assert dpace_weights(ce, labels, 1.0).tolist() == [[3.0, 2.0, 1.0]]


def test_dpace_ignores_past_the_end_and_treats_a_miss_as_rejection():
    ce = torch.zeros(1, 4)
    w = dpace_weights(ce, torch.tensor([[1, MISS, 2, IGNORE]]), 0.5)
    # q = 1, 0 (MISS), 1 -> smoothed 1, 0.5, 1 -> C = 1, 0.5, 0.5, 0 (IGNORE)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.5, 0.0]]))
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(ce, torch.ones(1, 4, dtype=torch.long), 0.0)


def test_dpace_loss_is_ce_reweighted_by_detached_weights():
    logits = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0), requires_grad=True)
    labels = torch.tensor([[1, 2, 3, 4, IGNORE], [0, MISS, 6, 5, 1]])
    loss, _ = BlockCrossEntropy(weighting="dpace", dpace_alpha=0.5)(logits, labels)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1).clamp_min(0),
                                           reduction="none").view(2, 5) * (labels >= 0)
    w = dpace_weights(ce, labels, 0.5) * (labels >= 0)
    torch.testing.assert_close(loss, (ce * w).sum() / w.sum())
    loss.backward()
    manual = logits.detach().clone().requires_grad_(True)
    ce2 = torch.nn.functional.cross_entropy(manual.reshape(-1, 7), labels.reshape(-1).clamp_min(0),
                                            reduction="none").view(2, 5) * (labels >= 0)
    ((ce2 * w).sum() / w.sum()).backward()  # w held constant: the gradient flows through CE only
    torch.testing.assert_close(logits.grad, manual.grad)
    decay, _ = BlockCrossEntropy()(logits, labels)
    assert not torch.isclose(loss, decay)


def test_dpace_is_wired_for_ce_only_and_configurable():
    assert build_loss("ce", weighting="dpace", dpace_alpha=0.3) == BlockCrossEntropy(weighting="dpace", dpace_alpha=0.3)
    with pytest.raises(ValueError, match="ce loss only"):
        build_loss("rkl", weighting="dpace")
    with pytest.raises(ValueError, match="unknown position weighting"):
        build_loss("ce", weighting="linear")


def test_train_config_reads_the_new_options(tmp_path):
    path = tmp_path / "arm.toml"
    path.write_text('data_dir = "d"\nout_dir = "o"\nposition_weighting = "dpace"\ndpace_alpha = 0.4\n'
                    'anchors_per_sequence = 0\n')
    cfg = TrainConfig.from_file(path)
    assert (cfg.position_weighting, cfg.dpace_alpha, cfg.anchors_per_sequence) == ("dpace", 0.4, 0)
