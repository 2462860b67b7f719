"""The policy-overhead benchmark times each policy's real bookkeeping for a step, at the batch size asked."""

from __future__ import annotations

import time

import pytest
import torch

from adaflash.speculative.cost_model import CostModel
from adaflash.speculative.length_policy import HeuristicLength, ThroughputLength
from benchmarks.policy_overhead import lookup_step_s, paired_excess_s, policy_step_s

COST = CostModel(total_tokens=(1, 8, 64), verify_s=(0.01, 0.012, 0.08), draft_s=0.001)


def test_a_policy_step_is_timed_in_the_drafting_arm_with_every_request_heard():
    heard = []

    class Counting(HeuristicLength):
        def feedback(self, request, drafted, accepted):
            heard.append((drafted, accepted))
            super().feedback(request, drafted, accepted)

    assert policy_step_s(Counting(initial=3), 4, 7, torch.zeros(4, 8, 16), steps=10) > 0
    assert len(heard) == 4 * 10 and all(d == 3 for d, _ in heard[:4])  # the drafting arm: the policy drafted
    assert policy_step_s(ThroughputLength(COST), 8, 7, torch.zeros(8, 8, 16), steps=10) > 0
    assert lookup_step_s(COST, 8, steps=10) > 0


def test_in_place_timing_runs_the_engine_step_before_each_policy_step_and_leaves_it_out():
    ran = []

    def engine_step():  # stands in for a decode step: slow, and not the policy's
        ran.append(1)
        time.sleep(0.005)

    assert policy_step_s(ThroughputLength(COST), 2, 7, torch.zeros(2, 8, 16), steps=10, before=engine_step) < 0.004
    assert len(ran) == 10
    assert lookup_step_s(COST, 2, steps=10, before=engine_step) < 0.004 and len(ran) == 20


def test_paired_excess_is_each_stepper_s_extra_time_over_the_baseline_in_the_same_round():
    calls = []

    def stepper(name, seconds):
        def step():
            calls.append(name)
            time.sleep(seconds)
        return step

    measured = paired_excess_s({"ar": stepper("ar", 0.002), "slow": stepper("slow", 0.006)}, rounds=8)
    assert calls[:4] == ["ar", "slow", "slow", "ar"]  # the order rotates round by round
    assert measured["ar"] == pytest.approx(0.002, abs=0.0015) and measured["slow"] == pytest.approx(0.004, abs=0.0015)
