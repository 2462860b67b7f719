"""Single-request reference loops: autoregressive decoding and DFlash speculative decoding.

These stay short and readable on purpose: the batched serving engine is tested against them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.layers import argmax_rows
from adaflash.models.targets.model import TargetModel
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.sampling import (SamplingParams, draw_exponentials, draw_uniforms, logits_to_probs,
                                           sample_tokens)
from adaflash.speculative.verify import verify_greedy, verify_sampling


@dataclass
class GenerationStats:
    target_passes: int = 0  # target forwards after prefill (one per decode / verify step)
    draft_tokens: int = 0  # drafted tokens sent to verification
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per target pass, incl. bonus
    draft_lengths: list[int] = field(default_factory=list)  # drafted tokens verified per target pass
    elapsed_s: float = 0.0
    first_token_s: float = 0.0  # of elapsed_s: the prompt's prefill and the first token's pick

    @property
    def accept_len_mean(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    def as_dict(self, num_tokens: int) -> dict:
        return {
            "accept_len_mean": self.accept_len_mean,
            "target_passes": self.target_passes,
            "draft_tokens": self.draft_tokens,
            "tokens_per_s": num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0,
            "elapsed_s": self.elapsed_s,
            "first_token_s": self.first_token_s,
        }


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats


def _pick(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    if sampling.greedy:
        return int(argmax_rows(logits[None])[0])  # the engine's greedy pick (torch.argmax's index, faster)
    return int(sample_tokens(logits_to_probs(logits[None], sampling), generator)[0])


def _finish(tokens: list[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> list[int]:
    """Cut at the budget and just after the first stop token (which is kept, as HF generate does)."""
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in stop_token_ids:
            return tokens[: i + 1]
    return tokens


def _done(tokens: list[int], max_new_tokens: int, stop_token_ids: Sequence[int]) -> bool:
    return len(tokens) >= max_new_tokens or any(t in stop_token_ids for t in tokens)


def _check_prompt(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


@torch.inference_mode()
def autoregressive_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
) -> GenerationResult:
    _check_prompt(prompt_ids, max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    n = len(prompt_ids)
    cache = target.new_cache(1, n + max_new_tokens)
    stats = GenerationStats()
    start = time.perf_counter()
    out = target(torch.tensor(prompt_ids), RaggedBatch.build([0], [0], [n]), cache, logit_indices=torch.tensor([n - 1]))
    tokens = [_pick(out.logits[0], sampling, generator)]
    stats.first_token_s = time.perf_counter() - start
    while not _done(tokens, max_new_tokens, stop_token_ids):
        batch = RaggedBatch.build([0], [n + len(tokens) - 1], [1])
        out = target(torch.tensor(tokens[-1:]), batch, cache)
        tokens.append(_pick(out.logits[0], sampling, generator))
        stats.target_passes += 1
        stats.accept_lengths.append(1)
        stats.draft_lengths.append(0)
    stats.elapsed_s = time.perf_counter() - start
    return GenerationResult(_finish(tokens, max_new_tokens, stop_token_ids), stats)


@torch.inference_mode()
def speculative_generate(
    target: TargetModel,
    proposer: DFlashProposer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    draft_length: int | None = None,
    stop_token_ids: Sequence[int] = (),
    seed: int = 0,
) -> GenerationResult:
    """Draft a block, verify it in one target pass, keep what the target would have produced, repeat.

    `draft_length` = drafted tokens verified per step (default: the whole block, block_size - 1).
    """
    _check_prompt(prompt_ids, max_new_tokens)
    max_draft = proposer.block_size - 1 if draft_length is None else draft_length
    if not 1 <= max_draft < proposer.block_size:
        raise ValueError(f"draft_length must be in [1, {proposer.block_size - 1}], got {draft_length}")
    generator = torch.Generator().manual_seed(seed)
    n, layers = len(prompt_ids), proposer.capture_layers
    max_len = n + max_new_tokens + proposer.block_size
    target_cache, draft_cache = target.new_cache(1, max_len), proposer.new_cache(1, max_len)
    stats = GenerationStats()
    start = time.perf_counter()

    # Prefill: the target picks the first new token; the prompt's features become the drafter's context.
    prompt = RaggedBatch.build([0], [0], [n])
    out = target(torch.tensor(prompt_ids), prompt, target_cache, capture_layers=layers, logit_indices=torch.tensor([n - 1]))
    proposer.add_context(draft_cache, out.hidden, prompt)
    tokens = [_pick(out.logits[0], sampling, generator)]
    stats.first_token_s = time.perf_counter() - start

    while not _done(tokens, max_new_tokens, stop_token_ids):
        anchor_pos = n + len(tokens) - 1  # the last committed token: in neither cache yet
        k = min(max_draft, max_new_tokens - len(tokens))  # never verify drafts past the budget
        drafts = proposer.propose(draft_cache, [0], [tokens[-1]], [k], [sampling], [generator])

        # Verify [anchor, d_1..d_k] in one pass: row j predicts the token after block position j.
        block = RaggedBatch.build([0], [anchor_pos], [k + 1])
        block_ids = torch.cat([torch.tensor(tokens[-1:], device=drafts.tokens.device), drafts.tokens])
        out = target(block_ids, block, target_cache, capture_layers=layers)
        if sampling.greedy:
            result = verify_greedy(drafts.tokens, argmax_rows(out.logits), [k])
        else:
            target_probs = logits_to_probs(out.logits, sampling)
            uniforms = draw_uniforms(k, generator, target_probs.device)
            noise = draw_exponentials((1, target_probs.shape[-1]), generator, target_probs.device)
            result = verify_sampling(drafts.tokens, drafts.probs[0], target_probs, [k], uniforms, noise)
        accepted = int(result.num_accepted[0])

        # Keep the anchor + accepted drafts; roll the target back past the rejected ones (free).
        target_cache.rollback(0, anchor_pos + accepted + 1)
        kept = RaggedBatch.build([0], [anchor_pos], [accepted + 1])
        proposer.add_context(draft_cache, out.hidden[: accepted + 1], kept)
        tokens += result.emitted(drafts.tokens, [k])[0]
        stats.target_passes += 1
        stats.draft_tokens += k
        stats.accept_lengths.append(accepted + 1)
        stats.draft_lengths.append(k)
    stats.elapsed_s = time.perf_counter() - start
    return GenerationResult(_finish(tokens, max_new_tokens, stop_token_ids), stats)
