"""The verifier: pure functions over a ragged batch of drafts.

Request r proposes `num_draft[r]` tokens (possibly 0). Drafts are flattened to [sum(num_draft)]; the
target's outputs for request r are the `num_draft[r] + 1` rows that verified its block (the last one
gives the bonus token). Randomness is passed in, so the functions are deterministic and testable.

Output per request: how many drafts were accepted, and the one token the target adds after them
(the correction at the first rejection, or the bonus when everything was accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from adaflash.speculative.sampling import sample_from_weights


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: torch.Tensor  # [R] int64
    next_tokens: torch.Tensor  # [R] int64

    def emitted(self, draft_tokens: torch.Tensor, num_draft: Sequence[int]) -> list[list[int]]:
        """Tokens each request commits this step: its accepted drafts, then the target's token."""
        out, offset = [], 0
        for r, k in enumerate(num_draft):
            n = int(self.num_accepted[r])
            out.append(draft_tokens[offset : offset + n].tolist() + [int(self.next_tokens[r])])
            offset += k
        return out


def _checked_counts(num_draft: Sequence[int]) -> list[int]:
    counts = [int(k) for k in num_draft]
    if not counts or min(counts) < 0:
        raise ValueError(f"need one non-negative draft count per request, got {counts}")
    return counts


@dataclass(frozen=True)
class _Layout:
    counts: torch.Tensor  # [R] drafts per request
    draft_offsets: torch.Tensor  # [R] first draft row of each request
    target_offsets: torch.Tensor  # [R] first target row of each request (one extra row per request)
    target_row_of_draft: torch.Tensor  # [sum(K)] target row that judges each draft

    @classmethod
    def of(cls, num_draft: Sequence[int], device: torch.device | str = "cpu") -> "_Layout":
        counts = torch.tensor(_checked_counts(num_draft), dtype=torch.long, device=device)
        draft_offsets = counts.cumsum(0) - counts
        arange = torch.arange(len(counts), device=device)
        request_of_draft = torch.repeat_interleave(arange, counts)
        return cls(
            counts=counts,
            draft_offsets=draft_offsets,
            target_offsets=draft_offsets + arange,
            target_row_of_draft=torch.arange(int(counts.sum()), device=device) + request_of_draft,
        )

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def accepted_prefix_len(self, accept: torch.Tensor) -> torch.Tensor:
        """Per request, the length of the all-True prefix of its slice of the flat `accept` [sum(K)]."""
        kmax = int(self.counts.max())
        if kmax == 0:
            return torch.zeros(len(self.counts), dtype=torch.long, device=self.counts.device)
        pos = torch.arange(kmax, device=self.counts.device)
        valid = pos[None, :] < self.counts[:, None]
        idx = (self.draft_offsets[:, None] + pos[None, :]).clamp(max=self.total - 1)
        return (accept[idx] & valid).long().cumprod(dim=1).sum(dim=1)


def verify_greedy(
    draft_tokens: torch.Tensor, target_argmax: torch.Tensor, num_draft: Sequence[int]
) -> VerifyResult:
    """Accept drafts while they equal the target's argmax; the target's argmax after them is the next token.

    draft_tokens [sum(K)], target_argmax [sum(K) + R] (row j of request r = argmax after its j-th block token).
    A loop over host lists: a step verifies at most a few hundred tokens, where the ~25 small tensor ops of a
    vectorised form cost more (~0.15 ms a step at batch 1) than comparing the integers.
    """
    counts = _checked_counts(num_draft)
    drafts, targets = draft_tokens.tolist(), target_argmax.tolist()
    if len(drafts) != sum(counts):
        raise ValueError(f"draft_tokens has {len(drafts)} tokens, num_draft sums to {sum(counts)}")
    if len(targets) != len(drafts) + len(counts):
        raise ValueError("target_argmax must have sum(num_draft) + len(num_draft) rows")
    accepted, next_tokens, d, t = [], [], 0, 0
    for k in counts:
        n = 0
        while n < k and drafts[d + n] == targets[t + n]:
            n += 1
        accepted.append(n)
        next_tokens.append(targets[t + n])
        d, t = d + k, t + k + 1
    return VerifyResult(num_accepted=torch.tensor(accepted, dtype=torch.long),
                        next_tokens=torch.tensor(next_tokens, dtype=torch.long))


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_draft: Sequence[int],
    uniforms: torch.Tensor,
    exponentials: torch.Tensor,
) -> VerifyResult:
    """Speculative rejection sampling (Leviathan et al. / Chen et al.), exact for the target distribution.

    Draft i of a request, drawn from q_i, is accepted with probability min(1, p_i(x) / q_i(x)); at the first
    rejection the next token is drawn from the residual max(0, p_i - q_i) (normalised); if all drafts are
    accepted, the bonus is drawn from the target's next row.

    draft_probs [sum(K), V], target_probs [sum(K) + R, V], uniforms [sum(K)] ~ U(0,1),
    exponentials [R, V] ~ Exp(1) (the noise for the one final sample per request).
    Runs where `target_probs` live; the other inputs are moved there.
    """
    device = target_probs.device
    draft_tokens, draft_probs = draft_tokens.to(device), draft_probs.to(device)
    uniforms, exponentials = uniforms.to(device), exponentials.to(device)
    layout = _Layout.of(num_draft, device)
    total = layout.total
    if draft_probs.shape[0] != total or target_probs.shape[0] != total + len(layout.counts):
        raise ValueError("draft_probs needs sum(K) rows and target_probs sum(K) + R rows")
    p_x = target_probs[layout.target_row_of_draft, draft_tokens]
    q_x = draft_probs[torch.arange(total, device=device), draft_tokens]
    # u < p/q without dividing (q_x > 0 for any token the drafter actually sampled).
    accept = uniforms * q_x < p_x
    num_accepted = layout.accepted_prefix_len(accept)
    rejected = num_accepted < layout.counts
    p_next = target_probs[layout.target_offsets + num_accepted]
    # Draft row of the first rejected token; for fully accepted requests any valid row, masked out below.
    reject_row = (layout.draft_offsets + num_accepted).clamp(max=max(total - 1, 0))
    q_next = draft_probs[reject_row] if total else torch.zeros_like(p_next)
    residual = (p_next - q_next * rejected[:, None].to(p_next.dtype)).clamp_min(0.0)
    # Float round-off can leave an all-zero residual where p == q; p itself is then the exact answer.
    empty = residual.sum(-1, keepdim=True) <= 0
    weights = torch.where(empty, p_next, residual)
    next_tokens = sample_from_weights(weights, exponentials)
    return VerifyResult(num_accepted=num_accepted, next_tokens=next_tokens)
