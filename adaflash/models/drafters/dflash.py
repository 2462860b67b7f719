"""The DFlash block-diffusion drafter (arXiv 2602.06036), in the public checkpoint's module layout.

Context: hidden states of n target layers, concatenated, projected by `fc` and RMS-normed (`hidden_norm`).
Each draft layer projects keys/values from [context ; block] with shared k/v projections, queries from the
block only; attention is non-causal inside the block and RoPE uses true positions. The block is
[last committed token, MASK x (B-1)]; one forward proposes B-1 tokens. The drafter owns no embedding and no
LM head: it borrows the target's. Parameter names equal the public checkpoints' (`fc`, `hidden_norm`,
`layers.N.self_attn.q_proj`, ..., `norm`), so state dicts load both ways without renaming.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from adaflash.models.drafters.config import DrafterConfig, LayerAttention
from adaflash.models.drafters.dflash2 import CandidateSelector, GroupedDynamicCausalConv
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.kernels.quant import exact_bf16_blocks, q8_0_blocks
from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.kv_cache.ragged import BlockMasks, RaggedAttention, RaggedBatch, kind_mask
from adaflash.models.kernels.layer_step import ContextStep, LayerSteps, StepHead, StepLayer
from adaflash.models.kernels.selection import FastLinear, KernelChoice, fast_linears_available, packable, version_of
from adaflash.models.layers import apply_rope, rms_norm, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Projection(nn.Linear):
    """nn.Linear (the checkpoint schema's names) that, once given a FastLinear, runs it for inference passes
    (no autograd, 2-D rows); training keeps torch's kernel and its gradients."""

    fast: FastLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (`fast.weight is self.weight`: a Parameter replaced since, e.g. by load_state_dict(assign=True), is not
        # what the kernel packed)
        if self.fast is not None and x.dim() == 2 and not torch.is_grad_enabled() and self.fast.weight is self.weight:
            return self.fast(x)
        return super().forward(x)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = Projection(d, cfg.num_heads * hd, bias=False)
        self.k_proj = Projection(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = Projection(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = Projection(cfg.num_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, d] -> rotated keys and values [..., T, kv_heads, head_dim]."""
        shape = (*x.shape[:-1], self.num_kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        return apply_rope(self.q_norm(self.q_proj(x).view(shape)), cos, sin)


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = Projection(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Projection(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Projection(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DFlash 2: convolutions along the block around attention and MLP (models/drafters/dflash2.py).
        conv = (lambda: GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)) \
            if cfg.dflash2 else (lambda: None)
        self.attention_conv: GroupedDynamicCausalConv | None = conv()
        self.mlp_conv: GroupedDynamicCausalConv | None = conv()

    def sublayer(self, conv: GroupedDynamicCausalConv | None, run, x: torch.Tensor, blocks: int) -> torch.Tensor:
        """run(x) over [blocks * B, d] rows, inside the layer's convolution pair when it has one."""
        if conv is None:
            return run(x)
        shape = x.shape
        x, kernel = conv.prepare(x.view(blocks, -1, shape[-1]))
        out = run(x.reshape(shape))
        return conv.finish(out.view(blocks, -1, shape[-1]), kernel).reshape(shape)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = Projection(len(config.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.candidate_selector = (CandidateSelector(d, config.vocab_size, config.selector_rank, config.selector_top_k)
                                   if config.dflash2 else None)
        # Not a parameter or buffer: the state dict stays the public schema's; saved in its own file.
        self.draft_vocab: DraftVocab | None = None
        self._layer_steps: LayerSteps | None = None  # the block pass in one kernel call per layer (use_fast_linears)
        self._context_step: ContextStep | None = None  # the context feed in one kernel call (use_fast_linears)
        # What the steps' stacked copies came from: (module, parameter name, tensor, its version) of every parameter.
        self._step_sources: list[tuple[nn.Module, str, torch.Tensor, int | None]] = []

    def set_draft_vocab(self, vocab: DraftVocab | None) -> None:
        if vocab is not None and vocab.vocab_size != self.config.vocab_size:
            raise ValueError(f"a draft vocabulary over {vocab.vocab_size} ids for a drafter of vocab {self.config.vocab_size}")
        self.draft_vocab = vocab
        self.config = replace(self.config, draft_vocab_size=vocab.size if vocab is not None else None)

    def use_fast_linears(self, int8_activations: bool = False) -> bool:
        """Inference passes run our kernels at the row counts where they measured faster (kernels/selection.py);
        False, changing nothing, where they cannot run here. Weights saved in bf16 (every shipped checkpoint) also get
        the BF16 kernel: bitwise the fp32 kernel's outputs from half the bytes. `int8_activations` (beside a
        `--dtype int8` target): the weights rounded to Q8_0 blocks and run by the int8 kernel - other drafts, no
        other outputs (verification keeps only the target's tokens)."""
        if not fast_linears_available(self.fc.weight):
            return False
        choice = KernelChoice(int8_activations)
        blocks_of = q8_0_blocks if int8_activations else exact_bf16_blocks
        for module in self.modules():
            if isinstance(module, Projection) and packable(module.weight):
                module.fast = FastLinear(module.weight, module.bias, choice, blocks_of(module.weight))
        self._layer_steps = self._build_layer_steps(choice, blocks_of)
        self._context_step = self._build_context_step(choice, blocks_of)
        self._step_sources = [(m, name, p, version_of(p)) for m in self.modules()
                              for name, p in m.named_parameters(recurse=False)]
        return True

    def _build_layer_steps(self, choice: KernelChoice, blocks_of) -> LayerSteps | None:
        """q/k/v and gate/up stacked into one packed weight each (an inference copy: `_steps_current` notices when
        training changes or replaces the originals, and the loop runs instead)."""
        c, steps = self.config, []
        if c.dflash2 or not c.plain_attention:  # the fused step knows neither convolutions nor masked layers
            return None
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            stacked = {"qkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                       "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight])}
            if a.o_proj.fast is None or m.down_proj.fast is None or not all(map(packable, stacked.values())):
                return None
            linears = {name: FastLinear(w.detach(), None, choice, blocks_of(w)) for name, w in stacked.items()}
            linears.update(o=a.o_proj.fast, down=m.down_proj.fast)  # unstacked: the projections' own kernels
            steps.append(StepLayer(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                                   linears, a.q_norm.weight.detach(), a.k_norm.weight.detach()))
        return LayerSteps(steps, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                          c.rms_norm_eps)

    def _build_context_step(self, choice: KernelChoice, blocks_of) -> ContextStep | None:
        """Each layer's k and v projections stacked into one packed weight (an inference copy, as above)."""
        c, layers = self.config, []
        for layer in self.layers:
            a = layer.self_attn
            kv = torch.cat([a.k_proj.weight, a.v_proj.weight]).detach()
            if self.fc.fast is None or not packable(kv):
                return None
            layers.append((FastLinear(kv, None, choice, blocks_of(kv)), a.k_norm.weight.detach()))
        return ContextStep(self.fc.fast, self.hidden_norm.weight.detach(), layers, c.hidden_size, c.num_kv_heads,
                           c.head_dim, c.rms_norm_eps)

    def _steps_current(self, step) -> bool:
        """Whether a fused step can run: built, and no parameter changed or replaced since (training, a reload)."""
        # (direct lookups, not self.parameters(): that walks the module tree, ~0.2 ms a decode step)
        return step is not None and all(m._parameters.get(name) is p and version_of(p) == v
                                        for m, name, p, v in self._step_sources)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The checkpoint's output multiplier and soft cap on raw draft logits (LM-head outputs), as the reference's
        compute_logits applies them."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_cache(self, num_slots: int, max_len: int, **pool) -> KVCache:
        """Context K/V per draft layer. Its length = context positions; block K/V are written past it, never kept.
        `pool`: KVCache's pool_tokens / block_size."""
        c = self.config
        return KVCache(c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, self.dtype, self.device, **pool)

    def _rope(self, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin of the batch's positions (one sequence's: views of the table, no gather)."""
        return rope_cos_sin(batch.positions, self.config.head_dim, self.config.rope, self.dtype, device=self.device,
                            first=batch.single_start)

    @torch.inference_mode()
    def extend_context(self, cache: KVCache, features: torch.Tensor, batch: RaggedBatch) -> None:
        """Append target features [T, n * d] of newly committed positions to the context cache."""
        features = features.to(device=self.device, dtype=self.dtype)
        cos, sin = self._rope(batch)
        attention = RaggedAttention(batch, causal=False, device=self.device)
        attention.reserve(cache)
        if self._steps_current(self._context_step) and self._context_step.run(features, attention, cache, cos, sin):
            attention.commit_lengths(cache)
            return
        ctx = self.hidden_norm(self.fc(features))
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            attention.write(cache, i, k, v)
        attention.commit_lengths(cache)

    @torch.inference_mode()
    def draft_hidden(self, cache: KVCache, block_embeds: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """One denoising pass over blocks [R, B, d] that start at each slot's context length -> [R, B, d] (normed).

        Each block attends to its whole context and to all of its own positions (non-causal).
        """
        r, b, d = block_embeds.shape
        attention, cos, sin = self._block_pass(cache, slots, r, b)
        h = block_embeds.to(device=self.device, dtype=self.dtype).reshape(r * b, d)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        # Block K/V land past the context length (overwritten by the next context): neither path commits lengths.
        fused = (self._layer_steps.run(h, attention, cache, cos, sin, set())
                 if self._steps_current(self._layer_steps) else None)
        if fused is not None:
            return self.norm(fused[0]).view(r, b, d)
        masked = BlockMasks(attention, self.device)
        for i, layer in enumerate(self.layers):
            attn, kind = layer.self_attn, self.config.attention_of(i)

            def attend(x: torch.Tensor) -> torch.Tensor:
                k, v = attn.keys_values(x, cos, sin)
                attention.write(cache, i, k, v)
                return attn.o_proj(masked.attend(kind, cache, i, attn.queries(x, cos, sin)))

            h = h + layer.sublayer(layer.attention_conv, attend, layer.input_layernorm(h), r)
            h = h + layer.sublayer(layer.mlp_conv, layer.mlp, layer.post_attention_layernorm(h), r)
        return self.norm(h).view(r, b, d)

    def _block_pass(self, cache: KVCache, slots: Sequence[int], r: int,
                    b: int) -> tuple[RaggedAttention, torch.Tensor, torch.Tensor]:
        """The attention and RoPE of R blocks of B positions starting at each slot's context length (non-causal)."""
        batch = RaggedBatch.build(slots, [cache.lengths[s] for s in slots], [b] * r)
        if max(batch.ends) > cache.max_len:
            raise ValueError(f"block end {max(batch.ends)} exceeds the drafter cache's {cache.max_len} positions")
        attention = RaggedAttention(batch, causal=False, device=self.device)
        attention.reserve(cache)
        return (attention, *self._rope(batch))

    @torch.inference_mode()
    def draft_logits(self, cache: KVCache, block_ids: torch.Tensor, slots: Sequence[int], embed: torch.Tensor,
                     head: FastLinear, rows: torch.Tensor) -> torch.Tensor | None:
        """draft_hidden over the blocks of token ids [R, B] (their rows of `embed`), then the final norm and `head` on
        the flat block rows `rows`, in one kernel call (LayerSteps.forward); None, running nothing, where that call
        cannot run here or `head` has no packed kernel at that row count (the caller takes draft_hidden's path)."""
        if (not self._steps_current(self._layer_steps) or head.kernel_for(rows.shape[0]) is None
                or self.config.input_embedding_scale != 1.0):  # (the fused call embeds the ids unscaled)
            return None
        attention, cos, sin = self._block_pass(cache, slots, *block_ids.shape)
        # Block K/V land past the context length (overwritten by the next context): nothing commits lengths.
        out = self._layer_steps.forward(block_ids.reshape(-1), embed, attention, cache, cos, sin, set(),
                                        StepHead(self.norm.weight, head), rows)
        return None if out is None else out[1]

    def forward(self, context_features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """The training pass (so DDP's hooks see it); inference uses extend_context / draft_hidden."""
        return self.forward_train(context_features, block_embeds, anchors)

    def forward_train(
        self, context_features: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """Many blocks of one sequence in one pass (training): [L, n*d] features, [A, B, d] blocks -> [A, B, d].

        Block j starts at position anchors[j]; its queries see the context strictly before the anchor and
        all positions of their own block, exactly what `draft_hidden` sees at inference time.
        """
        cfg = self.config
        seq_len = context_features.shape[0]
        a, b, d = block_embeds.shape
        device = self.fc.weight.device
        ctx = self.hidden_norm(self.fc(context_features))
        block_pos = (anchors[:, None] + torch.arange(b, device=anchors.device)[None, :]).reshape(-1)
        ctx_cos, ctx_sin = rope_cos_sin(torch.arange(seq_len), cfg.head_dim, cfg.rope, ctx.dtype, first=0,
                                        device=device)
        blk_cos, blk_sin = rope_cos_sin(block_pos.cpu(), cfg.head_dim, cfg.rope, ctx.dtype, device=device)
        # [1, 1, A*B, L + A*B] mask: context before the block's anchor, plus the block itself. SDPA gets 4-D
        # [batch, heads, q, k] tensors: 3-D ones fall back to the math kernel on CUDA, whose bf16 score tensor alone
        # is heads x A*B x (L + A*B) (~10 GB a layer at Qwen3-8B's training shapes); a boolean mask is one the
        # memory-efficient kernel takes.
        sees_ctx = torch.arange(seq_len, device=device)[None, :] < anchors.to(device).repeat_interleave(b)[:, None]
        block_id = torch.arange(a, device=device).repeat_interleave(b)
        sees_block = block_id[:, None] == block_id[None, :]
        visible = torch.cat([sees_ctx, sees_block], dim=1)
        key_pos = torch.cat([torch.arange(seq_len, device=device), block_pos.to(device)])
        masks: dict[LayerAttention, torch.Tensor] = {}
        h = block_embeds.reshape(a * b, d) * cfg.input_embedding_scale
        rep = cfg.num_heads // cfg.num_kv_heads
        for i, layer in enumerate(self.layers):
            attn, kind = layer.self_attn, cfg.attention_of(i)
            if kind not in masks:
                masks[kind] = (visible & kind_mask(kind, block_pos.to(device)[:, None], key_pos[None, :]))[None, None]

            def attend(x: torch.Tensor) -> torch.Tensor:
                k_ctx, v_ctx = attn.keys_values(ctx, ctx_cos, ctx_sin)
                k_blk, v_blk = attn.keys_values(x, blk_cos, blk_sin)
                k = torch.cat([k_ctx, k_blk]).transpose(0, 1)  # [kv_heads, L + A*B, head_dim]
                v = torch.cat([v_ctx, v_blk]).transpose(0, 1)
                q = attn.queries(x, blk_cos, blk_sin).transpose(0, 1)  # [heads, A*B, head_dim]
                out = F.scaled_dot_product_attention(
                    q[None], k.repeat_interleave(rep, 0)[None], v.repeat_interleave(rep, 0)[None], attn_mask=masks[kind]
                )  # [1, heads, A*B, head_dim]
                return attn.o_proj(out[0].transpose(0, 1).reshape(a * b, -1))

            h = h + layer.sublayer(layer.attention_conv, attend, layer.input_layernorm(h), a)
            h = h + layer.sublayer(layer.mlp_conv, layer.mlp, layer.post_attention_layernorm(h), a)
        return self.norm(h).view(a, b, d)
