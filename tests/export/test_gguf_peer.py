"""Our DFlash GGUF against llama.cpp's own converter (`convert_hf_to_gguf.py DRAFTER --target-model-dir TARGET`):
the same metadata keys, value types and values (bar the converter's guessed provenance names) and the same
tensors, bit for bit. Needs `make peer-src` (the llama.cpp source tree and the converter's venv); skipped otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from adaflash.export.gguf import GGUFExportConfig, export_gguf
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, save_drafter
from adaflash.models.targets.registry import shipped_drafter
from tests.export.gguf_files import PROVENANCE_KEYS, differences, read_gguf
from tests.export.peer_paths import CONVERTER, PEER_PYTHON

pytestmark = pytest.mark.peer



@pytest.fixture(scope="module")
def converter() -> Path:
    missing = [str(p) for p in (PEER_PYTHON, CONVERTER) if not p.exists()]
    if missing:
        pytest.skip(f"llama.cpp's converter is not set up ({', '.join(missing)} missing): run `make peer-src`")
    return CONVERTER


def convert_with_llama_cpp(drafter: Path, target: Path, out: Path, outtype: str) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [str(PEER_PYTHON), str(CONVERTER), str(drafter), "--target-model-dir", str(target), "--outtype", outtype,
         "--outfile", str(out)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, f"llama.cpp's converter failed on {drafter}:\n{proc.stderr[-4000:]}"
    return out


def assert_same_as_converter(drafter: Path, target: str, tmp_path: Path, outtype: str) -> dict:
    from adaflash.models.targets.registry import resolve_target

    target_dir = resolve_target(target)
    theirs = read_gguf(convert_with_llama_cpp(drafter, target_dir, tmp_path / f"theirs-{outtype}.gguf", outtype))
    ours_path = tmp_path / f"ours-{outtype}.gguf"
    export_gguf(GGUFExportConfig(drafter=drafter, out=ours_path, target=str(target_dir), outtype=outtype))
    ours = read_gguf(ours_path)
    assert differences(ours, theirs) == []
    assert set(ours.kv) - set(theirs.kv) <= PROVENANCE_KEYS  # we write general.name only
    assert theirs.kv["general.architecture"] == "dflash" and len(theirs.tensors) == len(ours.tensors) > 0
    return ours.kv


def _tiny_drafter(path: Path, target: str, vocab: DraftVocab | None = None) -> Path:
    cfg = DrafterConfig.for_target(TransformerConfig.from_dir(target), mask_token_id=16, num_layers=2, block_size=8,
                                   target_layer_ids=(0, 1))
    drafter = init_drafter(cfg, seed=11)
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    return save_drafter(drafter, path)


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_shipped_dflash_drafter_equals_the_converters(converter, smollm2_dir, tmp_path, outtype):
    kv = assert_same_as_converter(shipped_drafter("smollm2-135m"), smollm2_dir, tmp_path, outtype)
    assert kv["dflash.target_layers"] == [2, 15, 28]


def test_shipped_adaflash_drafter_equals_the_converters(converter, smollm2_dir, tmp_path):
    """The converter reads only model*.safetensors: the length head is left out there too."""
    drafter = shipped_drafter("smollm2-135m", "adaflash")
    if drafter is None:
        pytest.skip("no AdaFlash drafter ships in this installation")
    assert_same_as_converter(drafter, smollm2_dir, tmp_path, "bf16")


def test_tiny_llama_and_trimmed_vocabulary_drafters_equal_the_converters(converter, tiny_chat_checkpoint, tmp_path):
    plain = _tiny_drafter(tmp_path / "plain", tiny_chat_checkpoint)
    assert_same_as_converter(plain, tiny_chat_checkpoint, tmp_path / "plain", "f32")
    trimmed = _tiny_drafter(tmp_path / "trimmed", tiny_chat_checkpoint, DraftVocab(torch.arange(7, 519), 49152))
    assert_same_as_converter(trimmed, tiny_chat_checkpoint, tmp_path / "trimmed", "f32")


def test_qwen3_target_with_byte_level_post_processor_equals_the_converters(converter, tiny_chat_checkpoint,
                                                                          tmp_path):
    """The non-Llama vocab path (Qwen2Model.set_vocab) and the ByteLevel post-processor rule."""
    target = tmp_path / "qwen-style"
    shutil.copytree(tiny_chat_checkpoint, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["Qwen3ForCausalLM"], "qwen3"
    (target / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((target / "tokenizer.json").read_text())
    tok["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    (target / "tokenizer.json").write_text(json.dumps(tok))
    drafter = _tiny_drafter(tmp_path / "drafter", str(target))
    kv = assert_same_as_converter(drafter, str(target), tmp_path, "f32")
    assert kv["tokenizer.ggml.add_bos_token"] is False and kv["tokenizer.ggml.add_eos_token"] is False
