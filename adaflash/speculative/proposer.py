"""The DFlash proposer: turns drafter hidden states into draft tokens for a ragged batch of requests.

Narrow interface (as transformers' candidate generator and vLLM's proposers): `add_context` feeds back
the target features of committed positions, `propose` drafts `num_draft[r]` tokens after each anchor. It
is `draft_hidden` (one drafter pass) then `draft_tokens` (LM head on the verified positions only), split
so a length head can read the block between the two. A drafter with a trimmed draft vocabulary projects onto
its K rows of the target's LM head only, and its tokens map back to target ids; verification never changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from adaflash.models.drafters.dflash2 import selector_law
from adaflash.models.drafters.draft_vocab import DraftHead
from adaflash.models.drafters.dflash import DFlashDrafter
from adaflash.models.kernels.selection import FastLinear, KernelChoice, fast_linears_available, packable
from adaflash.models.kv_cache.cache import DEFAULT_BLOCK_SIZE, KVCache, drafter_pool
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.kernels.stock import linear
from adaflash.models.layers import argmax_rows
from adaflash.models.targets.model import TargetModel
from adaflash.speculative.sampling import SamplingParams, logits_to_probs, sample_tokens


@dataclass(frozen=True)
class Drafts:
    tokens: torch.Tensor  # [sum(num_draft)] int64, request-major
    probs: tuple[torch.Tensor | None, ...]  # per request: [num_draft, V] processed distribution; None if greedy
    num_draft: tuple[int, ...]


class DFlashProposer:
    """`whole_block`: every draft pass runs the whole block, as the DFlash reference does, instead of the anchor and
    as many positions as the longest draft asked for (the default: cheaper at nearly the same acceptance)."""

    def __init__(self, drafter: DFlashDrafter, target: TargetModel, whole_block: bool = False) -> None:
        drafter.config.check_compatible(target.config)
        self.whole_block = whole_block
        drafter = drafter.to(target.device)  # the drafter reads the target's features, embeddings and LM head
        drafter.use_fast_linears(target.int8_activations)
        self.drafter = drafter
        self.target = target
        # The target's LM head, or its rows of the draft vocabulary (sliced once, contiguous).
        self.head = DraftHead(target.lm_head, drafter.draft_vocab)
        # The head is the largest matmul of a draft step: the packed kernel where it measured faster here (the
        # target's own packed LM head when the drafter drafts over the full vocabulary).
        w = self.head.weight
        if drafter.draft_vocab is None:
            self._head_linear = target.fast_lm_head
        else:
            blocks = target.lm_head_blocks.rows(self.head.ids) if target.lm_head_blocks is not None else None
            # An int8 target's head rows run int8 too (a draft's numerics never touch what verification keeps); an
            # untied int8 head is only blocks (its weight on the meta device): their kernel is the only way to run it.
            from_blocks = w.is_meta and blocks is not None and target.int8_activations
            self._head_linear = (FastLinear(w, None, KernelChoice(target.int8_activations), blocks)
                                 if (fast_linears_available(w) or from_blocks) and packable(w) else None)
        if w.is_meta and self._head_linear is None:
            raise ValueError("the target's LM head is not in memory (an int8 target keeps only its blocks) and no "
                             "kernel runs those rows here: load the target with --dtype fp32")

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.drafter.config.target_layer_ids

    @property
    def cost_key(self) -> str:
        """What tells this drafter's cost profile from another's (speculative/cost_model.py): the draft vocabulary too,
        since trimming it exists to make drafting cheaper."""
        d = self.drafter.config
        return f"-L{d.num_layers}-B{d.block_size}-V{d.draft_vocab_size or 'full'}"

    def new_cache(self, num_slots: int, max_len: int, pool_tokens: int | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> KVCache:
        """`pool_tokens`: the target's pool beside it (KVCache), grown by what this drafter writes ahead."""
        return self.drafter.new_cache(num_slots, max_len + self.block_size, block_size=block_size,
                                     pool_tokens=drafter_pool(pool_tokens, num_slots, self.block_size, block_size))

    def step_probe(self, context: int) -> Callable[[int], None]:
        """What one drafting request costs the drafter in a step, by width (anchor + drafts): feeding the features of
        the last step's kept positions (two, typically: at batch 1 the feed is a third of the drafter's time), then a
        block of anchor + drafts, whose cost grows with the draft length (the cost model's profile times it)."""
        cache = self.new_cache(1, context + self.block_size)
        hidden = torch.zeros(context, len(self.capture_layers) * self.target.config.hidden_size, dtype=self.target.dtype)
        self.add_context(cache, hidden, RaggedBatch.build([0], [0], [context]))
        fed, anchor = RaggedBatch.build([0], [context], [2]), 100 % self.target.config.vocab_size

        def step(width: int) -> None:
            self.add_context(cache, hidden[:2], fed)
            self.propose(cache, [0], [anchor], [width - 1], [SamplingParams()], [None])
            cache.rollback(0, context)

        return step

    def add_context(self, cache: KVCache, features: torch.Tensor, batch: RaggedBatch) -> None:
        self.drafter.extend_context(cache, features, batch)

    def _check_lengths(self, num_draft: Sequence[int]) -> None:
        if any(not 0 <= k < self.block_size for k in num_draft):
            raise ValueError(f"draft lengths must be in [0, {self.block_size - 1}], got {list(num_draft)}")

    @torch.inference_mode()
    def draft_hidden(self, cache: KVCache, slots: Sequence[int], anchors: Sequence[int],
                     width: int | None = None) -> torch.Tensor:
        """The drafter's one pass over [anchor, MASK...] after each slot's context: hidden states [n, width, d].

        `width` (default: the whole block) = anchor + the positions wanted. A learned length head judges the whole
        block before any vocabulary projection runs; `propose` knows its draft lengths and runs a block only as
        wide as the longest (measured on eval prompts: accept lengths -0.03..+0.02 from the whole block's, for a
        drafter pass of 2.3 instead of 6.1 ms at two positions - docs/results/runtime/draft_width.md)."""
        block_ids = self._block_ids(anchors, width)
        return self.drafter.draft_hidden(cache, self.target.embed(block_ids), slots)

    def _block_ids(self, anchors: Sequence[int], width: int | None) -> torch.Tensor:
        b, mask = width or self.block_size, self.drafter.config.mask_token_id
        if not 2 <= b <= self.block_size:
            raise ValueError(f"a draft block is 2..{self.block_size} positions wide, got {b}")
        return torch.tensor([[anchor] + [mask] * (b - 1) for anchor in anchors], device=self.target.device)

    @torch.inference_mode()
    def draft_tokens(
        self,
        hidden: torch.Tensor,
        num_draft: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        anchors: Sequence[int] | None = None,
    ) -> Drafts:
        """Draft tokens from block hidden states [n, B, d]: the LM head runs only on the positions verified.
        `anchors` (the blocks' first tokens): a DFlash 2 drafter's selector starts its path there."""
        self._check_lengths(num_draft)
        rows = [hidden[r, 1 : 1 + k] for r, k in enumerate(num_draft)]
        x = (rows[0] if len(rows) == 1 else torch.cat(rows)).to(self.target.dtype)
        logits = (self._head_linear(x) if self._head_linear is not None else linear(x, self.head.weight)).float()
        logits = self.drafter.finish_logits(logits)
        if self.drafter.candidate_selector is not None:
            if anchors is None:
                raise ValueError("a DFlash 2 drafter's selector needs each block's anchor token")
            return self._selected(x, logits, num_draft, anchors, sampling, generators)
        return self._drafts_from_logits(logits, num_draft, sampling, generators)

    def _selected(self, hidden: torch.Tensor, logits: torch.Tensor, num_draft: Sequence[int], anchors: Sequence[int],
                  sampling: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> Drafts:
        """DFlash 2: each request's drafts along its selector path; sampling, the selector's q over its candidates
        (at the request's temperature) is the draft law verification sees (models/drafters/dflash2.py)."""
        selector, vocab = self.drafter.candidate_selector, self.target.config.vocab_size
        tokens, probs, offset = [], [], 0
        for k, anchor, params, gen in zip(num_draft, anchors, sampling, generators):
            rows = slice(offset, offset + k)
            offset += k
            if k == 0:
                tokens.append(torch.zeros(0, dtype=torch.long, device=logits.device))
                probs.append(None if params.greedy else logits.new_zeros(0, vocab))
                continue
            candidates, first, after = selector.scores(hidden[rows], logits[rows], int(anchor), self.head.ids)
            if params.greedy:
                picks, q = selector.greedy_path(first, after), None
            else:
                picks, q = _sampled_path(first, after, params.temperature, gen)
            index = torch.tensor(picks, device=candidates.device)
            tokens.append(candidates.gather(1, index[:, None])[:, 0])
            probs.append(None if q is None else selector_law(q, candidates, vocab))
        return Drafts(tokens=torch.cat(tokens), probs=tuple(probs), num_draft=tuple(num_draft))

    def _drafts_from_logits(self, logits: torch.Tensor, num_draft: Sequence[int], sampling: Sequence[SamplingParams],
                            generators: Sequence[torch.Generator | None]) -> Drafts:
        """Tokens (and, sampling, the drafter's law over the target's vocabulary) from the drafted rows' logits."""
        tokens, probs, offset = [], [], 0
        for k, params, gen in zip(num_draft, sampling, generators):
            chunk = logits[offset : offset + k]
            offset += k
            if params.greedy:
                tokens.append(self.head.ids_of(argmax_rows(chunk)))
                probs.append(None)
            else:
                p = logits_to_probs(chunk, params)
                tokens.append(self.head.ids_of(sample_tokens(p, gen)))
                probs.append(self._to_target_vocab(p))
        return Drafts(tokens=torch.cat(tokens), probs=tuple(probs), num_draft=tuple(num_draft))

    def _to_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """The drafter's distribution over the target's vocabulary (zero outside the draft vocabulary): the q of
        rejection sampling, which stays lossless for any q the drafts were really drawn from."""
        if self.head.ids is None:
            return probs
        full = probs.new_zeros(probs.shape[0], self.target.config.vocab_size)
        return full.index_copy_(1, self.head.ids, probs)

    def propose(
        self,
        cache: KVCache,
        slots: Sequence[int],
        anchors: Sequence[int],
        num_draft: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> Drafts:
        """Draft after each anchor (the last committed token, placed at its slot's context length)."""
        self._check_lengths(num_draft)  # before the drafter pass, not after it
        width = self.block_size if self.whole_block else max(2, max(num_draft) + 1)
        logits = (self.draft_logits(cache, slots, anchors, num_draft, width)
                  if self.drafter.candidate_selector is None else None)  # (the selector reads the hidden states)
        if logits is not None:
            return self._drafts_from_logits(self.drafter.finish_logits(logits), num_draft, sampling, generators)
        return self.draft_tokens(self.draft_hidden(cache, slots, anchors, width), num_draft, sampling, generators,
                                 anchors)

    @torch.inference_mode()
    def draft_logits(self, cache: KVCache, slots: Sequence[int], anchors: Sequence[int], num_draft: Sequence[int],
                     width: int) -> torch.Tensor | None:
        """The drafted rows' logits [sum(num_draft), V]: draft_hidden, then the norm and the draft head, in one kernel
        call where the drafter's layer step runs (else None, running nothing): the same kernels on the same values as
        draft_hidden + draft_tokens, so the same drafts (tested); propose 0.87-0.89x the time at batch 1
        (docs/results/runtime/draft_ab.txt)."""
        if self._head_linear is None or not sum(num_draft):
            return None
        rows = torch.tensor([r * width + 1 + j for r, k in enumerate(num_draft) for j in range(k)], dtype=torch.long)
        return self.drafter.draft_logits(cache, self._block_ids(anchors, width), slots, self.target.embed_tokens,
                                         self._head_linear, rows)


def _sampled_path(first: torch.Tensor, after: torch.Tensor, temperature: float,
                  generator: torch.Generator | None) -> tuple[list[int], torch.Tensor]:
    """A DFlash 2 selector's sampled path: each position's candidate drawn from the softmax of its scores after the
    candidate drawn before it (at the request's temperature, as the reference draws); returns the picks and each
    position's law over its candidates [k, K]."""
    scores, picks, laws = first, [], []
    for p in range(after.shape[0] + 1):
        q = torch.softmax(scores / temperature, dim=-1)
        picks.append(int(sample_tokens(q[None], generator)[0]))
        laws.append(q)
        if p < after.shape[0]:
            scores = after[p, picks[-1]]
    return picks, torch.stack(laws)
