"""The drafting check: two arms (drafting, plain) run in stretches, each judged by the tokens it commits a second; the
chosen arm's stretch doubles while the choice stands, so a losing arm is found early and later explored rarely."""

from __future__ import annotations

import pytest

from adaflash.speculative.drafting_check import DraftingCheck, DraftingChecks


def _steps(check: DraftingCheck, n: int, rate: dict[bool, float], tokens: int = 2) -> list[bool]:
    """n steps, each arm committing `tokens` at its rate; the arm of each step."""
    arms = []
    for _ in range(n):
        arm = check.next_step_drafts()
        check.record(tokens, tokens / rate[arm])
        arms.append(arm)
    return arms


def test_the_chosen_arm_runs_then_the_other_is_explored_then_the_choice_is_made():
    check = DraftingCheck(explore=3, first=5, settle=1)
    assert _steps(check, 8, {True: 100.0, False: 100.0}) == [True] * 5 + [False] * 3
    assert check.rates == {True: pytest.approx(100.0)}  # the explored stretch closes when the next one starts
    _steps(check, 1, {True: 100.0, False: 100.0})
    assert check.rates == {True: pytest.approx(100.0), False: pytest.approx(100.0)} and check.drafting_chosen


def test_the_chosen_stretch_doubles_while_the_choice_stands_up_to_the_longest():
    check = DraftingCheck(explore=2, first=4, longest=16, settle=1)
    arms = _steps(check, 4 + 2 + 8 + 2 + 16 + 2 + 16 + 2, {True: 100.0, False: 90.0})
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(arms)]
    assert runs == [4, 2, 8, 2, 16, 2, 16, 2]


def test_plain_is_chosen_only_where_it_beats_drafting_by_the_margin_and_a_flip_restarts_the_doubling():
    check = DraftingCheck(explore=3, first=5, settle=1, margin=0.05)
    assert _steps(check, 18, {True: 100.0, False: 104.0})[8:] == [True] * 10  # within the margin: drafting stays
    check = DraftingCheck(explore=3, first=5, settle=1, margin=0.05)
    assert _steps(check, 16, {True: 100.0, False: 110.0})[8:] == [False] * 5 + [True] * 3  # drafting now explored
    assert not check.drafting_chosen and check.stretch == 5


def test_a_decisive_loss_is_rechecked_four_times_less_often():
    check = DraftingCheck(explore=2, first=4, longest=64, settle=1, margin=0.05, decisive=0.12)
    arms = _steps(check, 4 + 2 + 8 + 2 + 32 + 2, {True: 100.0, False: 130.0})
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(arms)]
    assert runs == [4, 2 + 8, 2, 32, 2]  # plain won by 30%: its stretches 8, then 32


def test_a_slow_arm_is_explored_for_as_long_as_the_chosen_arms_steps_take():
    """Under load a drafting step can cost several plain ones: the losing arm's retry takes about the time `explore`
    chosen steps take, so exploring it costs a bounded share of the time, not of the steps."""
    check = DraftingCheck(explore=16, first=16, longest=64, settle=2, decisive=0.12)
    arms = []
    for _ in range(16 + 48 + 6 + 10):
        arm = check.next_step_drafts()
        check.record(1, 0.04 if arm else 0.01)  # a drafting step: 4x the time, the same one token
        arms.append(arm)
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(arms)]
    # drafting's first stretch, plain explored then chosen (16 + a stretch of 32), drafting retried for 6 steps (16 plain
    # steps' time, at least settle + 4), then plain again
    assert runs == [16, 48, 6, 10] and check.step_s[True] == pytest.approx(0.04)


def test_the_steps_right_after_a_switch_are_not_measured():
    """While the caches refill after a switch the first `settle` steps run slow; they must not count."""
    check = DraftingCheck(explore=4, first=4, settle=2)
    for _ in range(9):
        arm = check.next_step_drafts()
        check.record(1, 1.0 if check.since_switch < 2 else (0.01 if arm else 0.02))
    assert check.rates[True] == pytest.approx(100.0) and check.rates[False] == pytest.approx(50.0)


def test_a_new_stretch_moves_an_arms_rate_by_follow():
    check = DraftingCheck(explore=3, first=3, longest=3, settle=1, follow=0.5)
    _steps(check, 6, {True: 100.0, False: 50.0})
    _steps(check, 6, {True: 200.0, False: 50.0})
    check.next_step_drafts()
    assert check.rates[True] == pytest.approx(150.0)


def test_checks_are_kept_per_power_of_two_batch_size():
    checks = DraftingChecks(DraftingCheck(explore=3, first=5, settle=1, drafting_chosen=False))
    assert [DraftingChecks.bucket(n) for n in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    assert checks.of(5) is checks.of(8) and checks.of(8) is not checks.of(9)
    assert not checks.of(1).drafting_chosen and checks.of(1).explore == 3  # the template's settings


def test_a_new_batch_size_starts_plain_where_the_largest_smaller_judged_one_chose_plain():
    checks = DraftingChecks(DraftingCheck(explore=3, first=5, settle=1, margin=0.05))
    assert checks.of(2).drafting_chosen  # nothing judged yet: the template's choice
    _steps(checks.of(4), 9, {True: 100.0, False: 100.0})  # batch 4 judges both arms: drafting stays
    _steps(checks.of(8), 9, {True: 50.0, False: 100.0})  # batch 8: plain wins
    assert checks.of(4).drafting_chosen and not checks.of(8).drafting_chosen
    assert not checks.of(32).drafting_chosen  # from batch 8, the largest smaller judged size
    assert checks.of(16).drafting_chosen is False and checks.of(3).drafting_chosen  # 3 -> bucket 4, already there
    assert _steps(checks.of(64), 6, {True: 50.0, False: 100.0}) == [False] * 5 + [True]  # plain first, then explored


@pytest.mark.parametrize("bad", [dict(settle=0), dict(explore=8, settle=8), dict(first=32, longest=16)])
def test_impossible_stretches_are_refused(bad):
    with pytest.raises(ValueError, match="settle < explore"):
        DraftingCheck(**bad)


def test_a_head_that_looks_and_drafts_nothing_is_charged_to_the_drafting_arm():
    """A learned head reads every request's block (a drafter pass) and then keeps all of them at 0: the engine reports
    such steps unpriced (no cost model may learn from them) and the guard still counts them toward the drafting arm,
    which then loses to the plain one and stops running."""
    from types import SimpleNamespace

    from adaflash.speculative.drafting_check import DraftingGuard
    from adaflash.speculative.length_policy import FixedLength

    priced_seen = []

    class LooksThenDeclines(FixedLength):
        def observe_step(self, lengths, seconds, priced=True):
            priced_seen.append(priced)

    guard = DraftingGuard(LooksThenDeclines(0))
    requests = [SimpleNamespace(policy_state={}) for _ in range(4)]
    for _ in range(200):
        lengths = guard.decide(requests, 15)
        looked = guard.check.arm  # the drafting arm's step ran the head's look: twice the plain step's time
        for r in requests:
            guard.feedback(r, 0, 0)
        guard.observe_step(lengths, 0.02 if looked else 0.01, priced=not looked)
    check = guard.checks.of(len(requests))
    assert check.rates[True] < check.rates[False] and not check.drafting_chosen
    assert False in priced_seen and True in priced_seen  # the wrapped policy is told which steps it may learn from
