"""Replayed traces as the simulator's acceptance (`--record-trace`, `bench simulate --drafter trace:DIR`) and measured
step-cost tables (`--cost-model FILE`): what is recorded, that a replay under the recording's policy reproduces every
accept length, that every other policy stays lossless over it, and that bad files are refused by name and line."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.cli import main
from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.engine.trace_recorder import TraceRecorder
from adaflash.formats.traces import TRACE_FILE, read_traces
from adaflash.models.targets.model import load_target
from adaflash.simulation.clock import CostedProposer, CostedTarget, VirtualClock
from adaflash.simulation.replay import (FAIL, ReplayDrafter, ReplayHead, ReplayRecord, ReplayTarget, Trace,
                                        TraceSource)
from adaflash.simulation.simulate import VARIANTS, Variant, policy_profile, run_engine
from adaflash.simulation.step_cost import ProfileCost, RooflineCost, TableCost
from adaflash.speculative.cost_model import CostModel
from adaflash.speculative.length_policy import FixedLength, LearnedThroughputLength
from adaflash.speculative.reference import autoregressive_generate
from tests.helpers import scripted_dflash

PROMPTS = [[3, 14, 15, 92], [65, 35], [89, 79, 32, 38, 46, 26, 43], [11], [7, 7, 7, 7, 7, 7], [50, 51, 52]]
BUDGETS = [40, 34, 66, 44, 50, 36]
H100 = RooflineCost.of("h100", "qwen3-8b")
FLAT_COST = CostModel(total_tokens=(1, 8, 32, 128), verify_s=(0.01, 0.0101, 0.0105, 0.014), draft_s=0.001)


@pytest.fixture(scope="module")
def target(tiny_checkpoints):
    return load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)


@pytest.fixture(scope="module")
def expected(target):
    return [autoregressive_generate(target, p, n, stop_token_ids=(1,)).token_ids for p, n in zip(PROMPTS, BUDGETS)]


def _record(target, expected, out, policy, stop: int = 1) -> list[Request]:
    """The engine over the tiny target and a scripted drafter (mostly right, seeded corruptions: every accept length
    occurs), three slots, its trace recorded to `out`; `stop` ends a request (1: never made; 86: every one, 16-23
    tokens in, the drafter drafting past it)."""
    scripts = [p + e for p, e in zip(PROMPTS, expected)]
    engine = Engine(target, scripted_dflash(target, scripts), policy, max_batch=3, max_len=256,
                    recorder=TraceRecorder(out, 8, drafter_version="v1"))
    requests = [Request(f"r{i}", p, n, stop_token_ids=(stop,)) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in requests] == [e[:e.index(stop) + 1] if stop in e else e for e in expected]
    return requests


@pytest.fixture(scope="module")
def recorded(target, expected, tmp_path_factory):
    """A trace recorded under fixed:7 (the whole block of 8)."""
    out = tmp_path_factory.mktemp("trace")
    return out, _record(target, expected, out, FixedLength(7))


@pytest.fixture(scope="module")
def recorded_stops(target, expected, tmp_path_factory):
    out = tmp_path_factory.mktemp("trace-stops")
    return out, _record(target, expected, out, FixedLength(7), stop=86)


def test_a_trace_holds_every_pass_and_each_whole_block(recorded):
    out, requests = recorded
    records = {r.prompt_ids: r for r in read_traces(out)}
    assert len(records) == len(requests)
    for request in requests:
        record = records[tuple(request.prompt_ids)]
        assert record.output_ids == tuple(request.output_ids) and record.drafter_version == "v1"
        assert [s.accept_length for s in record.steps] == request.accept_lengths
        assert [s.verified for s in record.steps] == request.draft_lengths
        anchor = 0
        for step in record.steps:
            assert step.anchor == anchor and step.head == ()
            anchor += step.accept_length
            if not step.verified:
                continue
            kept = step.accept_length - 1  # the block's first drafts are the ones verified: the kept ones are right
            assert len(step.block) == 7 and step.block[:kept] == record.output_ids[step.anchor + 1:step.anchor + 1 + kept]
            if kept < step.verified:  # and the first one the target refused is not its token
                assert step.block[kept] != record.output_ids[step.anchor + 1 + kept]


def _replayed(trace: Trace, variant: Variant, concurrency: int, cost=H100) -> tuple[dict, list[Request]]:
    clock, replayed = VirtualClock(), ReplayTarget(trace)
    target, proposer = CostedTarget(replayed, cost, clock), CostedProposer(ReplayDrafter(replayed), cost, clock)
    requests, expected = trace.requests(len(trace.records))
    row = run_engine(variant, cost, clock, target, proposer, ReplayHead(trace), trace.survival(), concurrency,
                     requests, expected)
    return row, requests


@pytest.mark.parametrize("stops", [False, True])
@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_replay_under_the_recording_policy_reproduces_every_accept_length(recorded, recorded_stops, concurrency, stops):
    """Step for step, the last included: where a request stopped, the drafts the recording kept past its stop token
    are kept again (the replayed target's tail)."""
    out, recorded_requests = recorded_stops if stops else recorded
    trace = Trace.load(out)
    assert all(r.finish_reason == ("stop" if stops else "length") for r in recorded_requests)
    row, requests = _replayed(trace, Variant("fixed:7", "dflash", "fixed:7"), concurrency)
    assert row["lossless"] and row["accept_len"] > 2
    for request, record in zip(requests, trace.records):
        assert tuple(request.accept_lengths) == record.accept_lengths
    if stops:  # some request's last pass kept drafts past its stop token
        assert any(r.tail for r in trace.records)


@pytest.mark.parametrize("variant", ["ar", "fixed:2", "heuristic", "throughput", "ema-budget", "vllm-schedule",
                                     "adaflash", "adaflash-gated"])
def test_replay_under_another_policy_is_lossless(recorded, variant):
    v = VARIANTS.get(variant) or Variant(variant, "dflash", variant)
    row = TraceSource(Trace.load(recorded[0]), 9).run(v, H100, 4)  # the six recorded requests, cycled
    assert row["lossless"] and row["generated_tokens"] == sum(BUDGETS) + sum(BUDGETS[:3])
    if variant == "fixed:2":
        assert row["drafts_per_pass"] > 1 and row["accept_len"] > 1.5


def test_the_replay_rule_shifts_the_latest_block_and_fails_past_it():
    record = ReplayRecord(prompt=(5,), output=(10, 11, 12, 13, 14, 15, 16, 17), max_new_tokens=8, stop=(),
                          anchors=(0, 4), blocks=((11, 12, 9), (15, 16, 17)), heads={4: (0.9, 0.5, 0.1)}, tail=(),
                          rate=0.5, accept_lengths=())
    assert record.draft(0, 3) == [11, 12, 9]  # recorded here
    assert record.draft(1, 3) == [12, 9, FAIL]  # the block at 0, shifted by 1; past its end a failing token
    assert record.draft(3, 2) == [FAIL, FAIL]
    assert record.draft(5, 2) == [16, 17]
    assert record.survival(4, 4) == [0.9, 0.5, 0.1, 0.0] and record.survival(1, 2) == [0.5, 0.25]
    assert record.target(7, None) == 17 and record.target(8, 2) != 2 and record.target(8, 3) != 3


def test_the_learned_head_s_predictions_are_recorded_and_replayed(target, expected, tmp_path):
    from adaflash.models.drafters.length_head import LengthHeadConfig, PositionAcceptanceHead

    torch.manual_seed(3)
    head = PositionAcceptanceHead(LengthHeadConfig(kind="position", hidden_size=target.config.hidden_size,
                                                   block_size=8, head_dim=16)).eval()
    with torch.no_grad():
        head.fc2.bias.add_(4.0)  # leaning toward drafting, its input still moving it
    _record(target, expected, tmp_path, LearnedThroughputLength(FLAT_COST, head))
    steps = [s for r in read_traces(tmp_path) for s in r.steps]
    headed = [s for s in steps if s.head]
    assert headed and all(len(s.head) == 7 and len(s.block) == 7 and 0 <= min(s.head) <= max(s.head) <= 1
                          for s in headed)
    assert all(s.block for s in steps if s.verified)
    trace = Trace.load(tmp_path)
    record = next(r for r in trace.records if r.heads)
    anchor, survival = next(iter(record.heads.items()))
    hidden = torch.tensor([[[float(trace.records.index(record)), float(anchor)]] * 8])
    assert ReplayHead(trace).survival(hidden)[0].tolist() == pytest.approx(list(survival))
    assert TraceSource(trace, 6).run(VARIANTS["adaflash"], H100, 3)["lossless"]


def test_a_corrupt_trace_is_refused_by_file_and_line(recorded, tmp_path):
    lines = (recorded[0] / TRACE_FILE).read_text().splitlines()
    torn = tmp_path / "torn" / TRACE_FILE
    torn.parent.mkdir()
    torn.write_text("\n".join(lines) + "\n" + lines[0][:40])  # a writer killed mid-line: that line is skipped
    assert len(read_traces(torn.parent)) == len(lines)
    bad = tmp_path / "bad" / TRACE_FILE
    bad.parent.mkdir()
    bad.write_text("\n".join([lines[0], lines[1][:-30] + "}", *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=f"{TRACE_FILE}:2: not a trace record"):
        read_traces(bad.parent)
    record = json.loads(lines[0])
    record["steps"][0]["accept_length"] = record["steps"][0]["verified"] + 2  # more kept than verified
    bad.write_text(lines[1] + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=f"{TRACE_FILE}:2: .*accept length"):
        Trace.load(bad.parent)
    with pytest.raises(FileNotFoundError, match="no trace"):
        read_traces(tmp_path / "nowhere")


# A step-cost table in `make gpu-check`'s format (gpu/check.py: verify_cost.json), with made-up figures.
TABLE = {"command": "python gpu/check.py --out x", "shapes": "Qwen3-8B", "dtype": "bfloat16",
         "verify_cost": {"context": 1024, "verify16_over_decode_batch1": 1.4, "cells": [
             {"batch": b, "new_tokens": n, "total_tokens": b * n, "ms": ms}
             for b, row in ((1, (7.0, 7.2, 7.9, 9.8)), (8, (7.6, 8.4, 10.1, 14.0)), (32, (9.5, 12.5, 19.0, 33.0)))
             for n, ms in zip((1, 4, 8, 16), row)]},
         "cost_model": {"total_tokens": [1, 16], "verify_s": [0.007, 0.0098], "draft_s": 0.002,
                        "draft_widths": [2, 8, 16], "draft_width_s": [0.0012, 0.0016, 0.002],
                        "draft_batches": [1, 8, 32], "draft_batch_s": [0.002, 0.0025, 0.004]}}


def test_a_cost_table_is_exact_at_its_points_and_interpolates_between(tmp_path):
    path = tmp_path / "verify_cost.json"
    path.write_text(json.dumps(TABLE))
    cost = TableCost.load(path)
    for cell in TABLE["verify_cost"]["cells"]:
        b, n = cell["batch"], cell["new_tokens"]
        assert cost.target_s([n] * b, [1024] * b, b * n) == cell["ms"] / 1e3
    ms = {(c["batch"], c["new_tokens"]): c["ms"] for c in TABLE["verify_cost"]["cells"]}
    between = ms[1, 4] + (ms[1, 8] - ms[1, 4]) * 2 / 4  # batch 1, 6 tokens
    assert cost.target_s([6], [10], 6) * 1e3 == pytest.approx(between)
    corner = [ms[8, 4] + (ms[8, 8] - ms[8, 4]) / 2, ms[32, 4] + (ms[32, 8] - ms[32, 4]) / 2]  # batch 20, 6 tokens
    assert cost.target_s([2, 10] * 10, [0] * 20, 120) * 1e3 == pytest.approx(corner[0] + (corner[1] - corner[0]) / 2)
    assert cost.target_s([1] * 64, [0] * 64, 64) * 1e3 == pytest.approx(ms[32, 1] + (ms[32, 1] - ms[8, 1]) * 32 / 24)
    assert cost.drafter_s(16, [0] * 8, 120) == pytest.approx(0.0025)  # one batched pass
    assert cost.drafter_s(8, [0] * 8, 56) == pytest.approx(0.0025 * 0.0016 / 0.002)
    assert "verify_cost.json" in cost.describe()


@pytest.mark.parametrize("spoil, message", [
    (lambda t: t["verify_cost"]["cells"].pop(5), "lacks cells"),
    (lambda t: t.pop("cost_model"), "no drafter costs"),
    (lambda t: t["verify_cost"]["cells"][0].update(ms="fast"), "could not convert"),
    (lambda t: t.pop("verify_cost"), "verify_cost"),
])
def test_a_malformed_cost_table_is_refused_naming_the_file(tmp_path, spoil, message):
    table = json.loads(json.dumps(TABLE))
    spoil(table)
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=f"{path}: not a step-cost table.*{message}"):
        TableCost.load(path)
    path.write_text("{ not json")
    with pytest.raises(ValueError, match=f"{path}: not a step-cost table"):
        TableCost.load(path)


def test_the_policies_read_this_machine_s_profile_itself():
    profile = CostModel((1, 8, 64), (0.01, 0.012, 0.04), 0.004, (2, 16), (0.002, 0.004))
    assert policy_profile(ProfileCost(profile, "here"), 8, 16) is profile
    assert policy_profile(H100, 8, 16).batched_drafter  # a GPU's: priced, its drafter batched


def test_bench_simulate_replays_a_trace_on_a_cost_table(recorded, tmp_path, capsys):
    table = tmp_path / "gpu_check.json"
    table.write_text(json.dumps(TABLE))
    out = tmp_path / "replay.json"
    args = ["bench", "simulate", "--drafter", f"trace:{recorded[0]}", "--cost-model", str(table), "--concurrency",
            "1,4", "--variants", "ar,fixed-block,throughput", "--json", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    label = f"trace {recorded[0]} (replayed)"
    assert result["simulated"] and "measured step-cost table" in result["cost_model"]
    assert all(r["acceptance"] == label and r["lossless"] for r in result["rows"]) and len(result["rows"]) == 6
    assert result["workload"]["requests"] == len(PROMPTS) and label in out.with_suffix(".md").read_text()
    block = next(r for r in result["rows"] if r["concurrency"] == 1 and r["variant"] == "fixed-block")
    assert block["speedup_vs_ar"] > 1.5  # the scripted drafter is mostly right and the table's verify is cheap
    for bad, message in ((f"trace:{tmp_path}/none", "no trace"), ("synthetic:block=4", "tau")):
        assert main([*args[:2], "--drafter", bad]) == 2 and message in capsys.readouterr().err
    assert main([*args[:4], "--cost-model", str(tmp_path / "none.json")]) == 2
    assert "no step-cost table" in capsys.readouterr().err


def test_generate_records_a_trace_that_bench_simulate_replays(tiny_chat_checkpoint, tmp_path, capsys):
    from tests.test_cli import _json_lines, _trimmed_drafter

    base = ["generate", "--prompt", "Count to ten", "--model", tiny_chat_checkpoint, "--max-new-tokens", "12",
            "--json"]
    assert main(base) == 0
    ar = _json_lines(capsys.readouterr().out)[0]
    drafter = _trimmed_drafter(tiny_chat_checkpoint, ar["token_ids"], tmp_path / "drafter")
    spec = [*base, "--method", "dflash", "--drafter", drafter, "--record-trace", str(tmp_path / "trace")]
    assert main(spec) == 2 and "--record-trace records the serving engine" in capsys.readouterr().err
    assert main([*spec, "--length-policy", "fixed:7"]) == 0
    (record,) = read_traces(tmp_path / "trace")
    assert list(record.output_ids) == ar["token_ids"] and record.block_size == 8
    assert any(len(s.block) == 7 for s in record.steps)
    assert main(["bench", "simulate", "--drafter", f"trace:{tmp_path / 'trace'}", "--variants", "ar,fixed:7",
                 "--concurrency", "1,2", "--requests", "3"]) == 0
    assert "trace " in capsys.readouterr().out


def test_serve_and_the_factory_record_a_trace_beside_the_on_policy_buffer(target, tmp_path):
    """`serve --record --record-trace` builds one engine recorder for both (`Recorders`): each writes its own file, and a
    hot swap's version label reaches both."""
    from adaflash.cli import build_parser
    from adaflash.engine.engine_factory import EngineModels, build_engine
    from adaflash.engine.recorder import Recorders
    from adaflash.formats.trajectories import read_trajectories
    from adaflash.models.drafters.config import DrafterConfig
    from adaflash.models.drafters.checkpoint import init_drafter
    from adaflash.server.cli import engine_config
    from adaflash.speculative.proposer import DFlashProposer

    args = build_parser().parse_args(["serve", "--method", "dflash", "--length-policy", "fixed:3", "--record",
                                      str(tmp_path / "buffer"), "--record-trace", str(tmp_path / "trace")])
    config = engine_config(args)
    assert config.trace_dir == str(tmp_path / "trace")
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=8)
    engine = build_engine(config, EngineModels(target, DFlashProposer(init_drafter(cfg, seed=2), target), None, "tiny",
                                               "v3"))
    assert isinstance(engine.recorder, Recorders) and engine.recorder.wants_blocks
    engine.add_request(Request("a", [3, 14, 15], 12))
    while engine.has_work():
        engine.step()
    engine.recorder.drafter_version = "v4"
    assert {r.drafter_version for r in engine.recorder.recorders} == {"v4"}
    (trajectory,) = read_trajectories(tmp_path / "buffer")
    (record,) = read_traces(tmp_path / "trace")
    assert record.output_ids == trajectory.output_ids and record.drafter_version == "v3"
    assert record.steps[0].verified == 3 and max(s.verified for s in record.steps) == 3  # (fewer where the budget cuts)
    assert all(len(s.block) == 7 for s in record.steps if s.verified)
