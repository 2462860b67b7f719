"""`adaflash eval sensitivity` end to end on a tiny model (one setting per parameter), and the rate table."""

from __future__ import annotations

import json

import torch

from adaflash.cli import main
from adaflash.evaluation import sensitivity
from adaflash.models.drafters import checkpoint as drafter_checkpoint, length_head
from adaflash.formats.trajectories import Trajectory, append_trajectories
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, save_drafter
from adaflash.models.drafters.length_head import (BlockLengthHead, LengthHeadConfig, PositionAcceptanceHead,
    save_length_head)
from tests.evaluation.test_context_length import device_spy


def test_sensitivity_runs_each_setting(tiny_chat_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(sensitivity, "GRID", {"alpha": (0.5,), "gamma": (3.0,)})
    devices: list = []  # every drafter and head it scores loads on the target's device, named
    device_spy(monkeypatch, drafter_checkpoint, "load_drafter", devices)
    device_spy(monkeypatch, length_head, "load_length_head", devices)
    dcfg = DrafterConfig.for_target(TransformerConfig.from_dir(tiny_chat_checkpoint), mask_token_id=16, num_layers=1, block_size=8)
    start = save_drafter(init_drafter(dcfg, seed=3), tmp_path / "start")
    save_length_head(BlockLengthHead(LengthHeadConfig("block", dcfg.hidden_size, 8, head_dim=8)), start)
    positioned = save_drafter(init_drafter(dcfg, seed=3), tmp_path / "positioned")
    save_length_head(PositionAcceptanceHead(LengthHeadConfig("position", dcfg.hidden_size, 8, head_dim=8)), positioned)
    append_trajectories(tmp_path / "data" / "t.jsonl", [Trajectory((5, 6, 7), tuple(range(20, 40))) for _ in range(2)])
    config = tmp_path / "c.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\nout_dir = "unused"\nmodel = "{tiny_chat_checkpoint}"\n'
                      f'init_from = "{start}"\nloss = "rkl"\nsequences_per_step = 1\nanchors_per_sequence = 4\n')
    out = tmp_path / "sens"
    assert main(["eval", "sensitivity", "--config", str(config), "--steps", "2", "--limit", "2", "--max-new-tokens", "8",
                 "--block-head", str(start), "--position-head", str(positioned), "--runs-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert set(report["distillation"]) == {"alpha", "gamma"} and (tmp_path / "runs" / "alpha0.5-tau0.01-gamma7.0" / "drafter").is_dir()
    rates = report["rate"]
    assert [r["rate"] for r in rates] == list(sensitivity.RATES)
    assert all(1.0 <= r["accept_len"] <= r["verify_len"] <= 8 for r in rates)
    assert rates[0]["verify_len"] <= rates[-1]["verify_len"]  # a larger rate never verifies less
    cuts = report["threshold"]
    assert [r["threshold"] for r in cuts] == list(sensitivity.THRESHOLDS)
    assert all(1.0 <= r["accept_len"] <= r["verify_len"] <= 8 for r in cuts)
    assert cuts[0]["verify_len"] >= cuts[-1]["verify_len"]  # a higher threshold never verifies more
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(devices) == {torch.device("cpu")}  # the runs, the start drafter, both heads and their drafters
