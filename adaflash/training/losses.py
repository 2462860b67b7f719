"""Loss strategies for the one drafter training loop.

A strategy turns the drafter's block logits and the batch's labels into a scalar loss and metrics; the
loop does not know which one runs (the reverse-KL distillation of the AdaFlash method is one more).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE = -100


def position_weights(num_positions: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for block positions k = 1..K: early positions matter most for acceptance."""
    k = torch.arange(num_positions, dtype=torch.float32, device=device)
    return torch.exp(-k / gamma) if gamma > 0 and math.isfinite(gamma) else torch.ones(num_positions, device=device)


@dataclass(frozen=True)
class BlockCrossEntropy:
    """DFlash's objective: position-weighted cross-entropy against the target's own (regenerated) tokens."""

    gamma: float = 7.0
    name: str = "ce"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """logits [A, K, V] (fp32), labels [A, K] with IGNORE where the block runs past the sequence end."""
        a, k, v = logits.shape
        valid = labels != IGNORE
        ce = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1).clamp_min(0), reduction="none").view(a, k)
        weights = position_weights(k, self.gamma, logits.device)[None, :] * valid
        loss = (ce * weights).sum() / weights.sum().clamp_min(1e-8)
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels) & valid
            # Accepted under greedy verification = all earlier positions correct too.
            accepted = correct.long().cumprod(dim=1).bool()
        return loss, {
            "correct": correct.sum(0).tolist(),
            "accepted": accepted.sum(0).tolist(),
            "valid": valid.sum(0).tolist(),
        }


LOSSES = {"ce": BlockCrossEntropy}


def build_loss(name: str, **kwargs) -> BlockCrossEntropy:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}")
    return LOSSES[name](**kwargs)
