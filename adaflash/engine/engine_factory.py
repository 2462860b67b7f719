"""One way to build a serving engine: what to build (`EngineConfig`), from which loaded models (`EngineModels`),
by `build_engine`.

`serve`, the pipeline's engine path (generate, bench offline, eval tau: one slot per request), online adaptation and
the evaluations' plain engines all build their engine here, so whether a policy needs the profiled cost model or a
length head, and the size the cost model covers, are decided in this one place (what the flags mean, a method's
default policy included, is `speculative/config.py`'s). (Data generation
builds its feature-capturing engine itself: `Engine(capture_layers=...)`, no drafter, no policy.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from adaflash.engine.engine import Engine
from adaflash.models.device.memory import free_memory
from adaflash.models.kv_cache.cache import DEFAULT_BLOCK_SIZE
from adaflash.models.targets.model import TargetModel
from adaflash.speculative.config import LENGTH_HEAD_POLICIES, LengthPolicySpec, SpeculativeConfig
from adaflash.speculative.cost_model import CalibratedCost, CostModel, cost_model_for
from adaflash.speculative.drafting_check import DraftingChecks
from adaflash.speculative.length_policy import LengthPolicy
from adaflash.speculative.policies import build_length_policy
from adaflash.speculative.proposer import DFlashProposer


KV_DTYPES = {"auto": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
KV_MEMORY_SHARE = 0.5  # of the memory free once the models are loaded: the default KV pool's most


def method_of(speculative: bool, policy_name: str) -> str:
    """The method label of an engine, read from its parts (for an engine built without an `EngineConfig`)."""
    if not speculative:
        return "ar"
    return "adaflash" if policy_name in LENGTH_HEAD_POLICIES else "dflash"


@dataclass(frozen=True)
class EngineConfig:
    """What engine to build: how it speculates (`SpeculativeConfig`, checked when made) and its sizes. Checked when
    made, so a bad flag fails before the (slow) model load."""

    speculative: SpeculativeConfig = SpeculativeConfig()  # default: plain decoding
    max_batch: int = 8  # requests decoded together (batch slots)
    max_queue: int = 64  # requests waiting for a slot before QueueFullError
    max_len: int = 2048  # KV cache positions per slot (prompt + output + drafts); capped at the model's positions
    max_prefill_tokens: int = 2048  # prompt tokens one prefill pass takes at most (vLLM's max_num_batched_tokens)
    kv_dtype: str = "auto"  # what the target's KV cache stores: auto (the target's own), fp32, fp16, bf16 or int8
    kv_memory_gib: float | None = None  # the target's KV pool; None: every slot's max_len, within half the free memory
    kv_block_size: int = DEFAULT_BLOCK_SIZE  # positions a KV block holds
    record_dir: str | None = None  # on-policy buffer (engine/recorder.py): trajectories and verification outcomes
    trace_dir: str | None = None  # verification trace (engine/trace_recorder.py): what the simulator replays

    def __post_init__(self) -> None:
        if self.speculative.draft_length is not None:  # the reference loop's; an engine's policy picks its lengths
            raise ValueError("--draft-length applies to the reference loop, not the serving engine (for a fixed "
                             "draft length use --length-policy fixed:K)")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_memory_gib is not None and self.kv_memory_gib <= 0:
            raise ValueError(f"--kv-memory must be > 0 GiB, got {self.kv_memory_gib}")
        if self.kv_block_size < 8 or self.kv_block_size & (self.kv_block_size - 1):
            raise ValueError(f"--kv-block-size must be a power of two >= 8, got {self.kv_block_size}")

    @property
    def policy_spec(self) -> LengthPolicySpec | None:
        """The length policy this engine runs (None: no drafter drafts)."""
        return self.speculative.engine_policy

    @property
    def needs_cost_model(self) -> bool:
        return self.policy_spec is not None and self.policy_spec.needs_cost_model


@dataclass(frozen=True)
class EngineModels:
    """The loaded models an engine runs: the target, the drafter's proposer (None: plain decoding) and the length
    head its checkpoint carries (None if untrained). `model_name` keys the cost-model cache; `drafter_version`
    labels recorded trajectories."""

    target: TargetModel
    proposer: DFlashProposer | None = None
    length_head: object | None = None
    model_name: str = ""
    drafter_version: str = ""


@dataclass(frozen=True)
class LengthPolicyFactory:
    """A length policy for a drafter's head: the engine's first policy, and each hot-swapped drafter's (or a
    pipeline's, one per generation). They share one `CalibratedCost` and one set of `DraftingChecks`: what the step
    times taught of this machine outlives a policy's acceptance estimates."""

    spec: LengthPolicySpec
    cost: CalibratedCost | CostModel | None = None
    checks: DraftingChecks = field(default_factory=DraftingChecks)
    max_running: int | None = None  # the engine's max_batch (what `adaflash-gated` gates on)

    def __call__(self, head=None) -> LengthPolicy:
        return build_length_policy(self.spec, self.cost, head, self.max_running)


def length_policy_factory(config: EngineConfig, models: EngineModels) -> LengthPolicyFactory | None:
    """None for plain decoding. A policy that needs the cost model gets it here, profiled once per machine (cached
    in the user cache) for the largest verify pass: every slot's anchor plus a full block of drafts, then corrected
    by the policies' measured step times."""
    spec = config.policy_spec
    if spec is None or models.proposer is None:
        return None
    if spec.needs_length_head and models.length_head is None:  # say so before profiling the cost model
        raise ValueError(f"the {spec} length policy needs a drafter checkpoint carrying a length head (train one "
                         "with `adaflash train length-head`)")
    cost = None
    if config.needs_cost_model:
        cost = CalibratedCost(cost_model_for(models.target, models.proposer, models.model_name,
                                             max_tokens=config.max_batch * models.proposer.block_size))
    return LengthPolicyFactory(spec, cost, max_running=config.max_batch)


def build_engine(config: EngineConfig, models: EngineModels, policy: LengthPolicy | None = None,
                 checks: DraftingChecks | None = None, clock: Callable[[], float] = time.perf_counter) -> Engine:
    """The engine `config` describes over `models`. `policy`: one already built from `length_policy_factory` (kept
    across engines, so what it learned carries over); None builds it for the models' length head. `checks`: the
    drafting check's rates where the config's drafts are adaptive (`SpeculativeConfig.adaptive`), a factory's to
    share them across engines; None: the engine's own. `clock`: what a step's cost is read from (a simulation's
    virtual time; wall time by default)."""
    speculative = config.speculative
    proposer = models.proposer if speculative.uses_drafter else None
    if speculative.uses_drafter and proposer is None:
        raise ValueError(f"--method {speculative.name} needs a drafter (--drafter PATH)")
    if policy is None and proposer is not None:
        policies = length_policy_factory(config, models)
        policy = policies(models.length_head)
        checks = policies.checks if checks is None else checks
    if not speculative.adaptive:
        checks = None
    elif checks is None:
        checks = DraftingChecks()
    # Positions past the model's trained range would decode garbage, not fail: never cache that far.
    max_len = min(config.max_len, models.target.config.max_position_embeddings)
    recorders = []
    if config.record_dir is not None:
        from adaflash.engine.recorder import TrajectoryRecorder

        recorders.append(TrajectoryRecorder(Path(config.record_dir), drafter_version=models.drafter_version,
                                            record_outcomes=proposer is not None))
    if config.trace_dir is not None:
        from adaflash.engine.trace_recorder import TraceRecorder

        recorders.append(TraceRecorder(Path(config.trace_dir), proposer.block_size if proposer is not None else 1,
                                       drafter_version=models.drafter_version))
    if len(recorders) > 1:
        from adaflash.engine.recorder import Recorders

        recorders = [Recorders(recorders)]
    recorder = recorders[0] if recorders else None
    kv_dtype = KV_DTYPES[config.kv_dtype]
    return Engine(models.target, proposer, policy, max_batch=config.max_batch, max_queue=config.max_queue,
                  max_len=max_len, recorder=recorder, prompt_lookup=speculative.prompt_lookup,
                  lookup_cost=lookup_cost(config, models, proposer), max_prefill_tokens=config.max_prefill_tokens,
                  drafting_checks=checks, clock=clock, kv_pool_tokens=kv_pool_tokens(config, models.target, max_len),
                  kv_block_size=config.kv_block_size, kv_dtype=kv_dtype)


def kv_pool_tokens(config: EngineConfig, target: TargetModel, max_len: int) -> int:
    """The positions the target's KV pool holds: --kv-memory's worth, else every slot's max_len where that fits in
    KV_MEMORY_SHARE of the memory free now (vLLM sizes its pool by memory; its pages are resident only once used).
    A drafter's cache beside it holds as many positions (KVCache's drafter_pool)."""
    per_token = target.kv_bytes_per_token(KV_DTYPES[config.kv_dtype])
    if config.kv_memory_gib is not None:
        return max(1, int(config.kv_memory_gib * 2**30) // per_token)
    every_slot = config.max_batch * max_len
    free = free_memory(target.device)
    return every_slot if free is None else max(max_len, min(every_slot, int(free * KV_MEMORY_SHARE) // per_token))


def lookup_cost(config: EngineConfig, models: EngineModels, proposer: DFlashProposer | None) -> CostModel | None:
    """The verify costs that size prompt-lookup drafts (None where every match is verified whole). With a drafter the
    policies' profile (the same cached file); without one, the target's verify costs alone. The profile, not its
    calibration: a lookup costs no drafter pass, so only ratios of verify costs decide, and the machine's drift
    cancels out of them."""
    lookup = config.speculative.prompt_lookup
    if lookup is None or lookup.length == "all":
        return None
    width = proposer.block_size if proposer is not None else lookup.num_tokens + 1
    return cost_model_for(models.target, proposer, models.model_name, max_tokens=config.max_batch * width)
