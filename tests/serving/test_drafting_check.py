"""The drafting check: two arms (drafting, plain) run in stretches, each judged by the tokens it commits a second."""

from __future__ import annotations

import pytest

from adaflash.serving.drafting_check import DraftingCheck


def _steps(check: DraftingCheck, n: int, rate: dict[bool, float], tokens: int = 2) -> list[bool]:
    """n steps, each arm committing `tokens` at its rate; the arm of each step."""
    arms = []
    for _ in range(n):
        arm = check.next_step_drafts()
        check.record(tokens, tokens / rate[arm])
        arms.append(arm)
    return arms


def test_the_chosen_arm_runs_then_the_other_is_explored_and_the_choice_waits_for_the_period_end():
    check = DraftingCheck(period=10, explore=3, settle=1)
    assert _steps(check, 10, {True: 100.0, False: 100.0}) == [True] * 7 + [False] * 3
    assert check.rates == {True: pytest.approx(100.0)}  # the explored stretch closes when the next period starts
    _steps(check, 1, {True: 100.0, False: 100.0})
    assert check.rates == {True: pytest.approx(100.0), False: pytest.approx(100.0)} and check.drafting_chosen


def test_plain_is_chosen_only_where_it_beats_drafting_by_the_margin():
    check = DraftingCheck(period=10, explore=3, settle=1, margin=0.05)
    assert _steps(check, 20, {True: 100.0, False: 104.0})[10:] == [True] * 7 + [False] * 3  # within the margin
    check = DraftingCheck(period=10, explore=3, settle=1, margin=0.05)
    assert _steps(check, 20, {True: 100.0, False: 120.0})[10:] == [False] * 7 + [True] * 3  # drafting now explored
    assert not check.drafting_chosen


def test_the_steps_right_after_a_switch_are_not_measured():
    """While the caches refill after a switch the first `settle` steps run slow; they must not count."""
    check = DraftingCheck(period=10, explore=4, settle=2)
    for _ in range(11):
        arm = check.next_step_drafts()
        check.record(1, 1.0 if check.since_switch < 2 else (0.01 if arm else 0.02))
    assert check.rates[True] == pytest.approx(100.0) and check.rates[False] == pytest.approx(50.0)


def test_a_new_stretch_moves_an_arms_rate_by_follow():
    check = DraftingCheck(period=10, explore=3, settle=1, follow=0.5)
    _steps(check, 10, {True: 100.0, False: 50.0})
    _steps(check, 10, {True: 200.0, False: 50.0})
    assert check.rates[True] == pytest.approx(150.0)


@pytest.mark.parametrize("bad", [dict(settle=0), dict(explore=8, settle=8), dict(period=32, explore=32)])
def test_impossible_stretches_are_refused(bad):
    with pytest.raises(ValueError, match="settle < explore < period"):
        DraftingCheck(**bad)
