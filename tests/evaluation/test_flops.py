"""The FLOP accounting the serving benchmarks report against the matmul peak."""

from __future__ import annotations

import pytest
import torch

from adaflash.evaluation.flops import linear_flops_per_token, matmul_peak_flops, served_gflops
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.targets.model import TargetModel


def _config(**kw) -> TransformerConfig:
    base = dict(family="llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                qkv_bias=False, o_bias=False, qk_norm=False, max_position_embeddings=64)
    return TransformerConfig(**{**base, **kw})


@pytest.mark.parametrize("tied", [True, False])
def test_a_token_costs_two_flops_per_weight_of_every_linear_and_the_head(tied: bool):
    cfg = _config(tie_word_embeddings=tied)
    model = TargetModel(cfg)
    layer_weights = sum(getattr(layer, n).numel() for layer in model.layers for n in ("qkv", "o", "gate_up", "down"))
    assert linear_flops_per_token(cfg, with_head=False) == 2 * layer_weights
    assert linear_flops_per_token(cfg) == 2 * (layer_weights + model.lm_head.numel())


def test_served_gflops_adds_the_prompts_without_their_head():
    cfg = _config()
    g = served_gflops(cfg, output_tokens_per_s=100.0, prompt_tokens_per_output_token=2.0)
    assert g["output_gflops"] == pytest.approx(100 * linear_flops_per_token(cfg) / 1e9)
    prompts = 200 * linear_flops_per_token(cfg, with_head=False) / 1e9  # 2 prompt tokens an output token, no head
    assert g["with_prompts_gflops"] - g["output_gflops"] == pytest.approx(prompts)


def test_the_matmul_peak_is_a_positive_rate():
    assert 0 < matmul_peak_flops(torch.float32, n=64, repeats=2) < 1e15
