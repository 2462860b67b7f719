"""A request's life in the engine: what was asked, and what has been produced so far (token ids only)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adaflash.speculative.sampling import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    top_logprobs: int = 0  # > 0: each step also returns the target's top-k log-probabilities per committed token
    return_features: bool = False  # each step also returns the target features of the committed positions it processed
    # Engine-owned state.
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per target pass (incl. bonus)
    draft_lengths: list[int] = field(default_factory=list)  # drafted tokens verified per target pass
    policy_state: dict = field(default_factory=dict)  # owned by the length policy
    drafting_records: dict = field(default_factory=dict)  # owned by the drafting checks: per draft source, a RequestRecord
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def position(self) -> int:
        """Position of the last committed token, which no cache holds yet (the next anchor)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    def commit(self, tokens: list[int]) -> list[int]:
        """Append tokens up to the budget and the first stop token; returns what was actually appended."""
        kept = []
        for t in tokens[: self.remaining]:
            kept.append(t)
            if t in self.stop_token_ids:
                self.finish_reason = "stop"
                break
        self.output_ids += kept
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = "length"
        return kept


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    # Only when the request asked: [len(new_token_ids), k] log-probabilities (fp32) and token ids of the target's
    # unprocessed (temperature-1) top-k at each committed token, and the target features [len(new_token_ids), n*d]
    # (a prefill: [prompt length, n*d]) of the committed positions this step processed (the engine's capture layers).
    top_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    features: torch.Tensor | None = None
