"""Shared fixtures of the training tests."""

from __future__ import annotations

import pytest
import torch

from adaflash.data.prompt import Prompt, user_messages
from adaflash.models.target import load_target
from adaflash.training.datagen import DataGenConfig, generate_dataset

LAYERS = (1, 2)


@pytest.fixture(scope="session")
def tiny_data(tiny_checkpoints, tmp_path_factory) -> str:
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    prompts = [Prompt(id=f"p{i}", domain="chat", dataset="t", messages=user_messages(f"q{i}")) for i in range(8)]
    out = tmp_path_factory.mktemp("data")
    generate_dataset(
        target, lambda p: [3 + int(p.id[1:]), 7, 9 + int(p.id[1:])], [], prompts, out,
        DataGenConfig(model="tiny", capture_layers=LAYERS, max_new_tokens=24, batch_size=8, shard_size=8),
    )
    return str(out)



