"""Text in, text out: the target, its tokenizer and an optional drafter, behind one small object.

The CLI, the demo and the evaluation commands are thin layers over this; the decoding loops know only token ids.
Without a length policy `dflash` runs the single-request reference loop (a fixed draft length); `adaflash`, or
`dflash` with a policy, runs the serving engine at batch 1, built by the same `build_engine` as `serve`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from adaflash.engine.engine import max_verified
from adaflash.engine.engine_factory import (
    METHODS,
    EngineConfig,
    EngineModels,
    build_engine,
    check_method,
    length_policy_factory,
)
from adaflash.engine.request import Request
from adaflash.models.device import placed
from adaflash.models.drafter import DrafterConfig
from adaflash.models.drafter_checkpoint import init_drafter, load_drafter
from adaflash.models.dtype import resolve_dtype
from adaflash.models.length_head import load_length_head
from adaflash.models.registry import DEFAULT_TARGET, load_tokenizer, resolve_target
from adaflash.models.target import TargetModel, load_target_as
from adaflash.models.text_codec import TextCodec
from adaflash.speculative.length_policy import check_length_policy
from adaflash.speculative.prompt_lookup import PromptLookup
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import (
    GenerationResult,
    GenerationStats,
    autoregressive_generate,
    speculative_generate,
)
from adaflash.speculative.sampling import SamplingParams

__all__ = ["METHODS", "Completion", "Pipeline", "check_draft_length", "uses_engine"]

# Token ids 3-16 of SmolLM2's vocabulary are code/meta specials that chat never uses; one is the mask.
DEFAULT_MASK_TOKEN_IDS = {"smollm2-135m": 16}


def uses_engine(method: str, length_policy: str | None, prompt_lookup: bool = False) -> bool:
    """Whether `method` runs on the serving engine (a length policy decides the drafts, or prompt lookup drafts) or
    a reference loop."""
    return prompt_lookup or method == "adaflash" or (method == "dflash" and length_policy is not None)


def check_draft_length(method: str, length_policy: str | None, draft_length: int | None,
                       prompt_lookup: bool = False) -> None:
    """--draft-length is honoured by the reference loop only; on the engine it would be silently ignored."""
    if draft_length is not None and prompt_lookup:
        raise ValueError("--draft-length applies to the reference loop; with --prompt-lookup the serving engine runs "
                         "(for a fixed drafter length use --length-policy fixed:K)")
    if draft_length is not None and uses_engine(method, length_policy):
        policy = length_policy or EngineConfig(method).policy_spec
        raise ValueError(f"--draft-length applies to the reference loop (--method dflash without --length-policy); "
                         f"--method {method} runs the {policy} length policy on the serving engine, which picks the "
                         "draft lengths (for a fixed one use --length-policy fixed:K)")


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
        carry_policy_state: bool = False,
        prompt_lookup: PromptLookup | None = None,
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
        # A learning policy (throughput's shared acceptance estimate) adapts across requests. By default every
        # generation starts from a fresh policy, so a benchmark's numbers do not depend on its prompt order;
        # carry_policy_state keeps one policy across generations, as a server's engine does. What the step times
        # taught of this machine (the policies' shared `CalibratedCost`, in the factory) is kept either way.
        self.carry_policy_state = carry_policy_state
        # Prompt-lookup (n-gram) drafts before the drafter's, on the engine; with `ar`, the only drafts.
        self.prompt_lookup = prompt_lookup
        self._policy, self._policy_factory = None, None
        self.codec = TextCodec(tokenizer, target.config.eos_token_ids)
        self.stop_token_ids = self.codec.stop_token_ids

    @classmethod
    def load(
        cls, model: str = DEFAULT_TARGET, drafter: str | Path | None = None, dtype: str = "auto",
        length_policy: str | None = None, draft_vocab: str | None = None, carry_policy_state: bool = False,
        prompt_lookup: PromptLookup | None = None, device: str | None = None,
    ) -> "Pipeline":
        """`device`: where the models run (default: the process's, `--device`; models/device.py)."""
        if length_policy is not None:
            check_length_policy(length_policy)  # a bad spec fails before the (slow) load, not at the first generation
        checkpoint = resolve_target(model)
        device = placed(device)
        torch_dtype = resolve_dtype(dtype, device.type)
        target = load_target_as(checkpoint, dtype, device)
        proposer, head = None, None
        if drafter is not None:
            proposer = DFlashProposer(load_drafter(drafter, torch_dtype, device, draft_vocab), target)
            head = load_length_head(drafter, device)
        return cls(target, load_tokenizer(checkpoint), proposer, model_name=str(model), length_policy=length_policy,
                   length_head=head, carry_policy_state=carry_policy_state, prompt_lookup=prompt_lookup)

    def with_untrained_drafter(self, num_layers: int = 1, block_size: int = 16, seed: int = 0) -> "Pipeline":
        """A randomly initialised drafter: correct (lossless) but accepts almost nothing. For tests and demos."""
        mask = DEFAULT_MASK_TOKEN_IDS.get(self.model_name, 0)
        cfg = DrafterConfig.for_target(self.target.config, mask_token_id=mask, num_layers=num_layers, block_size=block_size)
        drafter = init_drafter(cfg, seed=seed, dtype=self.target.dtype)
        proposer = DFlashProposer(drafter, self.target)
        return Pipeline(self.target, self.tokenizer, proposer, self.model_name, self.length_policy,
                        carry_policy_state=self.carry_policy_state, prompt_lookup=self.prompt_lookup)

    def with_length_policy(self, length_policy: str | None, carry_policy_state: bool | None = None) -> "Pipeline":
        """The same loaded models under another length policy (None: the reference loop)."""
        carry = self.carry_policy_state if carry_policy_state is None else carry_policy_state
        return Pipeline(self.target, self.tokenizer, self.proposer, self.model_name, length_policy, self.length_head,
                        carry, self.prompt_lookup)

    def with_prompt_lookup(self, prompt_lookup: PromptLookup | None) -> "Pipeline":
        """The same loaded models with prompt-lookup drafts (None: without)."""
        return Pipeline(self.target, self.tokenizer, self.proposer, self.model_name, self.length_policy,
                        self.length_head, self.carry_policy_state, prompt_lookup)

    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None) -> list[int]:
        """Raw text is tokenised as is; chat messages go through the model's chat template."""
        return self.codec.encode(prompt, messages)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.codec.decode(token_ids)

    def engine_models(self, drafter_version: str = "") -> EngineModels:
        """The loaded models, for `build_engine`."""
        return EngineModels(self.target, self.proposer, self.length_head, self.model_name, drafter_version)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        method: str = "ar",
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        draft_length: int | None = None,
        seed: int = 0,
    ) -> GenerationResult:
        check_method(method)
        lookup = self.prompt_lookup is not None
        if method == "ar" and not lookup:
            return autoregressive_generate(self.target, prompt_ids, max_new_tokens, sampling, self.stop_token_ids, seed)
        if method == "ar":
            check_draft_length(method, None, draft_length, lookup)
            return self._engine_generate(prompt_ids, max_new_tokens, sampling, seed, method)
        if self.proposer is None:
            raise ValueError(f"--method {method} needs a drafter (--drafter PATH)")
        if method == "adaflash" and self.length_head is None:
            raise ValueError("--method adaflash needs a drafter checkpoint with a length head "
                             "(`adaflash train length-head`)")
        check_draft_length(method, self.length_policy, draft_length, lookup)
        if uses_engine(method, self.length_policy, lookup):
            return self._engine_generate(prompt_ids, max_new_tokens, sampling, seed, method)
        return speculative_generate(
            self.target, self.proposer, prompt_ids, max_new_tokens, sampling, draft_length, self.stop_token_ids, seed
        )

    def _engine_generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams, seed: int,
                         method: str) -> GenerationResult:
        # A one-slot engine whose cache fits this request exactly (not the model's whole context).
        widest = max_verified(self.proposer if method != "ar" else None, self.prompt_lookup) + 1
        config = EngineConfig(method, self.length_policy if method != "ar" else None, max_batch=1,
                              max_len=len(prompt_ids) + max_new_tokens + widest, prompt_lookup=self.prompt_lookup)
        models = self.engine_models()
        if method != "ar":
            if self._policy_factory is None or self._policy_factory.spec != config.policy_spec:
                self._policy_factory, self._policy = length_policy_factory(config, models), None
            if not self.carry_policy_state or self._policy is None:
                self._policy = self._policy_factory(self.length_head)
        engine = build_engine(config, models, self._policy if method != "ar" else None)
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
