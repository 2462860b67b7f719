"""Prompt-prefix reuse across requests: a slot's cache keeps what its last request left, and the next request placed
there prefills only the part of its prompt that differs (llama-server's `cache_prompt`, vLLM's prefix caching, in a
slot cache). Every chat prompt starts with the same system turn, and a multi-turn conversation re-sends its history.

Exact only where a position's K/V are bitwise the same whatever pass computed them (`TargetModel.rows_independent`:
the int8 target, every pass on row-independent kernels): then a reused prefix is what a fresh prefill would write,
and outputs do not depend on which slot a request lands in. The engine turns it on only there.
"""

from __future__ import annotations

from typing import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPrefixes:
    """Per slot, the token ids whose K/V its cache holds at positions 0.. (left by the slot's last request)."""

    def __init__(self, num_slots: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(num_slots)]

    def reusable(self, slot: int, prompt: Sequence[int]) -> int:
        """How many leading prompt tokens `slot` already holds; the last prompt token is always computed (its
        logits pick the first output token)."""
        return min(common_prefix(self.tokens[slot], prompt), len(prompt) - 1)

    def best_slot(self, prompt: Sequence[int], free_slots: Sequence[int]) -> int:
        """The free slot holding the longest prefix of `prompt`; among equals the scheduler's own next (the last)."""
        return max(reversed(free_slots), key=lambda s: self.reusable(s, prompt))

    def remember(self, slot: int, tokens: Sequence[int]) -> None:
        self.tokens[slot] = list(tokens)

    def forget(self, slot: int) -> None:
        self.tokens[slot] = []
