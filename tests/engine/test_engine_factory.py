"""EngineConfig and build_engine: the one place a method's default policy and its checks are decided."""

from __future__ import annotations

import pytest
import torch

from adaflash.engine.engine_factory import (
    EngineConfig,
    EngineModels,
    build_engine,
    length_policy_factory,
    method_of,
)
from adaflash.engine.request import Request
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.config import METHODS, LengthPolicySpec, SpeculativeConfig
from adaflash.speculative.policies import build_length_policy
from adaflash.speculative.prompt_lookup import PromptLookup
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate
from tests.helpers import private_cache


@pytest.fixture(scope="module")
def models(tiny_chat_checkpoint) -> EngineModels:
    target = load_target(tiny_chat_checkpoint, dtype=torch.float32)  # a real vocabulary: profiling feeds ids 100+
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=4)
    return EngineModels(target, DFlashProposer(init_drafter(cfg, seed=2), target), None, "tiny", "v0007")


def engine_config(method: str, length_policy: str | None = None, **kwargs) -> EngineConfig:
    return EngineConfig(SpeculativeConfig.of(method, length_policy), **kwargs)


def test_each_method_has_a_default_policy():
    assert EngineConfig().policy_spec is None and engine_config("ar").policy_spec is None  # default: plain decoding
    assert str(engine_config("dflash").policy_spec) == "throughput" and engine_config("dflash").needs_cost_model
    assert engine_config("adaflash").policy_spec == LengthPolicySpec("adaflash")
    assert engine_config("dflash", "fixed:3").policy_spec == LengthPolicySpec("fixed", 3)
    assert not engine_config("dflash", "fixed:3").needs_cost_model
    assert all(engine_config(m).policy_spec is not None for m in METHODS if m != "ar")


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative=SpeculativeConfig.of("dflash", draft_length=3)), "--draft-length applies to the reference loop"),
    (dict(max_batch=0), "max_batch"),
    (dict(max_prefill_tokens=0), "max_prefill_tokens"),
    (dict(kv_dtype="int4"), "--kv-dtype must be one of auto, fp32, fp16, bf16, int8"),
    (dict(kv_memory_gib=0), "--kv-memory must be > 0"),
    (dict(kv_block_size=24), "power of two"),
])
def test_bad_settings_fail_when_the_config_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_the_kv_pool_is_sized_by_kv_memory_or_by_free_memory(models, monkeypatch):
    from adaflash.engine import engine_factory

    per_token = models.target.kv_bytes_per_token(torch.bfloat16)
    engine = build_engine(EngineConfig(kv_dtype="bf16", kv_memory_gib=per_token * 1000 / 2**30, kv_block_size=16,
                                       max_len=256), models)
    assert engine.target_cache.k.dtype == torch.bfloat16 and engine.target_cache.block_size == 16
    assert engine.target_cache.num_blocks == -(-1000 // 16)
    monkeypatch.setattr(engine_factory, "free_memory", lambda device: 2 * 600 * models.target.kv_bytes_per_token())
    engine = build_engine(EngineConfig(max_batch=8, max_len=256), models)  # half the free memory: 600 positions
    assert engine.target_cache.num_blocks * engine.target_cache.block_size == 608
    monkeypatch.setattr(engine_factory, "free_memory", lambda device: None)
    assert build_engine(EngineConfig(max_batch=8, max_len=256), models).target_cache.num_blocks == 8 * 256 // 32


def test_the_config_is_frozen():
    with pytest.raises(AttributeError):
        EngineConfig().max_batch = 3


def test_build_engine_from_the_config(models, tmp_path):
    engine = build_engine(engine_config("dflash", "fixed:2", max_batch=3, max_queue=5, max_len=10_000,
                                       record_dir=str(tmp_path / "rec")), models)
    assert engine.policy.name == "fixed:2" and engine.scheduler.max_batch == 3 and engine.scheduler.max_queue == 5
    assert engine.max_len == models.target.config.max_position_embeddings  # never past the trained positions
    assert engine.recorder.drafter_version == "v0007" and engine.recorder.record_outcomes
    assert method_of(engine.proposer is not None, engine.policy.name) == "dflash" and method_of(True, "block-head") == "adaflash"
    request = Request("a", [3, 14, 15], 12)
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    assert request.output_ids == autoregressive_generate(models.target, [3, 14, 15], 12).token_ids


def test_ar_builds_a_plain_engine_even_with_a_drafter_loaded(models):
    engine = build_engine(engine_config("ar", max_len=64), models)
    assert engine.proposer is None and engine.max_draft == 0 and method_of(False, engine.policy.name) == "ar"


def test_speculative_methods_need_a_drafter(models):
    with pytest.raises(ValueError, match="needs a drafter"):
        build_engine(engine_config("dflash", "fixed:2"), EngineModels(models.target))


def test_cost_model_policies_profile_once_and_share_it(models, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(private_cache(tmp_path / "cache")))
    config = engine_config("dflash", max_batch=2)
    policies = length_policy_factory(config, models)
    assert str(policies.spec) == "throughput" and policies.cost.profile.total_tokens[-1] == 2 * models.proposer.block_size
    first, second = policies(), policies()
    assert first.name == "throughput" and first.step_cost is second.step_cost  # one calibration, e.g. across hot swaps
    assert build_length_policy("throughput-profiled", policies.cost).step_cost is policies.cost.profile
    with pytest.raises(ValueError, match="adaflash length policy needs a drafter checkpoint carrying a length head"):
        build_engine(engine_config("adaflash", max_batch=2), models)  # this drafter carries no head
    assert length_policy_factory(engine_config("ar"), models) is None
    assert length_policy_factory(engine_config("dflash", "heuristic"), models).cost is None


def test_adaptive_drafts_and_only_they_run_behind_the_drafting_check(models):
    """An adaptive length policy, or lookups sized by throughput, runs behind the check; fixed:K stays fixed (lookups
    included); an engine built on a factory's policy shares that factory's check (a pipeline's generations, a server's
    hot-swapped drafters)."""
    lookup = PromptLookup(4)
    behind = {
        ("dflash", "heuristic", None): True,
        ("dflash", "fixed:2", None): False,
        ("dflash", "fixed:2", lookup): False,
        ("ar", None, lookup): True,
        ("ar", None, PromptLookup(4, length="all")): False,
        ("ar", None, None): False,
    }
    for (method, policy, prompt_lookup), checked in behind.items():
        config = EngineConfig(SpeculativeConfig.of(method, policy, prompt_lookup=prompt_lookup), max_len=64)
        assert config.speculative.adaptive == checked
        engine = build_engine(config, models)
        assert (engine.drafting.checks is not None) == checked, (method, policy, prompt_lookup)
    config = engine_config("dflash", "heuristic", max_len=64)
    policies = length_policy_factory(config, models)
    engines = [build_engine(config, models, policies(), policies.checks) for _ in range(2)]
    assert engines[0].drafting.checks is engines[1].drafting.checks is policies.checks
