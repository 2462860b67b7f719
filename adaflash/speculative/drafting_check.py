"""Whether speculating at all beats plain decoding on this machine, judged by what each really commits a second.

The length policies price drafts step by step (`cost_model.py`), or not at all (`heuristic`, `block-head`), but
drafting also slows the steps around it (most likely the drafter's passes push the target's weights out of the caches):
on an AMX Xeon a 3-token verify took 5.1 ms while every step drafted and 4.5 ms while every fourth did, and a decode
step 3.4 ms in an engine that never drafted against 3.7-3.8 between drafting steps
(docs/results/adaflash/drafting_rhythm.txt). Priced step by step drafting looked worth it; as a regime it ran
0.85-0.92x plain decoding. So each draft source runs in two arms, drafting (as its policy decides) and plain (it runs
nothing), and each arm is judged by the committed tokens a second of its stretches.

Each source has its own check: prompt lookup's is asked first, the drafter's for the requests left, and a step's
tokens and time go to every check that decided in it (measured only where no other source was on trial; one source's
trial waits for another's to end). One check over both let lookup's gain on text that repeats itself (the demo's
multilingual prompt) carry the drafter's drafting onto prompts where that lost (its chat, code and math).

Stretches alternate: the chosen arm, then the other for as long as `explore` steps of the chosen one take (at most
`explore` steps, at least `settle` + 4: under load a drafting step can cost several plain ones, so the other arm's trial
is bounded in time, not in steps), after which the choice is made again. Drafting is chosen only where it commits more
than plain by `margin`, and kept while it commits at least as much: a tie goes to plain decoding unless drafting has won
before and still loses nothing, and is re-checked after `first` steps (which arm pays may change with the requests
running: text that repeats itself comes and goes). The chosen arm's stretch doubles each time a won choice stands (grows
4x where the other arm lost by more than `decisive`), up to `longest`, so a losing arm is found within the first ~30
steps and later costs at most about explore / longest of the time; a flip starts the growth over from `first`. The first
`settle` steps after a switch are left out while the caches refill.

Rates are kept per source and batch size (powers of two): tokens a second are comparable only at one batch size, and a
batch may draft where one request does not. A batch size opens with a short plain stretch (`settle` + 4 steps: the
yardstick its first drafting trial is timed against; a template given a first stretch and arm opens with those, as a
benchmark holding one arm does); where the largest smaller batch size that has judged both arms chose plain, it starts
from that choice and that confidence instead (verifying drafts only costs more as the batch grows).

In the drafting arm each request is judged too (`RequestRecord`): its drafting steps' committed tokens a step against
the check's hurdle (the drafting arm's seconds a step over the plain arm's); a request below it is closed to the source
for a while and not asked, so a batch size's choice of drafting does not carry onto the prompts where drafting loses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


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
    drafting_chosen: bool = False
    stretch: int = 0  # the chosen arm's next stretch (0: the opening, settle + 4 steps)
    rates: dict[bool, float] = field(default_factory=dict)  # arm (drafting?) -> committed tokens a second
    step_s: dict[bool, float] = field(default_factory=dict)  # arm -> seconds a step

    def __post_init__(self) -> None:
        if not 0 < self.settle < min(self.explore, self.first) or self.longest < self.first:
            raise ValueError(f"need 0 < settle < explore, first <= longest; got settle {self.settle}, explore "
                             f"{self.explore}, first {self.first}, longest {self.longest}")
        self.stretch = self.stretch or self.settle + 4
        self.arm: bool | None = None  # the current stretch's arm
        self.left = 0  # its steps still to run
        self.since_switch = -1  # the current step's index in its stretch
        self.elapsed = 0.0  # seconds of the current stretch, every step
        self.tokens = self.seconds = 0.0  # of the current stretch, past its settling steps
        self.steps = 0

    @property
    def judged(self) -> bool:
        """Both arms have a measured rate."""
        return len(self.rates) == 2

    @property
    def hurdle(self) -> float | None:
        """The tokens a request must commit a step of the drafting arm for drafting to pay: that arm's seconds a step
        over the plain arm's, in which every request commits one (None until both arms are measured). Exact at batch 1;
        in a batch, drafting pays where its requests clear it on average."""
        if len(self.step_s) < 2:
            return None
        return self.step_s[True] / self.step_s[False]

    def next_step_drafts(self, may_try: bool = True) -> bool:
        """Advance one step; whether it belongs to the drafting arm (else it must draft nothing). `may_try`: the other
        arm's trial may start now (else the chosen stretch runs on a step: another source is on trial)."""
        if self.arm is None:
            self.arm, self.left = self.drafting_chosen, self.stretch
        elif self.arm == self.drafting_chosen and self.left == 0 and not may_try:
            self.left = 1
        elif self.left == 0 or self._explored_enough():
            self._close(self.arm)
            if self.arm == self.drafting_chosen:  # the chosen arm ran its stretch: try the other
                self.arm, self.left = not self.drafting_chosen, self.explore
            else:  # the other arm was tried: choose, and run the choice for a stretch
                self._choose()
                self.arm, self.left = self.drafting_chosen, self.stretch
            self.since_switch = -1
        self.left -= 1
        self.since_switch += 1
        return self.arm

    @property
    def on_trial(self) -> bool:
        """The current stretch is the other arm's trial (not the chosen arm's)."""
        return self.arm is not None and self.arm != self.drafting_chosen

    def plain_steps_ahead(self) -> tuple[int, int, float]:
        """After a step of the plain arm is recorded, how long the plain arm certainly lasts: at most `most` more steps,
        and, in a plain trial, until `fewest` more have run and taken `seconds` (the trial's time, `_explored_enough`);
        (0, 0, 0.0) in the drafting arm. As (most, fewest, seconds)."""
        if self.arm is not False:
            return 0, 0, 0.0
        if self.on_trial and self.drafting_chosen in self.step_s:
            return (self.left, self.settle + 3 - self.since_switch,
                    self.explore * self.step_s[self.drafting_chosen] - self.elapsed)
        return self.left, 0, math.inf

    def record(self, tokens: int, seconds: float, measured: bool = True) -> None:
        """The step just decided committed `tokens` in `seconds`; `measured`: count it toward its arm's rate (else
        only toward the stretch's time)."""
        self.elapsed += seconds
        if measured and self.since_switch >= self.settle and seconds > 0:
            self.tokens += tokens
            self.seconds += seconds
            self.steps += 1

    def _explored_enough(self) -> bool:
        """The other arm's trial has taken as long as `explore` of the chosen arm's steps (and run settle + 4 steps)."""
        chosen = self.drafting_chosen
        return (self.arm != chosen and chosen in self.step_s and self.since_switch + 1 >= self.settle + 4
                and self.elapsed >= self.explore * self.step_s[chosen])

    def _close(self, arm: bool) -> None:
        if self.seconds > 0:
            for measured, value in ((self.rates, self.tokens / self.seconds), (self.step_s, self.seconds / self.steps)):
                measured[arm] = (1 - self.follow) * measured.get(arm, value) + self.follow * value
        self.elapsed = self.tokens = self.seconds = 0.0
        self.steps = 0

    def _choose(self) -> None:
        if not self.judged:
            return
        drafting, plain = self.rates[True], self.rates[False]
        # Drafting is chosen where it beats plain by the margin, and kept while it loses nothing: a gap within the
        # margin is no evidence that an arm which won now loses, and dropping it there gives up a gain until its next
        # trial (text that repeats itself, where lookups pay, is often short).
        chosen = drafting >= plain if self.drafting_chosen else drafting > plain * (1 + self.margin)
        winner, loser = self.rates[chosen], self.rates[not chosen]
        if winner <= loser * (1 + self.margin):  # a tie is no verdict: re-checked as often as at the start
            self.stretch = self.first
        else:
            growth = 4 if winner > loser * (1 + self.decisive) else 2
            stands = chosen == self.drafting_chosen
            self.stretch = min(growth * (max(self.stretch, self.first // 2) if stands else self.first // 2),
                               self.longest)
        self.drafting_chosen = chosen


@dataclass
class RequestRecord:
    """How one source's drafting has fared for one request: a check judges the mix of requests at a batch size, but on
    this machine the drafter pays on some prompts (arithmetic, 1.2x plain decoding at batch 1) and loses on others
    (chat, 0.92x), and a check that chose drafting on the first kind kept drafting into the second. So each request's
    drafting steps are judged on their own: every `window` of them, the committed tokens a step since the source was
    last opened to the request are set against the check's hurdle, and a request below it is closed to the source for
    `wait` of its steps (4x longer each time it is closed again, up to `longest`), then tried again. One that has not
    come halfway to the hurdle after half a window (every draft missed, say, or its policy drafted none, a step that
    still cost the policy's work) is closed then already: a short request pays for every drafting step that loses.
    The steps add up over batch sizes, each judgement against the hurdle of the batch size it falls in."""

    window: int = 8
    wait: int = 16
    longest: int = 256
    steps: int = 0  # drafting steps since the source was (re)opened to the request
    tokens: int = 0  # the tokens they committed
    closed_until: int = 0  # the request's step count from which the source may draft for it again

    def __post_init__(self) -> None:
        if not (0 < self.window and 0 < self.wait <= self.longest):
            raise ValueError(f"need 0 < window, 0 < wait <= longest; got window {self.window}, wait {self.wait}, "
                             f"longest {self.longest}")

    def record(self, steps_run: int, tokens: int, hurdle: float | None) -> None:
        """A drafting step of the source committed `tokens` for the request (now `steps_run` steps in)."""
        self.steps += 1
        self.tokens += tokens
        if hurdle is None:
            return
        # (a hurdle at or below 1: drafting costs nothing over a plain step, so nothing is lost by trying on; halfway
        # to it, (1 + hurdle) / 2, is then at or below the one token every step commits)
        if (self.steps % self.window == 0 and self.tokens < hurdle * self.steps
                or self.steps == self.window // 2 and self.tokens < self.steps * (1 + hurdle) / 2):
            self.closed_until = steps_run + self.wait
            self.wait = min(4 * self.wait, self.longest)
            self.steps = self.tokens = 0


@dataclass
class DraftingChecks:
    """A `DraftingCheck` per draft source and batch size (rounded up to a power of two), made on first use from
    `template`'s settings; `decide` before a source is asked (whether it may draft this step), `record` after the step,
    as the engine's drafting does. A step's tokens and time go to every check that decided in it. Each request's
    record per source (`RequestRecord`, from `request_template`): `closed_for` before the source is asked for it,
    `record_request` after a step in which the source drafted for it."""

    template: DraftingCheck = field(default_factory=DraftingCheck)
    by_size: dict[tuple[str, int], DraftingCheck] = field(default_factory=dict)
    request_template: RequestRecord = field(default_factory=RequestRecord)  # each request's record per source

    def __post_init__(self) -> None:
        self.deciding: list[DraftingCheck] = []  # the checks that decided in the step under way
        self.current: DraftingCheck | None = None  # the check that decided last
        self.steps = 0  # steps recorded
        self.decided_at: dict[tuple[str, int], int] = {}  # (source, size) -> the step its check last decided in

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, batch - 1).bit_length()

    def of(self, batch: int, source: str = "drafter") -> DraftingCheck:
        key = (source, self.bucket(batch))
        if key not in self.by_size:  # the template's settings, its own rates and step times
            self.by_size[key] = replace(self.template, rates={}, step_s={}, **self._start(*key))
        return self.by_size[key]

    def decide(self, batch: int, source: str = "drafter") -> bool:
        """Whether `source` may draft in this step of `batch` decoding requests (its check's drafting arm). One source
        is on trial at a time: trials run together would be measured by neither."""
        self.current = self.of(batch, source)
        self.deciding.append(self.current)
        size = self.bucket(batch)
        self.decided_at[(source, size)] = self.steps
        # A trial waits for another only while that one runs: a source closed to every request decides nothing, and
        # its check, left mid-trial, must not hold the other source's trials back for as long as the closure lasts.
        others_on_trial = any(check.on_trial and self.decided_at.get((src, s), -2) >= self.steps - 1
                              for (src, s), check in self.by_size.items() if s == size and src != source)
        return self.current.next_step_drafts(may_try=not others_on_trial)

    def record(self, tokens: int, seconds: float) -> None:
        """The step just run committed `tokens` in `seconds`: to the arm of every check that decided in it, measured
        where no other source was on trial (a drafter trial's slow steps must not count against lookups, nor the
        reverse)."""
        deciding, self.deciding = self.deciding, []
        self.steps += 1
        for check in deciding:
            check.record(tokens, seconds, measured=not any(o.on_trial for o in deciding if o is not check))

    @staticmethod
    def closed_for(records: dict[str, RequestRecord], steps_run: int, source: str) -> int:
        """The steps `source` stays closed to a request (0: it may draft for it now; `records`: the request's, per
        source; `steps_run`: the steps it has run)."""
        record = records.get(source)
        return 0 if record is None else max(0, record.closed_until - steps_run)

    def record_request(self, records: dict[str, RequestRecord], steps_run: int, source: str, batch: int,
                       tokens: int) -> None:
        """A step of `batch` requests in which `source` drafted for this one (its drafting arm) committed `tokens` for
        it: judged against the source's check at that batch size."""
        record = records.get(source)
        if record is None:
            record = records[source] = replace(self.request_template)
        record.record(steps_run, tokens, self.of(batch, source).hurdle)

    def _start(self, source: str, size: int) -> dict:
        """A new batch size starts plain, with the confidence of the same source's largest smaller size that has judged
        both arms, where that one chose plain: verifying drafts only costs more as the batch grows, and under load a
        drafting trial can take as long as several rounds of plain steps."""
        judged = [s for (src, s), check in self.by_size.items() if src == source and s < size and check.judged]
        smaller = self.by_size[(source, max(judged))] if judged else None
        if smaller is not None and not smaller.drafting_chosen:
            return dict(drafting_chosen=False, stretch=smaller.stretch)
        return dict(drafting_chosen=self.template.drafting_chosen, stretch=self.template.stretch)
