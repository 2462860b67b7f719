"""`adaflash export vllm-schedule`: our throughput policy's length per batch size, in the form vLLM's dynamic
speculative decoding validates (`num_speculative_tokens_per_batch_size`: inclusive ranges from 1, sorted, disjoint)."""

from __future__ import annotations

import json

import pytest

from adaflash.cli import main
from adaflash.export.vllm_schedule import batch_schedule, length_for_batch, survival_from_histograms
from adaflash.speculative.cost_model import CostModel

SURVIVAL = [0.9 ** j for j in range(1, 16)]  # a drafter accepted 90% per position


def _cost(per_token_s: float, base_s: float = 0.01, draft_s: float = 0.001) -> CostModel:
    tokens = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
    return CostModel(tokens, tuple(base_s + per_token_s * t for t in tokens), draft_s)


def _valid_for_vllm(schedule, max_batch: int) -> None:
    """vLLM 0.32.0's validate_and_normalize_dynamic_sd_schedule rules, plus full coverage up to max_batch."""
    assert schedule[0][0] == 1 and schedule[-1][1] == max_batch
    for (s0, e0, k0), (s1, _, _) in zip(schedule, schedule[1:]):
        assert s0 <= e0 and e0 + 1 == s1
    assert all(k >= 0 for _, _, k in schedule)


def test_survival_from_vllm_histograms():
    # Two requests: steps with 0/1/2 accepted of K=3 drafts.
    hists = [[2, 1, 1, 0], [1, 0, 0, 1]]
    survival = survival_from_histograms(hists)
    assert survival == pytest.approx([3 / 6, 2 / 6, 1 / 6])
    with pytest.raises(ValueError, match="no verify steps"):
        survival_from_histograms([[0, 0, 0]])


def test_free_verification_drafts_the_whole_block_and_costly_verification_none():
    assert length_for_batch(SURVIVAL, _cost(0.0), 1, 15) == 15
    assert length_for_batch([0.01] * 15, _cost(0.01), 1, 15) == 0


def test_lengths_shrink_as_the_batch_grows_when_tokens_cost():
    # Verify time flat up to 8 tokens then linear: cheap extra tokens at batch 1, every token costs at batch 64.
    tokens = (1, 8, 16, 32, 64, 128, 256, 1024)
    cost = CostModel(tokens, tuple(0.02 + 0.002 * max(0, t - 8) for t in tokens), 0.001)
    schedule = batch_schedule(SURVIVAL, cost, 15, 64)
    _valid_for_vllm(schedule, 64)
    lengths = [k for _, _, k in schedule]
    assert lengths[0] > lengths[-1]
    assert lengths == sorted(lengths, reverse=True)


def test_cli_prints_a_speculative_config(tmp_path, capsys):
    report = {"results": [{"spec": {"acceptance_histogram": [5, 3, 2, 0]}}, {"id": "ar-only"}]}
    (tmp_path / "run.json").write_text(json.dumps(report))
    (tmp_path / "cost.json").write_text(_cost(0.0005).to_json())
    assert main(["export", "vllm-schedule", "--acceptance", str(tmp_path / "run.json"), "--drafter-dir", "D",
                 "--cost-model", str(tmp_path / "cost.json"), "--max-batch", "32", "--out",
                 str(tmp_path / "out.json")]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["method"] == "dflash" and config["model"] == "D" and config["num_speculative_tokens"] == 3
    _valid_for_vllm(config["num_speculative_tokens_per_batch_size"], 32)
    assert json.loads((tmp_path / "out.json").read_text())["survival"] == pytest.approx([0.5, 0.2, 0.0])


def test_cli_says_serve_without_speculation_when_no_batch_size_drafts(tmp_path, capsys):
    """A schedule of zeros everywhere is not printed as a config: vLLM with one still pays for the drafter."""
    report = {"results": [{"spec": {"acceptance_histogram": [98, 2, 0, 0]}}]}
    (tmp_path / "run.json").write_text(json.dumps(report))
    (tmp_path / "cost.json").write_text(_cost(0.02).to_json())
    assert main(["export", "vllm-schedule", "--acceptance", str(tmp_path / "run.json"), "--drafter-dir", "D",
                 "--cost-model", str(tmp_path / "cost.json"), "--out", str(tmp_path / "out.json")]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) is None and "serve without a speculative config" in captured.err
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["speculative_config"] is None and written["schedule"] == [[1, 64, 0]]


def test_schedule_from_vllm_step_costs_picks_the_most_tokens_per_second():
    """vLLM's timed steps: at batch 1 a 3-token draft costs little more than a plain step (it pays), at batch 32 it
    costs double (it does not); untimed k are never chosen, and a k beyond the survival curve is ignored."""
    from adaflash.export.vllm_schedule import schedule_from_step_costs

    survival = [0.3, 0.1, 0.05]
    step_s = {"1": {"0": 0.050, "1": 0.055, "3": 0.060, "7": 0.07},
              "8": {"0": 0.060, "1": 0.070, "3": 0.080},
              "32": {"0": 0.100, "1": 0.140, "3": 0.200}}
    assert schedule_from_step_costs(survival, step_s, 64) == [[1, 7, 3], [8, 31, 1], [32, 64, 0]]
    with pytest.raises(ValueError, match="batch size 1"):
        schedule_from_step_costs(survival, {"8": step_s["8"]}, 64)


def test_cli_takes_vllm_step_costs(tmp_path, capsys):
    report = {"results": [{"spec": {"acceptance_histogram": [50, 30, 10, 10]}}]}
    (tmp_path / "run.json").write_text(json.dumps(report))
    (tmp_path / "steps.json").write_text(json.dumps({"step_s": {"1": {"0": 0.05, "2": 0.055}, "2": {"0": 0.05, "2": 0.2}}}))
    assert main(["export", "vllm-schedule", "--acceptance", str(tmp_path / "run.json"), "--drafter-dir", "D",
                 "--vllm-step-costs", str(tmp_path / "steps.json"), "--max-batch", "8"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 8, 0]]
    assert config["num_speculative_tokens"] == 2
