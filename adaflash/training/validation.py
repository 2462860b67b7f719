"""A held-out slice of the training data, and the drafter's teacher-forced accept length on it, per domain.

On greedy target-regenerated data a block drafted at an anchor sees exactly what inference would see there,
so the accept length at held-out anchors is the full-block greedy accept length of real decoding, measured at
random anchors instead of the ones decoding visits. It picks hyper-parameters and draws the scaling curve.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

HOLDOUT_SEED = 20261201


def split_holdout(num_samples: int, holdout: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids): a fixed pseudo-random `holdout` of the samples, the same in every run."""
    if holdout >= num_samples:
        raise ValueError(f"cannot hold out {holdout} of {num_samples} samples")
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(HOLDOUT_SEED)).tolist()
    return sorted(order[holdout:]), sorted(order[:holdout])


def expected_accept_length(accepted: Sequence[int], valid: Sequence[int]) -> float:
    """1 (the bonus token) + the per-position rates at which a full block's drafts are all accepted so far."""
    return 1.0 + sum(a / max(1, v) for a, v in zip(accepted, valid))


@torch.no_grad()
def holdout_accept_lengths(loss_of: Callable[[int, torch.Generator], tuple[torch.Tensor, dict]], drafter,
                           ids: Sequence[int], domains: Sequence[str]) -> dict[str, float]:
    """`loss_of(sample id, generator)` -> (loss, stats) for fixed anchors; returns accept length per domain + "all"."""
    sums: dict[str, tuple[list[int], list[int]]] = {}
    was_training = drafter.training
    drafter.eval()
    try:
        for i, domain in zip(ids, domains):
            _, stats = loss_of(i, torch.Generator().manual_seed(HOLDOUT_SEED + i))
            for key in (domain or "all", "all") if domain else ("all",):
                acc, val = sums.setdefault(key, ([0] * len(stats["valid"]), [0] * len(stats["valid"])))
                for k, (a, v) in enumerate(zip(stats["accepted"], stats["valid"])):
                    acc[k] += a
                    val[k] += v
    finally:
        drafter.train(was_training)
    return {key: expected_accept_length(acc, val) for key, (acc, val) in sorted(sums.items())}
