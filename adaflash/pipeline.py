"""Text in, text out: the target, its tokenizer and an optional drafter, behind one small object.

The CLI, the demo and the evaluation commands are thin layers over this; the decoding loops know only token ids.
A generation runs one `SpeculativeConfig` (speculative/config.py): `ar` or `dflash` without a length policy or prompt
lookup runs a single-request reference loop (`dflash` with a fixed draft length); with either it runs the serving
engine at batch 1, built by the same `build_engine` as `serve`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from adaflash.engine.engine import max_verified
from adaflash.engine.engine_factory import EngineConfig, EngineModels, build_engine, length_policy_factory
from adaflash.engine.request import Request
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, load_drafter
from adaflash.models.drafters.length_head import load_length_head
from adaflash.models.targets.registry import DEFAULT_TARGET, load_tokenizer, resolve_target
from adaflash.models.targets.model import TargetModel, load_target_as
from adaflash.models.targets.text_codec import TextCodec
from adaflash.speculative.config import FIXED, LengthPolicySpec, SpeculativeConfig, length_policy_of
from adaflash.speculative.draft_model import DraftModelProposer
from adaflash.speculative.prompt_lookup import PromptLookup
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import (
    GenerationResult,
    GenerationStats,
    autoregressive_generate,
    speculative_generate,
)
from adaflash.speculative.sampling import SamplingParams

__all__ = ["Completion", "Pipeline"]

# Token ids 3-16 of SmolLM2's vocabulary are code/meta specials that chat never uses; one is the mask. Qwen2.5's
# embedding has padding rows past its tokenizer's 151665 ids, never emitted: 151669 (as z-lab's Qwen3 drafters).
DEFAULT_MASK_TOKEN_IDS = {"smollm2-135m": 16, "qwen2.5-coder-1.5b": 151669, "qwen2.5-coder-0.5b": 151669}


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
        proposer: DFlashProposer | DraftModelProposer | None,
        model_name: str,
        length_policy: LengthPolicySpec | str | None = None,
        length_head=None,
        carry_policy_state: bool = False,
        prompt_lookup: PromptLookup | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.proposer = proposer  # a DFlash drafter's, or a draft model's (with_draft_model)
        self.length_head = length_head  # carried by the drafter checkpoint, if trained (adaflash.models.length_head)
        self.model_name = model_name
        # What a generation named by its method alone runs with (`speculative`): the length policy of the methods
        # that draft (None: the reference loop with a fixed draft length; else run through the engine at batch 1,
        # exactly as `serve` runs it), and prompt lookup (below).
        self.length_policy = length_policy_of(length_policy)
        # A learning policy (throughput's shared acceptance estimate, heuristic's carried length) adapts across
        # requests. By default every generation starts from a fresh policy, so a benchmark's numbers do not depend on
        # its prompt order; carry_policy_state keeps one policy across generations, as a server's engine does. What the
        # step times taught of this machine (the policies' shared `CalibratedCost` and drafting check, in the factory)
        # is kept either way.
        self.carry_policy_state = carry_policy_state
        # Prompt-lookup (n-gram) drafts before the drafter's, on the engine; with `ar`, the only drafts.
        self.prompt_lookup = prompt_lookup
        self._policy, self._policy_factory = None, None
        self.codec = TextCodec(tokenizer, target.config.eos_token_ids)
        self.stop_token_ids = self.codec.stop_token_ids

    @classmethod
    def load(
        cls, model: str = DEFAULT_TARGET, drafter: str | Path | None = None, dtype: str = "auto",
        length_policy: LengthPolicySpec | str | None = None, draft_vocab: str | None = None,
        carry_policy_state: bool = False, prompt_lookup: PromptLookup | None = None, device: str | None = None,
        draft_model: str | None = None, draft_max: int = 4,
    ) -> "Pipeline":
        """`device`: where the models run (default: the process's, `--device`; models/device/placement.py).
        `draft_model`: an autoregressive draft model drafts (`with_draft_model`) instead of `drafter`."""
        length_policy = length_policy_of(length_policy)  # a bad spec fails before the (slow) load
        checkpoint = resolve_target(model)
        target = load_target_as(checkpoint, dtype, device)
        pipeline = cls(target, load_tokenizer(checkpoint), None, model_name=str(model), length_policy=length_policy,
                       carry_policy_state=carry_policy_state, prompt_lookup=prompt_lookup)
        if draft_model is not None:
            return pipeline.with_draft_model(draft_model, dtype, draft_max)
        return pipeline if drafter is None else pipeline.with_drafter(drafter, draft_vocab)

    def with_untrained_drafter(self, num_layers: int = 1, block_size: int = 16, seed: int = 0) -> "Pipeline":
        """A randomly initialised drafter: correct (lossless) but accepts almost nothing. For tests and demos."""
        mask = DEFAULT_MASK_TOKEN_IDS.get(self.model_name, 0)
        cfg = DrafterConfig.for_target(self.target.config, mask_token_id=mask, num_layers=num_layers, block_size=block_size)
        drafter = init_drafter(cfg, seed=seed, dtype=self.target.dtype)
        proposer = DFlashProposer(drafter, self.target)
        return Pipeline(self.target, self.tokenizer, proposer, self.model_name, self.length_policy,
                        carry_policy_state=self.carry_policy_state, prompt_lookup=self.prompt_lookup)

    def with_drafter(self, drafter: str | Path, draft_vocab: str | None = None) -> "Pipeline":
        """The same loaded target with a drafter checkpoint (in the target's dtype, with the length head it carries):
        one copy of the target's weights under several drafters, as one server holds it. (A second `load` is a second
        copy, and two copies can run several percent apart, which an A/B across them would read as the method's.)"""
        device = self.target.device
        proposer = DFlashProposer(load_drafter(drafter, self.target.dtype, device, draft_vocab), self.target)
        return Pipeline(self.target, self.tokenizer, proposer, self.model_name, self.length_policy,
                        load_length_head(drafter, device), self.carry_policy_state, self.prompt_lookup)

    def with_draft_model(self, model: str, dtype: str = "auto", max_draft: int = 4) -> "Pipeline":
        """The same loaded target with an autoregressive draft model drafting up to `max_draft` tokens a step
        (llama.cpp's `-md`): a registry name, GGUF or HF checkpoint of the target's tokenizer, loaded in `dtype`."""
        checkpoint = resolve_target(model)
        theirs = load_tokenizer(checkpoint).get_vocab()
        if theirs != self.tokenizer.get_vocab():
            raise ValueError(f"draft model {model!r} does not share the target's tokenizer ({len(theirs)} against "
                             f"{len(self.tokenizer.get_vocab())} tokens, or the same count with other ids)")
        draft = load_target_as(checkpoint, dtype, self.target.device)
        proposer = DraftModelProposer(draft, self.target, max_draft, name=Path(str(model)).name)
        return Pipeline(self.target, self.tokenizer, proposer, self.model_name, self.length_policy, None,
                        self.carry_policy_state, self.prompt_lookup)

    def with_length_policy(self, length_policy: LengthPolicySpec | str | None,
                           carry_policy_state: bool | None = None) -> "Pipeline":
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

    def speculative(self, method: str, draft_length: int | None = None) -> SpeculativeConfig:
        """What a generation with `method` runs: this pipeline's length policy and prompt lookup, `draft_length`
        for the reference loop; the policy and length are the drafting methods' (`SpeculativeConfig.among`)."""
        return SpeculativeConfig.among(method, self.length_policy, draft_length, self.prompt_lookup)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        method: str | SpeculativeConfig = "ar",
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        draft_length: int | None = None,
        seed: int = 0,
        record_trace: str | Path | None = None,
    ) -> GenerationResult:
        """`method`: a parsed config (a command's, `SpeculativeConfig.parse`), or a method's name, run as
        `speculative(method, draft_length)` says. `record_trace`: a folder the engine's verification trace of this
        generation is appended to (engine/trace_recorder.py; the engine's path only)."""
        if isinstance(method, SpeculativeConfig):
            if draft_length is not None:
                raise ValueError("a SpeculativeConfig carries its own draft_length; pass it there")
            config = method
        else:
            config = self.speculative(method, draft_length)
        if config.uses_drafter and self.proposer is None:
            raise ValueError(f"--method {config.name} needs a drafter (--drafter PATH)")
        if config.uses_drafter and isinstance(self.proposer, DraftModelProposer) and not config.runs_on_engine:
            # A draft model has no reference loop of its own: the engine at batch 1, drafting a fixed length.
            length = config.draft_length or self.proposer.max_draft
            if length > self.proposer.max_draft:
                raise ValueError(f"--draft-length {length} exceeds the draft model's {self.proposer.max_draft} drafts "
                                 "a step (--draft-max)")
            config = replace(config, length_policy=LengthPolicySpec(FIXED, length), draft_length=None)
        if record_trace is not None and not config.runs_on_engine:
            raise ValueError("--record-trace records the serving engine's steps: give --length-policy (fixed:K for a "
                             "fixed draft length) or --prompt-lookup")
        if config.runs_on_engine:
            return self._engine_generate(prompt_ids, max_new_tokens, sampling, seed, config, record_trace)
        if config.uses_drafter:
            return speculative_generate(self.target, self.proposer, prompt_ids, max_new_tokens, sampling,
                                        config.draft_length, self.stop_token_ids, seed)
        return autoregressive_generate(self.target, prompt_ids, max_new_tokens, sampling, self.stop_token_ids, seed)

    def _engine_generate(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams, seed: int,
                         speculative: SpeculativeConfig, record_trace: str | Path | None = None) -> GenerationResult:
        # A one-slot engine whose cache fits this request exactly (not the model's whole context).
        widest = max_verified(self.proposer if speculative.uses_drafter else None, speculative.prompt_lookup) + 1
        config = EngineConfig(speculative, max_batch=1, max_len=len(prompt_ids) + max_new_tokens + widest,
                              trace_dir=None if record_trace is None else str(record_trace))
        models = self.engine_models()
        policy = self._policy_for(config, models) if speculative.uses_drafter else None
        engine = build_engine(config, models, policy, self._policy_factory.checks if policy is not None else None)
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

    def _policy_for(self, config: EngineConfig, models: EngineModels):
        """A fresh policy per generation, or the one kept (carry_policy_state); one factory per policy spec, so what
        the step times taught of this machine outlives both."""
        if self._policy_factory is None or self._policy_factory.spec != config.policy_spec:
            self._policy_factory, self._policy = length_policy_factory(config, models), None
        if not self.carry_policy_state or self._policy is None:
            self._policy = self._policy_factory(self.length_head)
        return self._policy

    def complete(self, prompt_ids: Sequence[int], method: str | SpeculativeConfig = "ar", **kwargs) -> Completion:
        result = self.generate_ids(prompt_ids, method, **kwargs)
        return Completion(
            text=self.decode(result.token_ids),
            token_ids=result.token_ids,
            method=method.name if isinstance(method, SpeculativeConfig) else method,
            stats=result.stats.as_dict(len(result.token_ids)),
        )
