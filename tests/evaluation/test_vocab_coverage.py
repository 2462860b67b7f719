"""Draft-vocabulary coverage per domain, the per-size accept length of a trimmed drafter, and the cost probe."""

from __future__ import annotations

import torch

from adaflash.evaluation.vocab_coverage import accept_length_by_size, coverage_by_domain, draft_step_ms, to_markdown
from adaflash.models.targets.model import load_target
from adaflash.training.dataset import DraftDataset
from adaflash.training.trainer import TrainConfig, train

LAYERS = (1, 2)


def test_coverage_grows_with_size_and_a_trimmed_drafter_is_scored_per_size(tiny_checkpoints, tiny_soft_data, tmp_path):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    data = DraftDataset(tiny_soft_data, LAYERS)
    report = coverage_by_domain(data, [4, 16, 32], holdout=2, vocab_size=target.config.vocab_size)
    cov = report["coverage"]
    assert set(cov) == {"4", "16", "32", "full"} and set(cov["4"]) >= {"all"}
    assert cov["4"]["all"] <= cov["16"]["all"] <= cov["32"]["all"] <= 1.0 == cov["full"]["all"]
    assert report["held_out_samples"] == 2 and report["train_samples"] == len(data) - 2
    drafter = train(TrainConfig(data_dir=tiny_soft_data, out_dir=str(tmp_path), model=tiny_checkpoints["llama"],
                                mask_token_id=5, num_layers=1, block_size=4, target_layer_ids=LAYERS, draft_vocab_size=32,
                                max_steps=2, sequences_per_step=2, anchors_per_sequence=4), progress=False)
    accept = accept_length_by_size(target, str(drafter), data, [4, 16, 32], holdout=2)
    assert set(accept) == {"4", "16", "32"} and all(v["all"] >= 1.0 for v in accept.values())
    report["draft_step_ms"] = {b: draft_step_ms(target, [4, 16, 32], int(b), context=6, repeats=1) for b in ("1", "32")}
    report.update(accept_length=accept, drafter=str(drafter), command="x", dtype="float32",
                  machine={"processor": "cpu", "threads": 1})
    md = to_markdown(report)
    assert "| 16 |" in md and "accept length" in md
