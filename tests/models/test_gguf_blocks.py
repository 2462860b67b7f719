"""Lining up a GGUF's quantized blocks with our weights: by content, bit for bit, or not at all."""

from __future__ import annotations

import os

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from adaflash.models.targets import gguf_blocks


def test_rows_are_matched_by_content_whatever_their_order():
    rng = np.random.default_rng(0)
    raw = quants.quantize(rng.standard_normal((64, 64)).astype(np.float32), GGMLQuantizationType.Q4_1)
    dequantized = quants.dequantize(raw, GGMLQuantizationType.Q4_1)
    order = rng.permutation(64)  # the HF conversion reorders q/k rows for RoPE: our weight is a row permutation
    matched = gguf_blocks.match_rows(dequantized[order], raw, dequantized)
    assert np.array_equal(matched, raw[order])


def test_a_weight_with_any_row_not_in_the_gguf_gets_no_blocks():
    rng = np.random.default_rng(1)
    raw = quants.quantize(rng.standard_normal((32, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    dequantized = quants.dequantize(raw, GGMLQuantizationType.Q8_0)
    weight = dequantized.copy()
    weight[5, 3] = np.nextafter(weight[5, 3], np.float32(np.inf))  # one ulp off: not the GGUF's value any more
    assert gguf_blocks.match_rows(weight, raw, dequantized) is None


def test_names_and_sources(tmp_path):
    assert gguf_blocks.gguf_name("model.layers.3.self_attn.k_proj.weight") == "blk.3.attn_k.weight"
    assert gguf_blocks.gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_blocks.gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_blocks.gguf_name("model.layers.0.input_layernorm.weight") is None
    assert gguf_blocks.source_gguf(tmp_path) is None  # not converted from a GGUF: no blocks, fp32 kernels only
    (tmp_path / "SOURCE").write_text(f"converted from {tmp_path / 'gone.gguf'}\n")
    assert gguf_blocks.source_gguf(tmp_path) is None  # the GGUF is gone
    assert gguf_blocks.quantized_weights(tmp_path, {"o": [("x", torch.zeros(16, 32))]}) == {}


def test_blocks_are_cached_and_matched_again_when_the_checkpoint_changes(tmp_path):
    from gguf import GGUFWriter
    from safetensors.torch import save_file

    rng = np.random.default_rng(2)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)
    dequantized = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0).copy())
    gguf = tmp_path / "model.gguf"
    writer = GGUFWriter(str(gguf), "llama")
    writer.add_tensor("blk.0.attn_output.weight", raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "SOURCE").write_text(f"converted from {gguf}\n")
    save_file({"w": dequantized}, str(ckpt / "model.safetensors"))
    weights = {"layers.0.o": [("model.layers.0.self_attn.o_proj.weight", dequantized)]}
    first = gguf_blocks.quantized_weights(ckpt, weights)
    assert set(first) == {"layers.0.o"} and first["layers.0.o"].fmt == "Q8_0"
    assert torch.equal(first["layers.0.o"].blocks, torch.from_numpy(raw))
    assert (ckpt / gguf_blocks.CACHE_FILE).is_file()
    again = gguf_blocks.quantized_weights(ckpt, weights)  # from the cache
    assert torch.equal(again["layers.0.o"].blocks, first["layers.0.o"].blocks)
    changed = dequantized.clone()
    changed[0, 0] += 1.0  # the checkpoint rewritten with other values: matched again, and no longer the GGUF's
    save_file({"w": changed}, str(ckpt / "model.safetensors"))
    os.utime(ckpt / "model.safetensors", ns=(1, 1))
    assert gguf_blocks.quantized_weights(ckpt, {"layers.0.o": [("model.layers.0.self_attn.o_proj.weight", changed)]}) == {}
