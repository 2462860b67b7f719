"""A step's drafting: the draft sources chained, the drafter's context fed, each source told how its drafts fared.

Each decoding request takes the first source that answers for it: prompt lookup where it has a match, else the drafter
and its length policy (draft_sources.py). Feedback goes back to the source that answered; a step's wall time only to a
source that answered for every request in it (its lengths are then the whole verify's: a step whose verify another
source widened prices neither source's drafts).

With adaptive lengths each source runs behind its own drafting check (speculative/drafting_check.py): in a step of its
plain arm the source runs nothing (no lookup; no drafter pass, no policy decision), and the step's committed tokens and
time go to the arm of every check that decided in it.

A chosen plain stretch is known for its whole length in advance, so its steps run as a plain run: each step only notes
its time, and the checks' decisions, the steps' records and the policy's calibration are replayed, in order, when the
run ends (its last step, a change of batch size, or the engine running empty). The replay is what those steps would
have done one by one, but warm: right after a step's target pass, whose weights have just streamed through the caches,
the same Python ran cold, and a plain-arm step cost 50-80 us more than an AR step at batch 1 (1-1.5% of an int8 decode
step), against ~4 us a step replayed (benchmarks/policy_overhead.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from adaflash.engine.draft_sources import NO_DRAFT, Draft, DrafterSource, DraftSource, PromptLookupSource
from adaflash.engine.request import Request
from adaflash.speculative.drafting_check import DraftingChecks


@dataclass(frozen=True)
class StepDrafts:
    """What a step verifies: per request its drafts and the source that proposed them (None: no source answered)."""

    requests: tuple[Request, ...]
    drafts: tuple[Draft, ...]
    sources: tuple[DraftSource | None, ...]
    start: float  # time.perf_counter() when drafting began: the step's cost, policies included, runs from here
    in_run: bool = False  # a step of a plain run: its bookkeeping waits for the run's end

    @property
    def lengths(self) -> list[int]:
        return [len(d.tokens) for d in self.drafts]

    @property
    def any(self) -> bool:
        return any(d.tokens for d in self.drafts)


@dataclass
class _PlainRun:
    """Steps every source's check has given to its chosen plain stretch, at one batch-size bucket (sizes in
    (low, high]): each step's decoding requests and seconds, replayed into the checks when the run ends."""

    low: int
    high: int
    granted: int  # steps the run may take: the stretch's rest
    steps: list[tuple[int, float]] = field(default_factory=list)


class Drafting:
    """Prompt lookup, then the drafter (either may be absent: without both, every step decodes one token)."""

    def __init__(self, lookup: PromptLookupSource | None, drafter: DrafterSource | None,
                 checks: DraftingChecks | None = None) -> None:
        """`checks`: the drafting check's arms (None: every step drafts as the sources decide)."""
        self.lookup, self.drafter, self.checks = lookup, drafter, checks
        self.sources: tuple[DraftSource, ...] = tuple(s for s in (lookup, drafter) if s is not None)
        self._run: _PlainRun | None = None

    def propose(self, requests: Sequence[Request]) -> StepDrafts:
        start = time.perf_counter()
        run = self._run
        if run is not None:
            if run.low < len(requests) <= run.high and len(run.steps) < run.granted:
                return StepDrafts(tuple(requests), (NO_DRAFT,) * len(requests), (None,) * len(requests), start, True)
            self.close_run()
        drafts: list[Draft] = [NO_DRAFT] * len(requests)
        sources: list[DraftSource | None] = [None] * len(requests)
        left = list(range(len(requests)))
        plain = 0  # sources held in their plain arm
        for source in self.sources:
            if not left:
                break
            asked = [requests[i] for i in left]
            if self.checks is not None and not self.checks.decide(len(requests), source.name):
                # The source's plain arm: it runs nothing. The drafter (last in the chain) still answers, with no
                # drafts, so its policy hears the step's time: the throughput policies' calibration learns the plain
                # step.
                plain += 1
                if source is self.drafter:
                    held = self.drafter.hold(asked)
                    for i in left:
                        sources[i] = held
                continue
            for i, draft in zip(left, source.propose(asked)):
                if draft is not None:
                    drafts[i], sources[i] = draft, source
            left = [i for i in left if sources[i] is None]
        if plain and plain == len(self.sources):  # every source held: the stretch's rest can run as a plain run
            ahead = self.checks.plain_ahead()
            if ahead > 0:
                high = self.checks.bucket(len(requests))
                self._run = _PlainRun(high // 2, high, ahead)
        return StepDrafts(tuple(requests), tuple(drafts), tuple(sources), start)

    def feedback(self, step: StepDrafts, accepted: Sequence[int]) -> None:
        """`accepted`: per request, how many of its drafts the target kept."""
        if step.in_run:  # nothing drafted: every request committed one token
            run = self._run
            run.steps.append((len(step.requests), time.perf_counter() - step.start))
            if len(run.steps) == run.granted:
                self.close_run()
            return
        lengths = step.lengths
        for source in self.sources:
            mine = [i for i, s in enumerate(step.sources) if s is source]
            if mine:
                source.feedback([step.requests[i] for i in mine], [lengths[i] for i in mine],
                                [accepted[i] for i in mine])
        seconds = time.perf_counter() - step.start  # the policies' feedback included: part of a step's cost
        first = step.sources[0]
        if first is not None and all(s is first for s in step.sources):
            first.observe_step(lengths, seconds)
        if self.checks is not None:  # the step counts toward the arm of every check that decided in it
            self.checks.record(sum(a + 1 for a in accepted), seconds)

    def close_run(self) -> None:
        """End the plain run, if one is under way: its steps' decisions, records and (for a held drafter) step times
        replayed in order, as they would have run one by one. The replay's own time goes to the run's last step, so
        the plain arm's rate still pays its bookkeeping."""
        run, self._run = self._run, None
        if run is None or not run.steps:
            return
        start = time.perf_counter()
        for k, (batch, seconds) in enumerate(run.steps, 1):
            if k == len(run.steps):
                seconds += time.perf_counter() - start
            for source in self.sources:
                drafts = self.checks.decide(batch, source.name)
                assert not drafts, "a plain run outlasted its stretch"
            if self.drafter is not None:
                self.drafter.hold(()).observe_step([0] * batch, seconds)
            self.checks.record(batch, seconds)

    # ---- the drafter's context (prompt lookup reads the request's own tokens) ----------------------

    def context_length(self, slot: int) -> int | None:
        """Positions of `slot` the drafter's context holds, fed or waiting (None: no drafter)."""
        return self.drafter.context_length(slot) if self.drafter is not None else None

    def restart_context(self, slot: int, keep: int) -> None:
        if self.drafter is not None:
            self.drafter.restart_context(slot, keep)

    def add_context(self, slot: int, start: int, features: torch.Tensor | None) -> None:
        if self.drafter is not None:
            self.drafter.add_context(slot, start, features)

