"""Training DFlash 2's candidate selector (models/drafters/dflash2.py), beside whichever loss trains the drafter.

DFlash 2's objective is unpublished; this is the public ports' (vLLM speculators' DFlash 2 support): a K-way
cross-entropy over each position's unary top-K, the gold token injected in place of the last candidate where the top-K
misses it, along the teacher-forced path (each position's predecessor is the gold token before it; the first's the
anchor), with a stop-gradient into the backbone (the selector reads the drafter's hidden states and logits detached,
so the drafter's own loss alone shapes them, and no warm-up is needed to protect them).

Teacher forcing is exact for what greedy verification keeps: while every earlier draft was the gold token, the path's
predecessor is the gold token. So the selector's teacher-forced picks give the drafter's accepted drafts, and the
metrics the trainer logs and holds out (`correct`, `accepted`, `run_lengths`) are the selector's for a DFlash 2
drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaflash.models.drafters.dflash2 import CandidateSelector
from adaflash.training.losses import IGNORE


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                  predecessors: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """hidden [A, K', d] and logits [A, K', V'] of the draft positions (detached here); labels [A, K'] rows of the
    drafter's head (IGNORE past the end, MISS outside a trimmed vocabulary); predecessors [A, K'] target ids (anchor,
    gold_1, ...); `ids` maps head rows to target ids (a trimmed vocabulary) or None. Returns the mean K-way
    cross-entropy over positions with a gold row, and greedy metrics of the selector's picks."""
    hidden, logits = hidden.detach(), logits.detach().float()
    unary, rows = torch.topk(logits, selector.top_k, dim=-1)  # [A, K', K]
    gold = labels.clamp_min(0)
    present = rows == gold[..., None]
    found = present.any(-1)
    has_gold = labels >= 0
    # The gold row where the top-K misses it: in place of the last candidate, with its own unary score.
    inject = has_gold & ~found
    rows = torch.where(inject[..., None] & (torch.arange(rows.shape[-1], device=rows.device) == rows.shape[-1] - 1),
                       gold[..., None], rows)
    unary = torch.where(inject[..., None] & (torch.arange(rows.shape[-1], device=rows.device) == rows.shape[-1] - 1),
                        logits.gather(-1, gold[..., None]), unary)
    candidates = ids[rows] if ids is not None else rows
    projected = selector.hidden_projection(hidden.to(selector.hidden_projection.weight.dtype)).float()
    query = selector.predecessor_codebook(predecessors.clamp_min(0)).float() * projected  # [A, K', rank]
    scores = unary + torch.einsum("apr,apkr->apk", query, selector.successor_codebook(candidates).float())
    target = (rows == gold[..., None]).float().argmax(-1)
    ce = F.cross_entropy(scores.reshape(-1, scores.shape[-1]), target.reshape(-1), reduction="none").view_as(labels)
    loss = (ce * has_gold).sum() / has_gold.sum().clamp_min(1)
    with torch.no_grad():
        valid = labels != IGNORE
        picked = rows.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        # A pick is right only where the top-K really held the gold row (an injected one is a training aid).
        correct = (picked == labels) & found
        accepted = correct.long().cumprod(dim=1).bool()
        stats = {"correct": correct.sum(0).tolist(), "accepted": accepted.sum(0).tolist(),
                 "valid": valid.sum(0).tolist(), "run_lengths": accepted.sum(1).tolist(),
                 "selector_recall": float((found & has_gold).sum() / has_gold.sum().clamp_min(1))}
    return loss, stats


def teacher_forced_predecessors(block: torch.Tensor, gold_ids: torch.Tensor) -> torch.Tensor:
    """Each draft position's predecessor along the gold path: the anchor, then the gold tokens [A, B-1] (target ids;
    IGNORE past the end, where no loss or metric reads them)."""
    return torch.cat([block[:, :1], gold_ids[:, :-1]], dim=1)
