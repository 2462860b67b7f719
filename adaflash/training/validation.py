"""A held-out slice of the training data, and the drafter's teacher-forced accept length on it, per domain.

On greedy target-regenerated data a block drafted at an anchor sees exactly what inference would see there,
so the accept length at held-out anchors is the full-block greedy accept length of real decoding, measured at
random anchors instead of the ones decoding visits. It picks hyper-parameters and draws the scaling curve.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import torch

HOLDOUT_SEED = 20261201


def split_holdout(keys: Sequence[str], holdout: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids): the `holdout` samples whose keys (prompt ids) hash lowest.

    By key, not by position: when the data grows between runs (a resumed training on more regenerated data), a new
    sample may take a held-out place (pushing the highest-hashed held-out one into training), but a sample once
    trained on never becomes a held-out one."""
    if holdout >= len(keys):
        raise ValueError(f"cannot hold out {holdout} of {len(keys)} samples")
    order = sorted(range(len(keys)), key=lambda i: (hashlib.sha1(f"{HOLDOUT_SEED}:{keys[i]}".encode()).digest(), i))
    return sorted(order[holdout:]), sorted(order[:holdout])


def expected_accept_length(accepted: Sequence[int], valid: Sequence[int]) -> float:
    """1 (the bonus token) + the per-position rates at which a full block's drafts are all accepted so far."""
    return 1.0 + sum(a / max(1, v) for a, v in zip(accepted, valid))


@torch.no_grad()
def _key_seed(key: str) -> int:
    return int.from_bytes(hashlib.sha1(f"{HOLDOUT_SEED}/anchors/{key}".encode()).digest()[:7], "big")


def holdout_accept_lengths(loss_of: Callable[[int, torch.Generator], tuple[torch.Tensor, dict]], drafter,
                           ids: Sequence[int], domains: Sequence[str], keys: Sequence[str]) -> dict[str, float]:
    """`loss_of(sample id, generator)` -> (loss, stats); returns accept length per domain + "all".

    Each held-out sample's anchors are seeded by its key, so runs on grown data score it at the same anchors."""
    sums: dict[str, tuple[list[int], list[int]]] = {}
    was_training = drafter.training
    drafter.eval()
    try:
        for i, domain in zip(ids, domains):
            _, stats = loss_of(i, torch.Generator().manual_seed(_key_seed(keys[i])))
            for key in {domain, "all"} if domain else {"all"}:
                acc, val = sums.setdefault(key, ([0] * len(stats["valid"]), [0] * len(stats["valid"])))
                for k, (a, v) in enumerate(zip(stats["accepted"], stats["valid"])):
                    acc[k] += a
                    val[k] += v
    finally:
        drafter.train(was_training)
    return {key: expected_accept_length(acc, val) for key, (acc, val) in sorted(sums.items())}
