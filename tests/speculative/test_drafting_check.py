"""The drafting check: two arms (drafting, plain) run in stretches, each judged by the tokens it commits a second; the
chosen arm's stretch doubles while the choice stands, so a losing arm is found early and later explored rarely."""

from __future__ import annotations

import itertools

import pytest

from adaflash.speculative.drafting_check import DraftingCheck, DraftingChecks, RequestRecord


def _steps(check: DraftingCheck, n: int, rate: dict[bool, float], tokens: int = 2) -> list[bool]:
    """n steps, each arm committing `tokens` at its rate; the arm of each step."""
    arms = []
    for _ in range(n):
        arm = check.next_step_drafts()
        check.record(tokens, tokens / rate[arm])
        arms.append(arm)
    return arms


def _runs(arms: list[bool]) -> list[int]:
    return [len(list(g)) for _, g in itertools.groupby(arms)]


def test_a_check_opens_plain_then_tries_drafting_then_chooses_and_a_tie_goes_to_plain():
    check = DraftingCheck(explore=3, first=8, settle=1)
    assert _steps(check, 8, {True: 100.0, False: 100.0}) == [False] * 5 + [True] * 3  # opening: settle + 4 steps
    assert check.rates == {False: pytest.approx(100.0)}  # the explored stretch closes when the next one starts
    _steps(check, 1, {True: 100.0, False: 100.0})
    assert check.judged and not check.drafting_chosen  # drafting must win by the margin: plain cannot lose to plain


def test_the_chosen_stretch_doubles_while_the_choice_stands_up_to_the_longest():
    check = DraftingCheck(explore=2, first=4, longest=16, settle=1, drafting_chosen=True, stretch=4)
    arms = _steps(check, 4 + 2 + 8 + 2 + 16 + 2 + 16 + 2, {True: 100.0, False: 90.0})
    assert _runs(arms) == [4, 2, 8, 2, 16, 2, 16, 2]


def test_drafting_is_chosen_only_where_it_beats_plain_by_the_margin_and_a_flip_restarts_the_doubling():
    check = DraftingCheck(explore=3, first=6, settle=1, margin=0.05)
    # Within the margin plain stays, and a tie is re-checked after `first` steps: it is no verdict to grow on.
    assert _steps(check, 17, {True: 104.0, False: 100.0})[8:] == [False] * 6 + [True] * 3
    assert not check.drafting_chosen and check.stretch == 6
    check = DraftingCheck(explore=3, first=6, settle=1, margin=0.05)
    assert _steps(check, 14, {True: 110.0, False: 100.0})[8:] == [True] * 6  # drafting won: a stretch of `first`
    assert check.drafting_chosen and check.stretch == 6


@pytest.mark.parametrize("plain, kept", [(101.0, True), (104.0, True), (106.0, False)])
def test_drafting_once_chosen_is_kept_while_it_loses_nothing_and_a_tie_is_rechecked_after_first(plain, kept):
    check = DraftingCheck(explore=3, first=6, settle=1, margin=0.05, follow=1.0, drafting_chosen=True, stretch=24,
                          rates={True: 110.0, False: 100.0}, step_s={True: 0.02, False: 0.02})
    # Drafting's stretch, then plain's trial: drafting now commits 105 tokens a second, plain `plain`.
    arms = _steps(check, 24 + 3 + 1, {True: 105.0, False: plain}, tokens=2)
    assert arms[:27] == [True] * 24 + [False] * 3
    assert check.drafting_chosen == (check.rates[True] >= check.rates[False]) == kept
    assert check.stretch == 6  # within the margin either way: a tie, re-checked after `first` steps


def test_a_decisive_loss_is_rechecked_four_times_less_often():
    check = DraftingCheck(explore=2, first=4, longest=64, settle=1, margin=0.05, decisive=0.12, drafting_chosen=True,
                          stretch=4)
    arms = _steps(check, 4 + 2 + 8 + 2 + 32 + 2, {True: 100.0, False: 130.0})
    assert _runs(arms) == [4, 2 + 8, 2, 32, 2]  # plain won by 30%: its stretches 8, then 32


@pytest.mark.parametrize("slower, tried", [(2, 8), (8, 5)])
def test_a_slow_arm_is_tried_for_as_long_as_the_chosen_arms_steps_take(slower, tried):
    """Under load a drafting step can cost several plain ones: its trial takes about the time `explore` plain steps
    take (here 16 x 1/128 s: 8 steps at twice the plain step's time), at least settle + 4 steps, so trying a losing
    arm costs a bounded share of the time, not of the steps."""
    check = DraftingCheck(explore=16, first=16, longest=64, settle=1, decisive=0.12)
    arms = []
    for _ in range(5 + tried + 32 + tried + 3):
        arm = check.next_step_drafts()
        check.record(1, slower / 128 if arm else 1 / 128)  # the same one token a step
        arms.append(arm)
    # the plain opening, drafting tried, plain chosen (a decisive win: a stretch of 4 x first / 2), drafting again
    assert _runs(arms) == [5, tried, 32, tried, 3] and check.step_s[True] == pytest.approx(slower / 128)


def test_the_steps_right_after_a_switch_are_not_measured():
    """While the caches refill after a switch the first `settle` steps run slow; they must not count."""
    check = DraftingCheck(explore=4, first=4, settle=2)
    for _ in range(11):
        arm = check.next_step_drafts()
        check.record(1, 1.0 if check.since_switch < 2 else (0.01 if arm else 0.02))
    assert check.rates[True] == pytest.approx(100.0) and check.rates[False] == pytest.approx(50.0)


def test_a_new_stretch_moves_an_arms_rate_by_follow():
    check = DraftingCheck(explore=3, first=3, longest=3, settle=1, follow=0.5, drafting_chosen=True, stretch=3)
    _steps(check, 6, {True: 100.0, False: 50.0})
    _steps(check, 6, {True: 200.0, False: 50.0})
    check.next_step_drafts()
    assert check.rates[True] == pytest.approx(150.0)


def test_checks_are_kept_per_power_of_two_batch_size():
    checks = DraftingChecks(DraftingCheck(explore=3, first=5, settle=1, drafting_chosen=True))
    assert [DraftingChecks.bucket(n) for n in (1, 2, 3, 4, 5, 33, 64)] == [1, 2, 4, 4, 8, 64, 64]
    assert checks.of(5) is checks.of(8) and checks.of(8) is not checks.of(9)
    assert checks.of(1).drafting_chosen and checks.of(1).explore == 3  # the template's settings
    assert checks.decide(3) and checks.current is checks.of(4)  # a step of 3 requests advances batch size 4's check
    checks.record(3, 0.01)
    assert checks.of(4).elapsed == pytest.approx(0.01) and checks.of(1).elapsed == 0


def test_each_source_has_its_own_checks_and_one_is_on_trial_at_a_time():
    checks = DraftingChecks(DraftingCheck(explore=3, first=5, settle=1))
    assert checks.of(4, "lookup") is not checks.of(4, "drafter") and checks.of(4) is checks.of(4, "drafter")
    lookup, drafter = checks.of(1, "lookup"), checks.of(1, "drafter")

    def step():
        checks.decide(1, "lookup"), checks.decide(1, "drafter")
        checks.record(1, 0.01)

    for _ in range(7):  # both open plain (5 steps); then the lookup's trial, asked first
        step()
    assert lookup.on_trial and not drafter.on_trial  # the drafter's trial waits: its plain stretch runs on
    assert drafter.tokens == 4 and drafter.elapsed == pytest.approx(0.07)  # no sample from the lookup's trial
    assert lookup.tokens == 1  # the trial's second step, past its settling one
    for _ in range(4):  # the lookup's trial ends (as long as 3 plain steps take, at least 5 steps)
        step()
    assert not lookup.on_trial and drafter.on_trial


def test_a_new_batch_size_starts_where_the_largest_smaller_judged_one_chose_plain_with_its_confidence():
    checks = DraftingChecks(DraftingCheck(explore=3, first=5, settle=1, margin=0.05, drafting_chosen=True))
    assert checks.of(2).drafting_chosen  # nothing judged yet: the template's choice
    _steps(checks.of(4), 9, {True: 110.0, False: 100.0})  # batch 4 judges both arms: drafting stays
    _steps(checks.of(8), 9, {True: 50.0, False: 100.0})  # batch 8: plain wins decisively (a stretch of 8)
    assert checks.of(4).drafting_chosen and not checks.of(8).drafting_chosen and checks.of(8).stretch == 8
    assert not checks.of(32).drafting_chosen  # from batch 8, the largest smaller judged size
    assert checks.of(16).drafting_chosen is False and checks.of(3).drafting_chosen  # 3 -> bucket 4, already there
    assert _steps(checks.of(64), 9, {True: 50.0, False: 100.0}) == [False] * 8 + [True]  # batch 8's stretch first


def test_a_template_with_an_opening_stretch_holds_its_arm_that_long_at_every_batch_size():
    checks = DraftingChecks(DraftingCheck(explore=3, first=5, settle=1, stretch=50, longest=50))
    assert [checks.decide(1) for _ in range(50)] == [False] * 50 and checks.decide(1)  # then drafting's trial
    assert checks.of(16).stretch == 50  # nothing judged at a smaller size: the template's opening
    assert DraftingChecks(DraftingCheck(explore=3, first=5, settle=1)).of(1).stretch == 5  # default: settle + 4


@pytest.mark.parametrize("bad", [dict(settle=0), dict(explore=8, settle=8), dict(first=32, longest=16)])
def test_impossible_stretches_are_refused(bad):
    with pytest.raises(ValueError, match="settle < explore"):
        DraftingCheck(**bad)


def test_the_hurdle_is_the_drafting_arms_step_time_over_the_plain_arms_once_both_are_measured():
    check = DraftingCheck(explore=3, first=8, settle=1)
    _steps(check, 5, {True: 100.0, False: 100.0}, tokens=1)  # the plain opening: 10 ms a step
    assert check.hurdle is None
    _steps(check, 4, {True: 75.0, False: 100.0}, tokens=3)  # drafting: 3 tokens in 40 ms
    assert check.hurdle == pytest.approx(4.0)  # a drafting step must commit 4 tokens a request to pay


def _closed_steps(record: RequestRecord, tokens, hurdle: float, steps: int = 40) -> list[int]:
    """The steps (of `steps`) in which the source was closed to a request whose drafting steps commit tokens[k]."""
    steps_run, drafted, closed = 0, 0, []
    for _ in range(steps):
        if DraftingChecks.closed_for({"drafter": record}, steps_run, "drafter"):
            closed.append(steps_run)
        else:
            record.record(steps_run + 1, tokens[drafted % len(tokens)], hurdle)
            drafted += 1
        steps_run += 1
    return closed


def test_a_request_below_the_hurdle_is_closed_for_ever_longer_waits_and_one_above_it_stays_open():
    # 1.5 tokens a drafting step against a hurdle of 1.8: judged every 4 drafting steps, closed 3, then 12, then 20
    # (the longest) steps
    closed = _closed_steps(RequestRecord(window=4, wait=3, longest=20), (1, 2), 1.8)
    assert closed == [*range(4, 7), *range(11, 23), *range(27, 40)]
    # every draft missed: closed after half a window already
    assert _closed_steps(RequestRecord(window=4, wait=3, longest=20), (1,), 1.8) == [
        *range(2, 5), *range(7, 19), *range(21, 40)]
    # not halfway to the hurdle (1.33 tokens a step against 1.4) after half a window: closed then; halfway (1.67), judged
    # at the window's end
    assert _closed_steps(RequestRecord(window=6, wait=3, longest=3), (2, 1, 1), 1.8)[:3] == [3, 4, 5]
    assert _closed_steps(RequestRecord(window=6, wait=3, longest=3), (2, 2, 1), 1.8)[:3] == [6, 7, 8]
    assert _closed_steps(RequestRecord(window=4), (2,), 1.8) == []  # it pays: never closed
    assert _closed_steps(RequestRecord(window=4), (1,), None) == []  # no hurdle yet: nothing to judge by
    assert _closed_steps(RequestRecord(window=4), (1,), 1.0) == []  # drafting costs nothing: nothing to lose


def test_a_requests_record_is_judged_by_its_sources_check_at_its_batch_size():
    checks = DraftingChecks(request_template=RequestRecord(window=2, wait=5))
    checks.of(1, "drafter").step_s.update({True: 0.03, False: 0.01})  # drafting steps: 3x the plain ones
    checks.of(2, "drafter").step_s.update({True: 0.01, False: 0.01})
    records: dict = {}
    for k in (1, 2):
        checks.record_request(records, k, "drafter", 2, 2)  # two tokens a step clear batch 2's hurdle ...
    assert checks.closed_for(records, 2, "drafter") == 0
    for k in (3, 4):
        checks.record_request(records, k, "drafter", 1, 2)  # ... not batch 1's (3): closed for 5 steps
    assert checks.closed_for(records, 4, "drafter") == 5 and checks.closed_for(records, 9, "drafter") == 0
    assert checks.closed_for(records, 4, "lookup") == 0  # each source its own record


@pytest.mark.parametrize("bad", [dict(window=0), dict(wait=0), dict(wait=300, longest=256)])
def test_impossible_request_records_are_refused(bad):
    with pytest.raises(ValueError, match="0 < window"):
        RequestRecord(**bad)


def test_a_trial_whose_source_stops_deciding_holds_no_other_trial_back():
    """A source closed to every request decides nothing; its check, left mid-trial, stops holding the other source's
    trial back after a step."""
    checks = DraftingChecks(DraftingCheck(explore=3, first=5, settle=1))
    arms = []
    for k in range(8):
        step = [checks.decide(1, "lookup")] if k <= 5 else []  # the lookup decides until its trial has begun
        step.append(checks.decide(1, "drafter"))
        checks.record(1, 0.01)
        arms.append(step)
    assert arms[:5] == [[False, False]] * 5  # both open plain
    assert arms[5] == [True, False]  # the lookup's trial; the drafter's waits
    assert arms[6:] == [[False], [True]]  # one step later the closed lookup holds it back no more
