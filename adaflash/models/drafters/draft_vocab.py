"""A trimmed draft vocabulary (FR-Spec, arXiv 2502.14856; VocabTrim, arXiv 2506.22694).

For a small target the vocabulary projection is the largest single cost of drafting and of drafter training
(SmolLM2: 49152 x 576 = 28M weights, several times the drafter's own layers). The drafter's LM head becomes the
target's LM head restricted to the K tokens the target itself emits most often. The drafter can then only
propose those tokens; verification is unchanged, so the output stays exactly the target's.

On disk it is an optional file beside the DFlash checkpoint (`draft_vocab.safetensors`: `token_ids` [K] int64,
most frequent first) plus a `draft_vocab` key beside `dflash_config` in config.json. llama.cpp reads the checkpoint
with the full vocabulary; vLLM loads every safetensors file in the folder and refuses this one, so `adaflash export
vllm` writes the rows as the drafter's own lm_head + d2t map instead (docs/deploy.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from adaflash.models.files import read_tensors, save_tensors

VOCAB_FILE = "draft_vocab.safetensors"
CONFIG_KEY = "draft_vocab"


@dataclass(frozen=True)
class DraftVocab:
    token_ids: torch.Tensor  # [K] int64, distinct target ids, most frequent first
    vocab_size: int  # the target's

    def __post_init__(self) -> None:
        ids = self.token_ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("a draft vocabulary needs a non-empty 1-D list of token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.vocab_size})")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("draft vocabulary ids must be distinct")

    @property
    def size(self) -> int:
        return int(self.token_ids.numel())

    @classmethod
    def most_frequent(cls, counts: Counter, size: int, vocab_size: int, always: Iterable[int] = ()) -> "DraftVocab":
        """The `size` most frequent ids of `counts` (ties by id), with `always` (e.g. the stop tokens) kept in."""
        if size < 1:
            raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
        forced = list(dict.fromkeys(always))
        if len(forced) > size:
            raise ValueError(f"{len(forced)} ids must be kept but the draft vocabulary holds only {size}")
        kept = set(forced)
        ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in kept]
        chosen = ranked[: size - len(forced)] + forced
        if len(chosen) < size:  # fewer distinct ids seen than asked: fill with the lowest unused ids
            seen = set(chosen)
            chosen += [t for t in range(vocab_size) if t not in seen][: size - len(chosen)]
        return cls(torch.tensor(chosen[:size], dtype=torch.long), vocab_size)

    def truncated(self, size: int) -> "DraftVocab":
        """The `size` most frequent of these ids: the same drafter, evaluated with a smaller head."""
        if not 1 <= size <= self.size:
            raise ValueError(f"cannot cut a {self.size}-token draft vocabulary to {size}")
        return DraftVocab(self.token_ids[:size].clone(), self.vocab_size)

    def to_draft(self) -> torch.Tensor:
        """Lookup [vocab_size] from target id to row in the draft head; -1 where the id is not kept."""
        table = torch.full((self.vocab_size,), -1, dtype=torch.long)
        table[self.token_ids] = torch.arange(self.size)
        return table

    def coverage(self, tokens: torch.Tensor) -> float:
        """Share of `tokens` (target ids) the drafter could propose."""
        return float((self.to_draft()[tokens.long()] >= 0).float().mean()) if tokens.numel() else float("nan")

    def save(self, directory: str | Path) -> dict:
        """Write the ids file into a drafter directory; returns the config.json entry that points at it."""
        save_tensors(Path(directory) / VOCAB_FILE, {"token_ids": self.token_ids.contiguous()})
        return {"file": VOCAB_FILE, "size": self.size}

    @classmethod
    def load(cls, directory: str | Path, entry: dict, vocab_size: int) -> "DraftVocab":
        path = Path(directory) / str(entry.get("file", VOCAB_FILE))
        if not path.is_file():
            raise FileNotFoundError(f"config.json names a draft vocabulary {path} that does not exist")
        ids = read_tensors(path).get("token_ids")
        if ids is None:
            raise ValueError(f"{path} holds no `token_ids` tensor")
        if "size" in entry and int(entry["size"]) != ids.numel():
            raise ValueError(f"{path} holds {ids.numel()} ids, config.json says {entry['size']}")
        try:
            return cls(ids.long(), vocab_size)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc


def count_tokens(sequences: Iterable[torch.Tensor | list[int]]) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        counts.update(seq.tolist() if isinstance(seq, torch.Tensor) else seq)
    return counts


class DraftHead:
    """What a drafter's vocabulary projection needs: the head rows and the target-id <-> row maps (identity
    for a full-vocabulary drafter)."""

    def __init__(self, lm_head: torch.Tensor, vocab: DraftVocab | None) -> None:
        self.vocab = vocab
        # The maps live where the logits are: with the head, or on the CPU for an int8 target's head, which is only
        # blocks (its weight on the meta device; its rows run in the quantized kernel).
        device = torch.device("cpu") if lm_head.is_meta else lm_head.device
        self.ids = vocab.token_ids.to(device) if vocab is not None else None
        self.weight = lm_head[self.ids.to(lm_head.device)].contiguous() if vocab is not None else lm_head
        self._rows = vocab.to_draft().to(device) if vocab is not None else None

    def rows_of(self, token_ids: torch.Tensor, ignore: int | None = None) -> torch.Tensor:
        """Target ids -> head rows (-1 outside the draft vocabulary); entries equal to `ignore` stay as they are."""
        if self._rows is None:
            return token_ids
        token_ids = token_ids.to(self._rows.device)  # labels built on the host, a head on a GPU
        rows = self._rows[token_ids.clamp_min(0)]
        return rows if ignore is None else torch.where(token_ids == ignore, token_ids, rows)

    def ids_of(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.ids is None else self.ids[rows]

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [..., V] -> the draft vocabulary's columns [..., K]."""
        return logits if self.ids is None else logits[..., self.ids]
