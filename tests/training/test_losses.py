"""Loss strategies: values against hand computation, the per-token floor, and gradients."""

from __future__ import annotations

import pytest
import torch

from adaflash.training.losses import IGNORE, BlockCrossEntropy, BlockDistillation, build_loss, divergence


def _logits(seed: int, shape=(3, 4, 11)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2


def test_divergences_match_definitions():
    q_logits, p_logits = _logits(0), _logits(1)
    q, p = q_logits.softmax(-1), p_logits.softmax(-1)
    torch.testing.assert_close(divergence("rkl", q_logits, p_logits, 1.0), (q * (q.log() - p.log())).sum(-1))
    torch.testing.assert_close(divergence("fkl", q_logits, p_logits, 1.0), (p * (p.log() - q.log())).sum(-1))
    torch.testing.assert_close(divergence("tv", q_logits, p_logits, 1.0), 0.5 * (q - p).abs().sum(-1))
    q2, p2 = (q_logits / 2).softmax(-1), (p_logits / 2).softmax(-1)
    torch.testing.assert_close(divergence("rkl", q_logits, p_logits, 2.0), (q2 * (q2.log() - p2.log())).sum(-1))
    assert torch.all(divergence("rkl", p_logits, p_logits, 1.0).abs() < 1e-6)
    with pytest.raises(ValueError, match="unknown divergence"):
        divergence("jsd", q_logits, p_logits, 1.0)


def test_distillation_is_the_paper_formula():
    q_logits, p_logits = _logits(2), _logits(3)
    labels = torch.zeros(3, 4, dtype=torch.long)
    labels[2, 3] = IGNORE
    loss_fn = BlockDistillation(alpha=0.8, tau=0.01, gamma=7.0)
    loss, stats = loss_fn(q_logits, labels, p_logits)
    valid = labels != IGNORE
    w = torch.exp(-torch.arange(4.0) / 7.0)[None, :] * valid
    argmax = p_logits.argmax(-1)
    ce = torch.nn.functional.cross_entropy(q_logits.reshape(-1, 11), argmax.reshape(-1), reduction="none").view(3, 4)
    q, p = q_logits.softmax(-1), p_logits.softmax(-1)
    kl = (q * (q.log() - p.log())).sum(-1).clamp_min(0.01)
    expected = 0.8 * (ce * w).sum() / w.sum() + 0.2 * (kl * w).sum() / w.sum()
    torch.testing.assert_close(loss, expected)
    assert stats["valid"] == [3, 3, 3, 2] and "divergence" in stats


def test_floor_stops_gradient_of_matched_tokens():
    """A token whose divergence is below tau contributes a constant: no gradient from the divergence term."""
    p_logits = _logits(4, (1, 2, 7))
    q_logits = p_logits.clone()
    q_logits[0, 1] += _logits(5, (7,))  # position 2 mismatched, position 1 exact
    q_logits.requires_grad_(True)
    labels = torch.zeros(1, 2, dtype=torch.long)
    loss, _ = BlockDistillation(alpha=0.0, tau=0.01)(q_logits, labels, p_logits)
    loss.backward()
    assert q_logits.grad[0, 0].abs().max() == 0 and q_logits.grad[0, 1].abs().max() > 0


def test_alpha_one_is_cross_entropy_to_the_target_argmax():
    q_logits, p_logits = _logits(6), _logits(7)
    labels = p_logits.argmax(-1)
    distill, _ = BlockDistillation(alpha=1.0)(q_logits, torch.zeros_like(labels), p_logits)
    ce, _ = BlockCrossEntropy()(q_logits, labels)
    torch.testing.assert_close(distill, ce)


def test_build_loss_and_errors():
    assert build_loss("ce").name == "ce" and not build_loss("ce").needs_teacher
    assert build_loss("fkl", alpha=0.5).divergence == "fkl" and build_loss("tv").needs_teacher
    with pytest.raises(ValueError, match="unknown loss"):
        build_loss("mse")
    with pytest.raises(ValueError, match="alpha"):
        BlockDistillation(alpha=1.5)
    with pytest.raises(ValueError, match="teacher"):
        BlockDistillation()(_logits(0), torch.zeros(3, 4, dtype=torch.long))


def test_miss_labels_carry_no_cross_entropy_but_count_as_rejections():
    from adaflash.training.losses import MISS

    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 1] = 5.0
    hit, stats = BlockCrossEntropy(gamma=float("inf"))(logits, torch.tensor([[1, MISS, 2]]))
    assert stats["correct"] == [1, 0, 0] and stats["valid"] == [1, 1, 1] and stats["accepted"] == [1, 0, 0]
    only_hits, _ = BlockCrossEntropy(gamma=float("inf"))(logits, torch.tensor([[1, -100, 2]]))
    torch.testing.assert_close(hit, only_hits)  # the MISS position adds nothing to the loss


def test_soft_targets_are_ce_plus_forward_kl_over_the_kept_top_k():
    from adaflash.training.losses import MISS, BlockSoftTargets, SoftTargets

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6, requires_grad=True)
    labels = torch.tensor([[0, 1, 2], [3, MISS, -100]])
    top = torch.log_softmax(torch.randn(2, 3, 4), -1)
    rows = torch.tensor([[0, 1, 2, MISS]]).expand(2, 3, 4).contiguous()
    loss, stats = BlockSoftTargets(weight=0.5, gamma=float("inf"))(logits, labels, SoftTargets(top, rows))
    # By hand: p renormalised over its kept entries, KL(p || q) at the valid positions, plain means.
    log_q = torch.log_softmax(logits, -1)
    p = torch.softmax(top[..., :3], -1)
    kl = (p * (p.log() - log_q[..., :3])).sum(-1)
    valid = labels != -100
    ce_terms = [-log_q[0, 0, 0], -log_q[0, 1, 1], -log_q[0, 2, 2], -log_q[1, 0, 3]]
    expected = torch.stack(ce_terms).mean() + 0.5 * kl[valid].mean()
    torch.testing.assert_close(loss, expected)
    assert stats["divergence"] == pytest.approx(float(kl[valid].mean().detach()), rel=1e-5)
    loss.backward()
    with pytest.raises(ValueError, match="top-logprobs"):
        BlockSoftTargets()(logits, labels, None)
