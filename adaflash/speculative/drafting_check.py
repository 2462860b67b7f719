"""Whether drafting at all beats plain decoding on this machine, judged by what each really commits a second.

The length policies price drafts step by step (`cost_model.py`), or not at all (`heuristic`, `block-head`), but
drafting also slows the steps around it (most likely the drafter's passes push the target's weights out of the caches):
on an AMX Xeon a 3-token verify took 5.1 ms while every step drafted and 4.5 ms while every fourth did, and a decode
step 3.4 ms in an engine that never drafted against 3.7-3.8 between drafting steps
(docs/results/adaflash/drafting_rhythm.txt). Priced step by step drafting looked worth it; as a regime it ran
0.85-0.92x plain decoding. So steps run in two arms, drafting as the policy decides and plain, and each arm is judged
by the committed tokens a second of its stretches.

Stretches alternate: the chosen arm, then the other for as long as `explore` steps of the chosen one take (a slow
arm is tried for fewer steps, down to `settle` + 4: under load a drafting step can cost several plain ones), after
which the choice is made again. The chosen arm's stretch starts at `first` steps and doubles each time the choice
stands (grows 4x where the other arm lost by more than `decisive`), up to `longest`, so a losing arm is found within
the first ~30 steps and later costs at most about explore / longest of the time; a flip starts the growth over. The first `settle` steps after a
switch are left out while the caches refill. Rates are kept per batch size (powers of two): tokens a second are
comparable only at one batch size, and a batch may draft where one request does not; a new batch size starts from the
choice of the largest smaller one that has judged both arms, where that was plain.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence


@dataclass
class DraftingCheck:
    """The two arms' schedule and measured rates at one batch size; `next_step_drafts` before each step, `record`
    after it."""

    explore: int = 16
    first: int = 16
    longest: int = 1536
    settle: int = 3
    margin: float = 0.03
    decisive: float = 0.12  # a loss this large needs re-checking less often
    follow: float = 0.5  # weight of a new stretch in its arm's rate
    drafting_chosen: bool = True
    rates: dict[bool, float] = field(default_factory=dict)  # arm (drafting?) -> committed tokens a second
    step_s: dict[bool, float] = field(default_factory=dict)  # arm -> seconds a step

    def __post_init__(self) -> None:
        if not 0 < self.settle < min(self.explore, self.first) or self.longest < self.first:
            raise ValueError(f"need 0 < settle < explore, first <= longest; got settle {self.settle}, explore "
                             f"{self.explore}, first {self.first}, longest {self.longest}")
        self.arm: bool | None = None  # the current stretch's arm
        self.left = 0  # its steps still to run
        self.stretch = self.first  # the chosen arm's next stretch
        self.since_switch = 0
        self.tokens = self.seconds = 0.0  # of the current stretch, past its settling steps
        self.steps = 0

    def next_step_drafts(self) -> bool:
        """Advance one step; whether it belongs to the drafting arm (else it must draft nothing)."""
        if self.arm is None:
            self.arm, self.left = self.drafting_chosen, self.stretch
        elif self.left == 0:
            self._close(self.arm)
            if self.arm == self.drafting_chosen:  # the chosen arm ran its stretch: try the other
                self.arm, self.left = not self.drafting_chosen, self._explore_steps()
            else:  # the other arm was tried: choose, and run the choice for a stretch
                self._choose()
                self.arm, self.left = self.drafting_chosen, self.stretch
            self.since_switch = -1
        self.left -= 1
        self.since_switch += 1
        return self.arm

    def record(self, tokens: int, seconds: float) -> None:
        """The step just decided committed `tokens` in `seconds` (an engine step the policy observes)."""
        if self.since_switch >= self.settle and seconds > 0:
            self.tokens += tokens
            self.seconds += seconds
            self.steps += 1

    def _explore_steps(self) -> int:
        """The other arm's steps: as long as `explore` of the chosen arm's steps take, at least settle + 4."""
        other = not self.drafting_chosen
        if other not in self.step_s or self.drafting_chosen not in self.step_s:
            return self.explore
        steps = round(self.explore * self.step_s[self.drafting_chosen] / self.step_s[other])
        return min(self.explore, max(self.settle + 4, steps))

    def _close(self, arm: bool) -> None:
        if self.seconds > 0:
            for measured, value in ((self.rates, self.tokens / self.seconds), (self.step_s, self.seconds / self.steps)):
                measured[arm] = (1 - self.follow) * measured.get(arm, value) + self.follow * value
        self.tokens = self.seconds = 0.0
        self.steps = 0

    def _choose(self) -> None:
        if True not in self.rates or False not in self.rates:
            return
        chosen = not self.rates[False] > self.rates[True] * (1 + self.margin)
        winner, loser = self.rates[chosen], self.rates[not chosen]
        growth = 4 if winner > loser * (1 + self.decisive) else 2
        self.stretch = min(growth * self.stretch if chosen == self.drafting_chosen else growth * self.first // 2,
                           self.longest)
        self.drafting_chosen = chosen


@dataclass
class DraftingChecks:
    """A `DraftingCheck` per batch size (rounded up to a power of two), made on first use from `template`'s settings."""

    template: DraftingCheck = field(default_factory=DraftingCheck)
    by_size: dict[int, DraftingCheck] = field(default_factory=dict)

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, batch - 1).bit_length()

    def of(self, batch: int) -> DraftingCheck:
        size = self.bucket(batch)
        if size not in self.by_size:  # the template's settings, its own rates and step times
            self.by_size[size] = replace(self.template, rates={}, step_s={}, drafting_chosen=self._starts_drafting(size))
        return self.by_size[size]

    def _starts_drafting(self, size: int) -> bool:
        """A new batch size starts plain where the largest smaller one that has judged both arms chose plain: verifying
        drafts only costs more as the batch grows, and under load a first drafting stretch can take as long as
        several rounds of plain steps."""
        judged = [s for s, check in self.by_size.items() if s < size and len(check.rates) == 2]
        return self.by_size[max(judged)].drafting_chosen if judged else self.template.drafting_chosen


@dataclass
class DraftingGuard:
    """Any length policy behind the drafting check: a step of the plain arm drafts nothing (and runs no drafter pass,
    a learned head's look included); a step of the drafting arm is the policy's. The policy still sees every step's
    feedback and time (the throughput policies' calibration learns the plain step from the plain arm)."""

    policy: object  # a LengthPolicy (length_policy.py)
    checks: DraftingChecks = field(default_factory=DraftingChecks)

    def __post_init__(self) -> None:
        self.step_tokens = 0  # committed by the step decided last
        self.check: DraftingCheck | None = None  # the check of the step decided last

    @property
    def name(self) -> str:
        return self.policy.name

    def __getattr__(self, attribute: str):  # the wrapped policy's own state (estimates, costs) reads through
        if attribute == "policy":
            raise AttributeError(attribute)
        return getattr(self.policy, attribute)

    def decide(self, requests, max_draft: int, hidden_of=None) -> list[int]:
        self.step_tokens = 0
        self.check = self.checks.of(len(requests))
        if not self.check.next_step_drafts():
            return [0] * len(requests)
        return self.policy.decide(requests, max_draft, hidden_of)

    def feedback(self, request, drafted: int, accepted: int) -> None:
        self.policy.feedback(request, drafted, accepted)
        self.step_tokens += accepted + 1

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        """Every step counts toward its arm, priced or not: a learned head's look at the blocks of requests it then
        keeps from drafting, or the drafter catching up on a backlog, is the drafting arm's cost."""
        self.policy.observe_step(lengths, seconds, priced)
        if self.check is not None:
            self.check.record(self.step_tokens, seconds)
