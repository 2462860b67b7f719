"""The quantization formats our kernels run, one row each, and a weight held in one of them.

A GGUF stores a weight as blocks of 32 values of one ggml type; `QUANT_FORMATS` lists the types a kernel here reads
(by ggml type name), what one block weighs, how the packed kernel lays it out, and whether the int8-activation kernel
(`--dtype int8`) takes it. A new format is a row here plus its arithmetic in the kernels (packed_linear.cpp,
int8_linear.cpp); every loader and selector reads this table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # k per GGUF quantization block


@dataclass(frozen=True)
class QuantFormat:
    name: str  # ggml's type name
    code: int  # the kernels' Format enum
    block_k: int  # k per GGUF block: 32, or 256 for the super-block ("K") formats
    block_bytes: int  # one GGUF block
    packed_block_bytes: int  # one (panel of 16 outputs, 32 k) as the kernels pack it (a super-block's share)
    int8: bool  # the int8-activation kernel (llama.cpp's arithmetic) takes it

    def row_bytes(self, k: int) -> int:
        return k // self.block_k * self.block_bytes


# BF16: 32 bf16 a "block", widened exactly (a checkpoint saved in bf16, streamed at half the fp32 bytes).
# Q5_0 and the K formats: kquant.cpp (packed by kquant.py). Q4_0 runs as Q8_0 (`runnable`).
QUANT_FORMATS = {f.name: f for f in (
    QuantFormat("Q4_1", code=1, block_k=32, block_bytes=20, packed_block_bytes=64 + BLOCK * 8, int8=True),
    QuantFormat("Q8_0", code=2, block_k=32, block_bytes=34, packed_block_bytes=32 + BLOCK * 16, int8=True),
    QuantFormat("BF16", code=3, block_k=32, block_bytes=64, packed_block_bytes=BLOCK * 32, int8=False),
    QuantFormat("Q5_0", code=4, block_k=32, block_bytes=22, packed_block_bytes=352, int8=True),
    QuantFormat("Q4_K", code=5, block_k=256, block_bytes=144, packed_block_bytes=2368 // 8, int8=True),
    QuantFormat("Q5_K", code=6, block_k=256, block_bytes=176, packed_block_bytes=2880 // 8, int8=True),
    QuantFormat("Q6_K", code=7, block_k=256, block_bytes=210, packed_block_bytes=3360 // 8, int8=True),
)}
# GGUF types that run as another format of the table, converted exactly at load.
CONVERTED_FORMATS = ("Q4_0",)


def int8_formats() -> tuple[str, ...]:
    """The formats the int8-activation kernel takes."""
    return tuple(name for name, f in QUANT_FORMATS.items() if f.int8)


@dataclass(frozen=True)
class QuantizedWeight:
    fmt: str  # a key of QUANT_FORMATS
    blocks: torch.Tensor  # [n, k / 32 * block bytes] uint8, row i = the blocks of our weight's row i

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The blocks of a subset of rows (a drafter's trimmed LM head)."""
        return QuantizedWeight(self.fmt, self.blocks[index].contiguous())


@dataclass(frozen=True)
class SplitWeight:
    """A fused weight (q, k, v stacked; gate, up) whose parts a GGUF stores in different formats (Q4_K q and k, a Q6_K
    v): each part runs its own kernel into its own outputs."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def fmt(self) -> str:
        return "+".join(p.fmt for p in self.parts)

    @property
    def rows_total(self) -> int:
        return sum(p.blocks.shape[0] for p in self.parts)


def stacked(parts: list[QuantizedWeight]) -> QuantizedWeight | SplitWeight:
    """Parts of one fused weight, in order: neighbours of one format joined, and split where the format changes."""
    runs: list[list[QuantizedWeight]] = []
    for part in parts:
        if runs and runs[-1][0].fmt == part.fmt:
            runs[-1].append(part)
        else:
            runs.append([part])
    joined = [QuantizedWeight(r[0].fmt, torch.cat([p.blocks for p in r]) if len(r) > 1 else r[0].blocks) for r in runs]
    return joined[0] if len(joined) == 1 else SplitWeight(tuple(joined))


def runnable(fmt: str, blocks: torch.Tensor) -> QuantizedWeight:
    """GGUF blocks as a weight our kernels run: Q4_0 (d, 16 bytes of nibbles; w = d * (q - 8)) becomes Q8_0 (d, the
    32 values q - 8 as int8; w = d * q8): gguf's values bitwise, a zero's sign included (Q4_1's d * q + m would give
    +0 where Q4_0 gives d * 0)."""
    if fmt != "Q4_0":
        return QuantizedWeight(fmt, blocks)
    b = blocks.numpy().reshape(-1, 18)
    q = (np.concatenate([b[:, 2:] & 0x0F, b[:, 2:] >> 4], axis=1).astype(np.int8) - np.int8(8)).view(np.uint8)
    out = np.concatenate([b[:, :2], q], axis=1)
    return QuantizedWeight("Q8_0", torch.from_numpy(out.reshape(blocks.shape[0], -1)))


def exact_bf16_blocks(weight: torch.Tensor) -> QuantizedWeight | None:
    """A weight every value of which is a bf16 (a checkpoint saved in bf16, loaded in fp32) as BF16 "blocks": the
    quantized kernel streams half the fp32 bytes and computes bitwise the same outputs. None if any value is not."""
    w = weight.detach()
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % BLOCK:
        return None
    half = w.to(torch.bfloat16)
    if not torch.equal(half.float(), w):
        return None
    return QuantizedWeight("BF16", half.contiguous().view(torch.uint8))


def q8_0_blocks(weight: torch.Tensor) -> QuantizedWeight | None:
    """A weight rounded to GGUF Q8_0 blocks (gguf's own quantizer), for the int8 kernel: a drafter beside an int8
    target (`--dtype int8`). Not the weight's values - a draft's numerics never touch what verification keeps."""
    from gguf import GGMLQuantizationType, quants

    w = weight.detach()
    if w.dim() != 2 or w.dtype != torch.float32 or w.shape[1] % BLOCK:
        return None
    raw = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    return QuantizedWeight("Q8_0", torch.from_numpy(np.ascontiguousarray(raw)))
