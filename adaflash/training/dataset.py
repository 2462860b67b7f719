"""Training samples from regenerated-data shards, and the deterministic anchor sampling of DFlash training."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from adaflash.formats.trajectories import read_trajectories
from adaflash.training.datagen import load_manifest, read_shard
from adaflash.training.losses import IGNORE


@dataclass(frozen=True)
class TrainSample:
    tokens: torch.Tensor  # [L] int64
    prompt_len: int
    features: torch.Tensor | None  # [L - 1, n*d] target features of every position but the last; None: compute
    # The target's stored top-k at each response position (row r: position prompt_len - 1 + r), if the data has it.
    top_logprobs: torch.Tensor | None = None  # [L - prompt_len, k] fp16
    top_ids: torch.Tensor | None = None  # [L - prompt_len, k] int32
    domain: str = ""
    key: str = ""  # the prompt id where known: what the held-out split hashes


class DraftDataset:
    """All samples of one or more regenerated-data directories, held in memory (features stay bf16 until used).

    Several directories (data generated in rounds, each its own recipe) train as one set; a prompt id held by two of
    them is refused, since the held-out split and the resume order key on prompt ids."""

    def __init__(self, data_dirs: str | Path | Sequence[str | Path], capture_layers: tuple[int, ...]) -> None:
        dirs = [data_dirs] if isinstance(data_dirs, (str, Path)) else list(data_dirs)
        if not dirs:
            raise ValueError("no data directory given")
        self.samples: list[TrainSample] = []
        owner: dict[str, str | Path] = {}
        for data_dir in dirs:
            for sample in _read_data_dir(data_dir, capture_layers):
                if sample.key in owner:
                    raise ValueError(f"prompt id {sample.key!r} is in both {owner[sample.key]} and {data_dir}")
                owner[sample.key] = data_dir
                self.samples.append(sample)
        self.has_soft_targets = all(s.top_logprobs is not None for s in self.samples)
        if not self.samples:
            raise ValueError(f"{', '.join(map(str, dirs))}: no sample with a response of at least 2 tokens")

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def keys(self) -> list[str]:
        return [s.key or str(i) for i, s in enumerate(self.samples)]


class TrajectoryDataset:
    """Token-only trajectories (on-policy data from the serving engine); features come from the target on the fly."""

    def __init__(self, path: str | Path) -> None:
        self.samples = [
            TrainSample(torch.tensor(t.tokens, dtype=torch.long), len(t.prompt_ids), None)
            for t in read_trajectories(path)
            if len(t.output_ids) >= 2
        ]
        if not self.samples:
            raise ValueError(f"{path} has no trajectory with a response of at least 2 tokens")
        self.has_soft_targets = False

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def keys(self) -> list[str]:
        return [s.key or str(i) for i, s in enumerate(self.samples)]


def _read_data_dir(data_dir: str | Path, capture_layers: tuple[int, ...]) -> list[TrainSample]:
    manifest = load_manifest(data_dir)
    if manifest is None or not manifest["shards"]:
        raise FileNotFoundError(f"no regenerated data in {data_dir}: run `adaflash data generate --out {data_dir}`")
    found = tuple(manifest["config"]["capture_layers"])
    tokens_only = not manifest["config"].get("store_features", True)  # any drafter's features are recomputed
    if found != tuple(capture_layers) and not tokens_only:
        raise ValueError(f"{data_dir} holds features of target layers {found}, the drafter reads {capture_layers}")
    return [
        TrainSample(torch.tensor(s.tokens, dtype=torch.long), s.prompt_len, s.features, s.top_logprobs, s.top_ids,
                    domain, key)
        for shard in manifest["shards"]
        for s, domain, key in zip(read_shard(Path(data_dir) / shard["file"]), shard["domains"], shard["prompt_ids"])
        if len(s.tokens) - s.prompt_len >= 2  # at least one anchor with a label
    ]


def load_training_data(data_dir: str | Path | Sequence[str | Path],
                       capture_layers: tuple[int, ...]) -> DraftDataset | TrajectoryDataset:
    """Feature shards (`adaflash data generate`; one directory or several) when manifests are there, else
    trajectories (*.jsonl)."""
    if not isinstance(data_dir, (str, Path)):
        if len(data_dir) != 1:  # several directories: each must hold feature shards
            return DraftDataset(data_dir, capture_layers)
        data_dir = data_dir[0]
    if load_manifest(data_dir) is not None:
        return DraftDataset(data_dir, capture_layers)
    return TrajectoryDataset(data_dir)


def first_anchor(sample: TrainSample) -> int:
    """The first position a block can start at: the last prompt token (position 0 has no context)."""
    return max(1, sample.prompt_len - 1)


def sample_anchors(sample: TrainSample, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Sorted random anchor positions inside the response (each predicts at least one response token); all of them,
    from `first_anchor` on, when there are no more than `num_anchors`, or when `num_anchors` <= 0 ("anchors
    everywhere": every valid position of the sequence, issue 52's ablation arm)."""
    last = len(sample.tokens) - 2
    candidates = torch.arange(first_anchor(sample), last + 1)
    if 0 < num_anchors < len(candidates):
        candidates = candidates[torch.randperm(len(candidates), generator=generator)[:num_anchors]]
    return candidates.sort().values


def block_inputs(sample: TrainSample, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids [A, B] = [anchor token, MASK...] and labels [A, B-1] = the tokens that follow."""
    offsets = torch.arange(1, block_size)
    pos = anchors[:, None] + offsets[None, :]
    inside = pos < len(sample.tokens)
    labels = torch.where(inside, sample.tokens[pos.clamp(max=len(sample.tokens) - 1)], torch.full_like(pos, IGNORE))
    block = torch.full((len(anchors), block_size), mask_token_id, dtype=torch.long)
    block[:, 0] = sample.tokens[anchors]
    return block, labels


def block_soft_targets(sample: TrainSample, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored top-k (log-probabilities [A, B-1, k] fp32, target ids [A, B-1, k]) for each block position.

    Block position j of anchor a predicts token a + j, drawn from the target's distribution at position
    a + j - 1, i.e. stored row a + j - prompt_len. Rows past the sequence end repeat the last (their labels
    are IGNORE anyway)."""
    if sample.top_logprobs is None:
        raise ValueError("this sample has no stored soft targets")
    rows = anchors[:, None] + torch.arange(1, block_size)[None, :] - sample.prompt_len
    rows = rows.clamp(0, sample.top_logprobs.shape[0] - 1)
    return sample.top_logprobs[rows].float(), sample.top_ids[rows].long()
