"""Prompt-lookup (n-gram) drafts: the tokens that followed an earlier occurrence of the sequence's last n tokens.

transformers' `prompt_lookup_num_tokens` and vLLM's / SGLang's `ngram` method, as a draft source beside the
drafter: it costs no model pass, and a small target repeats itself often (lists, code, loops), where a match
drafts a long run the target then verifies in one pass. Drafts are deterministic, so a sampling request verifies
them against a point mass (rejection sampling stays exact: accept with probability p(x), else draw from p without x).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

import torch

from adaflash.models.kernels.attention import MAX_QUERIES


# How many of a lookup's drafts a step verifies: as many as pay for their verify cost given each request's running
# lookup acceptance (the engine's `LookupLength`), or all of them (transformers' and vLLM's behaviour).
LOOKUP_LENGTHS = ("throughput", "all")

_ID_TYPE = "q"  # token ids as 8-byte integers in the searched string (any id a vocabulary has)
_ID_BYTES = array(_ID_TYPE).itemsize


@dataclass(frozen=True)
class PromptLookup:
    num_tokens: int  # the most drafts one lookup proposes
    max_ngram: int = 3  # the longest suffix tried first (a longer match predicts better)
    min_ngram: int = 2  # the shortest suffix that may match (1 matches almost anything, and a miss costs a verify)
    length: str = "throughput"  # one of LOOKUP_LENGTHS

    def __post_init__(self) -> None:
        if self.length not in LOOKUP_LENGTHS:
            raise ValueError(f"prompt lookup length must be one of {', '.join(LOOKUP_LENGTHS)}, got {self.length!r}")
        # At most 15: a longer verify would run the fp32 target's prefill attention (SDPA), whose last bits differ from
        # the short-step kernel's.
        if not 1 <= self.num_tokens < MAX_QUERIES:
            raise ValueError(f"prompt lookup needs 1 <= num_tokens <= {MAX_QUERIES - 1}, got {self.num_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to min(num_tokens, limit) drafts after `tokens` (every committed token, the anchor last); [] if no match.

        The longest suffix n-gram with an earlier occurrence wins; among its occurrences, the most recent one followed
        by a full run of drafts (the context nearest in the text), else the earliest (the longest run there is)."""
        want = self.num_tokens if limit is None else min(self.num_tokens, limit)
        length = len(tokens)
        if want < 1 or length < self.min_ngram + 1:
            return []
        # The tokens as one string of fixed-width ids, searched by bytes.rfind / find in C: a search with tensor ops
        # took ~65 us a step (1-2% of a decode step, every step of a request that asks), this one a few.
        text = array(_ID_TYPE, tokens).tobytes()
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = text[_ID_BYTES * (length - n):]
            start = _last_at_token(text, suffix, _ID_BYTES * max(0, length - want))  # followed by `want` tokens
            if start < 0:
                start = _first_at_token(text, suffix, _ID_BYTES * (length - 1))  # followed by at least one
            if start >= 0:
                start = start // _ID_BYTES + n
                return list(tokens[start : start + want])
        return []


def _last_at_token(text: bytes, pattern: bytes, end: int) -> int:
    """The byte offset of the last occurrence of `pattern` within text[:end] that starts on a token, or -1."""
    while True:
        i = text.rfind(pattern, 0, end)
        if i < 0 or i % _ID_BYTES == 0:
            return i
        end = i + len(pattern) - 1  # every occurrence starting before i


def _first_at_token(text: bytes, pattern: bytes, end: int) -> int:
    """The byte offset of the first occurrence of `pattern` within text[:end] that starts on a token, or -1."""
    i = text.find(pattern, 0, end)
    while i >= 0 and i % _ID_BYTES:
        i = text.find(pattern, i + 1, end)
    return i


def point_mass(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[len(tokens), V] one-hot rows: the draft distribution of deterministic drafts, for rejection sampling."""
    q = torch.zeros(len(tokens), vocab_size)
    q[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 1.0
    return q
