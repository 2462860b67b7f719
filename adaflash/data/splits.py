"""Deterministic eval/train splitting.

An item's split depends only on a stable key (a template id, a problem id, a conversation id) hashed
with a per-source salt: never on file order, on which other items exist, or on Python's randomised
`hash()`. So splits survive re-ordered or extended data, and every process agrees on them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

EVAL = "eval"
TRAIN = "train"
SPLITS = (EVAL, TRAIN)

# Fraction of keys that go to eval, per source. Chosen so each eval set is a few dozen to a few hundred
# prompts (enough for stable speed-up estimates) while the rest stays available for drafter training.
EVAL_FRACTION = {
    # GSM-Symbolic templates (100): half are eval-only, the other half feed training and the generator.
    "gsm8k": 0.5,
    # CHAMP problems (270): ~100 eval, ~170 train.
    "champ": 0.37,
    # ShareGPT conversations: one fraction for both the code and the chat slice, so the parts of one
    # conversation (ids `X_0`, `X_1`, ...) land on the same side even if they fall in different slices.
    "sharegpt": 0.07,
}


def bucket(key: str, salt: str) -> float:
    """Map `key` to a uniform number in [0, 1) via SHA-1 of `salt:key`."""
    digest = hashlib.sha1(f"{salt}:{key}".encode()).hexdigest()
    return int(digest[:15], 16) / float(16**15)


def split_of(key: str, salt: str, eval_fraction: float) -> str:
    """`"eval"` for the lowest `eval_fraction` of the hash range, else `"train"`."""
    return EVAL if bucket(key, salt) < eval_fraction else TRAIN


def select(items: Iterable[T], split: str, key: Callable[[T], str], salt: str, eval_fraction: float) -> list[T]:
    """Keep the items whose key falls in `split`, preserving their order."""
    check_split(split)
    return [item for item in items if split_of(key(item), salt, eval_fraction) == split]


def check_split(split: str, available: Iterable[str] = SPLITS, dataset: str | None = None) -> None:
    available = tuple(available)
    if split not in available:
        where = f" for dataset {dataset!r}" if dataset else ""
        raise ValueError(f"unknown split {split!r}{where}; available: {', '.join(available)}")
