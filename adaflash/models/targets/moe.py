"""Qwen3-MoE's sparse MLP: a router picks `num_experts_per_tok` of `num_experts` SwiGLU experts for each token.

The arithmetic is transformers' (Qwen3MoeTopKRouter, Qwen3MoeExperts): router logits over the normed hidden state,
softmax in fp32, top-k, renormalised to sum to one when `norm_topk_prob`, cast back; each chosen expert's
down(silu(gate x) * up x) scaled by its weight and summed into zeros in ascending expert order. A token's routing depends
on its own row only, so a verify block routes each position as a one-token decode step does.

Two ways to run the experts, the same sum in the same order:
- grouped (every pass of more than one token): tokens sorted by expert, one matmul pair per expert hit; the number of
  tokens per expert is read on the host (a sync), so not graph-capturable.
- gathered (a one-token step): the k experts' weights copied out by index on the device, no host sync and no shape that
  depends on the routing: what a CUDA graph of a decode step can capture (models/targets/decode_graph.py). It reads each chosen
  expert twice (the copy); a grouped-GEMM kernel would not, and is not used here.
Both run torch's ops on every device: our CPU kernels (packed linears, the fused layer step) do not cover experts.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from adaflash.models.targets.config import TransformerConfig
from adaflash.models.layers import silu_mul


class MoeBlock(nn.Module):
    """One sparse layer's router and experts, the experts stacked: gate_up [E, 2I, D] (gate rows, then up rows, as
    transformers 5 fuses them), down [E, D, I]."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        frozen = dict(requires_grad=False)
        self.router = nn.Parameter(torch.empty(e, d), **frozen)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, d), **frozen)
        self.down = nn.Parameter(torch.empty(e, d, i), **frozen)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] (the post-attention normed hidden state) -> (weights [T, k] in x's dtype, experts [T, k]),
        each row's experts ascending (the order their outputs are summed in)."""
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts, order = experts.sort(dim=-1)
        return weights.gather(-1, order).to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if x.shape[0] == 1:
            return self._gathered(x, weights, experts)
        return self._grouped(x, weights, experts)

    def _expert(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_mul(F.linear(x, gate_up)), down)

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for j in range(self.top_k):
            e = experts[0, j : j + 1]
            y = self._expert(x, self.gate_up.index_select(0, e)[0], self.down.index_select(0, e)[0])
            out = out + y * weights[:, j : j + 1]
        return out

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens ascending within each
        tokens = order // self.top_k
        scales = weights.flatten()[order, None]
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):  # ascending experts: each token's outputs are added in its routing order
            if n:
                rows = tokens[start : start + n]
                out.index_add_(0, rows, self._expert(x[rows], self.gate_up[e], self.down[e]) * scales[start : start + n])
                start += n
        return out


def expert_tensors(tensors: dict[str, torch.Tensor], layer: int, num_experts: int, source: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer `layer`'s (router, gate_up, down) from HF-named tensors: a checkpoint's per-expert
    `mlp.experts.N.{gate,up,down}_proj.weight` (stacked here; each consumed from `tensors` as it is stacked, so a 30B
    checkpoint is never held twice) or transformers 5's in-memory fused `mlp.experts.{gate_up,down}_proj`."""
    p = f"model.layers.{layer}.mlp."
    router = p + "gate.weight"
    if router not in tensors:
        raise ValueError(f"{source} lacks tensors {[router]} (the router of MoE layer {layer})")
    if p + "experts.gate_up_proj" in tensors and p + "experts.down_proj" in tensors:
        return tensors[router], tensors[p + "experts.gate_up_proj"], tensors[p + "experts.down_proj"]
    names = [[f"{p}experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")] for e in range(num_experts)]
    missing = [n for group in names for n in group if n not in tensors]
    if missing:
        shown = missing[:3] + (["..."] if len(missing) > 3 else [])
        raise ValueError(f"{source} lacks {len(missing)} expert tensors of MoE layer {layer}: {shown}")
    gate_up = torch.stack([torch.cat([tensors.pop(g), tensors.pop(u)]) for g, u, _ in names])
    down = torch.stack([tensors.pop(d) for _, _, d in names])
    return tensors[router], gate_up, down
