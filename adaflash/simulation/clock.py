"""Virtual time: a clock the engine reads (`Engine(clock=...)`), advanced by a step-cost model as passes run.

`CostedTarget` and `CostedProposer` wrap the models the engine drives - real ones (live acceptance, this machine's
compute, a GPU's time) or synthetic ones - and charge each pass to the clock before running it: the target's over its
ragged new tokens and the contexts they attend to, the drafter's over its block width and its requests' contexts, and
the drafter's context feeds (which only a measured fit prices). Everything else is the engine's own code: the
scheduler, the policies, the drafting checks read this clock for what a step cost. What is not charged, unless the
cost model's measured fit says what the engine's own time is (`TableCost`'s `engine_fit`, charged with the target's
pass): the engine's Python between passes, the length head's arithmetic, prompt lookup's search.
"""

from __future__ import annotations

from typing import Sequence

from adaflash.simulation.step_cost import StepCost


class VirtualClock:
    """Seconds that pass only when a pass is charged."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"time runs forward: {seconds} s")
        self.now += seconds


class CostedTarget:
    """The engine's target, each pass charged to `clock` (the wrapped target's attributes show through)."""

    def __init__(self, target, cost: StepCost, clock: VirtualClock) -> None:
        self._target, self._cost, self._clock = target, cost, clock
        self.passes = 0

    def __getattr__(self, name):
        return getattr(self._target, name)

    def __call__(self, token_ids, batch, cache, capture_layers=(), logit_indices=None):
        logits = len(token_ids) if logit_indices is None else len(logit_indices)
        self._clock.advance(self._cost.target_s(batch.query_lens, batch.starts, logits))
        self.passes += 1
        return self._target(token_ids, batch, cache, capture_layers, logit_indices)


class CostedProposer:
    """The engine's proposer, each drafter pass charged to `clock`: a `propose` (a block as wide as the longest draft,
    the LM head on the drafted rows), a learned head's look (`draft_hidden`: the whole block, no LM head), the drafts
    taken from a look (`draft_tokens`: the LM head's rows only, not charged) and a context feed (`add_context`, as the
    cost model prices it)."""

    def __init__(self, proposer, cost: StepCost, clock: VirtualClock) -> None:
        self._proposer, self._cost, self._clock = proposer, cost, clock
        self.passes = 0

    def __getattr__(self, name):
        return getattr(self._proposer, name)

    def _charge(self, width: int, contexts: Sequence[int], logits: int) -> None:
        self._clock.advance(self._cost.drafter_s(width, contexts, logits))
        self.passes += 1

    def propose(self, cache, slots, anchors, num_draft, sampling, generators):
        self._charge(max(2, max(num_draft) + 1), [cache.lengths[s] for s in slots], sum(num_draft))
        return self._proposer.propose(cache, slots, anchors, num_draft, sampling, generators)

    def draft_hidden(self, cache, slots, anchors, width=None):
        self._charge(width or self._proposer.block_size, [cache.lengths[s] for s in slots], 0)
        return self._proposer.draft_hidden(cache, slots, anchors, width)

    def add_context(self, cache, features, batch):
        self._clock.advance(self._cost.feed_s(sum(batch.query_lens)))
        return self._proposer.add_context(cache, features, batch)
