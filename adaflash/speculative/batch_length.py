"""Batch-level draft-length policies as other engines ship them, beside ours (length_policy.py), so the simulator
(adaflash/simulation) and `serve` can run them on the same engine:

- `EmaBudgetLength` (`--length-policy ema-budget`): SGLang's adaptive speculative length - one draft length for every
  request of a step, moved along a short list of candidates by an exponential moving average of recent acceptance.
- `GatedLength` (`--length-policy adaflash-gated`): the AdaFlash release's switch - its learned head decides only where
  the server runs more than 48 requests at most; otherwise every request drafts the whole block.

Both take the `LengthPolicy` protocol's hooks (`decide`, `feedback`, `observe_step`); neither changes what is
verified, only how many drafts are sent, so outputs stay the target's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from adaflash.speculative.length_policy import HiddenOf, LengthPolicy, PolicyRequest

# The AdaFlash release (sgl-project/sglang PR 34171, unmerged; its scripts/serve/serve_thresh_head.sh) runs the length
# head only when the server's max running requests exceed 48 and otherwise verifies the fixed block (ZinYY/AdaFlash
# issue 2: "Adaptive length head silently disabled when concurrency < 48").
RELEASE_GATE = 48


@dataclass
class EmaBudgetLength:
    """SGLang's EMA-adapted speculative length, as its DFlash port applies it: one length for the whole batch.

    What SGLang does (read, not copied): `AdaptiveSpeculativeParams` / `AdaptiveStepSlot` in
    python/sglang/srt/speculative/adaptive_spec_params.py (sgl-project/sglang PR 21599, "adaptive
    speculative_num_steps for EAGLE topk=1") keeps `ema_accept_len`, the EMA (weight `ema_alpha` 0.2) of each verify
    batch's mean accepted drafts per request; after `warmup_batches` (10) batches and then every `update_interval` (5)
    it steps `speculative_num_steps` down its sorted `candidate_steps` while the EMA is at most the lower candidate
    - 0.5 + `down_hysteresis` (-0.25), else up while the EMA exceeds the current one - 0.5 + `up_hysteresis` (0):
    it probes about one draft past what is accepted. The EMA starts at the starting length - 1. PR 24596 (closed,
    unmerged: "adaptive spec support for DFlash") drives DFlash's verify length with that controller over the
    candidates 4 / 8 / 12 / 16 tokens (drafts 3 / 7 / 11 / 15 of a 16 block), the drafter still drafting its whole
    block, starting from the whole block. Later SGLang keys a candidate list by batch size (PR 24055); this is the
    single-list form PR 24596 used, so the length does not see the load, only acceptance.

    Here a step's drafts are the first `length` of the block (the same verify; the drafter pass, at a block's width
    on a GPU, is priced by its width in the simulator). The EMA hears the requests that drafted in the last step
    (`feedback`), folded in at the next `decide`; a step of the drafting check's plain arm hears nothing.
    """

    verify_lengths: tuple[int, ...] = (4, 8, 12, 16)  # tokens a request verifies: its drafts + its own next token
    ema_alpha: float = 0.2
    warmup: int = 10  # batches heard before the first move
    interval: int = 5  # then a move is considered every this many batches
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    name: str = "ema-budget"
    length: int | None = field(default=None, init=False)  # drafts every request gets; None: no step decided yet
    ema: float = field(default=0.0, init=False)  # EMA of accepted drafts per request a step
    batches: int = field(default=0, init=False)  # steps heard
    _heard: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.verify_lengths or min(self.verify_lengths) < 1:
            raise ValueError(f"verify lengths must be >= 1 tokens, got {self.verify_lengths}")
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")

    def candidates(self, max_draft: int) -> list[int]:
        """Draft lengths it moves between: each verify length less the request's own token, within the block."""
        return sorted({min(v - 1, max_draft) for v in self.verify_lengths})

    def decide(self, requests: Sequence[PolicyRequest], max_draft: int,
               hidden_of: HiddenOf | None = None) -> list[int]:
        candidates = self.candidates(max_draft)
        if self.length is None:  # as the DFlash worker starts: the whole block
            self.length = candidates[-1]
            self.ema = float(self.length - 1)
        self._hear(candidates)
        return [min(self.length, max_draft)] * len(requests)

    def _hear(self, candidates: list[int]) -> None:
        if not self._heard:
            return
        batch_mean = sum(self._heard) / len(self._heard)
        self._heard.clear()
        self.ema = (1.0 - self.ema_alpha) * self.ema + self.ema_alpha * batch_mean
        self.batches += 1
        if self.batches > self.warmup and (self.batches - self.warmup) % self.interval == 0:
            self.length = self._moved(candidates)

    def _moved(self, candidates: list[int]) -> int:
        """The candidate the EMA points to from the current one: down while it sits below the next lower candidate
        (less the hysteresis), else up while it exceeds the current one."""
        lower = [k for k in candidates if k < self.length]
        i = len(lower)  # the current length's place (a length past a changed cap sits at the end)
        moved = i
        while moved > 0 and self.ema <= candidates[moved - 1] - 0.5 + self.down_hysteresis:
            moved -= 1
        if moved == i:
            moved = min(i, len(candidates) - 1)
            while moved < len(candidates) - 1 and self.ema > candidates[moved] - 0.5 + self.up_hysteresis:
                moved += 1
        return candidates[moved]

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        if drafted > 0:
            self._heard.append(accepted)

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        pass


@dataclass
class GatedLength:
    """A policy that decides only above `gate` running requests; at or below it every request drafts the whole block
    (`max_draft`), as the AdaFlash release verifies the fixed block there. `adaflash-gated` is the `adaflash` policy
    behind the release's gate of 48.

    The release gates on its server's final `max_running_requests` (its serve_thresh_head.sh: "only used ... when the
    final SGLang max_running_requests is > 48"), a setting its benchmark sets from the concurrency: one switch for the
    server's life, whatever the load of the moment. `max_running` is that setting here (the engine's `max_batch`,
    `--max-batch`: `build_engine` passes it); a policy built without it counts the requests the drafter answers for in
    each step instead. The gated policy hears every outcome and step time either way, so its estimates stay current."""

    policy: LengthPolicy
    gate: int = RELEASE_GATE
    max_running: int | None = None
    name: str = "adaflash-gated"

    def __post_init__(self) -> None:
        if self.gate < 0:
            raise ValueError(f"gate must be >= 0 running requests, got {self.gate}")

    @property
    def step_cost(self):
        return self.policy.step_cost

    def decide(self, requests: Sequence[PolicyRequest], max_draft: int,
               hidden_of: HiddenOf | None = None) -> list[int]:
        running = len(requests) if self.max_running is None else self.max_running
        if running > self.gate:
            return self.policy.decide(requests, max_draft, hidden_of)
        return [max_draft] * len(requests)

    def feedback(self, request: PolicyRequest, drafted: int, accepted: int) -> None:
        self.policy.feedback(request, drafted, accepted)

    def observe_step(self, lengths: Sequence[int], seconds: float, priced: bool = True) -> None:
        self.policy.observe_step(lengths, seconds, priced)
