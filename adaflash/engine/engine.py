"""The continuous-batching speculative engine (token ids only; HTTP lives in the server).

One step: admit waiting requests and prefill them in ragged passes of up to `max_prefill_tokens`; then, for every
other running request, ask the length policy how many drafts it gets, run one batched drafter pass, one batched target
verification over the ragged per-request lengths (linear layers see only real tokens), verify each
request with the pure verifier, commit, roll the caches back and feed accepted features to the drafter.
The scheduler (slots, queue) knows nothing of drafting; the proposer nothing of scheduling.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from adaflash.engine.prefix_reuse import SlotPrefixes
from adaflash.engine.request import Request, StepOutput
from adaflash.engine.scheduler import Scheduler
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.layers import argmax_rows
from adaflash.models.target import TargetModel
from adaflash.speculative.cost_model import CalibratedCost, CostModel
from adaflash.speculative.length_policy import FixedLength, LengthPolicy, LookupLength
from adaflash.speculative.prompt_lookup import PromptLookup, point_mass
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.sampling import draw_exponentials, draw_uniforms, logits_to_probs, sample_tokens
from adaflash.speculative.verify import verify_greedy, verify_sampling


class Engine:
    def __init__(
        self,
        target: TargetModel,
        proposer: DFlashProposer | None = None,
        policy: LengthPolicy | None = None,
        max_batch: int = 8,
        max_queue: int = 64,
        max_len: int = 2048,
        recorder=None,
        capture_layers: Sequence[int] | None = None,
        prompt_lookup: PromptLookup | None = None,
        lookup_cost: CostModel | CalibratedCost | None = None,
        max_prefill_tokens: int = 2048,
    ) -> None:
        """`capture_layers`: target layers whose features a plain (drafter-less) engine returns to requests that
        ask (`Request.return_features`): data generation. With a proposer they are the drafter's layers.
        `prompt_lookup`: n-gram drafts first; a request without a match (or whose match does not pay) goes to the
        drafter and its length policy (without a proposer: decodes one token). `lookup_cost`: the verify costs that
        size the lookups (`LookupLength`), needed unless `prompt_lookup.length` is "all". `max_prefill_tokens`: the
        most prompt tokens one prefill pass takes (admitted prompts go in passes of up to that many; a longer prompt
        alone): a 64-prompt pass ran ~0.8x the tokens a second of 450-1800-token passes (its intermediates outgrow the
        caches and glibc's reused heap, and are faulted in afresh; docs/results/serving/prefill_pass_size.txt)."""
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.target, self.proposer, self.prompt_lookup = target, proposer, prompt_lookup
        self.lookup_length = None
        if prompt_lookup is not None and prompt_lookup.length == "throughput":
            if lookup_cost is None:
                raise ValueError("prompt lookup sized by throughput needs the verify cost model (lookup_cost)")
            self.lookup_length = LookupLength(lookup_cost)
        self.recorder = recorder  # optional: on-policy trajectories and verification outcomes (engine/recorder.py)
        self.policy = _checked(policy or FixedLength(proposer.block_size - 1 if proposer else 0))
        self.scheduler = Scheduler(max_batch, max_queue)
        self.max_len = max_len
        self.target_cache = target.new_cache(max_batch, max_len)
        self.draft_cache = proposer.new_cache(max_batch, max_len) if proposer else None
        if proposer is not None and capture_layers is not None and tuple(capture_layers) != tuple(proposer.capture_layers):
            raise ValueError(f"capture_layers {tuple(capture_layers)} differ from the drafter's {proposer.capture_layers}")
        self.capture = tuple(proposer.capture_layers if proposer else capture_layers or ())
        self.max_draft = proposer.block_size - 1 if proposer else 0  # the drafter's most drafts a step
        self.max_verified = max_verified(proposer, prompt_lookup)
        # Target features not yet fed to the drafter, per slot: (first position, [T, n*d] chunks). Fed just
        # before the slot's next drafter pass, so a request the policy keeps from drafting costs no drafter work.
        self._pending: dict[int, tuple[int, list[torch.Tensor]]] = {}
        # A new request reuses the prompt prefix its slot's cache already holds, where that is exact (prefix_reuse.py).
        self.prefixes = SlotPrefixes(max_batch) if target.rows_independent else None
        self.prompt_tokens = self.prompt_tokens_reused = 0  # prefilled prompt tokens, and those a slot already held

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        need = len(request.prompt_ids) + request.max_new_tokens + self.max_verified + 1
        if need > self.max_len:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the context of {self.max_len - self.max_verified - 1} tokens"
            )
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.find(request_id)
        if request is None:
            return False
        request.finish_reason = "abort"
        self._release(request)
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- one step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        admitted = self.scheduler.admit(self._choose_slot if self.prefixes is not None else None)
        # In slot order: when the slots in use are contiguous, attention reads the caches as views, not gathered copies.
        decoding = sorted((r for r in self.scheduler.running if r not in admitted), key=lambda r: r.slot)
        outputs = self._prefill(admitted) if admitted else []
        if decoding:
            speculative = self.proposer is not None or self.prompt_lookup is not None
            outputs += self._speculate(decoding) if speculative else self._decode(decoding)
        for request in [r for r in self.scheduler.running if r.finished]:
            if self.recorder is not None:
                self.recorder.on_finish(request)
            self._release(request)
        return outputs

    def _release(self, request: Request) -> None:
        if request.slot is not None and request in self.scheduler.running:
            self._pending.pop(request.slot, None)
            if self.prefixes is not None:  # what the slot's cache holds: every position below its length
                held = self.target_cache.lengths[request.slot]
                self.prefixes.remember(request.slot, (request.prompt_ids + request.output_ids)[:held])
        self.scheduler.release(request)

    def _choose_slot(self, request: Request, free_slots: list[int]) -> int:
        return self.prefixes.best_slot(request.prompt_ids, free_slots)

    def _reusable(self, request: Request) -> int:
        """Leading prompt positions `request`'s slot holds and may keep (none where the prompt's features are asked
        for, or without reuse); with a drafter, no more than its context cache holds too."""
        if self.prefixes is None or request.return_features:
            return 0
        keep = self.prefixes.reusable(request.slot, request.prompt_ids)
        if self.draft_cache is not None:
            keep = min(keep, self.draft_cache.lengths[request.slot])
        return keep

    def swap_proposer(self, proposer: DFlashProposer, policy: LengthPolicy | None = None, version: str = "") -> None:
        """Between steps, a new drafter (a published checkpoint) takes over; running requests keep going.

        The old drafter's context K/V mean nothing to the new one, so each running request's context is
        rebuilt from the target's features of its committed tokens, computed in a scratch cache: the
        target's own cache, hence every output token, is untouched (the swap stays lossless).
        """
        if self.proposer is None or tuple(proposer.capture_layers) != tuple(self.capture) or proposer.block_size != self.max_draft + 1:
            raise ValueError("a hot-swapped drafter must read the same target layers with the same block size")
        draft_cache = proposer.new_cache(self.scheduler.max_batch, self.max_len)
        with torch.inference_mode():
            for r in self.scheduler.running:
                committed = (r.prompt_ids + r.output_ids)[: r.position]
                scratch = self.target.new_cache(1, len(committed))
                out = self.target(torch.tensor(committed), RaggedBatch.build([0], [0], [len(committed)]), scratch,
                                  self.capture, torch.tensor([len(committed) - 1]))
                draft_cache.reset(r.slot)
                proposer.add_context(draft_cache, out.hidden, RaggedBatch.build([r.slot], [0], [len(committed)]))
        self.proposer, self.draft_cache = proposer, draft_cache
        self._pending.clear()  # the rebuilt context already holds every committed position
        if self.recorder is not None:  # outcomes of the old drafter's hidden states stay in their own shard
            self.recorder.flush()
            self.recorder.drafter_version = version
        if policy is not None:
            self.policy = _checked(policy)

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
        kept = [self._reusable(r) for r in requests]
        for r, keep in zip(requests, kept):
            self.target_cache.rollback(r.slot, keep)
            if self.draft_cache is not None:
                self.draft_cache.rollback(r.slot, keep)
            if self.prefixes is not None:
                self.prefixes.forget(r.slot)  # the slot is being rewritten; _release records what it holds then
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
        if self.proposer is not None:
            for r, keep, f in zip(requests, kept, features):
                self._pending[r.slot] = (keep, [f])
        picks = self._picks(requests, out.logits)
        return [self._output(r, r.commit([picks[i]]), out.logits[i : i + 1], features[i]) for i, r in enumerate(requests)]

    def _decode(self, requests: Sequence[Request]) -> list[StepOutput]:
        """Plain autoregressive step for every request: an AR engine's step, and a speculative engine's where nothing is
        drafted (the same pass, so a request kept from drafting costs what decoding costs; its features wait for the
        drafter's next pass)."""
        batch = RaggedBatch.build([r.slot for r in requests], [r.position for r in requests], [1] * len(requests))
        out = self.target(torch.tensor([r.output_ids[-1] for r in requests]), batch, self.target_cache, self.capture)
        outputs = []
        for i, (r, token) in enumerate(zip(requests, self._picks(requests, out.logits))):
            features = out.hidden[i : i + 1] if self.capture else None
            if self.proposer is not None:
                self._pending.setdefault(r.slot, (r.position, []))[1].append(features)
            outputs.append(self._output(r, r.commit([token]), out.logits[i : i + 1], features))
            r.accept_lengths.append(1)
            r.draft_lengths.append(0)
        return outputs

    def feed_context(self, slots: Sequence[int]) -> int:
        """One ragged drafter-context pass over the pending target features of these slots; returns the most
        positions one slot fed (a step's kept tokens, typically; a prompt or an idle stretch's backlog, more)."""
        todo = [s for s in slots if s in self._pending]
        if not todo:
            return 0
        starts = [self._pending[s][0] for s in todo]
        chunks = [torch.cat(self._pending.pop(s)[1]) for s in todo]
        batch = RaggedBatch.build(todo, starts, [len(c) for c in chunks])
        self.proposer.add_context(self.draft_cache, torch.cat(chunks), batch)
        return max(len(c) for c in chunks)

    def _speculate(self, requests: Sequence[Request]) -> list[StepOutput]:
        start = time.perf_counter()  # the whole step, policy included: what the length policy's costs must predict
        slots, anchors = [r.slot for r in requests], [r.output_ids[-1] for r in requests]
        drafted_hidden: dict[int, torch.Tensor] = {}
        fed = 0  # the most context positions one slot fed to the drafter this step

        def hidden_of(indices: Sequence[int]) -> torch.Tensor:
            """The drafter's block hidden states [len(indices), B, d], one pass for those not yet drafted this step."""
            nonlocal fed
            todo = [i for i in indices if i not in drafted_hidden]
            if todo:
                fed = max(fed, self.feed_context([slots[i] for i in todo]))
                h = self.proposer.draft_hidden(self.draft_cache, [slots[i] for i in todo], [anchors[i] for i in todo])
                drafted_hidden.update(zip(todo, h))
            return torch.stack([drafted_hidden[i] for i in indices])

        # Prompt-lookup drafts first (no model pass); the requests without a match are the length policy's.
        draft_tokens = self._lookup_drafts(requests)
        looked_up = {i for i, d in enumerate(draft_tokens) if d}
        by_policy = [i for i in range(len(requests)) if i not in looked_up]
        lengths = [len(d) for d in draft_tokens]
        if by_policy and self.proposer is not None:  # without a drafter, they decode one token
            # Learned policies look at the drafter's blocks (of the requests they choose) before any LM head runs.
            wanted = self.policy.decide([requests[i] for i in by_policy], self.max_draft,
                                        lambda idx: hidden_of([by_policy[j] for j in idx]))
            for i, k in zip(by_policy, wanted):
                lengths[i] = max(0, min(k, self.max_draft, requests[i].remaining - 1))
        drafting = [i for i in by_policy if lengths[i] > 0]  # the drafter's
        if not any(lengths):  # nothing to verify: a plain decode step
            outputs = self._decode(requests)
            for r in requests:
                self.policy.feedback(r, 0, 0)
            # A learned head's look ran the drafter: not a plain step's cost.
            self.policy.observe_step(lengths, time.perf_counter() - start, priced=not drafted_hidden)
            return outputs
        draft_probs: list[torch.Tensor | None] = [
            point_mass(draft_tokens[i], self.target.config.vocab_size) if i in looked_up and not r.sampling.greedy
            else None for i, r in enumerate(requests)]
        if drafting:
            sub = [requests[i] for i in drafting]
            rest = ([lengths[i] for i in drafting], [r.sampling for r in sub], [r.generator for r in sub])
            if drafted_hidden or self.recorder is not None:
                drafts = self.proposer.draft_tokens(hidden_of(drafting), *rest)
            else:
                fed = max(fed, self.feed_context([slots[i] for i in drafting]))
                drafts = self.proposer.propose(self.draft_cache, [slots[i] for i in drafting], [anchors[i] for i in drafting], *rest)
            for j, chunk in enumerate(drafts.tokens.split([lengths[i] for i in drafting])):
                draft_tokens[drafting[j]] = chunk.tolist()
                draft_probs[drafting[j]] = drafts.probs[j]

        # One target pass over every request's [anchor, drafts...]: the ragged verify batch.
        batch = RaggedBatch.build([r.slot for r in requests], [r.position for r in requests], [k + 1 for k in lengths])
        ids = torch.tensor([t for r, d in zip(requests, draft_tokens) for t in [r.output_ids[-1], *d]])
        out = self.target(ids, batch, self.target_cache, self.capture)
        rows = out.logits.split([k + 1 for k in lengths])
        features = out.hidden.split([k + 1 for k in lengths]) if self.capture else [None] * len(requests)

        results = self._verify(requests, lengths, draft_tokens, draft_probs, rows)

        # Roll each target cache back past its rejected drafts; the kept positions' features become context.
        for r, (accepted, _) in zip(requests, results):
            self.target_cache.rollback(r.slot, r.position + accepted + 1)
        if self.proposer is not None:
            for r, f, (accepted, _) in zip(requests, features, results):
                # The kept positions' features: the drafter's next context (after any still pending for the slot).
                self._pending.setdefault(r.slot, (r.position, []))[1].append(f[: accepted + 1])

        if self.recorder is not None and drafting:
            self.recorder.on_step(hidden_of(drafting), [lengths[i] for i in drafting], [results[i][0] for i in drafting])
        outputs = []
        for i, (r, k, d, (accepted, next_token), row, f) in enumerate(
                zip(requests, lengths, draft_tokens, results, rows, features)):
            r.accept_lengths.append(accepted + 1)
            r.draft_lengths.append(k)
            if i not in looked_up:  # the policy learns from the drafter's outcomes only
                self.policy.feedback(r, k, accepted)
            elif self.lookup_length is not None:
                self.lookup_length.feedback(r, k, accepted)
            committed = r.commit(d[:accepted] + [next_token])  # a stop token or the budget may cut it short
            outputs.append(self._output(r, committed, row, f[: len(committed)] if f is not None else None))
        # The step's cost teaches a cost model only when its drafter work is what its lengths say: not when the drafter
        # also caught up on a backlog (a prompt, or a request drafting again after idle steps) or ran for a request
        # that then drafted nothing (a learned head's look), nor when lookup drafts widened the verify (on text that
        # repeats itself the calibration then learns from fewer steps).
        priced = fed <= self.max_draft + 1 and drafted_hidden.keys() <= set(drafting) and not looked_up
        self.policy.observe_step(lengths, time.perf_counter() - start, priced)
        return outputs

    def _lookup_drafts(self, requests: Sequence[Request]) -> list[list[int]]:
        """Per request, the prompt-lookup drafts it verifies (never past its budget; sized by `LookupLength` unless
        every match is verified whole); [] without a match or lookup."""
        if self.prompt_lookup is None:
            return [[] for _ in requests]
        proposals = [self.prompt_lookup.propose(r.prompt_ids + r.output_ids, r.remaining - 1) for r in requests]
        if self.lookup_length is None or not any(proposals):
            return proposals
        return [p[:k] for p, k in zip(proposals, self.lookup_length.decide(requests, proposals))]

    def _verify(self, requests, lengths, draft_tokens, draft_probs, rows) -> list[tuple[int, int]]:
        """(accepted drafts, next token) per request. Greedy requests go through the ragged verifier in one
        call; sampling requests one by one, since each has its own temperature / top-k / top-p."""
        results: list[tuple[int, int] | None] = [None] * len(requests)
        greedy = [i for i, r in enumerate(requests) if r.sampling.greedy]
        if greedy:
            res = verify_greedy(
                torch.tensor([t for i in greedy for t in draft_tokens[i]], dtype=torch.long),
                argmax_rows(torch.cat([rows[i] for i in greedy]) if len(greedy) > 1 else rows[greedy[0]]),
                [lengths[i] for i in greedy],
            )
            for j, i in enumerate(greedy):
                results[i] = (int(res.num_accepted[j]), int(res.next_tokens[j]))
        for i, r in enumerate(requests):
            if results[i] is not None:
                continue
            k, p = lengths[i], logits_to_probs(rows[i], r.sampling)
            q = draft_probs[i] if draft_probs[i] is not None else p.new_zeros(0, p.shape[-1])
            res = verify_sampling(
                torch.tensor(draft_tokens[i], dtype=torch.long), q, p, [k],
                draw_uniforms(k, r.generator, p.device), draw_exponentials((1, p.shape[-1]), r.generator, p.device),
            )
            results[i] = (int(res.num_accepted[0]), int(res.next_tokens[0]))
        return results

    @staticmethod
    def _output(request: Request, new_tokens: list[int], logits: torch.Tensor, features: torch.Tensor | None) -> StepOutput:
        """`logits` [>= len(new_tokens), V]: the target's rows the new tokens were chosen from (in order)."""
        top_logprobs = top_ids = None
        if request.top_logprobs > 0 and new_tokens:
            top = torch.log_softmax(logits[: len(new_tokens)].float(), -1).topk(request.top_logprobs, -1)
            top_logprobs, top_ids = top.values.cpu(), top.indices.cpu()
        # Host copies (no-ops on a CPU): what callers keep of a step outlives the device's buffers.
        returned = features.cpu() if request.return_features and features is not None else None
        return StepOutput(request.request_id, new_tokens, request.finish_reason, top_logprobs, top_ids, returned)


def max_verified(proposer: DFlashProposer | None, prompt_lookup: PromptLookup | None) -> int:
    """Drafts one step may verify (either source): what every request's cache must leave room for."""
    return max(proposer.block_size - 1 if proposer else 0, prompt_lookup.num_tokens if prompt_lookup else 0)


def _checked(policy: LengthPolicy) -> LengthPolicy:
    """A policy missing part of the protocol fails here, not after a step has committed its tokens."""
    missing = [m for m in ("decide", "feedback", "observe_step") if not callable(getattr(policy, m, None))]
    if missing:
        raise TypeError(f"length policy {type(policy).__name__} lacks {', '.join(missing)} (speculative/length_policy.py)")
    return policy
