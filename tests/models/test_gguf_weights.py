"""A GGUF loads from its own blocks: tiny random qwen2 and llama files (gguf's writer; K-quant, Q5_0, Q8_0 and F32
tensors, a Q4_K q / k beside a Q6_K v) give the tensors transformers' GGUF load gives, bitwise; the fp32 target runs
the quantized kernels on them, the int8 target never dequantizes its linears; a type or an architecture we do not run
is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from adaflash.models.kernels import packed
from adaflash.models.kernels.quant import QUANT_FORMATS
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.config import UnsupportedModelError
from adaflash.models.targets.gguf_weights import GGUFWeights, _stamp
from adaflash.models.targets.model import load_target, load_target_as
from tests.models.kernels.test_kquant import random_blocks

pytestmark = pytest.mark.skipif(packed.library() is None, reason="our CPU kernels are unavailable (no AVX2 or compiler)")

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 512, 2
# per layer: q / k in Q4_K, v in Q6_K (a split qkv), o in Q5_0, gate / up in Q4_K, down in Q6_K
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
         "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}


def write_gguf(path, arch: str = "qwen2", odd_type: str | None = None) -> None:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    seed = iter(range(1000))

    def quantized(name: str, fmt: str, n: int, k: int) -> None:
        if fmt in QUANT_FORMATS:
            raw = random_blocks(fmt, n, k, seed=next(seed))
        else:  # a type we do not run: its bytes only
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
            raw = np.zeros((n, k // block * size), dtype=np.uint8)
        w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[fmt])

    def f32(name: str, *shape: int, scale: float = 0.1) -> None:
        w.add_tensor(name, (1 + scale * rng.standard_normal(shape)).astype(np.float32))

    quantized("token_embd.weight", "Q8_0", VOCAB, HIDDEN)
    quantized("output.weight", odd_type or "Q6_K", VOCAB, HIDDEN)
    f32("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        for short, fmt in TYPES.items():
            quantized(f"blk.{i}.{short}.weight", fmt, *SHAPES[short])
        f32(f"blk.{i}.attn_norm.weight", HIDDEN)
        f32(f"blk.{i}.ffn_norm.weight", HIDDEN)
        if arch == "qwen2":
            for short in ("attn_q", "attn_k", "attn_v"):
                f32(f"blk.{i}.{short}.bias", SHAPES[short][0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prepared(tmp_path, gguf):
    """What the registry prepares for a GGUF, less the tokenizer (these files carry no vocabulary)."""
    out = tmp_path / "prepared"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(GGUFWeights(gguf).hf_config()))
    (out / "SOURCE").write_text(_stamp(gguf) + "\n")
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_tensors_are_transformers_own_gguf_load_bitwise(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    gguf = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(gguf, arch)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf.name, dtype=torch.float32)
    ours = GGUFWeights(gguf).hf_state()
    state = theirs.state_dict()
    assert set(ours) == set(state)
    for name, value in state.items():
        assert torch.equal(ours[name], value), name  # llama's q / k rows un-permuted as transformers does
    config = GGUFWeights(gguf).hf_config()
    assert config["attention_bias"] == (arch == "qwen2") and not config["tie_word_embeddings"]


def test_fp32_is_transformers_model_and_int8_never_dequantizes_the_linears(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf)
    path = prepared(tmp_path, gguf)
    fp32 = load_target(path, torch.float32)
    assert {f.choices[0] for layer in fp32.layers for f in layer.fast.values()} <= {"Q4_K", "Q5_0", "Q6_K",
                                                                                   "Q4_K+Q6_K", "packed"}
    int8 = load_target_as(path, "auto")  # a K-quant file: auto is int8
    assert int8.numerics == "int8"
    assert int8.layers[0].qkv.is_meta and int8.lm_head.is_meta and not int8.embed_tokens.is_meta
    assert int8.layers[0].fast["qkv"].choices[0] == "Q4_K+Q6_Kxint8"
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([1, 5, 9, 200, 300, 7])
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = theirs(ids[None]).logits[0]
    outs = []
    for model in (fp32, int8):
        cache = model.new_cache(2, 32)
        together = model(ids, RaggedBatch.build([0], [0], [6]), cache).logits
        cache2 = model.new_cache(1, 32)
        model(ids[:4], RaggedBatch.build([0], [0], [4]), cache2)
        rest = model(ids[4:], RaggedBatch.build([0], [4], [2]), cache2).logits
        outs.append(together)
        if model is int8:  # row-independent: a verification's rows are a decode step's
            assert torch.equal(rest, together[4:])
    scale = float(reference.abs().max())
    torch.testing.assert_close(outs[0], reference, rtol=1e-4, atol=1e-4 * scale)  # fp32: transformers' model
    assert not torch.equal(outs[1], outs[0])  # int8: another model


def test_a_type_or_architecture_we_do_not_run_is_refused_by_name(tmp_path):
    gguf = tmp_path / "odd.gguf"
    write_gguf(gguf, odd_type="Q3_K")
    with pytest.raises(UnsupportedModelError, match="output.weight is Q3_K"):
        load_target(prepared(tmp_path, gguf), torch.float32)
    other = tmp_path / "phi.gguf"
    w = GGUFWriter(str(other), "phi3")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="architecture 'phi3'"):
        GGUFWeights(other)


def test_a_prepared_folder_finds_its_gguf_under_a_path_with_spaces(tmp_path):
    from adaflash.models.targets.gguf_weights import is_prepared, source_gguf

    folder = tmp_path / "my models"
    folder.mkdir()
    gguf = folder / "tiny model.gguf"
    write_gguf(gguf)
    path = prepared(tmp_path, gguf)
    assert source_gguf(path) == gguf.resolve() and is_prepared(gguf, path)
