"""Text in, text out: the target, its tokenizer and an optional drafter, behind one small object.

The CLI, the demo and (later) the server are thin layers over this; the decoding loops themselves
know only token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from adaflash.models.drafter import DrafterConfig
from adaflash.models.drafter_checkpoint import init_drafter, load_drafter
from adaflash.models.dtype import resolve_dtype
from adaflash.models.length_head import load_length_head
from adaflash.models.registry import DEFAULT_TARGET, load_tokenizer, resolve_target
from adaflash.models.target import TargetModel, load_target
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import (
    GenerationResult,
    GenerationStats,
    autoregressive_generate,
    speculative_generate,
)
from adaflash.speculative.sampling import SamplingParams

METHODS = ("ar", "dflash", "adaflash")  # adaflash: the drafter + its learned length head + adaflash policy

# Token ids 3-16 of SmolLM2's vocabulary are code/meta specials that chat never uses; one is the mask.
DEFAULT_MASK_TOKEN_IDS = {"smollm2-135m": 16}


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    method: str
    stats: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "num_tokens": len(self.token_ids),
                "method": self.method, "stats": self.stats}


class Pipeline:
    def __init__(
        self,
        target: TargetModel,
        tokenizer,
        proposer: DFlashProposer | None,
        model_name: str,
        length_policy: str | None = None,
        length_head=None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.length_head = length_head  # carried by the drafter checkpoint, if trained (adaflash.models.length_head)
        self.model_name = model_name
        # None: the reference loop with a fixed draft length; else a serving-engine policy spec
        # (fixed:K, heuristic, throughput, adaflash, block-head) run through the engine at batch 1, exactly as
        # `serve` runs it.
        self.length_policy = length_policy
        self._policy, self._policy_spec = None, None  # built on first use; kept so what it learned carries over
        eos = set(target.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.stop_token_ids = tuple(sorted(eos))

    @classmethod
    def load(
        cls, model: str = DEFAULT_TARGET, drafter: str | Path | None = None, dtype: str = "auto",
        length_policy: str | None = None, draft_vocab: str | None = None,
    ) -> "Pipeline":
        checkpoint = resolve_target(model)
        torch_dtype = resolve_dtype(dtype)
        target = load_target(checkpoint, dtype=torch_dtype)
        proposer, head = None, None
        if drafter is not None:
            proposer = DFlashProposer(load_drafter(drafter, dtype=torch_dtype, draft_vocab=draft_vocab), target)
            head = load_length_head(drafter)
        return cls(target, load_tokenizer(checkpoint), proposer, model_name=str(model), length_policy=length_policy,
                   length_head=head)

    def with_untrained_drafter(self, num_layers: int = 1, block_size: int = 16, seed: int = 0) -> "Pipeline":
        """A randomly initialised drafter: correct (lossless) but accepts almost nothing. For tests and demos."""
        mask = DEFAULT_MASK_TOKEN_IDS.get(self.model_name, 0)
        cfg = DrafterConfig.for_target(self.target.config, mask_token_id=mask, num_layers=num_layers, block_size=block_size)
        drafter = init_drafter(cfg, seed=seed, dtype=self.target.dtype)
        proposer = DFlashProposer(drafter, self.target)
        return Pipeline(self.target, self.tokenizer, proposer, self.model_name, self.length_policy)

    def with_length_policy(self, length_policy: str | None) -> "Pipeline":
        """The same loaded models under another length policy (None: the reference loop)."""
        return Pipeline(self.target, self.tokenizer, self.proposer, self.model_name, length_policy, self.length_head)

    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None) -> list[int]:
        """Raw text is tokenised as is; chat messages go through the model's chat template."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if messages is not None:
            if not messages:
                raise ValueError("messages is empty")
            ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        method: str = "ar",
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        draft_length: int | None = None,
        seed: int = 0,
    ) -> GenerationResult:
        if method == "ar":
            return autoregressive_generate(self.target, prompt_ids, max_new_tokens, sampling, self.stop_token_ids, seed)
        if method in ("dflash", "adaflash") and self.proposer is None:
            raise ValueError(f"--method {method} needs a drafter (--drafter PATH)")
        if method == "adaflash":
            if self.length_head is None:
                raise ValueError("--method adaflash needs a drafter checkpoint with a length head "
                                 "(`adaflash train length-head`)")
            return self._engine_generate(prompt_ids, max_new_tokens, sampling, seed, self.length_policy or "adaflash")
        if method == "dflash":
            if self.length_policy is not None:
                return self._engine_generate(prompt_ids, max_new_tokens, sampling, seed, self.length_policy)
            return speculative_generate(
                self.target, self.proposer, prompt_ids, max_new_tokens, sampling, draft_length, self.stop_token_ids, seed
            )
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")

    def _engine_generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams, seed: int, spec: str) -> GenerationResult:
        from adaflash.serving.engine import Engine
        from adaflash.serving.length_policy import build_length_policy, cost_model_for
        from adaflash.serving.request import Request

        if self._policy is None or self._policy_spec != spec:
            needs_cost = spec in ("throughput", "adaflash")
            cost = cost_model_for(self, max_tokens=self.proposer.block_size) if needs_cost else None
            self._policy, self._policy_spec = build_length_policy(spec, cost, self.length_head), spec
        # A one-slot engine whose cache fits this request exactly (not the model's whole context).
        max_len = len(prompt_ids) + max_new_tokens + self.proposer.block_size
        engine = Engine(self.target, self.proposer, self._policy, max_batch=1, max_len=max_len)
        request = Request("generate", list(prompt_ids), max_new_tokens, sampling, self.stop_token_ids, seed)
        start = time.perf_counter()
        engine.add_request(request)
        while engine.has_work():
            engine.step()
        stats = GenerationStats(
            target_passes=len(request.accept_lengths), draft_tokens=sum(request.draft_lengths),
            accept_lengths=request.accept_lengths, draft_lengths=request.draft_lengths,
            elapsed_s=time.perf_counter() - start,
        )
        return GenerationResult(request.output_ids, stats)

    def complete(self, prompt_ids: Sequence[int], method: str = "ar", **kwargs) -> Completion:
        result = self.generate_ids(prompt_ids, method, **kwargs)
        return Completion(
            text=self.decode(result.token_ids),
            token_ids=result.token_ids,
            method=method,
            stats=result.stats.as_dict(len(result.token_ids)),
        )
