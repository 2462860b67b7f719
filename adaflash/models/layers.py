"""Small functional pieces shared by the target runtime and the drafter."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from adaflash.models.kernels import packed


def fused_kernels_available(x: torch.Tensor) -> bool:
    """Whether our fused CPU kernels (kernels/fused.cpp) can run on `x`: fp32 on CPU, no autograd, the kernel
    library built here, and not ADAFLASH_KERNELS=stock."""
    return _fused_library(x) is not None


def _fused_library(x: torch.Tensor):
    """The kernel library where fused_kernels_available(x), else None (one lookup: a decode step makes dozens)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled():
        return _kernel_library()
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        lib = _fused_library(x) if weight.dtype == torch.float32 else None
        if lib is not None:  # torch's costs ~20 us a call at one row
            x, w = x.contiguous(), weight.contiguous()  # bound: a temporary would be freed before the call
            out = torch.empty_like(x)
            if x.numel():
                with packed.profiled("adaflash::rms_norm"):
                    lib.adaflash_rms_norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], w.data_ptr(), eps,
                                          out.data_ptr(), torch.get_num_threads())
            return out
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    # Normalise in fp32 and scale in the model dtype, as transformers' Llama/Qwen RMSNorm does.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over the fused gate/up projection [rows, 2 * inter] (gate first)."""
    lib = _fused_library(gate_up)
    if lib is not None and gate_up.dim() == 2:  # one kernel where torch runs chunk, silu and mul
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        if rows:
            with packed.profiled("adaflash::silu_mul"):
                lib.adaflash_silu_mul(gate_up.data_ptr(), rows, inter, out.data_ptr(), torch.get_num_threads())
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) over [rows, V] (int64 [rows]); our kernel where it runs (torch's costs ~40 us a
    49152-wide row here, paid for every greedy token decoded or verified), the same indices.

    Lean on purpose: it runs right after a target pass, when the weights have just streamed through the caches and
    every Python step runs cold; the checks of `_fused_library` (the environment read among them) cost ~60 us a call
    there, ~1% of a decode step (2-core EPYC). The indices are torch's either way, so ADAFLASH_KERNELS is not read."""
    if logits.dtype is torch.float32 and logits.is_cpu and logits.dim() == 2 and not logits.requires_grad:
        lib = _argmax_library()
        rows, width = logits.shape
        if lib is not None and rows and width:
            logits = logits.contiguous()
            out = torch.empty(rows, dtype=torch.long)
            if torch.autograd.profiler._is_profiler_enabled:  # (a no-op context still costs its calls, cold)
                with packed.profiled("adaflash::argmax_rows"):
                    lib.adaflash_argmax_rows(logits.data_ptr(), rows, width, out.data_ptr(), torch.get_num_threads())
            else:
                lib.adaflash_argmax_rows(logits.data_ptr(), rows, width, out.data_ptr(), torch.get_num_threads())
            return out
    return logits.argmax(-1)


@lru_cache(maxsize=1)
def _argmax_library():
    return packed.library()


def _kernel_library():
    return packed.enabled_library()


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: "float | RopeSpec", dtype: torch.dtype, first: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, head_dim] on `device` (default the positions') for absolute positions (half-split layout, as HF
    checkpoints use): rows of one table per (head_dim, theta, dtype, device), grown to the largest position asked so
    far - one gather a call where computing them costs ~9 small ops (~3 a decode step: target, drafter context, draft
    block). `first`: the positions are first, first + 1, ... (one sequence's): the same rows as views, no gather.
    Host positions with an accelerator `device`: the table's size is read on the host, with no device sync."""
    device = positions.device if device is None else torch.device(device)
    if first is not None:
        t = positions.numel()
        cos, sin = _rope_table(head_dim, theta, dtype, device, first + t)
        return cos[first : first + t, None, :], sin[first : first + t, None, :]
    needed = int(positions.max()) + 1 if positions.numel() else 0
    cos, sin = _rope_table(head_dim, theta, dtype, device, needed)
    index = positions.to(device)
    return cos[index][:, None, :], sin[index][:, None, :]


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass(frozen=True)
class RopeSpec:
    """A scaled rotary embedding (yarn, linear, llama3, longrope), where `theta` alone does not say it: hashable, so it
    keys the tables as a plain theta does. Frequencies and the attention factor are transformers' own (its
    ROPE_INIT_FUNCTIONS), so a drafter rotates exactly as the reference that trained it."""

    theta: float
    scaling: tuple[tuple[str, object], ...]  # rope_parameters beyond theta, rope_type included
    max_position_embeddings: int
    head_dim: int

    def frequencies(self, device: torch.device) -> tuple[torch.Tensor, float]:
        from transformers import PretrainedConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = {k: list(v) if isinstance(v, tuple) else v for k, v in self.scaling}
        config = PretrainedConfig(rope_parameters={"rope_theta": self.theta, **params}, head_dim=self.head_dim,
                                  hidden_size=self.head_dim, num_attention_heads=1,
                                  max_position_embeddings=self.max_position_embeddings)
        inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, device)
        return inv_freq.float(), float(factor)


def _rope_table(head_dim: int, theta: "float | RopeSpec", dtype: torch.dtype, device: torch.device,
                rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (head_dim, theta, dtype, device)
    table = _ROPE_TABLES.get(key)
    if table is None or table[0].shape[0] < rows:
        size = max(rows, 4096, 2 * table[0].shape[0] if table is not None else 0)
        with torch.inference_mode(False):  # a normal tensor, usable by training passes too
            inv_freq, factor = (theta.frequencies(device) if isinstance(theta, RopeSpec)
                                else (_inv_freq(head_dim, theta, device), 1.0))
            freqs = torch.arange(size, device=device).float()[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            table = _ROPE_TABLES[key] = ((emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype))
    return table


@lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # cached: a normal tensor, usable by training passes too
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
