"""Draft sources: what proposes the tokens a step verifies, behind one narrow interface.

As transformers' candidate generators and vLLM's proposers: `propose` answers, per request, with its drafts this step
(token ids and the law they were drawn from) or None (not this source's: the next one in the chain asks);
`feedback` hears how the drafts it proposed fared; `observe_step` the wall time of a step whose every draft it
proposed. `Drafting` (drafting.py) chains the sources. Two of them:

- `PromptLookupSource`: n-gram matches in the request's own tokens (no model pass), sized by `LookupLength`.
- `DrafterSource`: the DFlash drafter with its length policy, its context cache and the target features waiting to
  be fed to it. All the drafter's work of a step (context feed, block pass, draft head) runs here.
- `DraftModelSource`: a smaller model of the same tokenizer drafting autoregressively with its length policy; its
  context is the request's committed tokens, which its proposer catches up on by itself.

The last two are the engine's `drafter`, one at a time: both keep a context per slot and run a length policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from adaflash.engine.request import Request
from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.speculative.length_policy import LengthPolicy, LookupLength
from adaflash.speculative.prompt_lookup import PromptLookup, point_mass
from adaflash.speculative.draft_model import DraftModelProposer
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """One request's drafts for one step."""

    tokens: tuple[int, ...] = ()
    # [len(tokens), V]: the law the drafts were drawn from, the q of rejection sampling; None for a greedy request.
    probs: torch.Tensor | None = None


NO_DRAFT = Draft()  # the request verifies only its own next token


class DraftSource(Protocol):
    name: str  # keys the source's drafting check

    def propose(self, requests: Sequence[Request]) -> list[Draft | None]:
        """Per request, its drafts this step (possibly none), or None to leave it to the next source."""

    def feedback(self, requests: Sequence[Request], drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """How the step went for the requests this source answered for (in the order it was asked)."""

    def observe_step(self, lengths: Sequence[int], seconds: float) -> None:
        """The step took `seconds`; this source answered for every request in it (`lengths`: their drafts)."""


class PromptLookupSource:
    """Prompt-lookup drafts: a request with a match verifies (a prefix of) it; one without is the next source's."""

    name = "lookup"

    def __init__(self, lookup: PromptLookup, length: LookupLength | None, vocab_size: int) -> None:
        """`length`: sizes each match (None: every match is verified whole)."""
        self.lookup, self.length, self.vocab_size = lookup, length, vocab_size

    def propose(self, requests: Sequence[Request]) -> list[Draft | None]:
        # Never past a request's budget: its last token is the target's own.
        proposals = [self.lookup.propose(r.prompt_ids + r.output_ids, r.remaining - 1) for r in requests]
        if self.length is not None and any(proposals):
            proposals = [p[:k] for p, k in zip(proposals, self.length.decide(requests, proposals))]
        # Lookup drafts are deterministic: a sampling request verifies them against a point mass.
        return [Draft(tuple(p), None if r.sampling.greedy else point_mass(p, self.vocab_size)) if p else None
                for r, p in zip(requests, proposals)]

    def feedback(self, requests: Sequence[Request], drafted: Sequence[int], accepted: Sequence[int]) -> None:
        if self.length is not None:
            for r, k, a in zip(requests, drafted, accepted):
                self.length.feedback(r, k, a)

    def observe_step(self, lengths: Sequence[int], seconds: float) -> None:
        pass  # lookups are sized by the verify profile alone (engine_factory.lookup_cost says why)


class DrafterSource:
    """The DFlash drafter: its length policy decides each request's drafts (zero included: the request is still this
    source's, and the policy hears how its step went), then one drafter pass drafts them.

    The drafter's context is fed lazily: the target features of committed positions wait, per slot, and are fed in one
    ragged pass just before the slot's next drafter pass, so a request the policy keeps from drafting costs no drafter
    work. `observer` (the engine's recorder) receives the block hidden states of the requests that drafted, with their
    outcomes; with one, drafts go through `draft_hidden` + `draft_tokens` so those states exist. An observer that
    `wants_blocks` (a verification trace) also gets each block's whole proposal before the policy's cut: the drafting
    requests draft the whole block and verify its first k (sampled drafts stay lossless: a prefix of drafts keeps its
    law, though the generator is drawn further), and a block the head read but did not draft from is drafted greedily
    for the trace alone.
    """

    name = "drafter"

    def __init__(self, proposer: DFlashProposer, policy: LengthPolicy, cache: KVCache, observer=None) -> None:
        self.proposer, self.policy, self.cache, self.observer = proposer, policy, cache, observer
        self.max_draft = proposer.block_size - 1
        # Per slot: (first position, [T, n*d] chunks) of target features not yet fed to the drafter.
        self._pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self._step: _DrafterStep | None = None  # the last `propose`'s work, read by its feedback
        self._held = _DrafterStep(self, ())  # a plain-arm step's: no drafter work (built once: a step's Python is dear)

    # ---- context ---------------------------------------------------------------------------------

    def adopt_prefix(self, slot: int, tokens: Sequence[int], limit: int) -> int:
        """The cached context blocks of the prompt's prefix (fed by an earlier request), up to `limit` positions: the
        target keeps no more than this, so the features of every later position reach the drafter."""
        return self.cache.adopt(slot, tokens, limit)

    def release(self, slot: int, committed: Sequence[int]) -> None:
        """Empty the slot, keeping the full blocks of its context for later prompts (`committed`: the tokens; none, no
        sharing): features still waiting are fed first (a request kept from drafting fed none, and its prompt is the
        likeliest prefix of the next: a drafter pass over them costs far less than the target's prefill it saves)."""
        if committed and slot in self._pending:
            self.feed_context([slot])
        self._pending.pop(slot, None)
        self.cache.release(slot, committed)

    def add_context(self, slot: int, start: int, features: torch.Tensor) -> None:
        """Target features of committed positions from `start` on (after any still pending for the slot)."""
        self._pending.setdefault(slot, (start, []))[1].append(features)

    def feed_context(self, slots: Sequence[int]) -> int:
        """One ragged drafter-context pass over the pending target features of these slots; returns the most
        positions one slot fed (a step's kept tokens, typically; a prompt or an idle stretch's backlog, more)."""
        todo = [s for s in slots if s in self._pending]
        if not todo:
            return 0
        starts = [self._pending[s][0] for s in todo]
        chunks = [torch.cat(self._pending.pop(s)[1]) for s in todo]
        batch = RaggedBatch.build(todo, starts, [len(c) for c in chunks])
        self.proposer.add_context(self.cache, torch.cat(chunks), batch)
        return max(len(c) for c in chunks)

    def take_over(self, proposer: DFlashProposer, cache: KVCache, policy: LengthPolicy | None = None) -> None:
        """A hot-swapped drafter with its context `cache`, already holding every committed position."""
        self.proposer, self.cache = proposer, cache
        self._pending.clear()
        if policy is not None:
            self.policy = policy

    # ---- a step ----------------------------------------------------------------------------------

    def propose(self, requests: Sequence[Request]) -> list[Draft | None]:
        step = self._step = _DrafterStep(self, requests)
        # Learned policies look at the drafter's blocks (of the requests they choose) before any LM head runs.
        wanted = self.policy.decide(requests, self.max_draft, step.hidden_of)
        capped = [max(0, min(k, self.max_draft, r.remaining - 1)) for r, k in zip(requests, wanted)]
        step.drafting = [i for i, k in enumerate(capped) if k > 0]
        drafts: list[Draft | None] = [NO_DRAFT] * len(requests)
        if not step.drafting:
            return drafts
        sub = [requests[i] for i in step.drafting]
        lengths = [capped[i] for i in step.drafting]
        rest = (lengths, [r.sampling for r in sub], [r.generator for r in sub])
        whole = self.observer is not None and self.observer.wants_blocks
        widths = [self.max_draft] * len(lengths) if whole else lengths  # a trace keeps the block before the cut
        if step.hidden or self.observer is not None:  # the block hidden states are wanted: draft from them
            drafted = self.proposer.draft_tokens(step.hidden_of(step.drafting), widths, *rest[1:],
                                                 anchors=[step.anchors[i] for i in step.drafting])
        else:
            slots, anchors = [step.slots[i] for i in step.drafting], [step.anchors[i] for i in step.drafting]
            step.fed = max(step.fed, self.feed_context(slots))
            drafted = self.proposer.propose(self.cache, slots, anchors, *rest)
        for i, k, chunk, probs in zip(step.drafting, lengths, drafted.tokens.split(widths), drafted.probs):
            if whole:
                step.blocks[i] = tuple(chunk.tolist())
                chunk, probs = chunk[:k], probs if probs is None else probs[:k]
            drafts[i] = Draft(tuple(chunk.tolist()), probs)
        return drafts

    def hold(self, requests: Sequence[Request]) -> "DrafterSource":
        """A step of the drafting check's plain arm: these requests are this source's, with no drafts, and neither the
        policy nor the drafter runs (the policy hears only the step's time)."""
        self._step = self._held
        return self

    def feedback(self, requests: Sequence[Request], drafted: Sequence[int], accepted: Sequence[int]) -> None:
        step = self._step
        if step is self._held:  # the policy decided nothing
            return
        if self.observer is not None and step.drafting:
            self.observer.on_step(step.hidden_of(step.drafting), [drafted[i] for i in step.drafting],
                                  [accepted[i] for i in step.drafting])
        if self.observer is not None and self.observer.wants_blocks and step.hidden:
            self.observer.on_blocks([(requests[i], block) for i, block in sorted(self._whole_blocks(step).items())])
        for r, k, a in zip(requests, drafted, accepted):
            self.policy.feedback(r, k, a)

    def _whole_blocks(self, step: "_DrafterStep") -> dict[int, tuple[int, ...]]:
        """Every block the drafter ran this step, whole: the drafted ones as proposed, the ones only a head read
        drafted greedily now (what a trace replays where another policy would have drafted there)."""
        looked = [i for i in step.hidden if i not in step.blocks]
        if looked:
            n = len(looked)
            tokens = self.proposer.draft_tokens(step.hidden_of(looked), [self.max_draft] * n, [SamplingParams()] * n,
                                                [None] * n, anchors=[step.anchors[i] for i in looked]).tokens
            step.blocks.update((i, tuple(chunk.tolist())) for i, chunk in zip(looked, tokens.split(self.max_draft)))
        return step.blocks

    def observe_step(self, lengths: Sequence[int], seconds: float) -> None:
        # The step's cost teaches a cost model only when its drafter work is what its lengths say: not when the drafter
        # also caught up on a backlog (a prompt, or a request drafting again after idle steps) or ran for a request
        # that then drafted nothing (a learned head's look). The policy still hears such a step, unpriced (the
        # drafting check counts every step toward its arm itself, drafting.py). Drafting asks only when no other
        # source's drafts widened the verify: on text that repeats itself the calibration learns from fewer steps.
        step = self._step
        priced = step.fed <= self.max_draft + 1 and (not step.hidden or step.hidden.keys() <= set(step.drafting))
        self.policy.observe_step(lengths, seconds, priced)


class DraftModelSource:
    """A draft model and its length policy: the policy decides each request's drafts (no block hidden states exist
    here, so the learned heads' policies do not apply), the proposer drafts them. Its cache holds committed tokens only,
    so a new request in a slot keeps what the target keeps of its prompt and the proposer feeds the rest."""

    name = "draft-model"

    def __init__(self, proposer: DraftModelProposer, policy: LengthPolicy, cache: KVCache) -> None:
        self.proposer, self.policy, self.cache = proposer, policy, cache
        self.max_draft = proposer.max_draft
        self._held = False  # the last step was the drafting check's plain arm: the policy decided nothing
        self._fed = 0  # the most committed tokens one request's cache caught up on in the last step

    def adopt_prefix(self, slot: int, tokens: Sequence[int], limit: int) -> int:
        """What its cache holds of the prompt's prefix; no limit on the target's: the proposer catches up from the
        tokens."""
        self.cache.adopt(slot, tokens, limit)
        return limit

    def release(self, slot: int, committed: Sequence[int]) -> None:
        self.cache.release(slot, committed)

    def add_context(self, slot: int, start: int, features: torch.Tensor | None) -> None:
        pass  # the committed tokens are the context: the request holds them

    def feed_context(self, slots: Sequence[int]) -> int:
        return 0

    def propose(self, requests: Sequence[Request]) -> list[Draft | None]:
        self._held, self._fed = False, 0
        wanted = self.policy.decide(requests, self.max_draft)
        capped = [max(0, min(k, self.max_draft, r.remaining - 1)) for r, k in zip(requests, wanted)]
        drafts: list[Draft | None] = [NO_DRAFT] * len(requests)
        drafting = [i for i, k in enumerate(capped) if k > 0]
        if drafting:
            sub = [requests[i] for i in drafting]
            lengths = [capped[i] for i in drafting]
            histories = [r.prompt_ids + r.output_ids for r in sub]
            self._fed = max(len(h) - self.cache.lengths[r.slot] for r, h in zip(sub, histories))
            drafted = self.proposer.propose(self.cache, [r.slot for r in sub], histories, lengths,
                                            [r.sampling for r in sub], [r.generator for r in sub])
            for i, chunk, probs in zip(drafting, drafted.tokens.split(lengths), drafted.probs):
                drafts[i] = Draft(tuple(chunk.tolist()), probs)
        return drafts

    def hold(self, requests: Sequence[Request]) -> "DraftModelSource":
        """A step of the drafting check's plain arm: no policy decision, no draft model pass."""
        self._held, self._fed = True, 0
        return self

    def feedback(self, requests: Sequence[Request], drafted: Sequence[int], accepted: Sequence[int]) -> None:
        if not self._held:
            for r, k, a in zip(requests, drafted, accepted):
                self.policy.feedback(r, k, a)

    def observe_step(self, lengths: Sequence[int], seconds: float) -> None:
        # Priced only when the catch-up was a step's kept tokens, not a prompt (as DrafterSource.observe_step).
        self.policy.observe_step(lengths, seconds, self._fed <= self.max_draft + 1)


class _DrafterStep:
    """One step's drafter work: the block hidden states computed so far (one drafter pass per request at most), and
    the most context positions one slot fed."""

    def __init__(self, source: DrafterSource, requests: Sequence[Request]) -> None:
        self.source = source
        self.slots, self.anchors = [r.slot for r in requests], [r.output_ids[-1] for r in requests]
        self.hidden: dict[int, torch.Tensor] = {}
        self.fed = 0
        self.drafting: list[int] = []  # the requests given drafts
        self.blocks: dict[int, tuple[int, ...]] = {}  # whole proposals, kept where the observer wants_blocks

    def hidden_of(self, indices: Sequence[int]) -> torch.Tensor:
        """The drafter's block hidden states [len(indices), B, d], one pass for those not yet drafted this step."""
        todo = [i for i in indices if i not in self.hidden]
        if todo:
            source = self.source
            slots, anchors = [self.slots[i] for i in todo], [self.anchors[i] for i in todo]
            self.fed = max(self.fed, source.feed_context(slots))
            self.hidden.update(zip(todo, source.proposer.draft_hidden(source.cache, slots, anchors)))
        return torch.stack([self.hidden[i] for i in indices])
