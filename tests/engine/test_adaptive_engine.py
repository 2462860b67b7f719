"""Learned length heads in the engine, the on-policy recorder and drafter hot swaps: all stay lossless."""

from __future__ import annotations

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.recorder import TrajectoryRecorder
from adaflash.formats.outcomes import load_outcomes
from adaflash.formats.trajectories import read_trajectories
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, latest_version, publish_version, save_drafter
from adaflash.models.drafters.length_head import (BlockLengthHead, LengthHeadConfig, PositionAcceptanceHead,
    save_length_head)
from adaflash.models.targets.model import load_target
from adaflash.speculative.drafting_check import RequestRecord
from adaflash.speculative.length_policy import BlockHeadLength, LearnedThroughputLength
from adaflash.speculative.policies import build_length_policy
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate
from tests.engine.test_engine import (ARRIVALS, BUDGETS, COST, FLAT_COST, MORE_PROMPTS, PROMPTS, _more_requests,
                                      _requests, _run, expected_more)
from tests.helpers import PassClock, decode_batches, drafting_happened, scripted_dflash


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)


def _proposer(target, seed: int) -> DFlashProposer:
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=8)
    return DFlashProposer(init_drafter(cfg, seed=seed), target)


def _head(target, kind: str, bias: float | None = None, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LengthHeadConfig(kind=kind, hidden_size=target.config.hidden_size, block_size=8, head_dim=16)
    head = (PositionAcceptanceHead if kind == "position" else BlockLengthHead)(cfg)
    if bias is not None:  # a head that ignores its input: always sure (large) or never (small)
        with torch.no_grad():
            last = head.fc2 if kind == "position" else head.out
            last.weight.zero_()
            last.bias.fill_(bias)
    return head.eval()


@pytest.fixture(scope="module")
def expected(target):
    return {f"r{i}": autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids
            for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))}


@pytest.mark.parametrize("max_batch", [2, 8])
@pytest.mark.parametrize("kind", ["position", "block"])
def test_learned_length_policies_are_lossless(target, expected_more, kind, max_batch):
    """A learned head reading a real drafter's block hidden states decides each request's drafts (drafts scripted to be
    mostly right, so they are accepted): eight requests, two or eight slots, each the target's own greedy output."""
    head = _head(target, kind, seed=3)
    if kind == "position":  # a random head doubts every draft: lean it toward drafting (its input still moves it)
        with torch.no_grad():
            head.fc2.bias.add_(4.0)
    policy = LearnedThroughputLength(FLAT_COST, head) if kind == "position" else BlockHeadLength(head)
    scripts = [p + expected_more[f"r{i}"] for i, p in enumerate(MORE_PROMPTS)]
    clock = PassClock(base_s=0.01, token_s=3e-5)
    engine = Engine(target, scripted_dflash(target, scripts), policy, max_batch=max_batch, max_queue=8, max_len=128,
                    clock=clock)
    batches = decode_batches(engine)
    reqs = _more_requests()
    with clock.driving(target):
        assert _run(engine, {step: reqs[part] for step, part in ARRIVALS.items()}) == expected_more
    assert sorted(engine.scheduler.free_slots) == list(range(max_batch)) and max(batches) == max_batch
    drafting_happened(reqs)


def test_learned_policy_follows_the_head(target):
    """A head sure of every draft gets long drafts, one sure of none gets none: the head decides, not a rule."""
    engine_args = dict(max_batch=2, max_queue=8, max_len=128)
    lengths = {}
    for name, bias in (("sure", 12.0), ("never", -12.0)):
        policy = LearnedThroughputLength(COST, _head(target, "position", bias))
        engine = Engine(target, _proposer(target, 2), policy, **engine_args)
        reqs = _requests()[:2]
        _run(engine, {0: reqs})
        lengths[name] = [k for r in reqs for k in r.draft_lengths]
    assert max(lengths["sure"]) == 7 and max(lengths["never"]) == 0
    block = BlockHeadLength(_head(target, "block", 12.0))  # ratio ~1 -> the whole block
    assert block.decide(_requests()[:1], 7, lambda idx: torch.zeros(len(idx), 8, target.config.hidden_size)) == [7]


def test_build_length_policy_needs_the_right_head(target):
    with pytest.raises(ValueError, match="PositionAcceptanceHead"):
        build_length_policy("adaflash", COST, None)
    with pytest.raises(ValueError, match="BlockLengthHead"):
        build_length_policy("block-head", None, _head(target, "position"))
    assert build_length_policy("adaflash", COST, _head(target, "position")).name == "adaflash"


def test_recorder_writes_trajectories_and_outcomes(target, expected, tmp_path):
    recorder = TrajectoryRecorder(tmp_path, drafter_version="v0001", source="test", outcomes_per_shard=8)
    engine = Engine(target, _proposer(target, 2), build_length_policy("fixed:7"), max_batch=2, max_len=128,
                    recorder=recorder)
    reqs = _requests()
    assert _run(engine, {0: reqs[:2], 3: reqs[2:4], 9: reqs[4:]}) == expected
    recorder.flush()
    trajectories = read_trajectories(tmp_path)
    assert sorted(t.output_ids for t in trajectories) == sorted(tuple(v) for v in expected.values())
    assert {t.drafter_version for t in trajectories} == {"v0001"}
    outcomes = load_outcomes(sorted(tmp_path.glob("outcomes-*.safetensors")))
    drafted = [k for r in reqs for k in r.draft_lengths if k > 0]
    assert len(outcomes) == len(drafted) and sorted(outcomes.drafted.tolist()) == sorted(drafted)
    assert outcomes.hidden.shape[1:] == (8, target.config.hidden_size)


def test_hot_swap_mid_flight_is_lossless(target, expected):
    engine = Engine(target, _proposer(target, 2), build_length_policy("fixed:5"), max_batch=2, max_len=128)
    reqs = _requests()
    outputs = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    step = 0
    while engine.has_work():
        if step in (4, 9):  # requests are mid-generation: their drafter context is rebuilt by the new drafter
            engine.swap_proposer(_proposer(target, 10 + step), build_length_policy("fixed:3"))
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        step += 1
    assert outputs == expected and engine.policy.name == "fixed:3"
    other = DFlashProposer(init_drafter(DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1,
                                                                 block_size=4), seed=0), target)
    with pytest.raises(ValueError, match="block size"):
        engine.swap_proposer(other)


def test_swapped_drafter_context_equals_a_fresh_one(target):
    """After a swap, the new drafter proposes what it would have proposed had it served from the start."""
    prompt = PROMPTS[2]
    fresh = Engine(target, _proposer(target, 7), build_length_policy("fixed:7"), max_batch=1, max_len=128)
    swapped = Engine(target, _proposer(target, 2), build_length_policy("fixed:7"), max_batch=1, max_len=128)
    for engine in (fresh, swapped):
        engine.add_request(_requests()[2])
        for _ in range(3):
            engine.step()
    swapped.scheduler.running[0].drafting_records["drafter"] = RequestRecord(closed_until=10 ** 6)
    swapped.scheduler.running[0].drafting_records["lookup"] = lookup = RequestRecord(closed_until=10 ** 6)
    swapped.swap_proposer(_proposer(target, 7))
    r_fresh, r_swapped = fresh.scheduler.running[0], swapped.scheduler.running[0]
    assert r_swapped.drafting_records == {"lookup": lookup}  # how the old drafter fared is forgotten, lookups' kept
    assert r_fresh.output_ids == r_swapped.output_ids and len(prompt) > 0
    fresh.feed_context([0])  # the fresh engine's drafter context is fed lazily, before its next draft
    a = fresh.proposer.draft_hidden(fresh.draft_cache, [0], [r_fresh.output_ids[-1]])
    b = swapped.proposer.draft_hidden(swapped.draft_cache, [0], [r_swapped.output_ids[-1]])
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_publish_versions_and_watch(target, tmp_path):
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=8)
    src = save_drafter(init_drafter(cfg, seed=1), tmp_path / "src")
    save_length_head(_head(target, "position"), src)
    versions = tmp_path / "versions"
    assert latest_version(versions) is None
    v1, v2 = publish_version(src, versions), publish_version(src, versions)
    assert (v1.name, v2.name) == ("v0001", "v0002") and latest_version(versions) == v2
    assert not list(versions.glob(".*tmp"))

    from adaflash.engine.hot_swap import VersionWatcher
    from adaflash.engine.runner import EngineRunner

    engine = Engine(target, _proposer(target, 2), build_length_policy("fixed:7"), max_batch=1, max_len=64)
    with EngineRunner(engine) as runner:
        watcher = VersionWatcher(runner, versions, lambda head: LearnedThroughputLength(COST, head), loaded=v1)
        assert watcher.check_once() == v2 and engine.policy.name == "adaflash"
        assert watcher.check_once() is None  # nothing new
