"""`adaflash export vllm`: the drafter folder vLLM's DFlash loader reads (no AdaFlash-only safetensors files, a trimmed
vocabulary as EAGLE-3's own lm_head + d2t) and a standard HF target. No vLLM needed: the structure vLLM 0.32.0's
`qwen3_dflash.py` expects is checked here; tests/export/test_vllm_interop.py runs vLLM on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adaflash.cli import main
from adaflash.export.vllm import clean_config, export_vllm, export_vllm_drafter, export_vllm_target, target_lm_head
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, load_drafter, save_drafter
from adaflash.models.drafters.length_head import LengthHeadConfig, build_length_head, save_length_head

MASK = 16


def _drafter(path: Path, target_dir: str, vocab: DraftVocab | None = None, head: bool = False) -> Path:
    config = DrafterConfig.for_target(TransformerConfig.from_dir(target_dir), mask_token_id=MASK, num_layers=1,
                                      block_size=8, target_layer_ids=(0, 1))
    drafter = init_drafter(config, seed=3)
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    save_drafter(drafter, path)
    if head:
        cfg = LengthHeadConfig(kind="position", hidden_size=config.hidden_size, block_size=8)
        save_length_head(build_length_head(cfg), path)
    return path


def _trimmed(vocab_size: int, size: int = 300) -> DraftVocab:
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(0))[:size]
    return DraftVocab(ids, vocab_size)


def test_trimmed_vocabulary_becomes_an_own_lm_head_and_d2t(tiny_chat_checkpoint, tmp_path):
    vocab = _trimmed(49152)
    src = _drafter(tmp_path / "src", tiny_chat_checkpoint, vocab=vocab, head=True)
    out, kept, notes = export_vllm_drafter(src, tmp_path / "out", tiny_chat_checkpoint)
    assert kept == vocab.size
    # vLLM loads every *.safetensors file of the folder as weights: only the drafter's may be there.
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert "draft_vocab" not in config and "adaflash_length_head" not in config
    assert config["draft_vocab_size"] == vocab.size and config["vocab_size"] == 49152
    assert config["dflash_config"] == json.loads((src / "config.json").read_text())["dflash_config"]
    weights = load_file(str(out / "model.safetensors"))
    # vLLM: target_id = row + d2t[row] (qwen3_dflash.compute_logits)
    assert torch.equal(torch.arange(vocab.size) + weights["d2t"], vocab.token_ids)
    assert torch.equal(weights["lm_head.weight"], target_lm_head(Path(tiny_chat_checkpoint))[vocab.token_ids])
    own = load_file(str(src / "model.safetensors"))
    assert set(weights) == set(own) | {"lm_head.weight", "d2t"}
    for name, tensor in own.items():
        assert torch.equal(weights[name], tensor), name
    assert any("length head" in n for n in notes)


def test_own_head_rows_give_the_same_drafts_as_our_runtime(tiny_chat_checkpoint, tmp_path):
    """Argmax over the exported rows, mapped by d2t, is the token our draft head picks for the same hidden state."""
    vocab = _trimmed(49152)
    src = _drafter(tmp_path / "src", tiny_chat_checkpoint, vocab=vocab)
    out, _, _ = export_vllm_drafter(src, tmp_path / "out", tiny_chat_checkpoint)
    weights = load_file(str(out / "model.safetensors"))
    hidden = torch.randn(32, weights["lm_head.weight"].shape[1], generator=torch.Generator().manual_seed(1))
    rows = (hidden @ weights["lm_head.weight"].float().T).argmax(-1)
    theirs = rows + weights["d2t"][rows]
    full = hidden @ target_lm_head(Path(tiny_chat_checkpoint)).float().T
    masked = torch.full_like(full, float("-inf"))
    masked[:, vocab.token_ids] = full[:, vocab.token_ids]
    assert torch.equal(theirs, masked.argmax(-1))
    assert load_drafter(src).draft_vocab is not None


def test_full_vocab_drops_the_trimmed_vocabulary(tiny_chat_checkpoint, tmp_path):
    src = _drafter(tmp_path / "src", tiny_chat_checkpoint, vocab=_trimmed(49152))
    out, kept, notes = export_vllm_drafter(src, tmp_path / "out", tiny_chat_checkpoint, full_vocab=True)
    assert kept is None and any("--full-vocab" in n for n in notes)
    config = json.loads((out / "config.json").read_text())
    assert "draft_vocab_size" not in config and "draft_vocab" not in config
    assert set(load_file(str(out / "model.safetensors"))) == set(load_file(str(src / "model.safetensors")))


def test_a_plain_drafter_is_copied_with_nothing_added(tiny_chat_checkpoint, tmp_path):
    src = _drafter(tmp_path / "src", tiny_chat_checkpoint)
    out, kept, notes = export_vllm_drafter(src, tmp_path / "out", tiny_chat_checkpoint)
    assert kept is None and notes == []
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_target_export_is_a_standard_checkpoint(tiny_chat_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_vllm_target(tiny_chat_checkpoint, tmp_path / "target")
    state = load_file(str(out / "model.safetensors"))
    assert "model.embed_tokens.weight" in state and "lm_head.weight" in state  # untied
    config = json.loads((out / "config.json").read_text())
    assert not {"quantization_config", "_name_or_path", "id2label", "torch_dtype"} & set(config)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny_chat_checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 42, 4000, 77]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    text = "Hello, vLLM!"
    assert AutoTokenizer.from_pretrained(str(out)).encode(text) == AutoTokenizer.from_pretrained(
        tiny_chat_checkpoint).encode(text)


def test_clean_config_drops_the_gguf_loads_leftovers():
    raw = {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "gguf"},
           "_name_or_path": "/x", "id2label": {"0": "LABEL_0"}, "torch_dtype": "float32", "dtype": "float32",
           "hidden_size": 576}
    assert clean_config(raw) == {"architectures": ["LlamaForCausalLM"], "dtype": "float32", "hidden_size": 576}


def test_cli_writes_both_folders_and_prints_the_serve_command(tiny_chat_checkpoint, tmp_path, capsys):
    src = _drafter(tmp_path / "src", tiny_chat_checkpoint, vocab=_trimmed(49152))
    assert main(["export", "vllm", "--drafter", str(src), "--target", tiny_chat_checkpoint,
                 "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "out" / "drafter" / "config.json").is_file()
    assert (tmp_path / "out" / "target" / "model.safetensors").is_file()
    assert "vllm serve" in printed and '"method": "dflash"' in printed and "300 rows" in printed


def test_errors_name_the_bad_input_and_leave_nothing_half_written(tiny_chat_checkpoint, tmp_path, capsys):
    assert main(["export", "vllm", "--drafter", str(tmp_path / "missing"), "--out", str(tmp_path / "out"),
                 "--target", tiny_chat_checkpoint]) == 2
    assert "not a DFlash drafter" in capsys.readouterr().err
    assert not (tmp_path / "out" / "drafter").exists()
    # A drafter whose draft vocabulary does not fit the target's LM head is refused.
    src = _drafter(tmp_path / "src", tiny_chat_checkpoint, vocab=_trimmed(49152))
    config = json.loads((src / "config.json").read_text())
    config["vocab_size"] = 60000
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LM-head rows"):
        export_vllm(src, tmp_path / "out2", tiny_chat_checkpoint, with_target=False)
    assert not (tmp_path / "out2" / "drafter").exists()


def test_a_gguf_target_exports_its_dequantized_tensors_under_transformers_names(tmp_path):
    """A registry target is a GGUF whose directory holds no weights: the export dequantizes the file (the values
    transformers' own GGUF load gives: tests/models/test_gguf_weights.py) under the names our loader reads."""
    from gguf import GGMLQuantizationType, quants

    from adaflash.models.targets.config import TransformerConfig
    from adaflash.models.targets.gguf_file import GGUFFile
    from adaflash.models.targets.model import _hf_weight_map
    from adaflash.models.targets.registry import target_gguf

    out = export_vllm_target("smollm2-135m", tmp_path / "target")
    exported = load_file(str(out / "model.safetensors"))
    config = TransformerConfig.from_dir(out)
    assert set(exported) == {n for names in _hf_weight_map(config).values() for n in names}
    raw = GGUFFile(target_gguf("smollm2-135m"))
    down = quants.dequantize(raw.data("blk.3.ffn_down.weight"), GGMLQuantizationType.Q4_1)
    assert torch.equal(exported["model.layers.3.mlp.down_proj.weight"], torch.from_numpy(down))
