"""Distillation through the one training loop: on-the-fly teacher pass, trajectories, `train distill`."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.cli import main
from adaflash.formats.trajectories import Trajectory, append_trajectories, read_trajectories
from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target
from adaflash.training.dataset import DraftDataset, TrajectoryDataset
from adaflash.training.trainer import TrainConfig, teacher_logits, teacher_pass, train

LAYERS = (1, 2)


@pytest.fixture(scope="module")
def trajectories(tiny_data, tmp_path_factory) -> str:
    """The same samples as token-only trajectories, as the server writes them."""
    path = tmp_path_factory.mktemp("traj") / "round-000.jsonl"
    samples = DraftDataset(tiny_data, LAYERS).samples
    append_trajectories(path, [Trajectory(tuple(s.tokens[: s.prompt_len].tolist()), tuple(s.tokens[s.prompt_len:].tolist()),
                                          source="t") for s in samples])
    return str(path)


def test_trajectories_round_trip_and_torn_line(tmp_path):
    path = tmp_path / "t.jsonl"
    t = Trajectory((1, 2), (3, 4, 5), source="gsm8k", drafter_version="v0001", accept_lengths=(2, 1))
    append_trajectories(path, [t, t])
    with path.open("a") as f:
        f.write('{"prompt_ids": [1, 2], "outp')  # a writer killed mid-line
    assert read_trajectories(path) == [t, t] and read_trajectories(tmp_path) == [t, t]
    path.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [1], "output_ids": [2, 3]}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        read_trajectories(path)
    with pytest.raises(FileNotFoundError):
        read_trajectories(tmp_path / "missing")


def test_teacher_pass_features_equal_the_generated_ones(tiny_checkpoints, tiny_data, trajectories):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    stored = DraftDataset(tiny_data, LAYERS).samples
    on_the_fly = TrajectoryDataset(trajectories).samples
    assert len(stored) == len(on_the_fly)
    for a, b in zip(stored, on_the_fly):
        assert torch.equal(a.tokens, b.tokens) and b.features is None
        features, final = teacher_pass(target, b.tokens, LAYERS)
        # Stored features are bf16 (captured during batched generation); these are recomputed in fp32.
        torch.testing.assert_close(features, a.features.float(), atol=3e-2, rtol=2e-2)
        # The teacher's logits from the final states are the target's own logits at those positions.
        positions = torch.tensor([0, len(b.tokens) - 1])
        cache = target.new_cache(1, len(b.tokens))
        direct = target(b.tokens, RaggedBatch.build([0], [0], [len(b.tokens)]), cache, (), positions).logits
        torch.testing.assert_close(teacher_logits(target, final, positions), direct, atol=1e-4, rtol=1e-4)


def _config(tiny_checkpoints, data, out_dir, **kw) -> TrainConfig:
    base = dict(
        data_dir=data, out_dir=str(out_dir), model=tiny_checkpoints["llama"], mask_token_id=5, num_layers=2,
        block_size=4, target_layer_ids=LAYERS, lr=5e-3, max_steps=12, sequences_per_step=2,
        anchors_per_sequence=6, log_every=3, save_every=12, warmup_frac=0.1,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("loss", ["rkl", "fkl", "tv"])
def test_distillation_from_a_drafter_lowers_the_divergence(tiny_checkpoints, tiny_data, trajectories, tmp_path, loss):
    base = train(_config(tiny_checkpoints, tiny_data, tmp_path / "base", max_steps=6), progress=False)
    cfg = _config(tiny_checkpoints, trajectories, tmp_path / "distill", init_from=str(base), loss=loss, alpha=0.0, lr=1e-2,
                  tau=0.0, max_steps=24)
    final = train(cfg, progress=False)
    records = [json.loads(line) for line in (tmp_path / "distill" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["divergence"] < 0.8 * records[0]["divergence"]
    assert load_drafter(final).config == load_drafter(base).config


def test_train_distill_cli(tiny_checkpoints, tiny_data, trajectories, tmp_path):
    base = train(_config(tiny_checkpoints, tiny_data, tmp_path / "base", max_steps=2), progress=False)
    rc = main(["train", "distill", "--from", str(base), "--data", trajectories, "--out", str(tmp_path / "d"),
               "--model", tiny_checkpoints["llama"], "--max-steps", "2", "--sequences-per-step", "2",
               "--anchors-per-sequence", "4"])
    assert rc == 0 and (tmp_path / "d" / "drafter" / "model.safetensors").is_file()
    # Resuming a finished run is a no-op that still exports the drafter.
    assert main(["train", "distill", "--from", str(base), "--data", trajectories, "--out", str(tmp_path / "d"),
                 "--model", tiny_checkpoints["llama"], "--max-steps", "2", "--sequences-per-step", "2"]) == 0
