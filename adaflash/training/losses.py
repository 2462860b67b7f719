"""Loss strategies for the one drafter training loop.

A strategy turns the drafter's block logits and the batch's labels into a scalar loss and metrics; the
loop does not know which one runs (the reverse-KL distillation of the AdaFlash method is one more).

Labels are rows of the drafter's head: with a trimmed draft vocabulary a target token outside it is MISS
(-1): it carries no cross-entropy (the head cannot name it) but counts as a wrong draft in the metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100  # past the end of the sequence: neither a loss term nor a metric
MISS = -1  # a target token outside the draft vocabulary: a certain rejection


def position_weights(num_positions: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..K: early positions matter most for acceptance."""
    k = torch.arange(num_positions, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma) if gamma > 0 and math.isfinite(gamma) else torch.ones(num_positions, device=device)


def dpace_weights(per_token_ce: torch.Tensor, labels: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights [A, K], detached, from the drafter's own per-token CE [A, K] (labels mark validity).

    Source: NVIDIA Model-Optimizer, modelopt/torch/speculative/plugins/hf_dflash.py (`_dpace_position_weights`,
    `dflash_loss_objective = "dpace"`, default `dflash_dpace_alpha = 0.5`), after D-PACE (arXiv:2605.18810, Eqs. 7-9):
    confidence q_j = exp(-CE_j) on the target's token, smoothed q~_j = alpha + (1 - alpha) q_j, cumulative confidence
    C_j = prod_{i<=j} q~_i, weight w_j = sum_{m>=j} C_m (C_j times the expected continuation). It replaces the gamma
    decay there, and so here. Positions past the sequence end (IGNORE) are no-ops in the product and weigh 0; a token
    outside the trimmed draft vocabulary (MISS) has q = 0, a certain rejection (the head cannot name it)."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"dpace_alpha must be in (0, 1], got {alpha}")
    with torch.no_grad():
        keep = labels != IGNORE
        q = torch.exp(-per_token_ce.detach().float()) * (labels >= 0)
        smoothed = torch.where(keep, alpha + (1.0 - alpha) * q, torch.ones_like(q))
        cum = torch.cumprod(smoothed, dim=1) * keep
        return cum.flip(1).cumsum(1).flip(1) * keep


def _greedy_stats(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> dict:
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
        # Accepted under greedy verification = all earlier positions correct too.
        accepted = correct.long().cumprod(dim=1).bool()
    return {"correct": correct.sum(0).tolist(), "accepted": accepted.sum(0).tolist(), "valid": valid.sum(0).tolist(),
            "run_lengths": accepted.sum(1).tolist()}  # per anchor: the drafts greedy verification would accept


def _weighted_mean(per_token: torch.Tensor, valid: torch.Tensor, gamma: float) -> torch.Tensor:
    weights = position_weights(per_token.shape[1], gamma, per_token.device)[None, :] * valid
    return (per_token * weights).sum() / weights.sum().clamp_min(1e-8)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token CE [A, K]; zero where the label is IGNORE or MISS (mask those out of the mean)."""
    a, k, v = logits.shape
    ce = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1).clamp_min(0), reduction="none").view(a, k)
    return ce * (labels >= 0)


@dataclass(frozen=True)
class BlockCrossEntropy:
    """DFlash's objective: position-weighted cross-entropy against the target's own (regenerated) tokens.
    `weighting`: "decay" (exp(-(k-1)/gamma), DFlash's) or "dpace" (`dpace_weights`, gamma unused)."""

    gamma: float = 7.0
    name: str = "ce"
    weighting: str = "decay"
    dpace_alpha: float = 0.5
    needs_teacher = False
    needs_soft_targets = False

    def __post_init__(self) -> None:
        if self.weighting not in ("decay", "dpace"):
            raise ValueError(f"unknown position weighting {self.weighting!r}; expected decay or dpace")
        if self.weighting == "dpace" and not 0.0 < self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}")

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor | None = None):
        """logits [A, K, V] (fp32), labels [A, K] with IGNORE where the block runs past the sequence end."""
        valid = labels != IGNORE
        ce = _cross_entropy(logits, labels)
        if self.weighting == "dpace":
            weights = dpace_weights(ce, labels, self.dpace_alpha) * (labels >= 0)
            loss = (ce * weights).sum() / weights.sum().clamp_min(1e-8)
        else:
            loss = _weighted_mean(ce, labels >= 0, self.gamma)
        return loss, _greedy_stats(logits, labels, valid)


@dataclass(frozen=True)
class SoftTargets:
    """The target's stored top-k next-token distribution at each block position (`data generate --top-logprobs`)."""

    logprobs: torch.Tensor  # [A, K, k] fp32 log-probabilities under the full vocabulary
    rows: torch.Tensor  # [A, K, k] draft-head rows of those tokens; MISS outside the draft vocabulary


@dataclass(frozen=True)
class BlockSoftTargets:
    """CE on the target's tokens plus `weight` x KL(p || q) to the target's top-k distribution at each position.

    p is the stored top-k renormalised over the tokens the drafter can propose (the mass it could ever match);
    the forward direction, since only the target's own top-k is known. Position-weighted as the CE.
    """

    weight: float = 1.0
    gamma: float = 7.0
    name: str = "ce+kl"
    needs_teacher = False
    needs_soft_targets = True

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, teacher: SoftTargets | None = None):
        if teacher is None:
            raise ValueError("the ce+kl loss needs soft targets: regenerate the data with `--top-logprobs K`")
        valid = labels != IGNORE
        ce = _weighted_mean(_cross_entropy(logits, labels), labels >= 0, self.gamma)
        kept = teacher.rows >= 0
        log_p = torch.log_softmax(teacher.logprobs.masked_fill(~kept, float("-inf")), dim=-1)
        p = log_p.exp().masked_fill(~kept, 0.0)
        log_q = torch.log_softmax(logits, dim=-1).gather(-1, teacher.rows.clamp_min(0))
        per_token = (p * (log_p.masked_fill(~kept, 0.0) - log_q)).sum(-1)
        has_mass = valid & kept.any(-1)
        kl = _weighted_mean(per_token, has_mass, self.gamma)
        stats = _greedy_stats(logits, labels, valid)
        stats["divergence"] = float(kl.detach())
        return ce + self.weight * kl, stats


def divergence(kind: str, student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-token divergence between drafter q and target p, exact over the vocabulary: [..., V] -> [...].

    rkl = KL(q || p) (mode-seeking: q's mass moves where p accepts), fkl = KL(p || q), tv = 1/2 sum |p - q|.
    """
    log_q = F.log_softmax(student_logits / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    if kind == "rkl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if kind == "fkl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if kind == "tv":
        return 0.5 * (log_q.exp() - log_p.exp()).abs().sum(-1)
    raise ValueError(f"unknown divergence {kind!r}; expected rkl, fkl or tv")


@dataclass(frozen=True)
class BlockDistillation:
    """AdaFlash's objective: alpha * CE(drafter, target argmax) + (1 - alpha) * sum_k w_k * clip(D(q_k, p_k), tau).

    D is reverse KL by default (forward KL and TV make the divergence an experiment). Teacher logits are the
    target's own on the same trajectory (teacher forcing). The per-token clip is a floor: a token whose
    divergence is already below tau counts as tau and stops pulling (no gradient), so the updates go to the
    positions the target still rejects. The release's "clip(KL, tau)" does not say which side; a ceiling at
    tau = 0.01 would silence almost every token of a drafter that is not already near-perfect.
    """

    divergence: str = "rkl"
    alpha: float = 0.8
    tau: float = 0.01
    gamma: float = 7.0
    temperature: float = 1.0
    needs_teacher = True
    needs_soft_targets = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.divergence not in ("rkl", "fkl", "tv"):
            raise ValueError(f"unknown divergence {self.divergence!r}; expected rkl, fkl or tv")

    @property
    def name(self) -> str:
        return self.divergence

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor | None = None):
        """logits, teacher_logits [A, K, V]; labels [A, K] (IGNORE past the sequence end) mark valid positions."""
        if teacher_logits is None:
            raise ValueError(f"the {self.name} loss needs the target's logits (teacher forcing)")
        valid = labels != IGNORE
        # With a draft vocabulary the teacher logits are already restricted to its rows: the argmax is a row.
        teacher_argmax = torch.where(valid, teacher_logits.argmax(-1), labels)
        ce = _weighted_mean(_cross_entropy(logits, teacher_argmax), valid, self.gamma)
        per_token = divergence(self.divergence, logits, teacher_logits.detach(), self.temperature)
        div = _weighted_mean(per_token.clamp_min(self.tau), valid, self.gamma)
        stats = _greedy_stats(logits, teacher_argmax, valid)
        stats["divergence"] = float(_weighted_mean(per_token.detach(), valid, self.gamma))
        return self.alpha * ce + (1 - self.alpha) * div, stats


LOSSES = {"ce": BlockCrossEntropy, "ce+kl": BlockSoftTargets, "rkl": BlockDistillation, "fkl": BlockDistillation,
          "tv": BlockDistillation}


def build_loss(name: str, gamma: float = 7.0, alpha: float = 0.8, tau: float = 0.01, temperature: float = 1.0,
               soft_weight: float = 1.0, weighting: str = "decay", dpace_alpha: float = 0.5):
    """`ce` (DFlash), `ce+kl` (CE plus KL to the stored top-k soft targets), or a distillation divergence
    `rkl` / `fkl` / `tv` with AdaFlash's alpha, tau, temperature. `weighting = "dpace"` only with `ce`."""
    if weighting != "decay" and name != "ce":
        raise ValueError(f"position weighting {weighting!r} is implemented for the ce loss only, not {name!r}")
    if name == "ce":
        return BlockCrossEntropy(gamma=gamma, weighting=weighting, dpace_alpha=dpace_alpha)
    if name == "ce+kl":
        return BlockSoftTargets(weight=soft_weight, gamma=gamma)
    if name in ("rkl", "fkl", "tv"):
        return BlockDistillation(divergence=name, alpha=alpha, tau=tau, gamma=gamma, temperature=temperature)
    raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}")
