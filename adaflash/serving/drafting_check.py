"""Whether drafting at all beats plain decoding on this machine, judged by what each really commits a second.

The throughput policies price every draft at the margin (`cost_model.py`), but drafting also slows the steps around it
(most likely the drafter's passes push the target's weights out of the caches). On session 20's Xeon a 3-token verify
took 5.1 ms while every step drafted and 4.5 ms while every fourth did, and a decode step 3.4 ms in an engine that
never drafted against 3.7-3.8 between drafting steps (docs/results/adaflash/drafting_rhythm.txt). Priced step by
step, drafting looked worth it; as a regime it ran 0.85-0.92x plain decoding. So the steps run in two arms, drafting
as the policy decides and plain: out of every `period` steps the last `explore` go to the arm not chosen, the others
to the chosen one. Each arm's committed tokens a second are measured over its stretches (the first `settle` steps
after a switch left out while the caches refill), and plain is chosen where it beats drafting by `margin`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftingCheck:
    """The two arms' schedule and measured rates; `next_step_drafts` before each step, `record` after it."""

    period: int = 256
    explore: int = 32
    settle: int = 8
    margin: float = 0.03
    follow: float = 0.5  # weight of a new stretch in its arm's rate
    drafting_chosen: bool = True
    rates: dict[bool, float] = field(default_factory=dict)  # arm (drafting?) -> committed tokens a second

    def __post_init__(self) -> None:
        if not 0 < self.settle < self.explore < self.period:
            raise ValueError(f"need 0 < settle < explore < period, got {self.settle}, {self.explore}, {self.period}")
        self.step = -1  # within the period
        self.tokens = self.seconds = 0.0  # of the current stretch, past its settling steps
        self.since_switch = 0

    def _arm(self, step: int) -> bool:
        """Whether `step` of the period runs the drafting arm: the chosen arm, then `explore` steps of the other."""
        return self.drafting_chosen != (step >= self.period - self.explore)

    def next_step_drafts(self) -> bool:
        """Advance one step; whether it belongs to the drafting arm (else it must draft nothing)."""
        previous = self._arm(self.step) if self.step >= 0 else None
        self.step = (self.step + 1) % self.period
        if previous is not None and self.step in (0, self.period - self.explore):  # a stretch ends
            self._close(previous)
            if self.step == 0:  # the choice changes only between periods
                self._choose()
        arm = self._arm(self.step)
        self.since_switch = 0 if arm != previous else self.since_switch + 1
        return arm

    def record(self, tokens: int, seconds: float) -> None:
        """The step just decided committed `tokens` in `seconds` (an engine step the policy observes)."""
        if self.since_switch >= self.settle and seconds > 0:
            self.tokens += tokens
            self.seconds += seconds

    def _close(self, arm: bool) -> None:
        if self.seconds > 0:
            rate = self.tokens / self.seconds
            old = self.rates.get(arm, rate)
            self.rates[arm] = (1 - self.follow) * old + self.follow * rate
        self.tokens = self.seconds = 0.0

    def _choose(self) -> None:
        if True in self.rates and False in self.rates:
            self.drafting_chosen = not self.rates[False] > self.rates[True] * (1 + self.margin)
