"""Shared fixtures of the training tests."""

from __future__ import annotations

import pytest

from tests.helpers import regenerate_tiny_data

LAYERS = (1, 2)


@pytest.fixture(scope="session")
def tiny_data(tiny_checkpoints, tmp_path_factory) -> str:
    return regenerate_tiny_data(tiny_checkpoints["llama"], tmp_path_factory.mktemp("data"),
                                [(f"p{i}", "chat") for i in range(8)], max_new_tokens=24, batch_size=8, shard_size=8)
