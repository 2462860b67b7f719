"""A GGUF file as a target checkpoint: its config, its tensors under Hugging Face names, its blocks as they are.

The file is memory-mapped (gguf's reader); a linear weight stays in its quantized blocks, which the kernels pack
directly (no fp32 copy, no transformers dequantization). A tensor is dequantized only where fp32 values are needed:
the embedding, the norms and biases, and every weight where `--dtype fp32` asks for them (gguf.quants.dequantize:
the values transformers' own GGUF load gives). Llama's q / k rows are stored permuted for llama.cpp's RoPE
(convert_hf_to_gguf); their blocks are re-ordered back by row, which leaves every block intact.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaflash.models.kernels.kquant import KQUANT_CODES
from adaflash.models.kernels.kquant import dequantize as kquant_values
from adaflash.models.kernels.quant import CONVERTED_FORMATS, QUANT_FORMATS, QuantizedWeight, runnable
from adaflash.models.targets.config import ARCHITECTURES, UnsupportedModelError
from adaflash.models.targets.gguf_file import GGUFFile

# HF name under model.layers.N. -> GGUF name under blk.N. (llama.cpp's naming for Llama / Qwen2 / Qwen3)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
                "model.norm.weight": "output_norm.weight"}
FLOAT_TYPES = ("F32", "F16", "BF16")
_FAMILIES = {a.family: a.hf_name for a in ARCHITECTURES.values() if not a.moe}


def gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor name of an HF one (None where the GGUF has no such tensor)."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
        stem, kind = ".".join(parts[3:-1]), parts[-1]
        if stem in LAYER_NAMES:
            return f"blk.{parts[2]}.{LAYER_NAMES[stem]}.{kind}"
    return None


class GGUFWeights:
    """One GGUF file, read lazily: `hf_config()`, and per HF tensor name its blocks or its fp32 values."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = GGUFFile(self.path)
        self._tensors = self._file.tensors
        self.arch = self._field("general.architecture")
        if self.arch not in _FAMILIES:
            raise UnsupportedModelError(f"{self.path}: architecture {self.arch!r} is not one we run "
                                        f"(have {sorted(_FAMILIES)})")

    def _field(self, key: str, default: Any = None) -> Any:
        return self._file.kv.get(key, default)

    def hf_config(self) -> dict[str, Any]:
        """config.json for this file, as transformers would write it for the same model."""
        a = self.arch
        if self._field(f"{a}.rope.scaling.type", "none") not in ("none", None):
            raise UnsupportedModelError(f"{self.path}: rope scaling {self._field(f'{a}.rope.scaling.type')!r} is not "
                                        "supported yet (only plain RoPE)")
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        embed = self._tensors["token_embd.weight"]
        cfg = {
            "architectures": [_FAMILIES[a]], "model_type": a, "hidden_act": "silu",
            "vocab_size": int(embed.shape[1]), "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self._field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(self._field(f"{a}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field(f"{a}.context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        return {k: v for k, v in cfg.items() if v is not None}

    @cached_property
    def _config(self) -> dict[str, Any]:
        return self.hf_config()

    def _tensor(self, hf_name: str):
        name = gguf_name(hf_name)
        tensor = self._tensors.get(name or "")
        if tensor is None:
            raise ValueError(f"{self.path} lacks {name or hf_name} (needed for {hf_name})")
        return tensor

    def linear_formats(self) -> set[str]:
        """The types of the layers' 2-D weights (what decides how `--dtype auto` runs the file)."""
        return {t.type for name, t in self._tensors.items()
                if name.startswith("blk.") and len(t.shape) == 2}

    def _row_order(self, hf_name: str, rows: int) -> np.ndarray | None:
        """Llama's q / k: HF row r is GGUF row order[r] (llama.cpp interleaves each head's two RoPE halves)."""
        if self.arch != "llama" or not any(p in hf_name for p in ("q_proj", "k_proj")):
            return None
        heads = self._config["num_attention_heads"] if "q_proj" in hf_name else self._config["num_key_value_heads"]
        return np.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(0, 2, 1).reshape(-1)

    def blocks(self, hf_name: str) -> QuantizedWeight | None:
        """A 2-D weight's blocks in HF row order, as our kernels take them (None for a float tensor). A type no kernel
        here runs is refused, naming the tensor and its type."""
        t = self._tensor(hf_name)
        fmt = t.type
        if fmt in FLOAT_TYPES:
            return None
        if fmt not in QUANT_FORMATS and fmt not in CONVERTED_FORMATS:
            runs = sorted({*QUANT_FORMATS, *CONVERTED_FORMATS, *FLOAT_TYPES})
            raise UnsupportedModelError(f"{self.path}: tensor {t.name} is {fmt}, a type we do not run (have {runs})")
        raw = self._file.data(t.name)
        order = self._row_order(hf_name, raw.shape[0])
        data = torch.from_numpy(np.ascontiguousarray(raw[order]) if order is not None else raw)
        return runnable(fmt, data)

    def dense(self, hf_name: str) -> torch.Tensor:
        """The tensor's fp32 values in HF layout (gguf.quants.dequantize's, rows re-ordered where llama permuted)."""
        t = self._tensor(hf_name)
        values = dequantized(t.type, self._file.data(t.name), t.shape[0])
        shape = tuple(int(s) for s in reversed(t.shape))
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        order = self._row_order(hf_name, shape[0]) if len(shape) == 2 else None
        if order is not None:
            values = values[order]
        return torch.from_numpy(np.ascontiguousarray(values))

    def hf_state(self) -> dict[str, torch.Tensor]:
        """Every tensor, fp32, under its HF name (an HF checkpoint of this file: what an export to vLLM writes)."""
        names = {gguf: hf for hf, gguf in GLOBAL_NAMES.items()}
        for i in range(self._config["num_hidden_layers"]):
            for stem, short in LAYER_NAMES.items():
                for kind in ("weight", "bias"):
                    names[f"blk.{i}.{short}.{kind}"] = f"model.layers.{i}.{stem}.{kind}"
        return {names[t]: self.dense(names[t]) for t in self._tensors if t in names}


def dequantized(fmt: str, data: np.ndarray, k: int) -> np.ndarray:
    """gguf.quants.dequantize's values, bitwise; whole-array numpy for the formats a load meets most (gguf's goes row
    group by row group: seconds for SmolLM2 at every load)."""
    if fmt == "F32":
        return data
    rows = data.reshape(-1, data.shape[-1])
    if fmt == "Q8_0":
        b = rows.reshape(-1, 34)
        out = b[:, :2].copy().view(np.float16).astype(np.float32) * b[:, 2:].view(np.int8).astype(np.float32)
    elif fmt == "Q4_1":
        b = rows.reshape(-1, 20)
        d, m = (b[:, i:i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))
        q = np.concatenate([b[:, 4:] & 0x0F, b[:, 4:] >> 4], axis=1).astype(np.float32)
        out = d * q + m
    elif fmt in KQUANT_CODES:
        out = kquant_values(fmt, rows, k)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return dequantize(data, GGMLQuantizationType[fmt])
    return out.reshape(rows.shape[0], -1)


SOURCE_FILE = "SOURCE"  # in a prepared checkpoint directory: which GGUF holds its weights


def _stamp(gguf: Path) -> str:
    st = gguf.stat()
    return f"gguf {gguf.resolve()} {st.st_size} {st.st_mtime_ns}"


def source_gguf(checkpoint_dir: str | Path) -> Path | None:
    """The GGUF whose weights a prepared checkpoint directory stands for, if it is one (None for an HF checkpoint)."""
    try:
        line = (Path(checkpoint_dir) / SOURCE_FILE).read_text().strip()
    except OSError:
        return None
    if not line.startswith("gguf "):
        return None
    path = Path(line.removeprefix("gguf ").rsplit(" ", 2)[0])  # "gguf PATH SIZE MTIME": a path may hold spaces
    return path if path.is_file() else None


def is_prepared(gguf: Path, checkpoint_dir: Path) -> bool:
    """Whether `checkpoint_dir` was prepared from this very file (same path, size and time)."""
    try:
        return (checkpoint_dir / SOURCE_FILE).read_text().strip() == _stamp(gguf)
    except OSError:
        return False


def prepare_checkpoint(gguf: Path, out_dir: Path) -> None:
    """A checkpoint directory for a GGUF: config.json from its metadata, the tokenizer and chat template transformers
    builds from it, and SOURCE naming the file; no weights (load_target reads them from the GGUF)."""
    from transformers import AutoTokenizer

    config = GGUFWeights(gguf).hf_config()  # refuses an architecture we do not run before any work
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / SOURCE_FILE).write_text(_stamp(gguf) + "\n")
