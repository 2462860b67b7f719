"""What the engine's own run adds to a machine's measured step costs (`measure_step_table` in
speculative/cost_model.py: what `make gpu-check` writes and `TableCost` reads), which no standalone profile sees
(`PassLog`, `fit_engine`).

The fit comes from a run of the real engine in wall time with every target pass, drafter pass and drafter context
feed timed where it runs: each kind of pass's seconds in place over the table's price for it (a scale a kind, decode /
verify by its requests), what a step took beyond its passes regressed on the step's requests and drafted tokens (the
host's seconds), and the feeds' seconds on their positions - `EngineFit`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from adaflash.simulation.step_cost import EngineFit, TableCost


class TimedPass(NamedTuple):
    """One pass's wall-time interval: a target pass (`lens`: its new tokens a request, `contexts`: the positions each
    request's cache held before it), a drafter's block or look (`lens`: the blocks' widths, as the simulator charges
    them) or a drafter's context feed (`lens`: the positions fed a request)."""

    kind: str  # "target", "drafter" or "feed"
    start: float
    end: float
    lens: Sequence[int]
    prefill: bool = False
    contexts: Sequence[int] = ()


@dataclass
class PassLog:
    """The timed passes of a run, in order."""

    passes: list[TimedPass] = field(default_factory=list)

    def target(self, target) -> "_Timed":
        return _Timed(target, self)

    def proposer(self, proposer) -> "_Timed":
        return _Timed(proposer, self)


class _Timed:
    """A model (target or proposer) whose passes are timed into a `PassLog` (its other attributes show through)."""

    def __init__(self, inner, log: PassLog) -> None:
        self._inner, self._log = inner, log

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _timed(self, kind: str, run, *args, lens: Sequence[int] = (), prefill: bool = False,
               contexts: Sequence[int] = ()):
        start = time.perf_counter()
        out = run(*args)
        self._log.passes.append(TimedPass(kind, start, time.perf_counter(), list(lens), prefill, list(contexts)))
        return out

    def __call__(self, token_ids, batch, cache, capture_layers=(), logit_indices=None):
        # A prefill asks for its last rows' logits only; a decode or verify pass for every row.
        return self._timed("target", self._inner, token_ids, batch, cache, capture_layers, logit_indices,
                           lens=batch.query_lens, prefill=logit_indices is not None, contexts=batch.starts)

    def propose(self, cache, slots, anchors, num_draft, *rest):
        return self._timed("drafter", self._inner.propose, cache, slots, anchors, num_draft, *rest,
                           lens=[max(2, max(num_draft) + 1)] * len(slots))

    def draft_hidden(self, cache, slots, anchors, width=None):
        return self._timed("drafter", self._inner.draft_hidden, cache, slots, anchors, width,
                           lens=[width or self._inner.block_size] * len(slots))

    def add_context(self, cache, features, batch):
        return self._timed("feed", self._inner.add_context, cache, features, batch, lens=batch.query_lens)


def host_gaps(log: PassLog) -> list[tuple[int, int, float]]:
    """Per target pass after the first: its requests, its drafted tokens (0 for a prefill), and the wall seconds since
    the previous target pass ended that no drafter pass took (the engine's own work: scheduling, drafting checks,
    verifying, committing)."""
    gaps, last_end, drafter = [], None, 0.0
    for p in log.passes:
        if p.kind != "target":
            drafter += p.end - p.start
            continue
        if last_end is not None:
            gaps.append((len(p.lens), 0 if p.prefill else sum(p.lens) - len(p.lens),
                         max(0.0, p.start - last_end - drafter)))
        last_end, drafter = p.end, 0.0
    return gaps


def seconds_by_kind(logs: Sequence[PassLog], table: TableCost, fitted: bool = True) -> dict[str, list[float]]:
    """Per kind of pass (decode / verify "step", "prefill", "drafter", "feed") and the engine's own time between passes
    ("host"): [measured, priced] seconds over the logs, priced by `table` with its in-engine fit (`fitted`) or as it
    stands alone (no scales, no host, no feeds)."""
    out = {k: [0.0, 0.0] for k in ("step", "prefill", "drafter", "feed", "host")}
    fit = table.engine_fit
    for p in (p for log in logs for p in log.passes):
        kind = p.kind if p.kind != "target" else "prefill" if p.prefill else "step"
        if kind == "feed":
            price = table.feed_s(sum(p.lens)) if fitted else 0.0
        elif kind != "drafter":
            price = table.standalone_target_s(p.lens, p.contexts, p.prefill)
            price *= (fit.prefill_scale if p.prefill else fit.step_scale_at(len(p.lens))) if fitted else 1.0
        else:
            price = table.standalone_drafter_s(p.lens[0], len(p.lens)) if p.lens else 0.0
            price *= fit.drafter_scale if fitted else 1.0
        out[kind][0] += p.end - p.start
        out[kind][1] += price
    for requests, drafted, seconds in (g for log in logs for g in host_gaps(log)):
        out["host"][0] += seconds
        out["host"][1] += fit.host_s(requests, drafted) if fitted else 0.0
    return out


def fit_engine(logs: Sequence[PassLog], table: TableCost) -> EngineFit:
    """`table`'s fit to the engine's timed runs: per kind of pass (decode / verify, prefill, drafter) its seconds in
    place over the table's standalone price for the same passes, decode / verify also by its requests (a power-of-two
    bucket with 20 passes or more); a least squares of each target pass's host gap on (1,
    its requests, its drafted tokens), and of each context feed's seconds on (1, its positions), no term below zero."""
    kinds = seconds_by_kind(logs, table, fitted=False)
    scales = {k: measured / priced if priced > 0 else 1.0 for k, (measured, priced) in kinds.items()}
    gaps = [g for log in logs for g in host_gaps(log)]
    if len(gaps) < 3:
        raise ValueError(f"too few timed steps to fit the engine's own time ({len(gaps)})")
    host = _nonnegative_fit([[1.0, requests, drafted] for requests, drafted, _ in gaps], [s for _, _, s in gaps])
    # The decode / verify scale by requests: per power-of-two bucket of a pass's requests with enough passes in it.
    buckets: dict[int, list[float]] = {}
    for p in (p for log in logs for p in log.passes if p.kind == "target" and not p.prefill):
        bucket = buckets.setdefault(1 << (len(p.lens).bit_length() - 1), [0.0, 0.0, 0])
        bucket[0] += p.end - p.start
        bucket[1] += table.standalone_target_s(p.lens, p.contexts)
        bucket[2] += 1
    step_scales = tuple((b, m / priced) for b, (m, priced, n) in sorted(buckets.items()) if n >= 20 and priced > 0)
    feeds = [(sum(p.lens), p.end - p.start) for log in logs for p in log.passes if p.kind == "feed"]
    feed = _nonnegative_fit([[1.0, n] for n, _ in feeds], [s for _, s in feeds]) if len(feeds) >= 2 else [0.0, 0.0]
    return EngineFit(host[0], host[1], host[2], scales["step"], scales["prefill"], scales["drafter"], feed[0], feed[1],
                     steps=len(gaps), step_scales=step_scales)


def _nonnegative_fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least-squares coefficients of ys on the rows' columns, none below zero (a negative one is dropped, the rest
    refitted)."""
    x, y = torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    keep = list(range(x.shape[1]))
    while True:
        coef = torch.linalg.lstsq(x[:, keep], y).solution.flatten().tolist()
        if min(coef) >= 0 or len(keep) == 1:
            break
        keep.pop(coef.index(min(coef)))
    terms = [0.0] * x.shape[1]
    for k, c in zip(keep, coef):
        terms[k] = max(0.0, c)
    return terms
