"""What greedy verification would do to a drafter's full blocks along target trajectories (teacher forcing).

Along a greedy trajectory of the target, the target's choice at every position is the trajectory's next
token, so a block drafted at anchor a keeps exactly its leading drafts that equal tokens a+1, a+2, ...:
the outcome serving would record with a full-block draft, computed in one training-style pass instead of
a decode loop. Used to score a candidate drafter on a held-out slice (online promotion), to measure accept
length per block position and per token (the reverse-KL picture), and to give a just-distilled drafter's
length head outcomes of its own hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from adaflash.formats.outcomes import Outcomes
from adaflash.formats.trajectories import Trajectory
from adaflash.models.drafters.draft_vocab import DraftHead
from adaflash.models.drafters.dflash import DFlashDrafter
from adaflash.models.targets.model import TargetModel
from adaflash.training.dataset import TrainSample, block_inputs, sample_anchors
from adaflash.training.losses import IGNORE, divergence
from adaflash.training.trainer import teacher_logits, teacher_pass


@dataclass(frozen=True)
class BlockScores:
    outcomes: Outcomes  # drafter hidden [N, B, d], drafted (block positions inside the sequence), accepted
    anchors: tuple[torch.Tensor, ...]  # per trajectory: the anchor positions scored
    divergence: tuple[torch.Tensor, ...]  # per trajectory: reverse KL(q || p) of the first draft position, per anchor

    @property
    def accept_length(self) -> float:
        """Mean tokens per target pass with full-block drafts (accepted drafts + the target's own token)."""
        return float((self.outcomes.accepted.float() + 1).mean()) if len(self.outcomes) else float("nan")

    def per_position_acceptance(self) -> list[float]:
        """P(draft k accepted | drafts 1..k-1 accepted), k = 1..B-1 (nan where no block reached k)."""
        b = self.outcomes.block_size
        rates = []
        for k in range(1, b):
            reached = (self.outcomes.accepted >= k - 1) & (self.outcomes.drafted >= k)
            kept = self.outcomes.accepted >= k
            rates.append(float(kept[reached].float().mean()) if bool(reached.any()) else float("nan"))
        return rates


@torch.no_grad()
def score_blocks(
    target: TargetModel,
    drafter: DFlashDrafter,
    trajectories: Sequence[Trajectory],
    anchors_per_sequence: int | None = None,
    seed: int = 0,
) -> BlockScores:
    """Full-block greedy outcomes at (all, or `anchors_per_sequence` random) anchors of each response."""
    cfg = drafter.config
    hidden_all, drafted_all, accepted_all, anchors_all, div_all = [], [], [], [], []
    dtype = next(drafter.parameters()).dtype
    head = DraftHead(target.lm_head.float(), drafter.draft_vocab)  # scores in fp32 whatever the target's dtype
    for i, t in enumerate(trajectories):
        if len(t.output_ids) < 2:
            continue
        sample = TrainSample(torch.tensor(t.tokens, dtype=torch.long), len(t.prompt_ids), None)
        limit = anchors_per_sequence or len(sample.tokens)
        anchors = sample_anchors(sample, limit, torch.Generator().manual_seed(seed * 100003 + i))
        block, labels = block_inputs(sample, anchors, cfg.block_size, cfg.mask_token_id)
        block, labels, at = block.to(target.device), labels.to(target.device), anchors.to(target.device)
        features, final = teacher_pass(target, sample.tokens, cfg.target_layer_ids)
        teacher = teacher_logits(target, final, at)
        hidden = drafter(features.to(dtype), F.embedding(block, target.embed_tokens).to(dtype), anchors).float()
        logits = F.linear(hidden[:, 1:], head.weight)
        valid = labels != IGNORE
        correct = (head.ids_of(logits.argmax(-1)) == labels) & valid
        hidden_all.append(hidden.to("cpu", torch.bfloat16))
        drafted_all.append(valid.sum(1).cpu())
        accepted_all.append(correct.long().cumprod(1).sum(1).cpu())
        anchors_all.append(anchors)
        # The target's distribution for the first draft position (token a+1) is its logits at the anchor.
        div_all.append(divergence("rkl", logits[:, 0], head.restrict(teacher.float()), 1.0).cpu())
    if not hidden_all:
        raise ValueError("no trajectory with a response of at least 2 tokens to score")
    outcomes = Outcomes(torch.cat(hidden_all), torch.cat(drafted_all).long(), torch.cat(accepted_all).long())
    return BlockScores(outcomes, tuple(anchors_all), tuple(div_all))
