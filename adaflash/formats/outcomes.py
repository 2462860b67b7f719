"""Recorded verification outcomes: the drafter's block hidden states and how many drafts the target kept.

These are the training data of the candidate-length heads (`adaflash.models.length_head`). Hidden states
are stored in bf16 (they dominate the file size; the heads train on them detached, so bf16 costs nothing
that matters), counts in int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from adaflash.models.files import read_tensors, save_tensors

_KEYS = ("hidden", "drafted", "accepted")


@dataclass(frozen=True)
class Outcomes:
    hidden: Tensor  # [N, B, d] drafter hidden states of the block (position 0 = anchor)
    drafted: Tensor  # [N] long: drafts the target verified, 0..B-1
    accepted: Tensor  # [N] long: leading drafts it accepted, 0..drafted

    def __post_init__(self) -> None:
        if self.hidden.dim() != 3:
            raise ValueError(f"hidden must be [N, B, d], got {tuple(self.hidden.shape)}")
        n, b = self.hidden.shape[:2]
        if b < 2:
            raise ValueError(f"block size must be >= 2, got {b}")
        for name in ("drafted", "accepted"):
            t = getattr(self, name)
            if t.shape != (n,) or t.dtype != torch.long:
                raise ValueError(f"{name} must be a long tensor of shape [{n}], got {t.dtype} {tuple(t.shape)}")
        if n and not (
            bool((self.accepted >= 0).all()) and bool((self.accepted <= self.drafted).all())
            and bool((self.drafted <= b - 1).all())
        ):
            raise ValueError(f"outcomes need 0 <= accepted <= drafted <= {b - 1}")

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.hidden.shape[1])

    @property
    def hidden_size(self) -> int:
        return int(self.hidden.shape[2])

    def select(self, index: Tensor) -> "Outcomes":
        return Outcomes(hidden=self.hidden[index], drafted=self.drafted[index], accepted=self.accepted[index])

    @staticmethod
    def concat(parts: Sequence["Outcomes"]) -> "Outcomes":
        if not parts:
            raise ValueError("nothing to concatenate: no outcomes")
        shape = tuple(parts[0].hidden.shape[1:])
        for i, part in enumerate(parts):
            if tuple(part.hidden.shape[1:]) != shape:
                raise ValueError(f"outcomes part {i} has [B, d] = {tuple(part.hidden.shape[1:])}, part 0 has {shape}")
        dtype = parts[0].hidden.dtype
        return Outcomes(
            hidden=torch.cat([p.hidden.to(dtype) for p in parts]),
            drafted=torch.cat([p.drafted for p in parts]),
            accepted=torch.cat([p.accepted for p in parts]),
        )

    def split(self, frac: float, seed: int) -> tuple["Outcomes", "Outcomes"]:
        """(train, held_out) by a seeded shuffle; held_out gets round(N * frac), at least 1 of each if possible."""
        if not 0.0 <= frac < 1.0:
            raise ValueError(f"held-out fraction must be in [0, 1), got {frac}")
        n = len(self)
        n_held = int(round(n * frac))
        if frac > 0 and n >= 2:
            n_held = min(max(n_held, 1), n - 1)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        return self.select(perm[n_held:]), self.select(perm[:n_held])


def save_outcomes(path: str | Path, outcomes: Outcomes) -> Path:
    """Atomic: written under a temporary name in the same directory, then renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        "hidden": outcomes.hidden.detach().to("cpu", torch.bfloat16).contiguous(),
        "drafted": outcomes.drafted.detach().to("cpu", torch.int64).contiguous(),
        "accepted": outcomes.accepted.detach().to("cpu", torch.int64).contiguous(),
    }
    return save_tensors(path, tensors, {"format": "adaflash-outcomes", "version": "1"})


def _load_one(path: Path) -> Outcomes:
    tensors = read_tensors(path, "outcomes file")
    missing = [k for k in _KEYS if k not in tensors]
    if missing:
        raise ValueError(f"{path} is not an outcomes file: it lacks {missing}")
    try:
        return Outcomes(hidden=tensors["hidden"], drafted=tensors["drafted"].long(), accepted=tensors["accepted"].long())
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def load_outcomes(paths: Sequence[str | Path] | str | Path) -> Outcomes:
    """Concatenate outcome files; they must agree on block size and hidden size."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("no outcomes files given")
    parts = [_load_one(p) for p in paths]
    shape = tuple(parts[0].hidden.shape[1:])
    for path, part in zip(paths, parts):
        if tuple(part.hidden.shape[1:]) != shape:
            raise ValueError(
                f"{path} has [B, d] = {tuple(part.hidden.shape[1:])} but {paths[0]} has {shape}: "
                "outcomes from different drafters cannot be mixed"
            )
    return Outcomes.concat(parts)
