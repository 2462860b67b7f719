"""Lining up a GGUF's quantized blocks with our weights: by content, bit for bit, or not at all."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from adaflash.models import gguf_blocks


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
