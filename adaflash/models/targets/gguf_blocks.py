"""A GGUF target's own quantized blocks, lined up with our fused weights, for the quantized kernels.

The embedded target ships as a GGUF (Q4_1 layers, a Q8_0 embedding) and runs as its dequantized fp32 values.
The quantized kernels (kernels/packed_linear.cpp) compute bitwise the same outputs from the blocks themselves,
streaming 4-6x fewer bytes per decode step. Rows are matched by content: each of our weight's rows takes the GGUF
row whose gguf-dequantized values equal it bit for bit (the HF conversion reorders q/k rows for RoPE), and a weight
any row of which finds no equal keeps the fp32 kernels only. So the blocks used are the weights, never an
approximation. Matched once per GGUF and cached beside the converted checkpoint.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from adaflash.models.kernels.quant import QUANT_FORMATS, QuantizedWeight

log = logging.getLogger(__name__)

CACHE_FILE = "gguf_blocks.safetensors"
# HF tensor name (under model.layers.N.) -> GGUF tensor name (under blk.N.), the llama.cpp naming for
# Llama / Qwen2 / Qwen3.
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output", "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str | None:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}.weight"
    return None


def source_gguf(checkpoint_dir: Path) -> Path | None:
    """The GGUF a converted checkpoint came from (its SOURCE file, written by the registry), if still present."""
    try:
        line = (checkpoint_dir / "SOURCE").read_text().strip()
    except OSError:
        return None
    path = Path(line.removeprefix("converted from ").strip())
    return path if line.startswith("converted from ") and path.is_file() else None


def match_rows(weight: np.ndarray, raw: np.ndarray, dequantized: np.ndarray) -> np.ndarray | None:
    """`raw` re-ordered so that row i dequantizes bitwise to weight[i]; None if some row has no equal."""
    by_content = {row.tobytes(): j for j, row in enumerate(dequantized)}
    order = [by_content.get(row.tobytes()) for row in weight]
    if any(j is None for j in order):
        return None
    return raw[np.asarray(order, dtype=np.int64)]


def _build(gguf: Path, weights: dict[str, list[tuple[str, torch.Tensor]]]) -> dict[str, QuantizedWeight]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    out = {}
    for ours, parts in weights.items():
        found = [tensors.get(gguf_name(hf) or "") for hf, _ in parts]
        if any(t is None for t in found) or len({t.tensor_type for t in found}) != 1:
            continue
        fmt = found[0].tensor_type.name
        if fmt not in QUANT_FORMATS:
            continue
        raw = np.concatenate([np.asarray(t.data).reshape(t.data.shape[0], -1) for t in found]).view(np.uint8)
        weight = torch.cat([w for _, w in parts]).float().numpy()
        dequantized = dequantize(raw, found[0].tensor_type)
        if dequantized.size != weight.size:  # another tensor than the name says: keep the fp32 kernels
            continue
        blocks = match_rows(weight, raw, dequantized.reshape(weight.shape))
        if blocks is None:
            log.warning("%s: the GGUF's %s blocks are not this weight's values; it keeps the fp32 kernels", ours, fmt)
            continue
        out[ours] = QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(blocks)))
    return out


def quantized_weights(checkpoint_dir: Path, weights: dict[str, list[tuple[str, torch.Tensor]]]
                      ) -> dict[str, QuantizedWeight]:
    """For each of our weights (name -> its HF parts in concatenation order), the GGUF blocks equal to it.

    Empty where the checkpoint was not converted from a GGUF. Cached in the checkpoint directory, keyed by the
    GGUF's path, size and mtime.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    gguf = source_gguf(checkpoint_dir)
    if gguf is None:
        return {}
    # The GGUF and the weights matched against it: a rewritten checkpoint is matched again.
    files = [gguf, *sorted(checkpoint_dir.glob("*.safetensors"))]
    key = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.name != CACHE_FILE)
    cache = checkpoint_dir / CACHE_FILE
    try:
        with safe_open(str(cache), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("source") == key:
                out = {name: QuantizedWeight(meta[f"fmt.{name}"], f.get_tensor(name)) for name in f.keys()}
                rows = {name: sum(w.shape[0] for _, w in parts) for name, parts in weights.items()}
                if all(rows.get(name) == q.blocks.shape[0] for name, q in out.items()):
                    return out
    except Exception:  # absent or damaged (safetensors raises its own types): matched again
        pass
    out = _build(gguf, weights)
    meta = {"source": key, **{f"fmt.{name}": q.fmt for name, q in out.items()}}
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=checkpoint_dir, suffix=".safetensors.tmp")
        os.close(fd)
        save_file({name: q.blocks for name, q in out.items()}, tmp, metadata=meta)
        os.replace(tmp, cache)  # atomic: a concurrent load never reads half a file
    except OSError as exc:  # a read-only checkpoint directory: matched again next time
        log.info("cannot cache GGUF blocks in %s: %s", checkpoint_dir, exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return out
