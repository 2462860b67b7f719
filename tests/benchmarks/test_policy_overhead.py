"""The policy-overhead benchmark times each policy's real bookkeeping for a step, at the batch size asked."""

from __future__ import annotations

import pytest
import torch

from adaflash.speculative.cost_model import CostModel
from adaflash.speculative.length_policy import HeuristicLength, LookupLength, ThroughputLength
from benchmarks.adaflash import policy_overhead
from benchmarks.adaflash.policy_overhead import lookup_step_s, policy_step_s

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


class VirtualClock:
    """The benchmark's clock, injected: seconds pass only where a test's stand-in says so, so the timings it reports
    are exact numbers on any machine, however busy (multiples of 1/4: float sums and differences stay exact)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> VirtualClock:
    clock = VirtualClock()
    monkeypatch.setattr(policy_overhead, "time", clock)
    return clock


def test_in_place_timing_runs_the_engine_step_before_each_policy_step_and_leaves_it_out(clock, monkeypatch):
    ran = []

    def engine_step():  # stands in for a decode step: slow, and not the policy's
        ran.append(1)
        clock.now += 8.0

    class SlowThroughput(ThroughputLength):  # its decision takes 0.25 s of the clock
        def decide(self, *args, **kwargs):
            clock.now += 0.25
            return super().decide(*args, **kwargs)

    class SlowLookup(LookupLength):
        def decide(self, *args, **kwargs):
            clock.now += 0.5
            return super().decide(*args, **kwargs)

    assert policy_step_s(SlowThroughput(COST), 2, 7, torch.zeros(2, 8, 16), steps=10, before=engine_step) == 0.25
    assert len(ran) == 10
    monkeypatch.setattr(policy_overhead, "LookupLength", SlowLookup)
    assert lookup_step_s(COST, 2, steps=10, before=engine_step) == 0.5 and len(ran) == 20


def test_paired_excess_is_each_stepper_s_extra_time_over_the_baseline_in_the_same_round(clock):
    """The machine slows by 1 s a round (drift): each pair's excess is still exact, the baseline's median drifts."""
    calls = []

    def stepper(name, seconds):
        def step():
            calls.append(name)
            clock.now += seconds + len(calls[:-1]) // 2  # the round's drift: both calls of a round get the same
        return step

    measured = policy_overhead.paired_excess_s({"ar": stepper("ar", 2.0), "slow": stepper("slow", 6.0)}, rounds=8)
    assert calls[:4] == ["ar", "slow", "slow", "ar"]  # the order rotates round by round
    assert measured == {"ar": 2.0 + 4.5, "slow": 4.0}  # rounds 2..7 kept (past warm-up): drift 2..7, median 4.5
