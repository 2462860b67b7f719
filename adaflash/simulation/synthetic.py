"""A target and a drafter with no weights: the engine runs unchanged over them, at GPU scale, in seconds.

`SyntheticTarget`'s next token is a fixed function of the last token and its position, so every pass is a lookup and
greedy decoding is well defined (speculative output can be checked against it). `SyntheticDrafter` drafts the target's
true continuation up to a drawn accept length, then a wrong token: its strength is stated, not learned - per request an
acceptance rate `alpha` (a draft position is accepted with probability alpha given the ones before it), drawn around
the rate whose mean accept length (bonus included) over a block is the published `tau`. Its "hidden states" carry
that rate, seen through a stated calibration error, so a length head (`SyntheticHead`) can read them as AdaFlash's
learned head reads a real drafter's. Every figure made with them is labelled synthetic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch

from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import ForwardOutput


@dataclass(frozen=True)
class SyntheticConfig:
    vocab_size: int = 512
    hidden_size: int = 2
    max_position_embeddings: int = 1 << 20
    eos_token_ids: tuple[int, ...] = ()


def next_token(token: int, position: int, vocab: int) -> int:
    """The synthetic target's greedy pick after `token` at `position` (never 0 or 1: no stop token is ever made)."""
    return (token * 1103515245 + position * 12345 + 7) % (vocab - 2) + 2


class SyntheticTarget:
    """The engine's target protocol over `next_token`: one-hot logits, zero features, a cache of lengths only."""

    rows_independent = False
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, config: SyntheticConfig = SyntheticConfig()) -> None:
        self.config = config

    def new_cache(self, num_slots: int, max_len: int, dtype=None, **pool) -> KVCache:
        return KVCache(1, num_slots, max_len, 1, 1, torch.float32, **pool)  # lengths only: nothing is written

    def kv_bytes_per_token(self, dtype=None) -> int:
        return 8  # the cache above: one fp32 K and V value a position

    def __call__(self, token_ids: torch.Tensor, batch: RaggedBatch, cache: KVCache, capture_layers=(),
                 logit_indices: torch.Tensor | None = None) -> ForwardOutput:
        tokens, positions = token_ids.tolist(), batch.positions.tolist()
        rows = range(len(tokens)) if logit_indices is None else logit_indices.tolist()
        logits = torch.zeros(len(rows), self.config.vocab_size)
        for r, i in enumerate(rows):
            logits[r, next_token(tokens[i], positions[i], self.config.vocab_size)] = 1.0
        for slot, end in zip(batch.slots, batch.ends):
            cache.lengths[slot] = end
        hidden = torch.zeros(len(tokens), len(capture_layers) * self.config.hidden_size) if capture_layers else None
        return ForwardOutput(logits=logits, hidden=hidden)


def accept_length(alpha: float, block_size: int) -> float:
    """Mean tokens a verify of a full block commits (bonus included) when each draft is kept with probability alpha
    given the ones before it."""
    return float(block_size) if alpha >= 1 else (1 - alpha ** block_size) / (1 - alpha)


@dataclass(frozen=True)
class Strength:
    """A drafter's stated strength: mean accept length `tau` (bonus included) over a block of `block_size`, requests'
    rates spread with standard deviation `spread` around it; the head sees each rate with `head_error` (std) noise."""

    tau: float
    block_size: int = 16
    spread: float = 0.05
    head_error: float = 0.0

    @property
    def alpha(self) -> float:
        """The acceptance rate whose accept length over a block is tau: (1 - a^B) / (1 - a) = tau, by bisection."""
        if not 1.0 <= self.tau <= self.block_size:
            raise ValueError(f"tau must be in [1, {self.block_size}], got {self.tau}")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if accept_length(mid, self.block_size) < self.tau else (lo, mid)
        return (lo + hi) / 2

    @classmethod
    def parse(cls, spec: str) -> "Strength":
        """`tau=8.01,block=16,spread=0.05,head_error=0.1` (tau required)."""
        names = {"tau": "tau", "block": "block_size", "spread": "spread", "head_error": "head_error"}
        values = {}
        for item in filter(None, spec.split(",")):
            key, _, value = item.partition("=")
            if key not in names or not value:
                raise ValueError(f"bad synthetic drafter spec {spec!r}: items are {', '.join(names)} (key=value)")
            values[names[key]] = int(value) if key == "block" else float(value)
        if "tau" not in values:
            raise ValueError(f"bad synthetic drafter spec {spec!r}: tau= is required")
        return cls(**values)


class SyntheticDrafter:
    """The engine's proposer protocol: drafts the synthetic target's continuation, right up to a drawn accept length.
    A request's rate is drawn when its slot's context starts (seeded by the slot's request count)."""

    def __init__(self, target: SyntheticTarget, strength: Strength, seed: int = 0) -> None:
        self.target, self.strength, self.seed = target, strength, seed
        self.capture_layers = (0,)
        self._alpha = strength.alpha
        self._rates: dict[int, tuple[float, float]] = {}  # slot -> (its rate, what the head sees of it)
        self._starts: dict[int, int] = {}  # slot -> requests started there
        self._looked: dict[int, tuple[int, int]] = {}  # slot -> (anchor, its position) of the last look
        self._rng = random.Random(seed)

    @property
    def block_size(self) -> int:
        return self.strength.block_size

    def new_cache(self, num_slots: int, max_len: int, **pool) -> KVCache:
        return KVCache(1, num_slots, max_len, 1, 1, torch.float32, **pool)  # lengths only: nothing is written

    def add_context(self, cache: KVCache, features: torch.Tensor, batch: RaggedBatch) -> None:
        for slot, start, end in zip(batch.slots, batch.starts, batch.ends):
            if start == 0:  # a new request in this slot
                self._starts[slot] = n = self._starts.get(slot, 0) + 1
                rng = random.Random(hash((self.seed, slot, n)))
                rate = min(max(rng.gauss(self._alpha, self.strength.spread), 0.0), 0.999)
                seen = min(max(rate + rng.gauss(0.0, self.strength.head_error), 0.0), 0.999)
                self._rates[slot] = (rate, seen)
            cache.lengths[slot] = end

    def _draft(self, slot: int, anchor: int, position: int, k: int) -> list[int]:
        rate, vocab = self._rates.get(slot, (self._alpha, 0.0))[0], self.target.config.vocab_size
        right, token = [], anchor
        for i in range(k):
            token = next_token(token, position + i, vocab)
            right.append(token)
        kept = 0
        while kept < k and self._rng.random() < rate:
            kept += 1
        if kept < k:  # the first rejected draft: any token but the right one
            right[kept] = 2 + (right[kept] - 1) % (vocab - 2)
            right[kept + 1:] = [2] * (k - kept - 1)
        return right

    def propose(self, cache, slots, anchors, num_draft, sampling, generators):
        from adaflash.speculative.proposer import Drafts

        if any(not p.greedy for p in sampling):
            raise ValueError("the synthetic drafter drafts greedy requests only")
        tokens = [t for s, a, k in zip(slots, anchors, num_draft) for t in self._draft(s, a, cache.lengths[s], k)]
        return Drafts(tokens=torch.tensor(tokens, dtype=torch.long), probs=(None,) * len(slots),
                      num_draft=tuple(num_draft))

    def draft_hidden(self, cache, slots, anchors, width=None) -> torch.Tensor:
        """[n, width, 2]: the rate the head sees, and the slot (so `draft_tokens` knows whose block it drafts)."""
        width = width or self.block_size
        hidden = torch.zeros(len(slots), width, 2)
        for row, (slot, anchor) in enumerate(zip(slots, anchors)):
            self._looked[slot] = (anchor, cache.lengths[slot])
            hidden[row, :, 0] = self._rates.get(slot, (self._alpha, self._alpha))[1]
            hidden[row, :, 1] = slot
        return hidden

    def draft_tokens(self, hidden, num_draft, sampling, generators, anchors=None):
        from adaflash.speculative.proposer import Drafts

        tokens = []
        for row, k in zip(hidden, num_draft):
            slot = int(row[0, 1])
            anchor, position = self._looked[slot]
            tokens += self._draft(slot, anchor, position, k)
        return Drafts(tokens=torch.tensor(tokens, dtype=torch.long), probs=(None,) * len(num_draft),
                      num_draft=tuple(num_draft))


class SyntheticHead:
    """A length head over the synthetic drafter's blocks: the survival of each draft position from the rate it
    sees (the true rate plus the stated calibration error)."""

    def survival(self, hidden: torch.Tensor) -> torch.Tensor:
        rate = hidden[:, 0, 0:1]
        k = torch.arange(1, hidden.shape[1], dtype=torch.float32)[None, :]
        return rate ** k


def synthetic_prompt(length: int, seed: int, vocab: int = SyntheticConfig.vocab_size) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(max(1, length))]


def synthetic_greedy(prompt: Sequence[int], new_tokens: int, vocab: int = SyntheticConfig.vocab_size) -> list[int]:
    """What the synthetic target decodes after `prompt`: the reference every synthetic run is checked against."""
    out, token = [], prompt[-1]
    for i in range(new_tokens):
        token = next_token(token, len(prompt) - 1 + i, vocab)
        out.append(token)
    return out
