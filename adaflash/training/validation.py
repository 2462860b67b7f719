"""A held-out slice of the training data, and the drafter's teacher-forced accept length on it, per domain.

On greedy target-regenerated data a block drafted at an anchor sees exactly what inference would see there. Two
numbers come of it. The expected accept length at random anchors (`holdout_accept_lengths`) weighs every position
alike; decoding does not: it crosses an easy stretch in a few long passes and a hard one a token a pass, so its
tokens per pass are lower wherever acceptance varies along a response. The decoded accept length
(`decoded_accept_lengths`) walks each held-out response as greedy decoding would, from its first response token,
each pass committing the drafts accepted at its anchor plus the bonus token: the tokens per pass that
`generate` reports on those prompts (checked against live decoding, docs/drafter.md).
"""

from __future__ import annotations

import hashlib
from typing import Callable, NamedTuple, Sequence

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


def _key_seed(key: str) -> int:
    return int.from_bytes(hashlib.sha1(f"{HOLDOUT_SEED}/anchors/{key}".encode()).digest()[:7], "big")


@torch.no_grad()
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


class DecodedRun(NamedTuple):
    """Drafts accepted at every anchor `first, first + 1, ...` of one response (all anchors, teacher-forced)."""

    run_lengths: Sequence[int]
    first: int  # the position of run_lengths[0]
    prompt_len: int
    length: int  # tokens in the sequence


def decoded_walk(run: DecodedRun) -> tuple[int, int]:
    """(tokens committed, target passes) of greedy decoding over one response, after its first (prefill) token."""
    tokens = passes = 0
    anchor, last = run.prompt_len, run.length - 2  # decoding's first anchor is the prefill's token
    while anchor <= last:
        accepted = run.run_lengths[anchor - run.first]
        tokens += min(accepted + 1, run.length - 1 - anchor)  # the last pass has no bonus token past the data
        passes += 1
        anchor += accepted + 1
    return tokens, passes


@torch.no_grad()
def decoded_accept_lengths(run_of: Callable[[int], DecodedRun], drafter, ids: Sequence[int],
                           domains: Sequence[str]) -> dict[str, float]:
    """Tokens per target pass of greedy decoding over the held-out responses, per domain + "all"."""
    sums: dict[str, list[int]] = {}
    was_training = drafter.training
    drafter.eval()
    try:
        for i, domain in zip(ids, domains):
            tokens, passes = decoded_walk(run_of(i))
            for key in {domain, "all"} if domain else {"all"}:
                total = sums.setdefault(key, [0, 0])
                total[0] += tokens
                total[1] += passes
    finally:
        drafter.train(was_training)
    return {key: t / max(1, p) for key, (t, p) in sorted(sums.items())}
