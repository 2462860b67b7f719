"""`adaflash serve --watch-versions`: a published version that fails to load or does not fit the target is
refused (the log names the file), the incumbent keeps serving, and /metrics counts the refusal."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil

import pytest
from fastapi.testclient import TestClient

from adaflash.models.drafters.checkpoint import (WEIGHTS_FILE, init_drafter, load_drafter_config, publish_version,
    save_drafter)
from adaflash.server.cli import build_app, register_cli
from tests.server.test_server import CHAT, metric, pipeline, random_drafter, reference  # noqa: F401


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def _variant(tmp_path, name: str, source: str, **changes) -> str:
    """A drafter checkpoint like `source` with some config fields changed (a drafter for another target)."""
    config = dataclasses.replace(load_drafter_config(source), **changes)
    return str(save_drafter(init_drafter(config, seed=7), tmp_path / name))


@pytest.fixture
def watched(tiny_chat_checkpoint, random_drafter, tmp_path):  # noqa: F811
    versions = tmp_path / "versions"
    publish_version(random_drafter, versions)  # v0001: what serves first
    args = _parse(["--model", tiny_chat_checkpoint, "--dtype", "fp32", "--length-policy", "fixed:3", "--max-batch", "2",
                   "--max-len", "256", "--served-model-name", "tiny-chat", "--watch-versions", str(versions)])
    app, runner, watcher = build_app(args)
    with runner:
        yield app, runner, watcher, versions


def _still_serving(client, pipeline) -> None:  # noqa: F811
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 10, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reference(pipeline, 10, messages=CHAT)[0]


def test_corrupt_and_foreign_versions_are_refused_and_the_incumbent_serves(watched, pipeline, random_drafter,  # noqa: F811
                                                                           tmp_path, caplog):
    app, runner, watcher, versions = watched
    client = TestClient(app)
    incumbent = runner.engine.proposer
    assert watcher.loaded.name == "v0001" and metric(client, "adaflash_hot_swap_refused_total") == 0

    corrupt = tmp_path / "corrupt"
    shutil.copytree(random_drafter, corrupt)
    weights = (corrupt / WEIGHTS_FILE).read_bytes()
    (corrupt / WEIGHTS_FILE).write_bytes(weights[: len(weights) // 2])  # a truncated upload
    hidden = _variant(tmp_path, "hidden", random_drafter, hidden_size=32, intermediate_size=64)
    layers = _variant(tmp_path, "layers", random_drafter, num_target_layers=4)
    cases = [  # (what is published, the file the refusal names, why)
        (corrupt, f"v0002/{WEIGHTS_FILE}", "corrupt or truncated"),
        (hidden, "v0003/config.json", "hidden_size 32 != target's 64"),
        (layers, "v0004/config.json", "num_target_layers 4 != target's 2"),
    ]
    for refused, (source, file, reason) in enumerate(cases, start=1):
        publish_version(source, versions)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="adaflash.engine.hot_swap"):
            assert watcher.check_once() is None
        message = caplog.text
        assert file in message and reason in message and "still serving v0001" in message
        assert metric(client, "adaflash_hot_swap_refused_total") == refused
        assert runner.engine.proposer is incumbent and watcher.loaded.name == "v0001"
        _still_serving(client, pipeline)
        assert watcher.check_once() is None and metric(client, "adaflash_hot_swap_refused_total") == refused  # not retried

    # The next good version swaps in as before.
    good = publish_version(_variant(tmp_path, "good", random_drafter), versions)
    assert watcher.check_once() == good and runner.engine.proposer is not incumbent
    assert metric(client, "adaflash_hot_swaps_total") == 1 and metric(client, "adaflash_hot_swap_refused_total") == 3
    _still_serving(client, pipeline)  # lossless with the new drafter too


def test_a_version_with_another_block_size_is_refused(watched, random_drafter, tmp_path, caplog):  # noqa: F811
    app, runner, watcher, versions = watched
    publish_version(_variant(tmp_path, "block", random_drafter, block_size=4), versions)
    with caplog.at_level(logging.ERROR, logger="adaflash.engine.hot_swap"):
        assert watcher.check_once() is None
    assert "v0002/config.json" in caplog.text and "block size 4" in caplog.text
    assert metric(TestClient(app), "adaflash_hot_swap_refused_total") == 1
