"""Replayed traces as the simulator's acceptance (`bench simulate --drafter trace:DIR`): real drafts, virtual time.

A trace (`--record-trace DIR` on `generate`, `serve` or `bench sweep`; formats/traces.py) holds, per finished request,
its prompt, the target's output and, per target pass, the drafter's whole block at the anchor it drafted from. The
replay runs the real engine over two stand-ins:

- `ReplayTarget` emits the recorded output: after output index i - 1 its greedy token is output[i]. Past the output
  (only a request that stopped on a stop token verifies there) it emits the drafts the recording's last pass accepted
  past the stop, then a token unlike the draft it verifies. So each replayed output is checked against the recorded one
  (`lossless`), as the synthetic path checks against the synthetic target's greedy decoding.
- `ReplayDrafter`, asked for k drafts at output index p (the anchor: the request's last committed token), proposes
  from the recorded blocks by one rule: take the block recorded at the latest anchor q <= p that has one (q = p when
  the recording anchored there), shifted by p - q (its token j drafted output index q + 1 + j, so the drafts for
  p + 1 ... p + k are block[p - q ...]); positions past the block's end (and every position before the first recorded
  block) get a token no output holds, which fails verification.

Replayed with the policy that recorded it (a deterministic one: `fixed:K`), every pass anchors where the recording's
did, so the accept lengths are the recording's, step for step (tested). Under another policy the engine reaches other
positions: a shifted block drafts there what the drafter drafted from an earlier anchor, which is what it proposes
after re-anchoring only where its proposal does not depend on the anchor; and no position past a recorded block's
reach is ever accepted, so a policy that drafts further than the recording did is under-stated. Record with the whole
block every step (`--length-policy fixed:B-1`) for the widest coverage.

The learned head (`ReplayHead`) reads, at a recorded anchor where the recording's head ran, the survival it recorded
there; anywhere else (and for a trace recorded without a head) the synthetic head's rule: survival alpha^j, alpha the
request's per-position acceptance rate over its recorded blocks (their leading tokens equal to the output, against the
first one that is not: an oracle of the request's rate, as the synthetic head with no calibration error).

Token ids are renumbered to a compact vocabulary (0 and 1 are no token's; 1 is the failing draft), so a pass's one-hot
logits stay small; prompts and outputs keep their lengths, so a pass's cost is the recorded lengths' on the priced
machine. Replay is greedy only: a sampled trace is refused. What it does not model: the recorded drafter's cost (the
step-cost model prices it), prompt lookup (its drafts carry no block), and a drafter re-anchored at a position the
recording never drafted from.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from adaflash.engine.request import Request
from adaflash.formats.traces import TraceRecord, read_traces
from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import ForwardOutput
from adaflash.simulation.clock import CostedProposer, CostedTarget, VirtualClock
from adaflash.simulation.simulate import run_engine
from adaflash.simulation.synthetic import SyntheticConfig

FAIL = 1  # the compact id no recorded token has: a draft that fails verification


@dataclass(frozen=True)
class ReplayRecord:
    """One recorded request in compact ids: its blocks by anchor (sorted), its head's survival by anchor, what the
    target agreed to past its output (`tail`) and its per-position acceptance rate (the fallback head's)."""

    prompt: tuple[int, ...]
    output: tuple[int, ...]
    max_new_tokens: int
    stop: tuple[int, ...]
    anchors: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    heads: dict[int, tuple[float, ...]]
    tail: tuple[int, ...]
    rate: float
    accept_lengths: tuple[int, ...]  # the recording's, one a target pass

    def draft(self, p: int, k: int) -> list[int]:
        """The replay rule: k drafts at anchor p from the latest recorded block at q <= p, shifted by p - q."""
        i = bisect.bisect_right(self.anchors, p) - 1
        if i < 0:
            return [FAIL] * k
        shift, block = p - self.anchors[i], self.blocks[i]
        return [block[shift + m] if shift + m < len(block) else FAIL for m in range(k)]

    def survival(self, p: int, n: int) -> list[float]:
        """The head at anchor p: the recorded survival where the recording's head read a block there, else rate^j."""
        head = self.heads.get(p)
        if head:
            return [*head[:n], *[0.0] * (n - len(head))]
        return [self.rate ** j for j in range(1, n + 1)]

    def target(self, i: int, verifying: int | None) -> int:
        """The replayed target's token at output index i, `verifying` the draft it is checked against (if any)."""
        if 0 <= i < len(self.output):
            return self.output[i]
        j = i - len(self.output)
        if 0 <= j < len(self.tail):
            return self.tail[j]
        return 2 + ((verifying or 0) - 1) % 2  # unlike the draft (2 or 3): past the output no draft is kept


def _matched(block: Sequence[int], output: Sequence[int], q: int) -> tuple[int, int]:
    """(leading block tokens equal to the output after anchor q, block positions inside the output)."""
    covered = min(len(block), len(output) - 1 - q)
    m = 0
    while m < covered and block[m] == output[q + 1 + m]:
        m += 1
    return m, covered


@dataclass(frozen=True)
class Trace:
    """A loaded trace in compact ids. `dropped`: records left out because an earlier one had the same prompt (the
    replayed target knows a request by its prompt)."""

    records: tuple[ReplayRecord, ...]
    vocab_size: int
    block_size: int
    source: str
    dropped: int = 0

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        raw = read_traces(path)
        if not raw:
            raise ValueError(f"{path}: the trace holds no records")
        sampled = sum(not r.greedy for r in raw)
        if sampled:
            raise ValueError(f"{path}: {sampled} of {len(raw)} records were sampled: replay takes greedy traces")
        sizes = {r.block_size for r in raw}
        if len(sizes) > 1 or min(sizes) < 2:
            raise ValueError(f"{path}: replay needs one drafter's blocks, got block sizes {sorted(sizes)} (1: recorded "
                             "without a drafter)")
        seen, kept = set(), []
        for r in raw:
            if r.prompt_ids not in seen:
                seen.add(r.prompt_ids)
                kept.append(r)
        ids = sorted({t for r in kept for t in (*r.prompt_ids, *r.output_ids, *r.stop_token_ids,
                                                 *(x for s in r.steps for x in s.block))})
        compact = {t: i + 2 for i, t in enumerate(ids)}
        records = tuple(_compact(r, compact) for r in kept)
        return cls(records, max(len(ids) + 2, 4), sizes.pop(), str(path), len(raw) - len(kept))

    def survival(self) -> list[float]:
        """P(the first j drafts of a recorded block are all accepted), j = 1 .. block - 1, over every block's positions
        inside its output (non-increasing): the vLLM schedule's survival curve, as the synthetic path's alpha^j."""
        hits, covers = [0] * (self.block_size - 1), [0] * (self.block_size - 1)
        for r in self.records:
            for q, block in zip(r.anchors, r.blocks):
                m, covered = _matched(block, r.output, q)
                for j in range(covered):
                    covers[j] += 1
                    hits[j] += j < m
        curve, last = [], 1.0
        for h, c in zip(hits, covers):
            last = min(last, h / c) if c else last
            curve.append(last)
        return curve

    def requests(self, n: int) -> tuple[list[Request], list[list[int]]]:
        """n requests, the recorded ones cycled, and the outputs each must produce."""
        picked = [self.records[i % len(self.records)] for i in range(n)]
        return ([Request(f"r{i}", list(r.prompt), r.max_new_tokens, stop_token_ids=r.stop) for i, r in enumerate(picked)],
                [list(r.output) for r in picked])

    def describe(self) -> str:
        dropped = f", {self.dropped} left out (a prompt recorded twice)" if self.dropped else ""
        return (f"trace {self.source} (replayed): {len(self.records)} recorded requests{dropped}, block "
                f"{self.block_size}, recorded blocks shifted to the replayed anchors (simulation/replay.py)")


def _compact(r: TraceRecord, ids: dict[int, int]) -> ReplayRecord:
    output = tuple(ids[t] for t in r.output_ids)
    anchors, blocks, heads, tail = [], [], {}, ()
    successes = trials = 0
    for s in r.steps:
        if s.head:
            heads[s.anchor] = s.head
        if not s.block:
            continue
        block = tuple(ids[t] for t in s.block)
        if anchors and anchors[-1] == s.anchor:  # (one block an anchor; a later one would be a retry)
            continue
        anchors.append(s.anchor)
        blocks.append(block)
        m, covered = _matched(block, output, s.anchor)
        successes, trials = successes + m, trials + m + (m < covered)
    last = r.steps[-1] if r.steps else None
    if last is not None and last.block and r.finish_reason == "stop":  # drafts kept past the stop: the target's too
        past = len(output) - 1 - last.anchor
        tail = tuple(ids[t] for t in last.block[past:last.accept_length - 1])
    rate = min(successes / trials, 0.999) if trials else 0.0
    return ReplayRecord(tuple(ids[t] for t in r.prompt_ids), output, r.max_new_tokens,
                        tuple(ids[t] for t in r.stop_token_ids), tuple(anchors), tuple(blocks), heads, tail, rate,
                        tuple(s.accept_length for s in r.steps))


class ReplayTarget:
    """The engine's target protocol over a trace: one-hot logits of the recorded tokens, zero features, a cache of
    lengths only. A slot's record is the one whose prompt its prefill carries."""

    rows_independent = False  # (no prefix reuse: a slot's prefill always carries its whole prompt)
    device = torch.device("cpu")
    dtype = torch.float32

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.config = SyntheticConfig(vocab_size=trace.vocab_size)
        self._by_prompt = {r.prompt: i for i, r in enumerate(trace.records)}
        self.slot_record: dict[int, int] = {}  # slot -> index of the record it replays

    def new_cache(self, num_slots: int, max_len: int, dtype=None, **pool) -> KVCache:
        return KVCache(1, num_slots, max_len, 1, 1, torch.float32, **pool)  # lengths only: nothing is written

    def kv_bytes_per_token(self, dtype=None) -> int:
        return 8  # the cache above: one fp32 K and V value a position

    def __call__(self, token_ids: torch.Tensor, batch: RaggedBatch, cache: KVCache, capture_layers=(),
                 logit_indices: torch.Tensor | None = None) -> ForwardOutput:
        tokens, positions = token_ids.tolist(), batch.positions.tolist()
        owner, offset = [], 0  # per flat row: (its record, its segment's end)
        for slot, start, n in zip(batch.slots, batch.starts, batch.query_lens):
            if start == 0:
                prompt = tuple(tokens[offset:offset + n])
                if prompt not in self._by_prompt:
                    raise ValueError("a prompt the trace does not hold")
                self.slot_record[slot] = self._by_prompt[prompt]
            record = self.trace.records[self.slot_record[slot]]
            owner += [(record, offset + n)] * n
            offset += n
        rows = range(len(tokens)) if logit_indices is None else logit_indices.tolist()
        logits = torch.zeros(len(rows), self.config.vocab_size)
        for r, i in enumerate(rows):
            record, end = owner[i]
            logits[r, record.target(positions[i] + 1 - len(record.prompt), tokens[i + 1] if i + 1 < end else None)] = 1
        for slot, end in zip(batch.slots, batch.ends):
            cache.lengths[slot] = end
        hidden = torch.zeros(len(tokens), len(capture_layers) * self.config.hidden_size) if capture_layers else None
        return ForwardOutput(logits=logits, hidden=hidden)


class ReplayDrafter:
    """The engine's proposer protocol over a trace (`ReplayRecord.draft`'s rule). Its "hidden states" carry the record
    and the anchor's output index, so `ReplayHead` and `draft_tokens` know whose block a row is."""

    def __init__(self, target: ReplayTarget) -> None:
        self.target = target
        self.capture_layers = (0,)

    @property
    def block_size(self) -> int:
        return self.target.trace.block_size

    def new_cache(self, num_slots: int, max_len: int, **pool) -> KVCache:
        return KVCache(1, num_slots, max_len, 1, 1, torch.float32, **pool)  # lengths only: nothing is written

    def add_context(self, cache: KVCache, features: torch.Tensor, batch: RaggedBatch) -> None:
        for slot, end in zip(batch.slots, batch.ends):
            cache.lengths[slot] = end

    def _anchor(self, cache: KVCache, slot: int) -> tuple[int, int]:
        """(the slot's record index, the anchor's output index): the context holds every position before it."""
        index = self.target.slot_record[slot]
        return index, int(cache.lengths[slot]) - len(self.target.trace.records[index].prompt)

    def _drafts(self, where: Sequence[tuple[int, int]], num_draft: Sequence[int], sampling):
        from adaflash.speculative.proposer import Drafts

        if any(not p.greedy for p in sampling):
            raise ValueError("a replayed trace drafts greedy requests only")
        records = self.target.trace.records
        tokens = [t for (index, p), k in zip(where, num_draft) for t in records[index].draft(p, k)]
        return Drafts(tokens=torch.tensor(tokens, dtype=torch.long), probs=(None,) * len(num_draft),
                      num_draft=tuple(num_draft))

    def propose(self, cache, slots, anchors, num_draft, sampling, generators):
        return self._drafts([self._anchor(cache, s) for s in slots], num_draft, sampling)

    def draft_hidden(self, cache, slots, anchors, width=None) -> torch.Tensor:
        """[n, width, 2]: the record index and the anchor's output index of each row's block."""
        hidden = torch.zeros(len(slots), width or self.block_size, 2)
        for row, slot in enumerate(slots):
            hidden[row, :, 0], hidden[row, :, 1] = self._anchor(cache, slot)
        return hidden

    def draft_tokens(self, hidden, num_draft, sampling, generators, anchors=None):
        return self._drafts([(int(row[0, 0]), int(row[0, 1])) for row in hidden], num_draft, sampling)


class ReplayHead:
    """A length head over replayed blocks: `ReplayRecord.survival` of each row's record at its anchor."""

    def __init__(self, trace: Trace) -> None:
        self.records = trace.records

    def survival(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[1] - 1
        return torch.tensor([self.records[int(row[0, 0])].survival(int(row[0, 1]), n) for row in hidden],
                            dtype=torch.float32).reshape(len(hidden), n)


@dataclass(frozen=True)
class TraceSource:
    """`bench simulate`'s acceptance from a trace: the recorded requests (cycled to `requests`) over the replayed
    models."""

    trace: Trace
    requests: int

    @property
    def label(self) -> str:
        return f"trace {self.trace.source} (replayed)"

    def describe(self) -> str:
        return self.trace.describe()

    def workload_dict(self) -> dict:
        return {"requests": self.requests, "recorded_requests": len(self.trace.records),
                "prompt_tokens": sum(len(r.prompt) for r in self.trace.records),
                "output_tokens": sum(len(r.output) for r in self.trace.records)}

    def run(self, variant, cost, concurrency: int) -> dict:
        clock, replayed = VirtualClock(), ReplayTarget(self.trace)
        target = CostedTarget(replayed, cost, clock)
        proposer = CostedProposer(ReplayDrafter(replayed), cost, clock)
        requests, expected = self.trace.requests(self.requests)
        return run_engine(variant, cost, clock, target, proposer, ReplayHead(self.trace), self.trace.survival(),
                          concurrency, requests, expected)
