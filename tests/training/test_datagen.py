"""Target-regenerated data: batched generation equals the reference loop; shards round-trip; runs resume."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.data.prompt import Prompt, user_messages
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.target import load_target
from adaflash.speculative.reference import autoregressive_generate
from adaflash.training.datagen import DataGenConfig, generate_batch, generate_dataset, load_manifest, read_shard

LAYERS = (1, 2)


def test_batched_generation_equals_reference_and_captures_features(tiny_checkpoints):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    prompts = [[3, 4, 5], [10, 11, 12, 13, 14, 15], [7]]
    outs = generate_batch(target, prompts, 12, LAYERS, stop_token_ids=[1])
    for prompt, (response, feats) in zip(prompts, outs):
        assert response == autoregressive_generate(target, prompt, 12, stop_token_ids=[1]).token_ids
        seq = prompt + response[:-1]
        ref = target(torch.tensor(seq), RaggedBatch.build([0], [0], [len(seq)]), target.new_cache(1, 64), LAYERS).hidden
        assert feats.shape == (len(prompt) + len(response) - 1, 2 * 64)
        torch.testing.assert_close(feats, ref, atol=1e-4, rtol=1e-4)


class _Encoder:
    def __init__(self):
        self.calls = 0

    def __call__(self, prompt: Prompt) -> list[int]:
        self.calls += 1
        return [3 + (ord(c) % 80) for c in prompt.text][:20]


def _prompts(n):
    return [Prompt(id=f"p{i}", domain="chat", dataset="t", messages=user_messages("hello world"[: 3 + i] + str(i))) for i in range(n)]


def test_dataset_shards_round_trip_and_resume(tiny_checkpoints, tmp_path):
    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32)
    config = DataGenConfig(model="tiny", capture_layers=LAYERS, max_new_tokens=6, batch_size=2, shard_size=2, max_prompt_tokens=12)
    first = generate_dataset(target, _Encoder(), [1], _prompts(3), tmp_path, config)
    assert [s["num_samples"] for s in first["shards"]] == [2, 1]
    # A rerun with more prompts only generates the new ones (resume after an interruption).
    encoder = _Encoder()
    manifest = generate_dataset(target, encoder, [1], _prompts(5), tmp_path, config)
    assert encoder.calls == 2
    assert [pid for s in manifest["shards"] for pid in s["prompt_ids"]] == ["p0", "p1", "p2", "p3", "p4"]
    assert load_manifest(tmp_path) == json.loads((tmp_path / "manifest.json").read_text())
    samples = [s for shard in manifest["shards"] for s in read_shard(tmp_path / shard["file"])]
    for (tokens, prompt_len, feats), prompt in zip(samples, _prompts(5)):
        ids = _Encoder()(prompt)
        assert tokens[:prompt_len] == ids
        assert tokens[prompt_len:] == autoregressive_generate(target, ids, 6, stop_token_ids=[1]).token_ids
        assert feats.shape == (len(tokens) - 1, 128) and feats.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="capture layers"):
        generate_dataset(target, _Encoder(), [1], _prompts(1), tmp_path, DataGenConfig(model="tiny", capture_layers=(0,)))


def test_corrupt_shard_is_named(tmp_path):
    bad = tmp_path / "shard-00000.safetensors"
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="shard-00000"):
        list(read_shard(bad))
