"""A draft model: a smaller model of the same tokenizer drafts autoregressively (llama.cpp's `-md`, transformers'
assisted generation), beside the DFlash drafter as the classic baseline.

Its context is the committed tokens themselves, held in its own KV cache per slot. A step feeds each request the
committed tokens its cache lacks (the kept drafts and the next token of the last step, or a whole prompt) together with
the anchor in one ragged pass, then one pass per further draft; the drafts' own positions are rolled back at once, so
the cache only ever holds committed tokens and a rejected draft costs no bookkeeping. Drafts are the draft model's
greedy picks, or samples from its distribution processed as the target's is (temperature, top-k, top-p): the q of
rejection sampling, so sampled speculation stays exact.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from adaflash.models.kv_cache.cache import DEFAULT_BLOCK_SIZE, KVCache, drafter_pool
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.layers import argmax_rows
from adaflash.models.targets.model import TargetModel
from adaflash.speculative.proposer import Drafts
from adaflash.speculative.sampling import SamplingParams, logits_to_probs, sample_tokens


class DraftModelProposer:
    """Drafts up to `max_draft` tokens a step with `model` for `target` (their vocabularies must agree: the draft
    model's ids are the target's; a draft vocabulary shorter than the target's padded one is fine)."""

    def __init__(self, model: TargetModel, target: TargetModel, max_draft: int = 4, name: str = "draft-model") -> None:
        if max_draft < 1:
            raise ValueError(f"a draft model drafts at least 1 token a step, got max_draft={max_draft}")
        if model.config.vocab_size > target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size} ids) is larger than the target's "
                             f"({target.config.vocab_size}): they do not share a tokenizer")
        if model.device != target.device:
            raise ValueError(f"the draft model runs on {model.device}, the target on {target.device}")
        self.model, self.target, self.max_draft, self.name = model, target, max_draft, name

    @property
    def block_size(self) -> int:
        """Anchor + the most drafts a step (what a verify pass is at widest, as a DFlash block)."""
        return self.max_draft + 1

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()  # its context is tokens, not target features

    @property
    def cost_key(self) -> str:
        """What tells this draft source's cost profile from another's (speculative/cost_model.py)."""
        c = self.model.config
        return f"-AR{c.num_layers}x{c.hidden_size}-{self.model.numerics}-K{self.max_draft}"

    def new_cache(self, num_slots: int, max_len: int, pool_tokens: int | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE) -> KVCache:
        """`pool_tokens`: the target's pool beside it (KVCache), grown by what this drafter writes ahead."""
        return self.model.new_cache(num_slots, max_len + self.block_size, block_size=block_size,
                                     pool_tokens=drafter_pool(pool_tokens, num_slots, self.block_size, block_size))

    @torch.inference_mode()
    def propose(self, cache: KVCache, slots: Sequence[int], histories: Sequence[Sequence[int]], num_draft: Sequence[int],
                sampling: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> Drafts:
        """Draft `num_draft[i]` (>= 1) tokens after each history (every committed token, the anchor last)."""
        if any(not 1 <= k <= self.max_draft for k in num_draft):
            raise ValueError(f"draft lengths must be in [1, {self.max_draft}], got {list(num_draft)}")
        starts = []
        for slot, history in zip(slots, histories):
            start = min(cache.lengths[slot], len(history) - 1)  # at least the anchor is fed
            cache.rollback(slot, start)
            starts.append(start)
        feeds = [list(h[s:]) for h, s in zip(histories, starts)]
        batch = RaggedBatch.build(list(slots), starts, [len(f) for f in feeds])
        logits = self.model(torch.tensor([t for f in feeds for t in f], device=self.model.device), batch, cache,
                            (), batch.last_token_indices().to(self.model.device)).logits
        picked: list[list[int]] = [[] for _ in slots]
        laws: list[list[torch.Tensor]] = [[] for _ in slots]
        active = list(range(len(slots)))
        while True:
            for row, i in enumerate(active):
                token, law = _pick(logits[row : row + 1], sampling[i], generators[i])
                picked[i].append(token)
                if law is not None:
                    laws[i].append(law)
            active = [i for i in active if len(picked[i]) < num_draft[i]]
            if not active:
                break
            batch = RaggedBatch.build([slots[i] for i in active], [len(histories[i]) + len(picked[i]) - 1 for i in active],
                                      [1] * len(active))
            ids = torch.tensor([picked[i][-1] for i in active], device=self.model.device)
            logits = self.model(ids, batch, cache, ()).logits
        for slot, history in zip(slots, histories):  # only committed tokens stay
            cache.rollback(slot, len(history))
        tokens = torch.tensor([t for p in picked for t in p], dtype=torch.long)
        probs = tuple(None if params.greedy else self._to_target_vocab(torch.cat(law))
                      for params, law in zip(sampling, laws))
        return Drafts(tokens=tokens, probs=probs, num_draft=tuple(num_draft))

    def _to_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        pad = self.target.config.vocab_size - probs.shape[-1]
        return probs if pad == 0 else torch.nn.functional.pad(probs, (0, pad))

    def step_probe(self, context: int) -> Callable[[int], None]:
        """What one drafting request costs this source in a step, by width (anchor + drafts): the kept tokens of the
        last step and the anchor fed, then a pass per further draft (the cost model's profile times it)."""
        cache = self.new_cache(1, context + self.block_size)
        vocab = self.model.config.vocab_size
        history = [(100 + i) % vocab for i in range(context + 2)]
        self.model(torch.tensor(history[:context], device=self.model.device), RaggedBatch.build([0], [0], [context]),
                   cache, ())

        def step(width: int) -> None:
            self.propose(cache, [0], [history], [width - 1], [SamplingParams()], [None])
            cache.rollback(0, context)

        return step


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """The next draft from one row of logits [1, V]: greedy (no law), or sampled from the processed law [1, V]."""
    if params.greedy:
        return int(argmax_rows(logits)[0]), None
    probs = logits_to_probs(logits, params)
    return int(sample_tokens(probs, generator)[0]), probs
