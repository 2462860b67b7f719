"""Target-regenerated data: batched generation equals the reference loop; shards round-trip; runs resume."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.data.prompt import Prompt, user_messages
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target
from adaflash.speculative.reference import autoregressive_generate
from adaflash.training.datagen import DataGenConfig, generate_dataset, generate_samples, load_manifest, read_shard

LAYERS = (1, 2)


def test_continuous_generation_equals_reference_and_captures_features_and_soft_targets(tiny_checkpoints):
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    ids = [[3, 4, 5], [10, 11, 12, 13, 14, 15], [7], [8, 9], [20, 21, 22, 23]]
    prompts = [Prompt(id=f"p{i}", domain="chat", dataset="t", messages=user_messages("x")) for i in range(len(ids))]
    # Two slots for five prompts: slots are refilled as sequences finish.
    config = DataGenConfig(model="tiny", capture_layers=LAYERS, max_new_tokens=12, max_prompt_tokens=8, batch_size=2,
                           top_logprobs=4)
    samples = {s.prompt_id: s for s in generate_samples(target, zip(prompts, ids), config, stop_token_ids=[1])}
    assert sorted(samples) == [p.id for p in prompts]
    for prompt, prompt_ids in zip(prompts, ids):
        s = samples[prompt.id]
        response = autoregressive_generate(target, prompt_ids, 12, stop_token_ids=[1]).token_ids
        assert s.tokens == prompt_ids + response and s.prompt_len == len(prompt_ids)
        seq = s.tokens[:-1]
        out = target(torch.tensor(seq), RaggedBatch.build([0], [0], [len(seq)]), target.new_cache(1, 64), LAYERS)
        assert s.features.shape == (len(seq), 2 * 64)
        torch.testing.assert_close(s.features, out.hidden, atol=1e-4, rtol=1e-4)
        # Soft targets: the target's top-k at every response position, the greedy token first.
        logprobs = torch.log_softmax(out.logits[len(prompt_ids) - 1 :], -1)
        assert s.top_ids.shape == (len(response), 4) and s.top_ids[:, 0].tolist() == response
        torch.testing.assert_close(s.top_logprobs.float(), logprobs.topk(4, -1).values, atol=2e-3, rtol=2e-3)


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
    held = [pid for s in manifest["shards"] for pid in s["prompt_ids"]]  # in the order sequences finished
    assert sorted(held) == ["p0", "p1", "p2", "p3", "p4"]
    assert load_manifest(tmp_path) == json.loads((tmp_path / "manifest.json").read_text())
    samples = [s for shard in manifest["shards"] for s in read_shard(tmp_path / shard["file"])]
    by_id = {p.id: p for p in _prompts(5)}
    for (tokens, prompt_len, feats, soft, _), prompt in zip(samples, [by_id[pid] for pid in held]):
        assert soft is None  # no soft targets asked for
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
