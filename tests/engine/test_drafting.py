"""The draft-source chain: each request takes the first source that answers for it, feedback goes back to that source,
a step's time only to a source that answered for the whole step, and every step to the arm of each drafting check
that decided in it."""

from __future__ import annotations

import time

import pytest

from adaflash.engine.draft_sources import NO_DRAFT, Draft
from adaflash.engine.drafting import Drafting, StepDrafts
from adaflash.engine.request import Request
from adaflash.speculative.drafting_check import DraftingCheck, DraftingChecks, RequestRecord


class Scripted:
    """A draft source answering from a script: request id -> its drafts (absent: left to the next source)."""

    def __init__(self, script: dict[str, tuple[int, ...]], name: str = "lookup") -> None:
        self.script, self.name = script, name
        self.asked: list[list[str]] = []
        self.heard: list[tuple[list[str], list[int], list[int]]] = []
        self.observed: list[list[int]] = []

    def propose(self, requests):
        self.asked.append([r.request_id for r in requests])
        return [Draft(self.script[r.request_id]) if r.request_id in self.script else None for r in requests]

    def feedback(self, requests, drafted, accepted):
        self.heard.append(([r.request_id for r in requests], list(drafted), list(accepted)))

    def observe_step(self, lengths, seconds):
        assert seconds >= 0
        self.observed.append(list(lengths))


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [3, 4], 8) for i in range(n)]


def test_each_request_takes_the_first_source_that_answers_and_feedback_returns_to_it():
    first, second = Scripted({"r0": (7, 8), "r2": (9,)}), Scripted({"r1": (), "r3": (5, 6, 7)})
    drafting = Drafting(first, second)
    requests = _requests(4)
    step = drafting.propose(requests)
    assert first.asked == [["r0", "r1", "r2", "r3"]] and second.asked == [["r1", "r3"]]  # only what is left
    assert step.lengths == [2, 0, 1, 3] and step.any
    assert step.sources == (first, second, first, second)
    drafting.feedback(step, [1, 0, 0, 3])
    assert first.heard == [(["r0", "r2"], [2, 1], [1, 0])]
    assert second.heard == [(["r1", "r3"], [0, 3], [0, 3])]  # an empty answer is still the source's
    assert first.observed == second.observed == []  # two sources sized the verify: neither's cost alone


def test_a_step_one_source_answered_whole_teaches_it_the_step_time():
    first, second = Scripted({}), Scripted({"r0": (), "r1": (4,)})
    drafting = Drafting(first, second)
    step = drafting.propose(_requests(2))
    drafting.feedback(step, [0, 1])
    assert second.observed == [[0, 1]] and first.heard == [] and first.observed == []
    only = Scripted({"r0": (3,), "r1": (4,)})
    later = Scripted({})
    drafting = Drafting(only, later)
    drafting.feedback(drafting.propose(_requests(2)), [1, 1])
    assert later.asked == [] and only.observed == [[1, 1]]  # nothing left to ask the next source


def test_without_sources_every_request_decodes_one_token():
    drafting = Drafting(None, None)
    step = drafting.propose(_requests(3))
    assert step.drafts == (NO_DRAFT,) * 3 and not step.any and step.sources == (None,) * 3
    drafting.feedback(step, [0, 0, 0])  # nobody to tell
    assert drafting.adopt_prefix(0, [1, 2, 3], 2) == 2  # no drafter: nothing limits what the target keeps
    drafting.release(0, [1, 2, 3])


class HeldDrafter(Scripted):
    """A drafter-like source: a step of the check's plain arm holds its requests (`DrafterSource.hold`); its drafting
    steps take `seconds` (a drafter pass and a wider verify)."""

    def __init__(self, script, seconds: float = 0.0) -> None:
        super().__init__(script, "drafter")
        self.seconds, self.held = seconds, 0

    def hold(self, requests):
        self.held += 1
        return self

    def propose(self, requests):
        time.sleep(self.seconds)
        return super().propose(requests)


def test_a_step_of_the_plain_arm_asks_no_source_and_the_drafter_still_hears_it():
    lookup, drafter = Scripted({"r0": (7,)}), HeldDrafter({"r1": (5,)})
    checks = DraftingChecks(DraftingCheck(explore=4, first=8, settle=1))  # a batch size opens with plain steps
    drafting = Drafting(lookup, drafter, checks)
    step = drafting.propose(_requests(2))
    assert not step.any and lookup.asked == [] and drafter.asked == [] and drafter.held == 1
    drafting.feedback(step, [0, 0])
    assert drafter.heard == [(["r0", "r1"], [0, 0], [0, 0])] and drafter.observed == [[0, 0]]  # calibration learns
    assert checks.current is checks.of(2) and checks.current.elapsed > 0


def test_every_step_counts_toward_its_arm_whichever_sources_drafted_in_it():
    lookup, drafter = Scripted({"r0": (7, 8)}), HeldDrafter({"r1": (5,)})
    checks = DraftingChecks(DraftingCheck(explore=4, first=8, settle=1, drafting_chosen=True))
    drafting = Drafting(lookup, drafter, checks)
    for _ in range(3):
        step = drafting.propose(_requests(2))
        assert step.sources == (lookup, drafter)  # two sources: neither learns the step's cost ...
        drafting.feedback(step, [2, 1])
    assert drafter.observed == [] and checks.of(2).tokens == 2 * 5  # ... but the arm does: 5 tokens a measured step


def test_a_drafting_arm_that_slows_every_step_is_dropped_and_tried_ever_more_rarely():
    """transformers' schedule never stops drafting on its own: behind the check, drafting steps that take longer for
    the same tokens lose to plain ones within the first few dozen steps."""
    drafter = HeldDrafter({"r0": (5, 6)}, seconds=0.002)
    checks = DraftingChecks()
    drafting = Drafting(None, drafter, checks)
    arms = []
    for _ in range(300):
        step = drafting.propose(_requests(1))
        arms.append(step.any)
        drafting.feedback(step, [0])  # every draft rejected: one token a step either way
    check = checks.of(1)
    assert not check.drafting_chosen and check.rates[False] > check.rates[True] * (1 + check.decisive)
    assert not any(arms[: check.settle + 4]) and 0 < sum(arms) <= 3 * check.explore
    assert not any(arms[-100:])  # the plain stretch has grown past 100 steps


def test_each_source_is_judged_by_its_own_check():
    """Lookups that pay keep drafting while the drafter, whose drafts slow its steps and never land, is dropped: one
    check over both sources would have kept or dropped them together."""
    lookup, drafter = Scripted({"r0": (7, 8)}), HeldDrafter({"r1": (5,)}, seconds=0.002)
    checks = DraftingChecks()
    drafting = Drafting(lookup, drafter, checks)
    drafted_by = {lookup: 0, drafter: 0}
    for k in range(400):  # one request a step: a match for the lookup every other step, the drafter's turn between
        step = drafting.propose([Request(f"r{k % 2}", [3, 4], 8)])
        source = step.sources[0] if step.any else None
        if source is not None:
            drafted_by[source] += 1
        drafting.feedback(step, [2 if source is lookup else 0])
    assert checks.of(1, "lookup").drafting_chosen and not checks.of(1, "drafter").drafting_chosen
    assert drafted_by[lookup] > 150 and drafted_by[drafter] < 40


class Clock:
    """The drafting's injected clock: the test moves it (a step's target pass), nothing else does."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedDrafter(HeldDrafter):
    def observe_step(self, lengths, seconds):
        self.observed.append((list(lengths), seconds))


def _side_by_side(drafting: Drafting, lookup, drafter, clock: Clock, steps: int = 600) -> list[tuple]:
    """Steps with scripted costs: lookups (two drafts, kept in the first 300 steps, then never) pay, then lose; the
    drafter's (one draft, never kept) cost 3 ms a step; in the first 300 steps a plain step costs 8 ms more (so a plain
    trial runs out of time before its steps); batch sizes 2, then 3 and 4 by turns of 25 steps, and a lone request
    every 37th step; the same four requests throughout, each closed to a source its drafts do not pay for.
    Per step: batch size, draft lengths, whether it ran in a plain run, whether that was a plain trial, and whether the
    drafter was closed to every request in it."""
    seen = []
    requests = [Request(f"r{i}", [3, 4], 8) for i in range(4)]  # each judged on its own drafting steps too
    for k in range(steps):
        n = 1 if k % 37 == 0 else 2 if k < 300 else 3 + k // 25 % 2
        step = drafting.propose(requests[:n])
        accepted = [len(d.tokens) if s is lookup and k < 300 else 0 for d, s in zip(step.drafts, step.sources)]
        for r, a in zip(requests, accepted):
            r.accept_lengths.append(a + 1)
        trial = step.in_run and drafting.checks.of(n, "lookup").drafting_chosen
        drafted = any(s is drafter and d.tokens for d, s in zip(step.drafts, step.sources))
        clock.now += 0.001 * n + 0.0004 * sum(step.lengths) + 0.003 * drafted + 0.008 * (not step.any and k < 300)
        drafting.feedback(step, accepted)
        closed = all(DraftingChecks.closed_for(r.drafting_records, len(r.accept_lengths) - 1, "drafter")
                     for r in requests[:n])
        seen.append((n, step.lengths, step.in_run, trial, closed))
    drafting.close_run()
    return seen


@pytest.mark.parametrize("window", [10 ** 6, 4], ids=["requests-never-closed", "requests-closed"])
def test_plain_runs_leave_checks_and_calibration_as_deciding_step_by_step_would(monkeypatch, window):
    """The same scripted steps with plain runs and without (each step deciding and recording at once): every step
    drafts the same, and every check and the drafter's policy end up the same, to the bit (the replay itself takes no
    time on this clock). Without requests closed to a source, plain trials run out of time within runs; with them,
    runs of requests the sources are closed to."""
    ends = []
    for runs in (True, False):
        clock = Clock()
        lookup, drafter = Scripted({"r0": (7, 8)}), TimedDrafter({f"r{i}": (5,) for i in range(4)})
        checks = DraftingChecks(DraftingCheck(explore=8, first=8, longest=64, settle=1),
                                request_template=RequestRecord(window=window, wait=2, longest=8))
        drafting = Drafting(lookup, drafter, checks, clock)
        if not runs:
            monkeypatch.setattr(drafting, "_start_run", lambda step: None)
        seen = _side_by_side(drafting, lookup, drafter, clock)
        ends.append((seen, {key: vars(check) for key, check in checks.by_size.items()}, drafter.observed))
    (with_runs, checks_with, heard_with), (without, checks_without, heard_without) = ends
    assert [s[:2] for s in with_runs] == [s[:2] for s in without]
    assert sum(s[2] for s in with_runs) > 150  # chosen plain stretches ...
    if window == 4:
        assert sum(s[2] and s[4] for s in with_runs) > 10  # ... runs of requests the drafter was closed to
    else:
        assert sum(s[3] for s in with_runs) > 10 and not any(s[4] for s in with_runs)  # ... plain trials
    assert not any(s[2] for s in without)
    assert checks_with == checks_without and heard_with == heard_without
    assert checks_with[("lookup", 2)]["drafting_chosen"] and not checks_with[("lookup", 4)]["drafting_chosen"]
    assert not checks_with[("drafter", 2)]["drafting_chosen"]


def test_a_chosen_plain_stretch_runs_without_bookkeeping_and_is_replayed_at_its_end():
    drafter = HeldDrafter({"r0": (5,), "r1": (6,)})
    checks = DraftingChecks(DraftingCheck(explore=4, first=8, settle=1, stretch=10))  # opens with 10 plain steps
    drafting = Drafting(None, drafter, checks)
    requests = _requests(2)
    step = drafting.propose(requests)  # decided one by one: the check grants the stretch's other 9 steps
    drafting.feedback(step, [0, 0])
    check = checks.of(2)
    assert not step.in_run and check.left == 9 and drafter.observed == [[0, 0]]
    for k in range(9):
        step = drafting.propose(requests)
        assert step.in_run and not step.any and step.sources == (None, None)
        if k < 8:  # nothing heard until the run's last step
            drafting.feedback(step, [0, 0])
            assert check.left == 9 and check.steps == 0 and len(drafter.observed) == 1
    drafting.feedback(step, [0, 0])
    assert check.left == 0 and check.since_switch == 9 and check.steps == 9  # as if decided step by step
    assert drafter.observed == [[0, 0]] * 10 and drafter.held == 10
    assert drafting.propose(requests).any  # the drafting arm's trial, decided as before


def test_new_requests_end_the_plain_run_before_their_step_is_decided():
    drafter = HeldDrafter({"r0": (5,)})
    checks = DraftingChecks(DraftingCheck(explore=4, first=8, settle=1, stretch=10))
    drafting = Drafting(None, drafter, checks)
    requests = _requests(4)
    for _ in range(3):  # one decided step, two in the run
        drafting.feedback(drafting.propose(requests[:2]), [0, 0])
    assert checks.of(2).since_switch == 0
    step = drafting.propose(requests[:3])  # new requests (bucket 4): the run ends, replayed into bucket 2's check
    assert not step.in_run and checks.of(2).since_switch == 2 and checks.of(2).left == 7
    assert checks.of(4).since_switch == 0 and drafter.observed == [[0, 0]] * 3
    drafting.feedback(step, [0, 0, 0])
    step = drafting.propose(requests[:3])
    assert step.in_run  # the same requests: their run goes on
    drafting.feedback(step, [0, 0, 0])
    step = drafting.propose(requests[1:4])  # another set of requests at the same batch size: decided afresh
    assert not step.in_run and checks.of(4).since_switch == 2


def _engine_step(drafting: Drafting, requests: list[Request], kept: dict[str, int]) -> StepDrafts:
    """One step as the engine runs it: each request keeps `kept[id]` of its drafts and commits one token more."""
    step = drafting.propose(requests)
    accepted = [min(kept[r.request_id], len(d.tokens)) for r, d in zip(requests, step.drafts)]
    for r, a in zip(requests, accepted):
        r.accept_lengths.append(a + 1)
    drafting.feedback(step, accepted)
    return step


def test_a_request_whose_drafts_do_not_pay_is_closed_to_the_drafter_and_tried_again_ever_more_rarely():
    """The check keeps drafting (it pays for `good`); `bad`, whose drafts never land, is judged on its own drafting
    steps against the check's hurdle, and closed: its steps then run as a plain run that no check hears."""
    drafter = HeldDrafter({"good": (5, 6), "bad": (5, 6)})
    checks = DraftingChecks(DraftingCheck(settle=1, drafting_chosen=True, stretch=10 ** 6, longest=10 ** 6),
                            request_template=RequestRecord(window=8, wait=16))
    drafting = Drafting(None, drafter, checks)
    checks.of(1).step_s.update({True: 0.0015, False: 0.001})  # a drafting step must commit 1.5 tokens to pay
    good, bad = Request("good", [3, 4], 400), Request("bad", [3, 4], 400)
    steps = [_engine_step(drafting, [bad], {"bad": 0}) for _ in range(120)]
    # every draft missed: closed after half a window of drafting steps
    assert [s.any for s in steps] == [True] * 4 + [False] * 16 + [True] * 4 + [False] * 64 + [True] * 4 + [False] * 28
    assert [s.in_run for s in steps[4:20]] == [False] + [True] * 15  # the closed steps: one held, then a plain run
    assert checks.of(1).since_switch == 4 * 3 - 1  # the check decided only the drafting steps
    assert sum(len(asked) for asked in drafter.asked) == 12 and drafter.held == 0
    for _ in range(50):  # another request, whose drafts all land, drafts every step
        assert _engine_step(drafting, [good], {"good": 2}).lengths == [2]
    both = [_engine_step(drafting, [good, bad], {"good": 2, "bad": 0}) for _ in range(4)]
    assert [s.lengths for s in both] == [[2, 0]] * 4 and all(s.sources == (drafter, None) for s in both)
