"""The verify-cost model: interpolation, its file, and the on-disk cache that spares a second profile."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.targets.model import load_target
from adaflash.speculative.cost_model import (PROFILE_VERSION, CalibratedCost, CostModel, cost_model_file, cost_model_for,
                                        load_or_profile_cost_model)
from adaflash.speculative.length_policy import allocate_drafts
from adaflash.speculative.proposer import DFlashProposer
from tests.helpers import private_cache

COST = CostModel(total_tokens=(4, 8, 16), verify_s=(0.02, 0.03, 0.07), draft_s=0.005)


def test_verify_is_piecewise_linear_and_extrapolates():
    assert COST.verify(2) == pytest.approx(0.01)  # below the first point: proportional
    assert COST.verify(8) == pytest.approx(0.03)
    assert COST.verify(12) == pytest.approx(0.05)
    assert COST.verify(24) == pytest.approx(0.11)  # past the last point: the last segment's slope


def test_drafter_cost_by_draft_length():
    assert COST.draft(0) == 0.0 and COST.draft(1) == COST.draft(9) == 0.005  # no widths profiled: one block cost
    by_width = CostModel((4,), (0.02,), draft_s=0.009, draft_widths=(2, 4, 16), draft_width_s=(0.002, 0.003, 0.009))
    assert by_width.draft(0) == 0.0
    assert by_width.draft(1) == pytest.approx(0.002)  # width 2: anchor + 1 draft
    assert by_width.draft(2) == pytest.approx(0.0025)
    assert by_width.draft(15) == pytest.approx(0.009)


def test_json_round_trip():
    assert CostModel.from_json(COST.to_json()) == COST
    by_width = CostModel((4,), (0.02,), draft_s=0.009, draft_widths=(2, 16), draft_width_s=(0.002, 0.009))
    assert CostModel.from_json(by_width.to_json()) == by_width


# A GPU-like profile: one sequence's curve says a plain step of 32 requests costs what 32 tokens of one do; the grid
# by requests says it costs more (each request's KV reads).
GRID = CostModel(total_tokens=(1, 32, 512), verify_s=(0.005, 0.0055, 0.02), draft_s=0.0005, draft_batches=(1, 32),
                 draft_batch_s=(0.0005, 0.001), verify_batches=(1, 32), verify_widths=(1, 16),
                 verify_grid_s=((0.005, 0.0056), (0.009, 0.024)))


def test_a_verify_grid_prices_a_pass_by_its_requests_too():
    assert COST.verify(32, requests=32) == COST.verify(32)  # no grid: total tokens alone
    assert GRID.verify(32, requests=32) == pytest.approx(0.009)  # at a point
    assert GRID.verify(32) == pytest.approx(0.005 + (0.0056 - 0.005) * 31 / 15)  # one request of 32: past the edge
    assert GRID.verify(16 * 32, requests=32) == pytest.approx(0.024)
    assert GRID.verify(8 * 32, requests=32) == pytest.approx(0.009 + (0.024 - 0.009) * 7 / 15)  # between widths
    assert CostModel.from_json(GRID.to_json()) == GRID
    # Read through the calibration as through the profile; and the allocation prices a step by its requests: a plain
    # step of 32 dearer than one sequence's curve says makes drafting relatively cheaper, so more is drafted.
    assert CalibratedCost(GRID).verify(32, 32) == pytest.approx(0.009)
    survival = [[0.6 ** j for j in range(1, 9)] for _ in range(32)]
    curve_only = dataclasses.replace(GRID, verify_batches=(), verify_widths=(), verify_grid_s=())
    assert sum(allocate_drafts(survival, GRID, 8)) == 96 > sum(allocate_drafts(survival, curve_only, 8)) == 64


def test_calibration_starts_at_the_profile():
    calibrated = CalibratedCost(COST)
    assert calibrated.scale == 1.0 and calibrated.per_draft_s == 0.0
    assert calibrated.verify(12) == COST.verify(12) and calibrated.draft(3) == COST.draft(3) and calibrated.draft(0) == 0.0
    assert calibrated.predicted([0, 3]) == pytest.approx(COST.verify(5) + COST.draft(3))


def test_calibration_learns_the_drift_and_the_engine_work_per_drafting_request():
    """Steps on a machine 1.5x slower than its profile, each drafting request adding 3 ms the profile never timed:
    the plain steps give the scale, the drafting ones the extra seconds, within a few steps' noise."""
    calibrated, rng = CalibratedCost(COST, forget=0.98), torch.Generator().manual_seed(0)
    for step in range(300):
        lengths = [0, 0] if step % 3 == 0 else [int(k) for k in torch.randint(0, 8, (2,), generator=rng)]
        true = 1.5 * calibrated.predicted(lengths) + 0.003 * sum(k > 0 for k in lengths)
        calibrated.observe(lengths, true * (1.0 + 0.02 * float(torch.randn(1, generator=rng))))
    assert calibrated.scale == pytest.approx(1.5, rel=0.03)
    assert calibrated.per_draft_s == pytest.approx(0.003, abs=0.0015)
    assert calibrated.per_extra_draft_s == pytest.approx(0.0, abs=0.0005)  # nothing per extra draft here
    assert calibrated.draft(2) == pytest.approx(calibrated.scale * COST.draft(2) + calibrated.per_draft_s
                                                + calibrated.per_extra_draft_s)
    calibrated.observe([], 1.0)  # an empty step teaches nothing
    assert calibrated.scale == pytest.approx(1.5, rel=0.03)


def test_calibration_learns_what_each_extra_draft_costs_in_place():
    """In place a verified draft token can cost more than the standalone profile says: 2 ms per drafting request and
    1 ms per draft after its first, on draft lengths that vary - the fit separates the two."""
    calibrated, rng = CalibratedCost(COST, forget=0.98), torch.Generator().manual_seed(1)
    for step in range(300):
        k = 0 if step % 4 == 0 else int(torch.randint(1, 8, (1,), generator=rng))
        true = calibrated.predicted([k]) + (0.002 + 0.001 * (k - 1) if k else 0.0)
        calibrated.observe([k], true * (1.0 + 0.01 * float(torch.randn(1, generator=rng))))
    assert calibrated.per_draft_s == pytest.approx(0.002, abs=0.0007)
    assert calibrated.per_extra_draft_s == pytest.approx(0.001, abs=0.0003)
    assert calibrated.draft(5) == pytest.approx(calibrated.scale * COST.draft(5) + 0.006, abs=0.001)


def test_single_drafts_teach_the_per_request_cost_alone():
    calibrated = CalibratedCost(COST)
    for _ in range(100):
        calibrated.observe([1], calibrated.predicted([1]) + 0.004)
    assert calibrated.per_draft_s == pytest.approx(0.004, rel=0.03) and calibrated.per_extra_draft_s == 0.0


def test_calibration_never_makes_drafting_free():
    calibrated = CalibratedCost(COST)
    for _ in range(50):  # drafting steps far cheaper than profiled
        calibrated.observe([4], 0.25 * calibrated.predicted([4]))
    assert calibrated.per_draft_s < 0 and calibrated.draft(4) >= 0.0


def test_a_cached_file_is_read_not_profiled(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(COST.to_json())
    assert load_or_profile_cost_model(None, None, 16, path) == COST  # no models needed: nothing is measured
    # Parsed once per file version: a re-profiled (rewritten) file is read again.
    slower = dataclasses.replace(COST, draft_s=2 * COST.draft_s)
    path.write_text(slower.to_json())
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert load_or_profile_cost_model(None, None, 16, path) == slower


def test_profile_once_then_cached(tiny_chat_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(private_cache(tmp_path)))
    target = load_target(tiny_chat_checkpoint, dtype=torch.float32)  # a real vocabulary: the profile feeds ids 100+
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=4)
    proposer = DFlashProposer(init_drafter(cfg, seed=2), target)
    path = cost_model_file(target, proposer, "tiny/qwen2", max_tokens=8)
    assert path.parent == tmp_path / "cost_models" and path.name.startswith("qwen2-float32-L1-B4-Vfull-T8-th")
    assert path.name.endswith(f"-p{PROFILE_VERSION}.json")  # a profile of an older method is not read
    model = cost_model_for(target, proposer, "tiny/qwen2", max_tokens=8)
    assert model.total_tokens == (1, 2, 4, 8) and all(t > 0 for t in model.verify_s) and model.draft_s > 0
    assert model.draft_widths == (2, 4) and model.draft_width_s[-1] == model.draft_s  # block 4: widths 2 and 4
    assert path.is_file() and CostModel.from_json(path.read_text()) == model
    assert cost_model_for(target, proposer, "tiny/qwen2", max_tokens=8) == model  # the second call reads the file
    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")  # other kernels, other costs: another file
    assert cost_model_file(target, proposer, "tiny/qwen2", max_tokens=8) != path


def test_profile_points_are_timed_round_robin_after_a_warm_up_round(monkeypatch):
    """A slow stretch of the machine must fall on every point alike: each round times every point once."""
    from adaflash.speculative import cost_model

    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: float(next(clock)))
    medians = cost_model._round_robin(calls.append, [1, 2, 4], repeats=3)
    assert calls == [1, 2, 4] * 4  # the untimed round, then three timed ones
    assert medians == [1.0, 1.0, 1.0]  # each sample spans one tick of the fake clock


def test_a_burst_times_each_point_warm_and_back_to_back(monkeypatch):
    """A step table's cells: in each round a point runs once untimed, then `burst` times within one timing."""
    from adaflash.speculative import cost_model

    calls, clock = [], iter(range(1000))
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: float(next(clock)))
    medians = cost_model._round_robin(calls.append, [1, 2], repeats=2, burst=3)
    assert calls == [1, 2] + ([1] * 4 + [2] * 4) * 2  # the untimed round, then per round: warm, then three timed
    assert medians == [1 / 3, 1 / 3]  # one tick of the fake clock over three passes
