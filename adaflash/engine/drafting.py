"""A step's drafting: the draft sources chained, the drafter's context fed, each source told how its drafts fared.

Each decoding request takes the first source that answers for it: prompt lookup where it has a match, else the drafter
and its length policy (draft_sources.py). Feedback goes back to the source that answered; a step's wall time only to a
source that answered for every request in it (its lengths are then the whole verify's: a step whose verify another
source widened prices neither source's drafts).

With adaptive lengths each source runs behind its own drafting check (speculative/drafting_check.py): in a step of its
plain arm the source runs nothing (no lookup; no drafter pass, no policy decision), and the step's committed tokens and
time go to the arm of every check that decided in it. In its drafting arm each request's drafting steps are also judged
on their own (`RequestRecord`): a request whose drafts do not clear the check's hurdle is closed to the source for a
while, and is not asked; a source closed to every request left runs nothing and its check decides nothing.

Once every source has run nothing in a step (its check decided its plain arm, or it is closed to the requests), the
steps that follow run as a plain run while that is certain to last (the rest of a chosen plain stretch; in a plain
trial, until it has run its time; until a closed source opens again; while the same requests decode): each step only
notes its time, and the checks' decisions, the drafter policy's calibration and the checks' records are replayed, in
order, when the run ends (its last step, new requests, the engine running empty, a new policy or drafter).
The replay is what those steps would have done one by one, but warm: right after a step's target pass, whose weights
have just streamed through the caches, the same Python ran cold, and a plain-arm step cost 50-80 us more than an AR
step at batch 1 (1-1.5% of an int8 decode step), against ~4 us a step replayed (benchmarks/adaflash/policy_overhead.py). An
engine dropped mid-run (an exception) leaves its run's steps untold: the checks then hold that stretch a little longer.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from adaflash.engine.draft_sources import NO_DRAFT, Draft, DrafterSource, DraftSource, PromptLookupSource
from adaflash.engine.request import Request
from adaflash.speculative.drafting_check import DraftingCheck, DraftingChecks


@dataclass(frozen=True)
class StepDrafts:
    """What a step verifies: per request its drafts and the source that proposed them (None: no source answered)."""

    requests: tuple[Request, ...]
    drafts: tuple[Draft, ...]
    sources: tuple[DraftSource | None, ...]
    start: float  # the engine's clock when drafting began: the step's cost, policies included, runs from here
    decided: tuple[str, ...] = ()  # the sources whose check decided this step
    trying: tuple[DraftSource, ...] = ()  # of those, the ones in their drafting arm (each request's record hears them)
    held: bool = False  # no source ran: the steps after it may run as a plain run
    closed_after: float = math.inf  # held: steps after this one during which a source closed to every request stays so
    in_run: bool = False  # a step of a plain run: its bookkeeping waits for the run's end

    @property
    def lengths(self) -> list[int]:
        return [len(d.tokens) for d in self.drafts]

    @property
    def any(self) -> bool:
        return any(d.tokens for d in self.drafts)


@dataclass
class _PlainRun:
    """Plain steps of one set of requests in which every source ran nothing (its check chose its plain arm, or it was
    closed to the requests left): each step's seconds, replayed into the deciding sources' checks when the run ends.
    It ends after `most` steps, or, in a plain trial, once it has run `fewest` steps and `budget_s` seconds
    (`DraftingCheck.plain_steps_ahead`), or when the requests change (which sources decide depends on who is left)."""

    members: tuple[Request, ...]
    sources: tuple[str, ...]  # the deciding sources, in the chain's order
    checks: tuple[DraftingCheck, ...]
    most: float
    fewest: int = 0
    budget_s: float = math.inf
    steps: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def over(self) -> bool:
        return len(self.steps) >= self.most or (self.seconds >= self.budget_s and len(self.steps) >= self.fewest)

    def holds(self, requests: Sequence[Request]) -> bool:
        """The run goes on for a step of these requests."""
        members = self.members
        return len(members) == len(requests) and all(a is b for a, b in zip(members, requests))


class Drafting:
    """Prompt lookup, then the drafter (either may be absent: without both, every step decodes one token)."""

    def __init__(self, lookup: PromptLookupSource | None, drafter: DrafterSource | None,
                 checks: DraftingChecks | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        """`checks`: the drafting check's arms (None: every step drafts as the sources decide). One engine at a time
        may step a set of checks: a plain run holds back what its steps teach them until it ends. `clock`: seconds, as
        the checks and the policies are to see a step's cost (wall time; tests and simulations inject their own)."""
        self.lookup, self.drafter, self.checks, self.clock = lookup, drafter, checks, clock
        self.sources: tuple[DraftSource, ...] = tuple(s for s in (lookup, drafter) if s is not None)
        self._run: _PlainRun | None = None

    def propose(self, requests: Sequence[Request]) -> StepDrafts:
        if self._run is not None:
            if self._run.holds(requests):
                n = len(requests)
                return StepDrafts(tuple(requests), (NO_DRAFT,) * n, (None,) * n, self.clock(), in_run=True)
            self.close_run()
        start = self.clock()
        drafts: list[Draft] = [NO_DRAFT] * len(requests)
        sources: list[DraftSource | None] = [None] * len(requests)
        left = list(range(len(requests)))
        decided, trying = [], []
        held, closed_after = 0, math.inf  # sources that ran nothing; steps after this one a source stays closed to all
        for source in self.sources:
            if not left:
                break
            asked = left
            if self.checks is not None:
                closed = [self.checks.closed_for(requests[i].drafting_records, len(requests[i].accept_lengths),
                                                 source.name) for i in left]
                asked = [i for i, c in zip(left, closed) if c == 0]
                if not asked:  # closed to every request left: the source runs nothing and its check hears nothing
                    held += 1
                    closed_after = min(closed_after, min(closed) - 1)
                    continue
                decided.append(source.name)
                if not self.checks.decide(len(requests), source.name):
                    # The source's plain arm: it runs nothing. The drafter (last in the chain) still answers, with no
                    # drafts, so its policy hears the step's time: the throughput policies' calibration learns the
                    # plain step.
                    held += 1
                    if source is self.drafter:
                        drafter = self.drafter.hold([requests[i] for i in left])
                        for i in left:
                            sources[i] = drafter
                    continue
                trying.append(source)
            for i, draft in zip(asked, source.propose([requests[i] for i in asked])):
                if draft is not None:
                    drafts[i], sources[i] = draft, source
            left = [i for i in left if sources[i] is None]
        return StepDrafts(tuple(requests), tuple(drafts), tuple(sources), start, tuple(decided), tuple(trying),
                          held=bool(self.sources) and held == len(self.sources), closed_after=closed_after)

    def feedback(self, step: StepDrafts, accepted: Sequence[int]) -> None:
        """`accepted`: per request, how many of its drafts the target kept."""
        if step.in_run:  # nothing drafted: every request committed one token
            run = self._run
            seconds = self.clock() - step.start
            run.steps.append(seconds)
            run.seconds += seconds
            if run.over:
                self.close_run()
            return
        lengths = step.lengths
        for source in self.sources:
            mine = [i for i, s in enumerate(step.sources) if s is source]
            if mine:
                source.feedback([step.requests[i] for i in mine], [lengths[i] for i in mine],
                                [accepted[i] for i in mine])
        seconds = self.clock() - step.start  # the policies' feedback included: part of a step's cost
        first = step.sources[0]
        if first is not None and all(s is first for s in step.sources):
            first.observe_step(lengths, seconds)
        if self.checks is None:
            return
        # The step counts toward the arm of every check that decided in it, and each request's drafting steps toward
        # its own record.
        batch = len(step.requests)
        self.checks.record(sum(a + 1 for a in accepted), seconds)
        for source in step.trying:
            for r, s, a in zip(step.requests, step.sources, accepted):
                if s is source:
                    self.checks.record_request(r.drafting_records, len(r.accept_lengths), source.name, batch, a + 1)
        if step.held:
            self._start_run(step)

    def _start_run(self, step: StepDrafts) -> None:
        """The steps after a held one run as a plain run, for as long as every check that held it stays plain and
        every source closed to the requests stays closed."""
        batch = len(step.requests)
        checks = tuple(self.checks.of(batch, name) for name in step.decided)
        most, fewest, budget_s = step.closed_after, 0, math.inf
        if checks:
            ahead = [check.plain_steps_ahead() for check in checks]
            _, fewest, budget_s = min(ahead, key=lambda limits: limits[2])  # a trial's time, if one is under way
            most = min(most, *(m for m, _, _ in ahead))
        run = _PlainRun(step.requests, step.decided, checks, most, fewest, budget_s)
        if not run.over:  # (a trial that has run its time ends at the next decision)
            self._run = run

    def close_run(self) -> None:
        """End the plain run, if one is under way: its steps' decisions, step times (to a held drafter's policy) and
        records replayed in order, as they would have run one by one. The replay's own time goes to the record of
        the run's last step, so the plain arm's rate still pays for its bookkeeping."""
        run, self._run = self._run, None
        if run is None or not run.steps:
            return
        if any(check.arm is not False or check.left < len(run.steps) for check in run.checks):
            raise RuntimeError("drafting checks stepped by another engine during a plain run: one engine at a time "
                               "may step a set of checks")
        drafter_held = self.drafter is not None and self.drafter.name in run.sources
        batch = len(run.members)
        start = self.clock()
        for k, seconds in enumerate(run.steps, 1):
            for name in run.sources:
                self.checks.decide(batch, name)
            if drafter_held:  # (leaves the drafter's step held, as a plain-arm step does)
                self.drafter.hold(()).observe_step([0] * batch, seconds)
            if k == len(run.steps):
                seconds += self.clock() - start
            self.checks.record(batch, seconds)

    # ---- the drafter's context (prompt lookup reads the request's own tokens) ----------------------

    def adopt_prefix(self, slot: int, tokens: Sequence[int], limit: int) -> int:
        """A new request in `slot` whose target cache kept `limit` positions of its prompt `tokens`: the drafter maps in
        what its own cache holds of them; returns the positions the target may keep (no drafter: all)."""
        return self.drafter.adopt_prefix(slot, tokens, limit) if self.drafter is not None else limit

    def release(self, slot: int, committed: Sequence[int]) -> None:
        """The request in `slot` is over: the drafter empties the slot, keeping its full blocks of `committed`."""
        if self.drafter is not None:
            self.drafter.release(slot, committed)

    def add_context(self, slot: int, start: int, features: torch.Tensor | None) -> None:
        if self.drafter is not None:
            self.drafter.add_context(slot, start, features)

