"""Our runtime against transformers, and the KV cache's ragged batching and rollback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaflash.models.targets.config import TransformerConfig, UnsupportedModelError
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target

FAMILIES = ["llama", "llama-tied", "qwen2", "qwen3", "qwen3-tied"]


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _run(model, ids: list[int], cache, slot: int = 0, start: int = 0, **kw):
    return model(torch.tensor(ids), RaggedBatch.build([slot], [start], [len(ids)]), cache, **kw)


@pytest.mark.parametrize("name", FAMILIES)
def test_prefill_and_incremental_logits_match_transformers(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    ids = torch.randint(0, 96, (24,))
    with torch.no_grad():
        ref = _hf(path)(ids[None]).logits[0]
    ours = load_target(path, dtype=torch.float32)
    cache = ours.new_cache(1, 64)
    full = _run(ours, ids.tolist(), ours.new_cache(1, 64)).logits
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)
    # Same sequence fed as prefill + uneven chunks: the cache must reproduce the one-shot logits.
    pieces, start = [10, 1, 5, 8], 0
    for n in pieces:
        out = _run(ours, ids[start : start + n].tolist(), cache, start=start).logits
        torch.testing.assert_close(out, ref[start : start + n], atol=1e-4, rtol=1e-4)
        start += n


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_bf16_logits_close_to_fp32_transformers(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    ids = torch.randint(0, 96, (16,))
    with torch.no_grad():
        ref = _hf(path)(ids[None]).logits[0]
    ours = load_target(path, dtype=torch.bfloat16)
    out = _run(ours, ids.tolist(), ours.new_cache(1, 32)).logits
    assert out.dtype == torch.float32
    # bf16 weights and activations: compare relative to the logit scale, and the argmax mostly agrees.
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_captured_hidden_states_match_transformers(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"]
    ids = torch.randint(0, 96, (12,))
    with torch.no_grad():
        ref = _hf(path)(ids[None], output_hidden_states=True).hidden_states
    ours = load_target(path, dtype=torch.float32)
    out = _run(ours, ids.tolist(), ours.new_cache(1, 16), capture_layers=(2, 0))
    # Layer i's output is HF hidden_states[i + 1] (index 0 is the embedding); order follows the request.
    expected = torch.cat([ref[3][0], ref[1][0]], dim=-1)
    torch.testing.assert_close(out.hidden, expected, atol=1e-5, rtol=1e-5)


def test_ragged_batch_equals_separate_sequences(tiny_checkpoints):
    model = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32)
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (7, 3, 12)]
    news = [torch.randint(0, 96, (n,)).tolist() for n in (1, 5, 2)]
    slots = [4, 1, 2]  # non-contiguous on purpose
    cache = model.new_cache(6, 32)
    for slot, p in zip(slots, prompts):
        _run(model, p, cache, slot=slot)
    batch = RaggedBatch.build(slots, [len(p) for p in prompts], [len(n) for n in news])
    batched = model(torch.tensor(sum(news, [])), batch, cache).logits
    offset = 0
    for p, n in zip(prompts, news):
        alone = _run(model, p + n, model.new_cache(1, 32)).logits[len(p) :]
        torch.testing.assert_close(batched[offset : offset + len(n)], alone, atol=1e-5, rtol=1e-5)
        offset += len(n)
    assert [cache.lengths[s] for s in slots] == [8, 8, 14]


def test_contiguous_slots_batch_and_logit_selection(tiny_checkpoints):
    model = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    a, b = [5, 6, 7, 8], [9, 10]
    cache = model.new_cache(2, 16)
    batch = RaggedBatch.build([0, 1], [0, 0], [4, 2])
    out = model(torch.tensor(a + b), batch, cache, logit_indices=batch.last_token_indices())
    for i, seq in enumerate((a, b)):
        alone = _run(model, seq, model.new_cache(1, 16)).logits[-1]
        torch.testing.assert_close(out.logits[i], alone, atol=1e-5, rtol=1e-5)


def test_rollback_then_rerun_equals_fresh_run(tiny_checkpoints):
    model = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32)
    prompt, rejected, accepted = [3, 14, 15, 92, 65], [35, 89, 79, 32], [38, 46]

    def verify_then_continue(block: list[int]) -> torch.Tensor:
        cache = model.new_cache(1, 32)
        _run(model, prompt, cache)
        _run(model, block, cache, start=len(prompt))
        cache.rollback(0, len(prompt) + 1)  # keep the first block token only
        return _run(model, accepted, cache, start=len(prompt) + 1).logits

    after = verify_then_continue(rejected)
    # Different rejected tokens, same shapes: bit-identical results prove stale entries are never read.
    other = verify_then_continue(rejected[:1] + [1, 2, 3])
    torch.testing.assert_close(after, other, atol=0, rtol=0)
    fresh = _run(model, prompt + rejected[:1] + accepted, model.new_cache(1, 32)).logits[-2:]
    torch.testing.assert_close(after, fresh, atol=1e-5, rtol=1e-5)


def test_cache_misuse_is_refused(tiny_checkpoints):
    model = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="starts at"):
        _run(model, [1, 2], cache, start=3)
    with pytest.raises(ValueError, match="exceeds"):
        _run(model, list(range(9)), cache)
    _run(model, [1, 2], cache)
    with pytest.raises(ValueError, match="roll"):
        cache.rollback(0, 5)


def test_unsupported_architecture_and_missing_files(tmp_path, tiny_checkpoints):
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        TransformerConfig.from_hf_dict({"architectures": ["MistralForCausalLM"]})
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((Path(tiny_checkpoints["llama"]) / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_target(bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_target(bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        TransformerConfig.from_hf_dict(cfg)
