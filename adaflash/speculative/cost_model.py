"""What a step costs on this machine: the target's verify time against the batch's total tokens and the drafter's
time per drafting request, profiled once (`profile_cost_model`) and cached on disk per target, drafter, size and
thread count (`cost_model_for`), then corrected online from the engine's measured step times (`CalibratedCost`).
The expected-throughput length policies (`length_policy.py`) read it.
"""

from __future__ import annotations

import bisect
import functools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

# The profiling method's version, part of a cached profile's file name: a profile taken by an older method is not read.
# 2: round-robin over the points after a warm-up round, where 1 timed them one after another. 3: on CUDA, the drafter's
# pass by its number of requests too. 4: on CUDA, the verify by requests x new tokens too.
PROFILE_VERSION = 4


@dataclass(frozen=True)
class CostModel:
    """Seconds of one target verify pass as a function of the batch's total tokens (and of its requests, where a grid
    of requests x new tokens was profiled), plus the drafter's cost per drafting request: `draft_s` for a whole block,
    or by draft length where `draft_widths` were profiled (the proposer runs a block only as wide as the drafts it is
    asked for).

    Profiled on the running machine (`profile_cost_model`), piecewise-linear in between the measured points.
    """

    total_tokens: tuple[int, ...]
    verify_s: tuple[float, ...]
    draft_s: float
    draft_widths: tuple[int, ...] = ()  # drafter block widths profiled (anchor + drafts), ascending
    draft_width_s: tuple[float, ...] = ()
    # One drafter pass over n drafting requests (whole blocks), where a pass batches them (a GPU: eight requests cost
    # about what one does). Empty: n requests cost n times one (a CPU's compute-bound pass).
    draft_batches: tuple[int, ...] = ()
    draft_batch_s: tuple[float, ...] = ()
    # The verify pass by its requests too, where profiled (a GPU's: its step grows with every request's KV reads, which
    # one sequence's total-token curve never sees): seconds at verify_batches[i] requests of verify_widths[j] new
    # tokens each. Empty: by total tokens alone (a CPU's, whose pass is its tokens' compute).
    verify_batches: tuple[int, ...] = ()
    verify_widths: tuple[int, ...] = ()
    verify_grid_s: tuple[tuple[float, ...], ...] = ()

    def verify(self, tokens: int, requests: int = 1) -> float:
        """A verify pass of `tokens` new tokens over `requests` requests."""
        if not self.verify_grid_s:
            return _interpolate(self.total_tokens, self.verify_s, tokens)
        return bilinear(self.verify_batches, self.verify_widths, self.verify_grid_s, requests,
                        tokens / max(1, requests))

    def draft(self, num_draft: int) -> float:
        """The drafter's seconds for one request drafting `num_draft` tokens (0: not drafting)."""
        if num_draft <= 0:
            return 0.0
        if not self.draft_widths:
            return self.draft_s
        return _interpolate(self.draft_widths, self.draft_width_s, num_draft + 1, through_zero=False)

    @property
    def batched_drafter(self) -> bool:
        return bool(self.draft_batches)

    def draft_pass(self, requests: int, widest: int) -> float:
        """A batched drafter pass over `requests` drafting requests, the widest drafting `widest` tokens (its block's
        cost scales as one request's does with the width)."""
        if requests <= 0:
            return 0.0
        whole = _interpolate(self.draft_batches, self.draft_batch_s, requests, through_zero=False)
        return whole * self.draft(widest) / self.draft_s if self.draft_s > 0 else whole

    def to_json(self) -> str:
        return json.dumps({"total_tokens": self.total_tokens, "verify_s": self.verify_s, "draft_s": self.draft_s,
                           "draft_widths": self.draft_widths, "draft_width_s": self.draft_width_s,
                           "draft_batches": self.draft_batches, "draft_batch_s": self.draft_batch_s,
                           "verify_batches": self.verify_batches, "verify_widths": self.verify_widths,
                           "verify_grid_s": self.verify_grid_s})

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        d = json.loads(text)
        return cls(tuple(d["total_tokens"]), tuple(d["verify_s"]), float(d["draft_s"]),
                   tuple(d.get("draft_widths", ())), tuple(d.get("draft_width_s", ())),
                   tuple(d.get("draft_batches", ())), tuple(d.get("draft_batch_s", ())),
                   tuple(d.get("verify_batches", ())), tuple(d.get("verify_widths", ())),
                   tuple(tuple(row) for row in d.get("verify_grid_s", ())))


class CalibratedCost:
    """A profiled `CostModel` corrected online by the engine's measured step times (`observe`).

    The profile times the target's forward and the drafter's block alone. A real speculative step also pays the
    engine's own work per drafting request - feeding it the kept features, verifying, rolling caches back, host
    lists - which the profile never sees (2-4 ms a step on a Zen 1 EPYC in fp32, docs/notes.md, "Length policies"),
    and the machine's speed drifts after the profile. In place, each verified draft token may also cost more than
    the standalone profile says (an AMX Xeon: a 3-token verify 1.5x a decode step inside the engine, 1.1x alone).
    Three running estimates fix these: `scale`, measured / predicted over steps where nobody drafted (the drift);
    `per_draft_s`, the seconds a drafting request adds beyond the scaled prediction; and `per_extra_draft_s`, what each
    of its drafts after the first adds. The last two are a least-squares fit of the drafting steps' excess over their
    drafting requests and extra drafts (a step whose drafts are all single fits the first alone). All are exponentially
    weighted, forgetting by `forget` per observed step, starting from the profile (scale 1, 0 s) worth `prior_steps`
    steps; a step far off the prediction (a garbage collection, a first-shape warm-up) counts as at most 4x or 1/4 of
    it. While no plain step is seen the scale stays at its prior and the fit absorbs any drift; the plain steps that
    follow restore the split (`DraftingCheck`'s plain stretches make sure some come). The engine reports only steps
    whose drafter work is what their lengths say (`DrafterSource.observe_step`, engine/draft_sources.py).
    """

    def __init__(self, profile: CostModel, forget: float = 0.98, prior_steps: float = 4.0) -> None:
        if not 0.0 < forget <= 1.0 or prior_steps <= 0:
            raise ValueError(f"forget must be in (0, 1] and prior_steps > 0, got {forget} and {prior_steps}")
        self.profile, self.forget = profile, forget
        self._scale_sum, self._scale_weight = prior_steps, prior_steps  # sum of measured/predicted, of weights
        # The excess fit's normal equations over (drafting requests, extra drafts); the prior: (0 s, 0 s), a ridge.
        self._dd, self._de, self._ee = prior_steps, 0.0, prior_steps
        self._d_excess, self._e_excess = 0.0, 0.0
        self._solve()

    def _solve(self) -> None:
        """The three estimates from the running sums, once per observed step rather than at every price asked (a
        policy asks several a step, and each step's Python runs cold after the target's kernel)."""
        self.scale = self._scale_sum / self._scale_weight
        det = self._dd * self._ee - self._de ** 2
        self.per_draft_s = (self._d_excess * self._ee - self._e_excess * self._de) / det
        self.per_extra_draft_s = (self._e_excess * self._dd - self._d_excess * self._de) / det

    def predicted(self, lengths: Sequence[int]) -> float:
        """The profile's seconds for a step that verifies these draft lengths (one per request, 0: plain)."""
        verify = self.profile.verify(len(lengths) + sum(lengths), len(lengths))
        if not any(lengths):
            return verify
        if self.profile.batched_drafter:
            return verify + self.profile.draft_pass(len(lengths) - lengths.count(0), max(lengths))
        return verify + sum(self.profile.draft(k) for k in lengths if k > 0)

    def observe(self, lengths: Sequence[int], seconds: float) -> None:
        """One engine step (its requests' draft lengths) took `seconds` of wall time."""
        if not lengths:
            return
        predicted, drafting = self.predicted(lengths), len(lengths) - lengths.count(0)
        if predicted <= 0:
            return
        seconds = min(max(seconds, predicted * self.scale / 4), predicted * self.scale * 4)
        f = self.forget
        if drafting == 0:
            self._scale_sum = f * self._scale_sum + seconds / predicted
            self._scale_weight = f * self._scale_weight + 1.0
        else:
            excess, extra = seconds - self.scale * predicted, sum(k - 1 for k in lengths if k > 0)
            self._dd, self._de, self._ee = f * self._dd + drafting ** 2, f * self._de + drafting * extra, \
                f * self._ee + extra ** 2
            self._d_excess, self._e_excess = f * self._d_excess + drafting * excess, f * self._e_excess + extra * excess
        self._solve()

    def verify(self, tokens: int, requests: int = 1) -> float:
        return self.scale * self.profile.verify(tokens, requests)

    def draft(self, num_draft: int) -> float:
        if num_draft <= 0:
            return 0.0
        # A correction below zero says the profile over-priced drafting; it cannot make drafting free.
        return max(0.0, self.scale * self.profile.draft(num_draft) + self.per_draft_s
                   + self.per_extra_draft_s * (num_draft - 1))

    @property
    def batched_drafter(self) -> bool:
        return self.profile.batched_drafter

    def draft_pass(self, requests: int, widest: int) -> float:
        """A batched drafter pass (`CostModel.draft_pass`), corrected as `draft` is, per drafting request."""
        if requests <= 0:
            return 0.0
        return max(0.0, self.scale * self.profile.draft_pass(requests, widest)
                   + requests * (self.per_draft_s + self.per_extra_draft_s * (widest - 1)))


def axis_point(xs: Sequence[float], x: float) -> tuple[int, int, float]:
    """The two grid points around x on a sorted axis (the last two past its end) and x's weight on the second; on an
    axis of one point, that point."""
    if len(xs) == 1:
        return 0, 0, 0.0
    i = max(1, min(bisect.bisect_left(xs, x), len(xs) - 1))
    return i - 1, i, (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def bilinear(xs: Sequence[float], ys: Sequence[float], grid, x: float, y: float) -> float:
    """grid[i][j] at (xs[i], ys[j]), bilinear between points and linear past the edges, never below 0."""
    i0, i1, wx = axis_point(xs, x)
    j0, j1, wy = axis_point(ys, y)
    row = [(1 - wy) * grid[i][j0] + wy * grid[i][j1] for i in (i0, i1)]
    return max(0.0, (1 - wx) * row[0] + wx * row[1])


def _interpolate(xs: tuple, ys: tuple, x: float, through_zero: bool = True) -> float:
    """Piecewise-linear through the points, extrapolated linearly past the last; below the first, towards 0 (a
    verify of fewer tokens) or flat (a drafter pass has a floor)."""
    if x <= xs[0]:
        return ys[0] * x / xs[0] if through_zero else ys[0]
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def profile_points(max_tokens: int) -> list[int]:
    """The verify passes' total tokens a profile times."""
    return sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, max_tokens} & set(range(1, max_tokens + 1)))


def profile_widths(block_size: int) -> list[int]:
    """The drafter block widths (anchor + drafts) a profile times."""
    return sorted({w for w in (2, 4, 8, block_size) if w <= block_size})


def profile_batches(most: int) -> list[int]:
    """The drafting requests a batched drafter pass is timed over (on CUDA)."""
    return sorted({1, 2, 4, 8, 16, 32, 64, 128, most} & set(range(1, most + 1)))


def profile_cost_model(target, proposer, max_tokens: int, context: int = 128, repeats: int = 7,
                       batched_drafter: bool | None = None) -> CostModel:
    """Measure verify time at a few total-token counts and the drafter's step at a few widths, on this machine.

    Round-robin, after one warm-up round: each repeat times every point once, so a slow stretch of the machine (these
    VMs drift by tens of percent within a minute) falls on all points alike instead of bending the curve; medians.
    Timed one point after another, a profile had a 2-token verify cheaper than a 1-token one (4.75 vs 4.78 ms, session
    20's Xeon), and the throughput policy, reading the extra tokens as free, drafted where drafting lost.

    `batched_drafter`: time the drafter's pass by its number of drafting requests too (default: on CUDA, where a pass
    batches them; the simulator's measured tables ask for it on a CPU as well, to price what a CPU's batch costs)."""
    from adaflash.models.kv_cache.ragged import RaggedBatch
    from adaflash.speculative.sampling import SamplingParams

    from adaflash.models.device.placement import synchronize

    points = profile_points(max_tokens)
    vocab = target.config.vocab_size
    cache = target.new_cache(1, context + max_tokens)
    target((torch.arange(context) + 100) % vocab, RaggedBatch.build([0], [0], [context]), cache)

    def verify(n: int) -> None:
        target((torch.arange(n) + 100) % vocab, RaggedBatch.build([0], [context], [n]), cache)
        cache.rollback(0, context)
        synchronize(target.device)  # a pass is over when the device has run it

    times = _round_robin(verify, points, repeats)
    widths, width_s = [], []
    if proposer is not None:
        widths = profile_widths(proposer.block_size)
        probe = proposer.step_probe(context)

        def draft_step(w: int) -> None:
            probe(w)
            synchronize(target.device)

        width_s = _round_robin(draft_step, widths, repeats)
    batches, batch_s = [], []
    if batched_drafter is None:
        batched_drafter = target.device.type == "cuda"  # a GPU runs the drafting requests in one pass
    if proposer is not None and batched_drafter and proposer.capture_layers:  # (a DFlash drafter's pass)
        hidden = torch.zeros(context, len(proposer.capture_layers) * target.config.hidden_size, dtype=target.dtype)
        most = max(1, max_tokens // proposer.block_size)
        batches = profile_batches(most)
        slots = list(range(most))
        bcache = proposer.new_cache(most, context + proposer.block_size)
        proposer.add_context(bcache, hidden.repeat(most, 1), RaggedBatch.build(slots, [0] * most, [context] * most))

        def draft_batch(n: int) -> None:
            """As `draft_step`, for n requests in one pass: their kept positions fed, then their blocks."""
            proposer.add_context(bcache, hidden[:2].repeat(n, 1), RaggedBatch.build(slots[:n], [context] * n, [2] * n))
            proposer.propose(bcache, slots[:n], [100 % vocab] * n, [proposer.block_size - 1] * n, [SamplingParams()] * n,
                             [None] * n)
            for slot in slots[:n]:
                bcache.rollback(slot, context)
            synchronize(target.device)

        batch_s = _round_robin(draft_batch, batches, repeats)
    grid_batches, grid_widths, grid_s = (), (), ()
    if target.device.type == "cuda":  # a GPU's step grows with its requests' KV reads: the verify by requests too
        widest = proposer.block_size if proposer is not None else 16
        grid_batches = tuple(b for b in profile_batches(max(1, max_tokens // widest)) if b <= 32)
        grid_widths = tuple(w for w in (1, 2, 4, 8, 16) if w <= widest)
        if len(grid_batches) >= 2 and len(grid_widths) >= 2:
            cells = measure_step_table(target, grid_batches, grid_widths, (context,), repeats, burst=2)["cells"]
            ms = {(c["batch"], c["new_tokens"]): c["ms"] for c in cells}
            grid_s = tuple(tuple(ms[b, w] / 1e3 for w in grid_widths) for b in grid_batches)
        else:
            grid_batches, grid_widths = (), ()
    return CostModel(tuple(points), tuple(times), width_s[-1] if width_s else 0.0, tuple(widths), tuple(width_s),
                     tuple(batches), tuple(batch_s), grid_batches, grid_widths, grid_s)


def measure_step_table(target, batches: Sequence[int], new_tokens: Sequence[int], contexts: Sequence[int],
                       repeats: int = 5, prefill_batches: Sequence[int] = (), prefill_tokens: Sequence[int] = (),
                       burst: int = 1) -> dict:
    """Forward ms of every (context, batch, new tokens) cell, each sequence at `context` cached positions (random K/V:
    attention reads them whatever they hold) and logits for every new row, as a verify pass needs; and, where
    `prefill_batches` and `prefill_tokens` are given, of every prefill cell (batch x prompt tokens from an empty cache,
    logits for each sequence's last row). The format `TableCost.load` reads under "verify_cost" ("context": the first
    context, for readers of one-context tables; "prefill": its own grid).

    Round-robin over the cells after a warm-up round, `repeats` rounds, medians; `burst` > 1 times each cell warm, in
    a run of that many passes (`_round_robin`)."""
    from adaflash.models.device.placement import synchronize
    from adaflash.models.kv_cache.ragged import RaggedBatch

    widest, device = max(new_tokens), target.device
    longest = max([max(contexts) + widest, *prefill_tokens])
    slots = max([*batches, *prefill_batches])
    cache = target.new_cache(slots, longest)
    for slot in range(slots):  # every slot's blocks held throughout: a cell sets its context length only
        cache.grow(slot, longest)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    vocab = target.config.vocab_size
    low = min(100, vocab // 2)
    cells = [(c, b, n, False) for c in contexts for b in batches for n in new_tokens]
    cells += [(0, b, n, True) for b in prefill_batches for n in prefill_tokens]
    inputs = {}
    for c, b, n, prefill in cells:
        batch = RaggedBatch.build(list(range(b)), [c] * b, [n] * b)
        inputs[c, b, n, prefill] = (torch.randint(low, vocab, (b * n,), device=device), batch,
                                    batch.last_token_indices() if prefill else None)

    def run(i: int) -> None:
        context, b, _, _ = cells[i]
        ids, batch, logit_rows = inputs[cells[i]]
        cache.lengths[:b] = [context] * b
        target(ids, batch, cache, (), logit_rows)
        synchronize(device)  # a pass is over when the device has run it

    ms = [s * 1e3 for s in _round_robin(run, range(len(cells)), repeats, burst)]
    rows = [{"context": c, "batch": b, "new_tokens": n, "total_tokens": b * n, "ms": m}
            for (c, b, n, prefill), m in zip(cells, ms) if not prefill]
    one = {r["new_tokens"]: r["ms"] for r in rows if r["batch"] == min(batches) and r["context"] == contexts[0]}
    table = {"context": contexts[0], "contexts": list(contexts), "cells": rows,
             "verify16_over_decode_batch1": one[widest] / one[min(new_tokens)]}
    if prefill_batches and prefill_tokens:
        table["prefill"] = [{"batch": b, "new_tokens": n, "total_tokens": b * n, "ms": m}
                            for (_, b, n, prefill), m in zip(cells, ms) if prefill]
    return table


def _round_robin(run, points: Sequence[int], repeats: int, burst: int = 1) -> list[float]:
    """The median seconds of run(point) per point: one untimed round, then `repeats` rounds over every point. With
    `burst` > 1 a point runs once untimed in each round and then `burst` times back to back, timed together: an engine
    runs passes of one shape in a row, warm, where one timed call after a pass of another shape pays for the switch (on
    a CPU, a decode step alone cost 1.2x what it costs in a decode loop)."""
    for point in points:
        run(point)
    samples: list[list[float]] = [[] for _ in points]
    for _ in range(repeats):
        for i, point in enumerate(points):
            if burst > 1:
                run(point)
            start = time.perf_counter()
            for _ in range(burst):
                run(point)
            samples[i].append((time.perf_counter() - start) / burst)
    return [statistics.median(s) for s in samples]


@functools.lru_cache(maxsize=16)
def _read_cost_model(path: str, modified_ns: int) -> CostModel:
    """A cached profile, parsed once per process and file version: every engine a pipeline builds (one per generation)
    reads the same profile for its policy and its lookup sizing."""
    return CostModel.from_json(Path(path).read_text())


def load_or_profile_cost_model(target, proposer, max_tokens: int, cache_file: Path | None) -> CostModel:
    if cache_file is not None and cache_file.is_file():
        return _read_cost_model(str(cache_file), cache_file.stat().st_mtime_ns)
    model = profile_cost_model(target, proposer, max_tokens)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(model.to_json())
    return model


def cost_model_file(target, proposer, model_name: str, max_tokens: int) -> Path:
    """Where this target + drafter's cost model is cached in the user cache (one file per machine setting)."""
    from adaflash.models.device.placement import describe
    from adaflash.models.kernels.selection import kernel_fingerprint
    from adaflash.models.files import cache_root

    # Thread count is part of the key: verify time scales with it, and servers may be pinned to fewer cores.
    # The draft vocabulary too: trimming it exists to make drafting cheaper. And the CPU + kernel build + kernel mode:
    # a new kernel changes every cost. Without a drafter (prompt lookup alone) only the verify costs are profiled.
    if proposer is None:
        drafter = "-nodrafter"
    else:
        drafter = proposer.cost_key
    if target.device.type == "cpu":
        machine = f"th{torch.get_num_threads()}-k{kernel_fingerprint()}"
    else:  # a GPU's pass costs depend on the GPU, not on the host's threads or our CPU kernels
        gpu = "".join(c if c.isalnum() else "_" for c in describe(target.device))
        machine = f"{target.device.type}-{gpu}"
    name = f"{Path(str(model_name)).name}-{target.numerics}{drafter}-T{max_tokens}-{machine}-p{PROFILE_VERSION}.json"
    return cache_root() / "cost_models" / name


def cost_model_for(target, proposer, model_name: str, max_tokens: int) -> CostModel:
    """The cost model of this target + drafter (None: the target alone) on this machine, profiled once and cached in
    the user cache."""
    return load_or_profile_cost_model(target, proposer, max_tokens, cost_model_file(target, proposer, model_name, max_tokens))
