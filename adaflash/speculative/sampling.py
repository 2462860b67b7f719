"""Sampling parameters and the logits -> probabilities transform applied identically to drafter and target.

Lossless speculative sampling reproduces the target's *processed* distribution (after temperature,
top-k and top-p), so both models must go through exactly this function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] fp32 probabilities of the processed sampling distribution."""
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use argmax")
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (the top-1 always stays).
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_from_weights(weights: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """Sample one index per row with probability proportional to `weights` (need not be normalised).

    argmax(w / E) with E ~ Exp(1) i.i.d. is an exact sample from w / sum(w); passing the noise in keeps
    the verifier a pure, seedable function.
    """
    return torch.argmax(weights / exponentials, dim=-1)


def draw_exponentials(shape: tuple[int, ...], generator: torch.Generator | None,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) noise from `generator` (a request's seeded CPU generator: the same draws on every device), placed on
    `device`."""
    # Clamped away from 0 so a zero weight divided by the noise is never 0/0.
    return torch.empty(shape).exponential_(1.0, generator=generator).clamp_min_(1e-30).to(device)


def draw_uniforms(n: int, generator: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """U(0, 1) draws from `generator`, placed on `device` (the acceptance tests of rejection sampling)."""
    return torch.rand(n, generator=generator).to(device)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of [N, V] probabilities."""
    return sample_from_weights(probs, draw_exponentials(tuple(probs.shape), generator, probs.device))
