"""Teacher-forced block outcomes equal what the speculative loop's verification records, anchor by anchor."""

from __future__ import annotations

import torch

from adaflash.formats.trajectories import Trajectory
from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import speculative_generate
from adaflash.training.block_outcomes import score_blocks
from adaflash.training.trainer import train
from tests.training.test_distill import _config


def test_score_blocks_matches_real_verification(tiny_checkpoints, tiny_data, tmp_path):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    # A drafter trained a little on the tiny target, so that some drafts are accepted and some are not.
    path = train(_config(tiny_checkpoints, tiny_data, tmp_path, max_steps=40, lr=1e-2), progress=False)
    drafter = load_drafter(path, dtype=torch.float32)
    proposer = DFlashProposer(drafter, target)
    b = drafter.config.block_size
    compared, accepted_any = 0, 0
    for prompt in ([3, 7, 9], [5, 7, 11], [4, 7, 10, 12]):
        run = speculative_generate(target, proposer, prompt, 40)
        scores = score_blocks(target, drafter, [Trajectory(tuple(prompt), tuple(run.token_ids))])
        by_anchor = dict(zip(scores.anchors[0].tolist(), zip(scores.outcomes.drafted.tolist(), scores.outcomes.accepted.tolist())))
        anchor = len(prompt)  # the first generated token (from the prefill) is the first anchor
        for k, a in zip(run.stats.draft_lengths, run.stats.accept_lengths):
            drafted, accepted = by_anchor[anchor]
            if k == b - 1 and drafted == b - 1:
                assert accepted == a - 1, f"anchor {anchor}"
                compared += 1
                accepted_any += accepted > 0
            anchor += a
    assert compared >= 10 and accepted_any >= 2
    assert 1.0 <= scores.accept_length <= b and len(scores.per_position_acceptance()) == b - 1
