"""Measured step-cost tables with a context axis and an in-engine fit (`step_table.py`, `TableCost`): priced exactly
at their points and linearly between contexts, each kind of pass scaled to its seconds in place and the host's seconds
(both fitted from timed passes) added per pass, and a table measured on a real (tiny) target loading as the simulator
reads it."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.models.targets.model import load_target
from adaflash.simulation.step_cost import EngineFit, TableCost
from adaflash.simulation.step_table import PassLog, TimedPass, fit_engine, host_gaps
from adaflash.speculative.cost_model import measure_step_table
from adaflash.speculative.length_policy import FixedLength
from adaflash.speculative.reference import autoregressive_generate
from tests.helpers import scripted_dflash

DRAFTER = {"total_tokens": [1, 16], "verify_s": [0.007, 0.0098], "draft_s": 0.002, "draft_widths": [2, 16],
           "draft_width_s": [0.0012, 0.002]}


def _table(fit: dict | None = None) -> dict:
    """Two contexts; at 512 every cell costs 1.5x its 128 figure."""
    cells = [{"context": c, "batch": b, "new_tokens": n, "ms": (1.0 + b * n / 10) * (1.5 if c == 512 else 1.0)}
             for c in (128, 512) for b in (1, 8) for n in (1, 4)]
    table = {"verify_cost": {"context": 128, "cells": cells}, "cost_model": DRAFTER}
    return table | ({"engine_fit": fit} if fit else {})


def test_a_two_context_table_prices_linearly_in_context_and_adds_the_engine_fit(tmp_path):
    path = tmp_path / "table.json"
    fit = {"pass_s": 0.001, "request_s": 0.0002, "draft_token_s": 0.00005, "step_scale": 0.9, "prefill_scale": 0.8,
           "drafter_scale": 1.25, "feed_call_s": 0.0003, "feed_token_s": 0.00001, "steps": 9}
    path.write_text(json.dumps(_table(fit)))
    cost = TableCost.load(path)
    assert cost.contexts == (128, 512) and cost.engine_fit == EngineFit(**fit)
    host_verify = 0.001 + 8 * 0.0002 + 8 * 3 * 0.00005  # 8 requests verifying 3 drafts each
    assert cost.target_s([4] * 8, [128] * 8, 32) == pytest.approx(0.9 * (1 + 3.2) / 1e3 + host_verify)
    assert cost.target_s([4] * 8, [512] * 8, 32) == pytest.approx(0.9 * 1.5 * (1 + 3.2) / 1e3 + host_verify)
    between = (1 + 3.2) * 1.25 / 1e3  # mean context 320: halfway
    assert cost.target_s([4] * 8, [128, 512] * 4, 32) == pytest.approx(0.9 * between + host_verify)
    # A prefill (logits for its last rows only) pays its own scale and the pass and request terms, no drafted tokens'.
    assert cost.target_s([4] * 8, [128] * 8, 8) == pytest.approx(0.8 * (1 + 3.2) / 1e3 + 0.001 + 8 * 0.0002)
    assert cost.drafter_s(16, [0] * 3, 45) == pytest.approx(1.25 * 3 * 0.002)  # per request: no batched profile
    assert cost.feed_s(20) == pytest.approx(0.0003 + 20 * 0.00001) and cost.feed_s(0) == 0.0


def test_a_prefill_grid_prices_prefills_and_only_them(tmp_path):
    table = _table()
    table["verify_cost"]["prefill"] = [{"batch": b, "new_tokens": n, "ms": 2.0 * b * n / 32}
                                       for b in (1, 4) for n in (32, 256)]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    cost = TableCost.load(path)
    assert cost.target_s([256] * 4, [0] * 4, 4) == pytest.approx(2.0 * 4 * 256 / 32 / 1e3)  # at a point
    assert cost.target_s([144, 144], [0] * 2, 2) == pytest.approx(2.0 * 2 * 144 / 32 / 1e3)  # between (bilinear)
    assert cost.target_s([4] * 8, [128] * 8, 32) == pytest.approx((1 + 3.2) / 1e3)  # a verify pass: the verify grid
    table["verify_cost"]["prefill"].pop()
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=f"{path}: not a step-cost table.*prefill grid"):
        TableCost.load(path)


def test_a_table_without_a_host_or_contexts_reads_as_before(tmp_path):
    table = _table()
    table["verify_cost"]["cells"] = [{k: v for k, v in c.items() if k != "context"}
                                     for c in table["verify_cost"]["cells"] if c["context"] == 128]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    cost = TableCost.load(path)
    assert cost.contexts == (128,) and cost.engine_fit == EngineFit()
    assert cost.target_s([4] * 8, [5000] * 8, 32) == pytest.approx((1 + 3.2) / 1e3)  # one context: the table's


@pytest.mark.parametrize("fit, message", [({"pass_s": -0.001}, "negative"), ({"step_scale": 0}, "positive"),
                                          ({"speed": 2}, "unexpected keyword")])
def test_a_bad_engine_fit_is_refused_naming_the_file(tmp_path, fit, message):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table(fit)))
    with pytest.raises(ValueError, match=f"{path}: not a step-cost table.*{message}"):
        TableCost.load(path)


def _log(passes: list[tuple[str, float, list[int], bool]], host: EngineFit) -> PassLog:
    """A pass log whose gaps are `host`'s seconds (plus any drafter passes between): (kind, seconds, lens, prefill),
    every request at context 128."""
    log, now = PassLog(), 0.0
    for kind, seconds, lens, prefill in passes:
        if kind == "target" and log.passes:
            now += host.host_s(len(lens), 0 if prefill else sum(lens) - len(lens))
        log.passes.append(TimedPass(kind, now, now + seconds, lens, prefill, [128] * len(lens)))
        now += seconds
    return log


def test_the_engine_fit_scales_each_kind_of_pass_and_fits_the_gaps_less_the_drafter_s(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table()))
    table = TableCost.load(path)
    truth = EngineFit(0.002, 0.0003, 0.0001, feed_call_s=0.0004, feed_token_s=0.00002)
    shapes = [[1], [4], [1] * 8, [4] * 8, [2, 5, 1], [8] * 3, [3] * 16]
    passes = [("target", 0.7, [30], True)]
    for i, lens in enumerate(shapes * 3):
        if any(n > 1 for n in lens):
            passes += [("feed", 0.0, [2] * len(lens), False), ("drafter", 0.004, [16] * len(lens), False)]
        prefill = i % 5 == 4
        passes.append(("target", 0.7 if prefill else 1.1, lens, prefill))  # x table price below
    # Each pass's seconds: its standalone price times 0.7 (prefill) or 1.1 (decode / verify); drafter blocks 2.5x.
    passes = [(k, (s * table.standalone_target_s(lens, [128] * len(lens)) if k == "target" else
                   truth.feed_call_s + truth.feed_token_s * sum(lens) if k == "feed" else
                   2.5 * table.standalone_drafter_s(16, len(lens))), lens, p)
              for k, s, lens, p in passes]
    log = _log(passes, truth)
    assert len(host_gaps(log)) == len(shapes) * 3
    fitted = fit_engine([log], table)
    assert (fitted.pass_s, fitted.request_s, fitted.draft_token_s) == pytest.approx(
        (truth.pass_s, truth.request_s, truth.draft_token_s), abs=1e-9)
    assert (fitted.prefill_scale, fitted.drafter_scale) == pytest.approx((0.7, 2.5))
    assert (fitted.feed_call_s, fitted.feed_token_s) == pytest.approx((0.0004, 0.00002))
    assert fitted.step_scale == pytest.approx(1.1) and fitted.steps == len(shapes) * 3
    # No term below zero: gaps that shrink with the drafts fit a zero draft term, not a negative one.
    shrinking = _log(passes, EngineFit(0.002, 0.0003, 0.0))
    shrinking.passes[:] = [p._replace(start=p.start - 1e-5 * i, end=p.end - 1e-5 * i)
                           for i, p in enumerate(shrinking.passes)]
    assert min(v for v in fit_engine([shrinking], table).to_dict().values() if not isinstance(v, list)) >= 0
    with pytest.raises(ValueError, match="too few"):
        fit_engine([PassLog()], table)


def test_a_measured_table_of_a_real_target_loads_and_a_timed_engine_run_is_unchanged(tiny_checkpoints, tmp_path):
    target = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)
    table = measure_step_table(target, (1, 2), (1, 4), (8, 24), repeats=1, prefill_batches=(1, 2),
                               prefill_tokens=(6, 12), burst=2)
    assert {(c["context"], c["batch"], c["new_tokens"]) for c in table["cells"]} == {
        (c, b, n) for c in (8, 24) for b in (1, 2) for n in (1, 4)}
    assert {(c["batch"], c["new_tokens"]) for c in table["prefill"]} == {(b, n) for b in (1, 2) for n in (6, 12)}
    assert all(c["ms"] > 0 for c in table["cells"] + table["prefill"])
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"verify_cost": table, "cost_model": DRAFTER}))
    loaded = TableCost.load(path)
    assert loaded.contexts == (8, 24) and loaded.prefill_tokens == (6, 12)
    # The engine over timed models emits what it emits untimed; every target pass but the first leaves a gap.
    prompt, expected = [3, 14, 15], autoregressive_generate(target, [3, 14, 15], 20).token_ids
    log = PassLog()
    engine = Engine(log.target(target), log.proposer(scripted_dflash(target, [prompt + expected])), FixedLength(3),
                    max_batch=1, max_len=64)
    request = Request("r", prompt, 20)
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    assert request.output_ids == expected
    targets = [p for p in log.passes if p.kind == "target"]
    assert targets[0].prefill and not any(p.prefill for p in targets[1:])  # the prefill, then verify passes
    assert targets[1].contexts == [len(prompt)] and targets[1].lens == [4]  # the anchor and 3 drafts after the prompt
    assert len(host_gaps(log)) == len(targets) - 1
    assert [p.lens for p in log.passes if p.kind == "drafter"][0] == [4]  # a block of anchor + 3 drafts
    assert sum(sum(p.lens) for p in log.passes if p.kind == "feed") > 0  # the drafter's context feeds, timed apart


def test_the_virtual_clock_charges_a_context_feed_as_the_cost_model_prices_it(tmp_path):
    from adaflash.models.kv_cache.ragged import RaggedBatch
    from adaflash.simulation.clock import CostedProposer, VirtualClock

    class Fed:
        def add_context(self, cache, features, batch):
            self.fed = sum(batch.query_lens)

    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table({"feed_call_s": 0.0003, "feed_token_s": 0.00001})))
    clock, inner = VirtualClock(), Fed()
    CostedProposer(inner, TableCost.load(path), clock).add_context(None, None, RaggedBatch.build([0, 1], [5, 9], [2, 3]))
    assert inner.fed == 5 and clock.now == pytest.approx(0.0003 + 5 * 0.00001)


def test_the_step_scale_is_fitted_by_requests_and_read_between_them(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(_table()))
    table = TableCost.load(path)
    passes = [("target", 1.0, [30], True)]  # a prefill first, then decode passes of 1 request and of 16
    for lens, scale in [([1], 0.8)] * 30 + [([1] * 16, 1.3)] * 30 + [([1] * 5, 1.0)] * 5:  # 5 at 4-7: too few
        passes.append(("target", scale * table.standalone_target_s(lens, [128] * len(lens)), lens, False))
    fit = fit_engine([_log(passes, EngineFit())], table)
    assert [b for b, _ in fit.step_scales] == [1, 16]
    assert [x for _, x in fit.step_scales] == pytest.approx([0.8, 1.3])
    assert fit.step_scale_at(1) == pytest.approx(0.8) and fit.step_scale_at(64) == pytest.approx(1.3)
    assert fit.step_scale_at(4) == pytest.approx(0.8 + 0.5 * 0.5)  # halfway in log2 between 1 and 16
    assert EngineFit.from_dict(fit.to_dict()) == fit
    with pytest.raises(ValueError, match="ascending"):
        EngineFit.from_dict(fit.to_dict() | {"step_scales": [[16, 1.0], [1, 1.0]]})
