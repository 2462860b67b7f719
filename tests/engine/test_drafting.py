"""The draft-source chain: each request takes the first source that answers for it, feedback goes back to that source,
and a step's time only to a source that answered for the whole step."""

from __future__ import annotations

from adaflash.engine.draft_sources import NO_DRAFT, Draft
from adaflash.engine.drafting import Drafting
from adaflash.engine.request import Request


class Scripted:
    """A draft source answering from a script: request id -> its drafts (absent: left to the next source)."""

    def __init__(self, script: dict[str, tuple[int, ...]]) -> None:
        self.script = script
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
    drafting.restart_context(0, 0)
    drafting.release(0)  # no drafter: no context to keep
