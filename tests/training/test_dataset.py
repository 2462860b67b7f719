"""Training data: one regenerated-data directory or several trained as one set."""

from __future__ import annotations

import pytest
import torch

from adaflash.training.dataset import DraftDataset, load_training_data
from adaflash.training.trainer import TrainConfig, train
from tests.helpers import regenerate_tiny_data

LAYERS = (1, 2)


@pytest.fixture(scope="module")
def second_round(tiny_checkpoints, tmp_path_factory) -> str:
    """A second data round: other prompt ids than `tiny_data`'s, generated into its own directory."""
    return regenerate_tiny_data(tiny_checkpoints["llama"], tmp_path_factory.mktemp("round2"),
                                [(f"r{i}", "math") for i in range(5)], max_new_tokens=16, batch_size=4, shard_size=4)


def test_several_directories_train_as_one_set(tiny_checkpoints, tiny_data, second_round, tmp_path):
    first, second = DraftDataset(tiny_data, LAYERS), DraftDataset(second_round, LAYERS)
    both = load_training_data((tiny_data, second_round), LAYERS)
    assert both.keys == first.keys + second.keys
    assert load_training_data([tiny_data], LAYERS).keys == first.keys  # a list of one is that directory
    assert {s.domain for s in both.samples} == {"chat", "math"}
    for a, b in zip(both.samples, first.samples + second.samples):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)

    cfg = TrainConfig(data_dir=(tiny_data, second_round), out_dir=str(tmp_path / "run"), model=tiny_checkpoints["llama"],
                      mask_token_id=5, num_layers=2, block_size=4, target_layer_ids=LAYERS, max_steps=3,
                      sequences_per_step=2, anchors_per_sequence=4, holdout_samples=2, save_every=3)
    assert (train(cfg, progress=False) / "config.json").exists()


def test_a_prompt_in_two_directories_is_refused(tiny_data, tiny_soft_data):
    with pytest.raises(ValueError, match="prompt id 'p0' is in both"):
        DraftDataset([tiny_data, tiny_soft_data], LAYERS)


def test_missing_directory_is_named(tiny_data, tmp_path):
    with pytest.raises(FileNotFoundError, match="empty"):
        DraftDataset([tiny_data, str(tmp_path / "empty")], LAYERS)


def test_config_lists_several_directories(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('data_dir = ["a", "b"]\nout_dir = "o"\n')
    assert TrainConfig.from_file(toml).data_dir == ("a", "b")
    assert TrainConfig.from_file(toml, data_dir=["c"]).data_dir == ("c",)
