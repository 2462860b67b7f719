"""The continuous-batching speculative engine (token ids only; HTTP lives in the server).

One step: admit -> prefill -> propose -> verify -> commit -> feedback. Waiting requests are admitted and prefilled in
ragged passes of up to `max_prefill_tokens`; every other running request gets its drafts from the draft sources
(`Drafting`: prompt lookup, then the drafter and its length policy), one target pass verifies all of them over the
ragged per-request lengths (linear layers see only real tokens), the pure verifier decides each request's accepted
drafts, the kept tokens are committed, the caches rolled back and the kept positions' features queued for the drafter,
and each source hears how its drafts fared. A step that verifies no drafts is a plain decode pass.
The scheduler (slots, queue) knows nothing of drafting; the draft sources nothing of scheduling.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from adaflash.engine.draft_sources import DrafterSource, DraftModelSource, PromptLookupSource
from adaflash.engine.drafting import Drafting, StepDrafts
from adaflash.engine.request import Request, StepOutput
from adaflash.engine.scheduler import Scheduler
from adaflash.models.kv_cache.cache import DEFAULT_BLOCK_SIZE, KVCache
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.layers import argmax_rows
from adaflash.models.targets.model import TargetModel
from adaflash.speculative.cost_model import CalibratedCost, CostModel
from adaflash.speculative.draft_model import DraftModelProposer
from adaflash.speculative.drafting_check import DraftingChecks
from adaflash.speculative.length_policy import FixedLength, LengthPolicy, LookupLength
from adaflash.speculative.prompt_lookup import PromptLookup
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.sampling import draw_exponentials, draw_uniforms, logits_to_probs, sample_tokens
from adaflash.speculative.verify import verify_greedy, verify_sampling


class Engine:
    def __init__(
        self,
        target: TargetModel,
        proposer: DFlashProposer | DraftModelProposer | None = None,
        policy: LengthPolicy | None = None,
        max_batch: int = 8,
        max_queue: int = 64,
        max_len: int = 2048,
        recorder=None,
        capture_layers: Sequence[int] | None = None,
        prompt_lookup: PromptLookup | None = None,
        lookup_cost: CostModel | CalibratedCost | None = None,
        max_prefill_tokens: int = 2048,
        drafting_checks: DraftingChecks | None = None,
        clock: Callable[[], float] = time.perf_counter,
        kv_pool_tokens: int | None = None,
        kv_block_size: int = DEFAULT_BLOCK_SIZE,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`capture_layers`: target layers whose features a plain (drafter-less) engine returns to requests that
        ask (`Request.return_features`): data generation. With a proposer they are the drafter's layers.
        `prompt_lookup`: n-gram drafts first; a request without a match (or whose match does not pay) goes to the
        drafter and its length policy (without a proposer: decodes one token). `lookup_cost`: the verify costs that
        size the lookups (`LookupLength`), needed unless `prompt_lookup.length` is "all". `max_prefill_tokens`: the
        most prompt tokens one prefill pass takes (admitted prompts go in passes of up to that many; a longer prompt
        alone): a 64-prompt pass ran ~0.8x the tokens a second of 450-1800-token passes (its intermediates outgrow the
        caches and glibc's reused heap, and are faulted in afresh; docs/results/serving/prefill_pass_size.txt).
        `drafting_checks`: the drafting check the draft sources run behind (adaptive lengths; None: they always ask).
        `clock`: what the drafting checks and the length policies read a step's cost from (wall time by default).
        `kv_pool_tokens`: the positions the target's paged KV cache holds for all requests together (default every
        slot's max_len); a request is admitted only while the pool can hold all it may write (its prompt, its
        max_new_tokens and a step's drafts), so a running request never runs short; the rest wait in the queue.
        `kv_block_size`: positions a KV block holds. `kv_dtype`: what the target's cache stores (default the target's
        `cache_dtype`): part of the numbers, so greedy output equals plain decoding's at the same setting."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.target, self.prompt_lookup = target, prompt_lookup
        lookup = None
        if prompt_lookup is not None:
            if prompt_lookup.length == "throughput" and lookup_cost is None:
                raise ValueError("prompt lookup sized by throughput needs the verify cost model (lookup_cost)")
            sized = LookupLength(lookup_cost) if prompt_lookup.length == "throughput" else None
            lookup = PromptLookupSource(prompt_lookup, sized, target.config.vocab_size)
        self.recorder = recorder  # optional: on-policy trajectories and verification outcomes (engine/recorder.py)
        policy = _checked(policy or FixedLength(proposer.block_size - 1 if proposer else 0))
        self.scheduler = Scheduler(max_batch, max_queue)
        self.max_len = max_len
        pool = {"pool_tokens": kv_pool_tokens, "block_size": kv_block_size}
        self.target_cache = target.new_cache(max_batch, max_len, kv_dtype, **pool)
        self._reserved: dict[str, int] = {}  # request id -> the target blocks it may come to hold (admitted ones)
        if proposer is not None and capture_layers is not None and tuple(capture_layers) != tuple(proposer.capture_layers):
            raise ValueError(f"capture_layers {tuple(capture_layers)} differ from the drafter's {proposer.capture_layers}")
        self.capture = tuple(proposer.capture_layers if proposer else capture_layers or ())
        self.max_draft = proposer.block_size - 1 if proposer else 0  # the drafter's most drafts a step
        self.max_verified = max_verified(proposer, prompt_lookup)
        drafter = None
        if isinstance(proposer, DraftModelProposer):
            drafter = DraftModelSource(proposer, policy, proposer.new_cache(max_batch, max_len, **pool))
        elif proposer is not None:  # the recorder observes the drafter's outcomes
            drafter = DrafterSource(proposer, policy, proposer.new_cache(max_batch, max_len, **pool), recorder)
        self._pool = pool
        self.drafting = Drafting(lookup, drafter, drafting_checks, clock)
        self._policy_without_drafter = policy if drafter is None else None  # decides nothing; its name is shown
        # A new request maps in the cached blocks of its prompt's prefix (KVCache.adopt) only where that is exact: a
        # position's K/V bitwise the same whatever pass computed them (TargetModel.rows_independent), so outputs never
        # depend on what ran before.
        self.share_prefixes = target.rows_independent
        self.prompt_tokens = self.prompt_tokens_reused = 0  # prefilled prompt tokens, and those a slot already held

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        need = self._positions(request)
        if need > self.max_len:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the context of {self.max_len - self.max_verified - 1} tokens"
            )
        cache = self.target_cache
        if cache.blocks_for(need) > cache.num_blocks:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the KV cache pool of {cache.num_blocks * cache.block_size - self.max_verified - 1} tokens"
            )
        self.scheduler.add(request)

    def _positions(self, request: Request) -> int:
        """The most positions `request` may write: its prompt, its tokens, and the drafts of a step verified past them."""
        return len(request.prompt_ids) + request.max_new_tokens + self.max_verified + 1

    def _reserve(self, request: Request) -> bool:
        """Admission by the KV pool: whether what every admitted request may come to hold, and this one, fit in it
        (then it is reserved: the scheduler admits the request)."""
        need = self.target_cache.blocks_for(self._positions(request))
        if sum(self._reserved.values()) + need > self.target_cache.num_blocks:
            return False
        self._reserved[request.request_id] = need
        return True

    def kv_stats(self) -> dict[str, int]:
        """The target pool's blocks: in all, held by requests, reserved for what they may write, and its block size."""
        cache = self.target_cache
        return {"blocks": cache.num_blocks, "held": cache.blocks_held(), "reserved": sum(self._reserved.values()),
                "block_size": cache.block_size}

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.find(request_id)
        if request is None:
            return False
        request.finish_reason = "abort"
        self._release(request)
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- the drafter's parts, read and set by its callers (hot swap, profiles, tests) ---------------

    @property
    def proposer(self) -> DFlashProposer | DraftModelProposer | None:
        drafter = self.drafting.drafter
        return drafter.proposer if drafter is not None else None

    @property
    def draft_cache(self) -> KVCache | None:
        drafter = self.drafting.drafter
        return drafter.cache if drafter is not None else None

    @property
    def policy(self) -> LengthPolicy:
        drafter = self.drafting.drafter
        return drafter.policy if drafter is not None else self._policy_without_drafter

    @policy.setter
    def policy(self, policy: LengthPolicy) -> None:
        self.drafting.close_run()  # the old policy hears the steps it was held through
        if self.drafting.drafter is not None:
            self.drafting.drafter.policy = _checked(policy)
        else:
            self._policy_without_drafter = _checked(policy)

    def feed_context(self, slots: Sequence[int]) -> int:
        """Feed the drafter the target features these slots have waiting (`DrafterSource.feed_context`)."""
        return self.drafting.drafter.feed_context(slots) if self.drafting.drafter is not None else 0

    # ---- one step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        admitted = self.scheduler.admit(self._reserve)
        # In slot order: a batch's order does not depend on when its requests arrived.
        decoding = sorted((r for r in self.scheduler.running if r not in admitted), key=lambda r: r.slot)
        outputs = self._prefill(admitted) if admitted else []
        if decoding:
            drafts = self.drafting.propose(decoding)
            if drafts.any:
                rows, features = self._verify_pass(drafts)
                results = self._verify(drafts, rows)
                outputs += self._commit(drafts, results, rows, features)
                accepted = [a for a, _ in results]
            else:  # nothing to verify: the plain pass, so a request kept from drafting costs exactly a decode step
                outputs += self._decode(decoding)
                accepted = [0] * len(decoding)
            self.drafting.feedback(drafts, accepted)
        for request in [r for r in self.scheduler.running if r.finished]:
            if self.recorder is not None:
                self.recorder.on_finish(request)
            self._release(request)
        return outputs

    def _release(self, request: Request) -> None:
        if request.slot is not None and request in self.scheduler.running:
            # The caches keep the full blocks of committed tokens for later prompts that start with them (or none).
            committed = request.prompt_ids + request.output_ids if self.share_prefixes else ()
            self.target_cache.release(request.slot, committed)
            self.drafting.release(request.slot, committed)
            self._reserved.pop(request.request_id, None)
        self.scheduler.release(request)
        if not self.scheduler.running:  # what the checks learned is whole whenever the engine runs empty
            self.drafting.close_run()

    def _adopt_prefix(self, request: Request) -> int:
        """Map into `request`'s empty slots the cached blocks of its prompt's longest cached prefix (none where the
        prompt's features are asked for, or without sharing); with a drafter, no more than its cache holds too.
        Returns the prompt positions kept; the last prompt token is always computed (its logits pick the first token)."""
        if not self.share_prefixes or request.return_features:
            return 0
        slot, prompt = request.slot, request.prompt_ids
        keep = self.target_cache.adopt(slot, prompt, len(prompt) - 1)
        held = self.drafting.adopt_prefix(slot, prompt, keep)
        if held < keep:
            self.target_cache.rollback(slot, held)
        return min(keep, held)

    def swap_proposer(self, proposer: DFlashProposer, policy: LengthPolicy | None = None, version: str = "") -> None:
        """Between steps, a new drafter (a published checkpoint) takes over; running requests keep going.

        The old drafter's context K/V mean nothing to the new one, so each running request's context is
        rebuilt from the target's features of its committed tokens, computed in a scratch cache: the
        target's own cache, hence every output token, is untouched (the swap stays lossless).
        """
        drafter = self.drafting.drafter
        if not isinstance(drafter, DrafterSource):
            raise ValueError("only a DFlash drafter is hot-swapped (this engine drafts with a draft model, or none)")
        if tuple(proposer.capture_layers) != tuple(self.capture) or proposer.block_size != self.max_draft + 1:
            raise ValueError("a hot-swapped drafter must read the same target layers with the same block size")
        policy = _checked(policy) if policy is not None else None
        self.drafting.close_run()
        draft_cache = proposer.new_cache(self.scheduler.max_batch, self.max_len, **self._pool)
        with torch.inference_mode():
            for r in self.scheduler.running:
                committed = (r.prompt_ids + r.output_ids)[: r.position]
                scratch = self.target.new_cache(1, len(committed), self.target_cache.k.dtype)
                out = self.target(torch.tensor(committed), RaggedBatch.build([0], [0], [len(committed)]), scratch,
                                  self.capture, torch.tensor([len(committed) - 1]))
                draft_cache.reset(r.slot)
                proposer.add_context(draft_cache, out.hidden, RaggedBatch.build([r.slot], [0], [len(committed)]))
        drafter.take_over(proposer, draft_cache, policy)  # the rebuilt context holds every committed position
        for r in self.scheduler.running:  # how the old drafter fared says nothing of the new one
            r.drafting_records.pop(drafter.name, None)
        if self.recorder is not None:  # outcomes of the old drafter's hidden states stay in their own shard
            self.recorder.flush()
            self.recorder.drafter_version = version

    @staticmethod
    def _picks(requests: Sequence[Request], logits: torch.Tensor) -> list[int]:
        """Each request's next token from its row of `logits` [len(requests), V]: the greedy rows in one argmax and one
        host copy (on a GPU a copy per request was a round trip per token), the sampled ones from their own law."""
        greedy = [i for i, r in enumerate(requests) if r.sampling.greedy]
        picks = [0] * len(requests)
        if greedy:
            rows = logits if len(greedy) == len(requests) else logits[torch.tensor(greedy, device=logits.device)]
            for i, token in zip(greedy, argmax_rows(rows).tolist()):
                picks[i] = token
        for i, r in enumerate(requests):
            if not r.sampling.greedy:
                picks[i] = int(sample_tokens(logits_to_probs(logits[i : i + 1], r.sampling), r.generator)[0])
        return picks

    def _prefill(self, requests: Sequence[Request]) -> list[StepOutput]:
        kept = [self._adopt_prefix(r) for r in requests]
        self.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.prompt_tokens_reused += sum(kept)
        outputs = []
        for group in self._prefill_passes([len(r.prompt_ids) - keep for r, keep in zip(requests, kept)]):
            outputs += self._prefill_pass([requests[i] for i in group], [kept[i] for i in group])
        return outputs

    def _prefill_passes(self, lengths: Sequence[int]) -> list[list[int]]:
        """Consecutive groups of request indices, each within max_prefill_tokens (a longer prompt alone)."""
        groups: list[list[int]] = []
        total = 0
        for i, n in enumerate(lengths):
            if not groups or total + n > self.max_prefill_tokens:
                groups.append([])
                total = 0
            groups[-1].append(i)
            total += n
        return groups

    def _prefill_pass(self, requests: Sequence[Request], kept: Sequence[int]) -> list[StepOutput]:
        lengths = [len(r.prompt_ids) - keep for r, keep in zip(requests, kept)]
        batch = RaggedBatch.build([r.slot for r in requests], kept, lengths)
        ids = torch.tensor([t for r, keep in zip(requests, kept) for t in r.prompt_ids[keep:]])
        out = self.target(ids, batch, self.target_cache, self.capture, batch.last_token_indices())
        features = out.hidden.split(lengths) if self.capture else [None] * len(requests)
        for r, keep, f in zip(requests, kept, features):
            self.drafting.add_context(r.slot, keep, f)
        picks = self._picks(requests, out.logits)
        return [self._output(r, r.commit([picks[i]]), _row(out.logits, i, r), features[i]) for i, r in enumerate(requests)]

    def _decode(self, requests: Sequence[Request]) -> list[StepOutput]:
        """Plain autoregressive step for every request: an AR engine's step, and a speculative engine's where nothing is
        drafted (the same pass, so a request kept from drafting costs what decoding costs; its features wait for the
        drafter's next pass)."""
        batch = RaggedBatch.build([r.slot for r in requests], [r.position for r in requests], [1] * len(requests))
        out = self.target(torch.tensor([r.output_ids[-1] for r in requests]), batch, self.target_cache, self.capture)
        outputs = []
        # Each request's row of features (one request: the whole tensor, not a split run cold after the pass).
        rows = (out.hidden.split(1) if len(requests) > 1 else (out.hidden,)) if self.capture else [None] * len(requests)
        for i, (r, token, features) in enumerate(zip(requests, self._picks(requests, out.logits), rows)):
            self.drafting.add_context(r.slot, r.position, features)
            outputs.append(self._output(r, r.commit([token]), _row(out.logits, i, r), features))
            r.accept_lengths.append(1)
            r.draft_lengths.append(0)
        return outputs

    def _verify_pass(self, step: StepDrafts) -> tuple[tuple[torch.Tensor, ...], Sequence[torch.Tensor | None]]:
        """One target pass over every request's [anchor, drafts...] (the ragged verify batch): per request its rows of
        logits and of captured features."""
        requests, widths = step.requests, [k + 1 for k in step.lengths]
        batch = RaggedBatch.build([r.slot for r in requests], [r.position for r in requests], widths)
        ids = torch.tensor([t for r, d in zip(requests, step.drafts) for t in [r.output_ids[-1], *d.tokens]])
        out = self.target(ids, batch, self.target_cache, self.capture)
        features = out.hidden.split(widths) if self.capture else [None] * len(requests)
        return out.logits.split(widths), features

    def _verify(self, step: StepDrafts, rows) -> list[tuple[int, int]]:
        """(accepted drafts, next token) per request. Greedy requests go through the ragged verifier in one
        call; sampling requests one by one, since each has its own temperature / top-k / top-p."""
        requests, drafts, lengths = step.requests, step.drafts, step.lengths
        results: list[tuple[int, int] | None] = [None] * len(requests)
        greedy = [i for i, r in enumerate(requests) if r.sampling.greedy]
        if greedy:
            res = verify_greedy(
                torch.tensor([t for i in greedy for t in drafts[i].tokens], dtype=torch.long),
                argmax_rows(torch.cat([rows[i] for i in greedy]) if len(greedy) > 1 else rows[greedy[0]]),
                [lengths[i] for i in greedy],
            )
            for j, i in enumerate(greedy):
                results[i] = (int(res.num_accepted[j]), int(res.next_tokens[j]))
        for i, r in enumerate(requests):
            if results[i] is not None:
                continue
            k, p = lengths[i], logits_to_probs(rows[i], r.sampling)
            q = drafts[i].probs if drafts[i].probs is not None else p.new_zeros(0, p.shape[-1])
            res = verify_sampling(
                torch.tensor(drafts[i].tokens, dtype=torch.long), q, p, [k],
                draw_uniforms(k, r.generator, p.device), draw_exponentials((1, p.shape[-1]), r.generator, p.device),
            )
            results[i] = (int(res.num_accepted[0]), int(res.next_tokens[0]))
        return results

    def _commit(self, step: StepDrafts, results: Sequence[tuple[int, int]], rows, features) -> list[StepOutput]:
        """Each request's accepted drafts and next token; the caches rolled back past the rejected drafts, and the
        kept positions' features queued as the drafter's next context."""
        outputs = []
        for r, d, (accepted, next_token), row, f in zip(step.requests, step.drafts, results, rows, features):
            # (r.position: the anchor's, until the commit below)
            self.target_cache.rollback(r.slot, r.position + accepted + 1)
            self.drafting.add_context(r.slot, r.position, f[: accepted + 1] if f is not None else None)
            r.accept_lengths.append(accepted + 1)
            r.draft_lengths.append(len(d.tokens))
            committed = r.commit([*d.tokens[:accepted], next_token])  # a stop token or the budget may cut it short
            outputs.append(self._output(r, committed, row, f[: len(committed)] if f is not None else None))
        return outputs

    @staticmethod
    def _output(request: Request, new_tokens: list[int], logits: torch.Tensor | None,
                features: torch.Tensor | None) -> StepOutput:
        """`logits` [>= len(new_tokens), V]: the target's rows the new tokens were chosen from (in order); needed only
        where the request asked for top log-probabilities."""
        top_logprobs = top_ids = None
        if request.top_logprobs > 0 and new_tokens:
            top = torch.log_softmax(logits[: len(new_tokens)].float(), -1).topk(request.top_logprobs, -1)
            top_logprobs, top_ids = top.values.cpu(), top.indices.cpu()
        # Host copies (no-ops on a CPU): what callers keep of a step outlives the device's buffers.
        returned = features.cpu() if request.return_features and features is not None else None
        return StepOutput(request.request_id, new_tokens, request.finish_reason, top_logprobs, top_ids, returned)


def _row(logits: torch.Tensor, i: int, request: Request) -> torch.Tensor | None:
    """Row `i` of a pass's logits, where `request` reads it (top log-probabilities): a view made for nothing costs
    ~18 us right after a decode pass, when Python runs cold (~0.3% of a step)."""
    return logits[i : i + 1] if request.top_logprobs > 0 else None


def max_verified(proposer: DFlashProposer | None, prompt_lookup: PromptLookup | None) -> int:
    """Drafts one step may verify (either source): what every request's cache must leave room for."""
    return max(proposer.block_size - 1 if proposer else 0, prompt_lookup.num_tokens if prompt_lookup else 0)


def _checked(policy: LengthPolicy) -> LengthPolicy:
    """A policy missing part of the protocol fails here, not after a step has committed its tokens."""
    missing = [m for m in ("decide", "feedback", "observe_step") if not callable(getattr(policy, m, None))]
    if missing:
        raise TypeError(f"length policy {type(policy).__name__} lacks {', '.join(missing)} (speculative/length_policy.py)")
    return policy
