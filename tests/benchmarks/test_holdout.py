"""Scoring drafters on the held-out split reproduces the training loop's own held-out numbers."""

from __future__ import annotations

import json

import pytest

from adaflash.training.trainer import TrainConfig, train
from benchmarks.drafter.holdout import score_drafters
from tests.helpers import regenerate_tiny_data


def test_scores_equal_what_a_continued_run_logs_at_step_0(tiny_checkpoints, tmp_path):
    data = regenerate_tiny_data(tiny_checkpoints["llama"], tmp_path / "data", [(f"p{i}", "chat") for i in range(8)],
                                max_new_tokens=24, batch_size=8, shard_size=8)
    common = dict(data_dir=data, model=tiny_checkpoints["llama"], mask_token_id=5, num_layers=2, block_size=4,
                  target_layer_ids=(1, 2), sequences_per_step=2, anchors_per_sequence=6, holdout_samples=3,
                  holdout_decoded=True, holdout_anchors=5, lr=5e-3, warmup_frac=0.1, log_every=10)
    trained = train(TrainConfig(out_dir=str(tmp_path / "a"), max_steps=20, save_every=20, **common), progress=False)
    train(TrainConfig(out_dir=str(tmp_path / "b"), max_steps=1, save_every=1, init_from=str(trained), **common),
          progress=False)
    logged = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])

    scores = score_drafters([trained], [data], holdout=3, model=tiny_checkpoints["llama"], anchors=5)[str(trained)]
    assert scores["holdout"] == pytest.approx(logged["holdout"], abs=1e-12)
    assert scores["holdout_decoded"] == pytest.approx(logged["holdout_decoded"], abs=1e-12)
    assert scores["holdout_decoded"]["all"] >= 1.0
