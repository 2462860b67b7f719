"""Our own inference runtime for Llama-family targets (Llama, Qwen2, Qwen3, Qwen3-MoE), loading HF weights.

Why not transformers: serving needs a paged KV cache with cheap rollback, forward over ragged
per-sequence query lengths, hidden-state capture at chosen layers, and low per-token overhead
(transformers' eager decode is overhead-bound on a small model). Equality with transformers is tested.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from adaflash.models.targets.config import TransformerConfig
from adaflash.models.targets.decode_graph import DecodeGraph, graphs_enabled
from adaflash.models.device.placement import placed
from adaflash.models.kernels.dtype import auto_dtype_name, int8_activations, own_cpu_kernels_available, resolve_dtype
from adaflash.models.kernels.quant import QuantizedWeight, SplitWeight, int8_formats, stacked
from adaflash.models.targets.gguf_weights import GGUFWeights, source_gguf
from adaflash.models.kernels import attention as attention_kernel
from adaflash.models.kernels.layer_step import LayerSteps, StepHead, StepLayer
from adaflash.models.kernels.selection import (FastLinear, KernelChoice, fast_linears_available, packable,
                                               runs_int8)
from adaflash.models.kv_cache.cache import KVCache
from adaflash.models.kv_cache.ragged import RaggedAttention, RaggedBatch
from adaflash.models.kernels.stock import linear
from adaflash.models.layers import apply_rope, fused_kernels_available, rms_norm, rope_cos_sin, silu_mul
from adaflash.models.targets.moe import MoeBlock, expert_tensors


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor | None  # [len(logit_indices) or T, vocab], fp32
    hidden: torch.Tensor | None  # [T, len(capture_layers) * hidden]: residual stream after each captured layer


class DecoderLayer(nn.Module):
    """Weights of one decoder layer, with q/k/v and gate/up fused so a decode step runs fewer kernels. A Qwen3-MoE
    sparse layer has a router and experts (`moe`) where a dense one has gate_up / down (then None)."""

    def __init__(self, cfg: TransformerConfig, index: int = 0) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
        frozen = dict(requires_grad=False)
        self.input_norm = nn.Parameter(torch.ones(d), **frozen)
        self.qkv = nn.Parameter(torch.empty(qkv_out, d), **frozen)
        self.qkv_bias = nn.Parameter(torch.zeros(qkv_out), **frozen) if cfg.qkv_bias else None
        self.o = nn.Parameter(torch.empty(d, cfg.num_heads * hd), **frozen)
        self.o_bias = nn.Parameter(torch.zeros(d), **frozen) if cfg.o_bias else None
        self.q_norm = nn.Parameter(torch.ones(hd), **frozen) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd), **frozen) if cfg.qk_norm else None
        self.post_norm = nn.Parameter(torch.ones(d), **frozen)
        self.moe = MoeBlock(cfg) if index in cfg.moe_layers else None
        if self.moe is None:
            self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, d), **frozen)
            self.down = nn.Parameter(torch.empty(d, cfg.intermediate_size), **frozen)
        else:
            self.gate_up = self.down = None
        self.fast: dict[str, FastLinear] = {}  # name -> packed-kernel linear (use_fast_linears), else torch's

    @property
    def linear_names(self) -> tuple[str, ...]:
        return ("qkv", "o") if self.moe is not None else ("qkv", "o", "gate_up", "down")

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        fast = self.fast.get(name)
        return fast(x) if fast is not None else linear(x, getattr(self, name), getattr(self, f"{name}_bias", None))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP over the post-attention normed hidden state: the experts of a sparse layer, else the dense SwiGLU."""
        return self.moe(x) if self.moe is not None else self.project("down", silu_mul(self.project("gate_up", x)))


class TargetModel(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        )
        self.fast_lm_head: FastLinear | None = None
        self.lm_head_blocks: QuantizedWeight | None = None
        self.layer_steps: LayerSteps | None = None  # one kernel call per layer, where use_fast_linears made it possible
        self.int8_activations = False  # --dtype int8: the GGUF-blocked linears round their inputs to int8 (another model)
        # One-sequence, one-token steps through a replayed CUDA graph (decode_graph.py): on by default on CUDA; on a
        # CPU the same static step runs eagerly where a test turns it on.
        self.static_decode: bool | None = None  # None: graphs_enabled(device)

    def use_fast_linears(self, quantized: dict[str, QuantizedWeight] | None = None,
                         int8_activations: bool = False) -> bool:
        """Run every linear with the kernel that measured fastest here at each row count (kernels/selection.py).

        Packs a second copy of the weights (the originals stay: training, the drafter's head and export read
        them); `quantized` (our weight name -> the GGUF's blocks of exactly its values) adds the quantized kernel.
        False, changing nothing, where the kernels cannot run (not fp32 on CPU, no AVX2, ADAFLASH_KERNELS=stock).
        `int8_activations`: every linear with blocks of int8_formats() runs the int8-activation kernel at every row
        count instead (llama.cpp's arithmetic; not the fp32 target). A Qwen3-MoE target packs its attention and
        dense-layer linears only, and runs layer by layer (the fused layer step has no experts: models/targets/moe.py).
        """
        if not fast_linears_available(self.embed_tokens):  # (an int8 target's LM head may live in its blocks only)
            return False
        quantized = quantized or {}
        # exact: the target's numbers never depend on how the timing fell (selection.py)
        choice = KernelChoice(int8_activations, exact=True)
        self.int8_activations = int8_activations
        for i, layer in enumerate(self.layers):
            layer.fast = {name: FastLinear(getattr(layer, name), getattr(layer, f"{name}_bias", None), choice,
                                           quantized.get(f"layers.{i}.{name}"))
                          for name in layer.linear_names if packable(getattr(layer, name))}
        head = "embed_tokens" if self.lm_head is self.embed_tokens else "lm_head"
        self.lm_head_blocks = quantized.get(head)  # the drafter's (trimmed) head takes its rows
        self.fast_lm_head = FastLinear(self.lm_head, None, choice, self.lm_head_blocks) if packable(self.lm_head) else None
        c = self.config
        if c.is_moe:
            self.layer_steps = None
            return True
        self.layer_steps = LayerSteps(
            [StepLayer(layer.input_norm, layer.post_norm, layer.fast, layer.q_norm, layer.k_norm) for layer in self.layers],
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps)
        return True

    def streamed_weight_bytes(self, rows: int = 1) -> int:
        """Weight bytes one forward over `rows` rows reads (the bandwidth bound of a decode step): each linear's
        kernel at that row count, every other parameter once; of a MoE layer's experts, the expected number of distinct
        experts `rows` tokens route to under uniform routing."""
        fast = {id(getattr(layer, name)): f for layer in self.layers for name, f in layer.fast.items()}
        if self.fast_lm_head is not None:
            fast[id(self.lm_head)] = self.fast_lm_head
        c = self.config
        touched = 1.0 if not c.is_moe else (1 - (1 - c.num_experts_per_tok / c.num_experts) ** max(rows, 1))
        experts = {id(p) for layer in self.layers if layer.moe is not None for p in (layer.moe.gate_up, layer.moe.down)}
        return int(sum(fast[id(p)].streamed_bytes(rows) if id(p) in fast
                       else p.numel() * p.element_size() * (touched if id(p) in experts else 1)
                       for p in self.parameters()))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def numerics(self) -> str:
        """What the target computes in, as `--dtype` names it: int8 (int8-activation linears), float32, bfloat16."""
        return "int8" if self.int8_activations else str(self.dtype).removeprefix("torch.")

    @property
    def rows_independent(self) -> bool:
        """Whether a position's K/V and logits are bitwise the same in every pass (a prefill of any split, a
        verification, a decode step, in any batch): the int8 target, whose linears and attention (the ragged kernel,
        prefills too) compute each row alone. What makes a shared prompt prefix exact (KVCache.adopt)."""
        return self.int8_activations and attention_kernel.available(self.dtype, self.device, self.config.head_dim)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def cache_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's dtype, or fp16 for the int8 target (llama.cpp's default cache; what
        batched decoding streams is then halved). Part of that target's numeric definition, the same in every pass."""
        return torch.float16 if self.int8_activations else self.dtype

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None, **pool) -> KVCache:
        """`dtype`: what the cache stores (default `cache_dtype`; --kv-dtype); `pool`: KVCache's pool_tokens /
        block_size."""
        c = self.config
        return KVCache(c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, dtype or self.cache_dtype,
                       self.device, **pool)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """What one position of the KV cache costs: K and V of every layer."""
        c, dtype = self.config, dtype or self.cache_dtype
        row = c.head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)  # an int8 row's fp32 scale
        return 2 * c.num_layers * c.num_kv_heads * row

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed_tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head over already-normed hidden states (the drafter shares it), returned in fp32."""
        if self.fast_lm_head is not None and hidden.device.type == "cpu":
            return self.fast_lm_head(hidden).float()
        return linear(hidden, self.lm_head).float()

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        batch: RaggedBatch,
        cache: KVCache,
        capture_layers: Sequence[int] = (),
        logit_indices: torch.Tensor | None = None,
        compute_logits: bool = True,
    ) -> ForwardOutput:
        """Append `token_ids` ([T], flattened over the batch) to each sequence's cache and run the model.

        `logit_indices` selects which of the T positions get logits (default: all); the vocabulary
        projection is the most expensive single matmul for small models, so callers ask only for what
        they use.
        """
        cfg = self.config
        for slot, start in zip(batch.slots, batch.starts):
            if cache.lengths[slot] != start:
                raise ValueError(f"slot {slot} holds {cache.lengths[slot]} positions but the batch starts at {start}")
        if max(batch.ends) > cache.max_len:
            raise ValueError(f"sequence of {max(batch.ends)} positions exceeds the cache's {cache.max_len}")
        static = graphs_enabled(self.device) if self.static_decode is None else self.static_decode
        if (static and batch.num_tokens == 1 and not capture_layers and compute_logits
                and (logit_indices is None or logit_indices.tolist() in ([0], [-1]))):
            slot = batch.slots[0]
            cache.ensure(slot, batch.starts[0] + 1)
            graph = cache.decode_graphs.get(slot)
            if graph is None:
                graph = cache.decode_graphs[slot] = DecodeGraph(self, cache, slot)
            logits = graph(cache, token_ids, batch.starts[0])
            cache.lengths[slot] = batch.starts[0] + 1
            return ForwardOutput(logits=logits, hidden=None)
        # int8: every pass, prefills too, on the ragged kernel (one model at every split: exact prefix reuse).
        attention = RaggedAttention(batch, causal=True, device=self.device, ragged_prefill=self.int8_activations)
        attention.reserve(cache)
        cos, sin = rope_cos_sin(batch.positions, cfg.head_dim, cfg.rope_theta, self.dtype, device=self.device,
                                first=batch.single_start)
        capture = set(capture_layers)
        logits = None
        fused = None
        if self.layer_steps is not None:  # embedding, layers and logits in one kernel call where they can
            head = (StepHead(self.final_norm, self.fast_lm_head)
                    if compute_logits and self.fast_lm_head is not None else None)
            fused = self.layer_steps.forward(token_ids.to(self.device), self.embed_tokens, attention, cache, cos, sin,
                                             capture, head, logit_indices)
        if fused is not None:
            h, logits, captured = fused
        else:
            t = token_ids.shape[0]
            if logit_indices is not None and logit_indices.numel() and not (
                    -t <= int(logit_indices.min()) and int(logit_indices.max()) < t):  # before the cache is written
                raise IndexError(f"logit rows {logit_indices.tolist()} out of the step's {t} tokens")
            h = self.embed(token_ids.to(self.device))
            h, captured = self._layer_loop(h, attention, cache, cos, sin, capture)
        attention.commit_lengths(cache)
        hidden = None
        if capture_layers:
            order = sorted(capture)
            if (isinstance(captured, torch.Tensor) and list(capture_layers) == order
                    and captured.shape[1] == len(order) * cfg.hidden_size):
                # The kernel's [T, layers ascending * hidden] is what the drafter reads: no tensor op runs after the
                # kernel (the first one there runs cold, ~50 us of a 4 ms decode step).
                hidden = captured
            else:
                if isinstance(captured, torch.Tensor):
                    captured = captured.split(cfg.hidden_size, dim=-1)
                by_layer = dict(zip(order, captured))
                hidden = torch.cat([by_layer[i] for i in capture_layers], dim=-1)
        if compute_logits and logits is None:
            selected = h if logit_indices is None else h[logit_indices.to(self.device)]
            logits = self.logits(rms_norm(selected, self.final_norm, cfg.rms_norm_eps))
        return ForwardOutput(logits=logits, hidden=hidden)

    def _layer_loop(self, h: torch.Tensor, attention: RaggedAttention, cache: KVCache, cos: torch.Tensor,
                    sin: torch.Tensor, capture: set[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every decoder layer, op by op (what LayerSteps does in one call per layer where it can)."""
        cfg = self.config
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        t = h.shape[0]
        fused_rope = not cfg.qk_norm and fused_kernels_available(h)
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.project("qkv", x)
            if fused_rope:  # bitwise the unfused path below, in one kernel call
                q = attention.rope_and_write(cache, i, qkv, cos, sin, nq)
            else:
                q = qkv[:, : nq * hd].view(t, nq, hd)
                k = qkv[:, nq * hd : (nq + nkv) * hd].view(t, nkv, hd)
                v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd)
                if cfg.qk_norm:
                    q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                    k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                attention.write(cache, i, k, v)
            h = h + layer.project("o", attention.attend(cache, i, q))
            h = h + layer.mlp(rms_norm(h, layer.post_norm, cfg.rms_norm_eps))
            if i in capture:
                captured.append(h)
        return h, captured


def _hf_weight_map(cfg: TransformerConfig) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensor names concatenated (in order) to build it."""
    names: dict[str, list[str]] = {"embed_tokens": ["model.embed_tokens.weight"], "final_norm": ["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        names["lm_head"] = ["lm_head.weight"]
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        names[f"layers.{i}.input_norm"] = [p + "input_layernorm.weight"]
        names[f"layers.{i}.post_norm"] = [p + "post_attention_layernorm.weight"]
        names[f"layers.{i}.qkv"] = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
        names[f"layers.{i}.o"] = [a + "o_proj.weight"]
        if i not in cfg.moe_layers:  # a sparse layer's router and experts: moe.expert_tensors
            names[f"layers.{i}.gate_up"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
            names[f"layers.{i}.down"] = [p + "mlp.down_proj.weight"]
        if cfg.qkv_bias:
            names[f"layers.{i}.qkv_bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
        if cfg.o_bias:
            names[f"layers.{i}.o_bias"] = [a + "o_proj.bias"]
        if cfg.qk_norm:
            names[f"layers.{i}.q_norm"] = [a + "q_norm.weight"]
            names[f"layers.{i}.k_norm"] = [a + "k_norm.weight"]
    return names


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def load_target(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                int8_activations: bool = False) -> TargetModel:
    """Load a checkpoint directory (config.json + safetensors, or one prepared for a GGUF: registry.py) into our
    runtime: Llama / Qwen2 / Qwen3 / Qwen3-MoE.

    A GGUF's weights come from its own blocks (gguf_weights.py): each linear runs the quantized kernel over them,
    bitwise the fp32 values gguf dequantizes to. `int8_activations` (`--dtype int8`): every linear with blocks of
    quant.int8_formats() runs with its inputs rounded to int8 per 32 values (int8_linear.cpp, kquant.cpp) - a faster,
    slightly different model than the fp32 one, the same in every pass, so speculative decoding stays lossless
    against it; those weights are then never dequantized (memory: the blocks, the embedding, the KV cache).
    `device`: default the process's (models/device/placement.py); our CPU kernels are packed only on a CPU."""
    path = Path(path)
    device = placed(device)
    cfg = TransformerConfig.from_dir(path)
    gguf = source_gguf(path)
    if gguf is not None:
        model = _gguf_target(GGUFWeights(gguf), cfg, dtype, device, int8_activations, path)
    else:
        tensors: dict[str, torch.Tensor] = {}
        for file in _safetensors_files(path):
            try:
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        tensors[key] = f.get_tensor(key)
            except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
                raise ValueError(f"cannot read weights from {file}: {exc}") from exc
        model = target_from_hf_tensors(cfg, tensors, dtype, device, f"checkpoint {path}")
        if fast_linears_available(model.embed_tokens):
            model.use_fast_linears(None, int8_activations)
    runs_int8_here = any(f.choices[0].endswith("xint8") for layer in model.layers for f in layer.fast.values())
    if int8_activations and not runs_int8_here:
        raise ValueError(f"--dtype int8 needs our CPU kernels and a GGUF target with blocks of {list(int8_formats())}; "
                         f"{path} runs none here (use fp32)")
    return model.eval()


_LINEAR_KINDS = ("qkv", "o", "gate_up", "down", "embed_tokens", "lm_head")


def _gguf_target(weights: GGUFWeights, cfg: TransformerConfig, dtype: torch.dtype, device: torch.device,
                 int8_activations: bool, path: Path) -> TargetModel:
    names = _hf_weight_map(cfg)
    blocks: dict[str, QuantizedWeight | SplitWeight] = {}
    if dtype == torch.float32 and device.type == "cpu" and own_cpu_kernels_available():
        for ours, theirs in names.items():
            if ours.rsplit(".", 1)[-1] in _LINEAR_KINDS:
                parts = [weights.blocks(n) for n in theirs]
                if all(p is not None for p in parts):
                    blocks[ours] = stacked(parts)
    # int8: a weight the int8 kernel runs at every row count is never needed in fp32 (the embedding is: it is looked up)
    absent = {ours for ours, q in blocks.items()
              if int8_activations and ours != "embed_tokens" and runs_int8(q)}
    tensors = {n: weights.dense(n) for ours, theirs in names.items() if ours not in absent for n in theirs}
    model = target_from_hf_tensors(cfg, tensors, dtype, device, f"{path} ({weights.path})", absent=absent)
    if fast_linears_available(model.embed_tokens):
        model.use_fast_linears(blocks, int8_activations)
    elif absent:
        raise ValueError(f"{weights.path}: the int8 kernels are unavailable here (use --dtype fp32)")
    return model


def target_from_hf_tensors(cfg: TransformerConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                           device: str | torch.device, source: str = "the state dict",
                           absent: set[str] = frozenset()) -> TargetModel:
    """Our runtime over HF-named tensors (a checkpoint's, or a transformers model's `state_dict()`), on `device`,
    with torch's kernels (load_target adds our CPU kernels where they run). `absent`: our parameters left on the meta
    device (their values live in the int8 kernels' blocks only)."""
    with torch.device("meta"):
        model = TargetModel(cfg)
    state = {}
    for ours, theirs in _hf_weight_map(cfg).items():
        if ours in absent:
            continue
        missing = [n for n in theirs if n not in tensors]
        if missing:
            raise ValueError(f"{source} lacks tensors {missing} (needed for {ours})")
        state[ours] = torch.cat([tensors[n].to(device) for n in theirs], dim=0).to(dtype)
    for i in cfg.moe_layers:
        for name, tensor in zip(("router", "gate_up", "down"), expert_tensors(tensors, i, cfg.num_experts, source)):
            state[f"layers.{i}.moe.{name}"] = tensor.to(device=device, dtype=dtype, copy=True)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head = model.embed_tokens
    if not absent:
        model = model.to(device)
    leftover = [n for n, p in model.named_parameters() if p.is_meta and n not in absent]
    if leftover:
        raise ValueError(f"{source} did not provide {leftover}")
    return model.eval()


def random_target(cfg: TransformerConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> TargetModel:
    """A target of `cfg`'s shapes with random weights, built on `device` (normal(0, 0.02), unit norms): what timing a
    pass needs (its cost depends on shapes, not values) without a checkpoint to download."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype` directly: an 8B target never exists in fp32
    try:
        with torch.device(device):
            model = TargetModel(cfg)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm") or name.endswith("final_norm"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def load_target_as(path: str | Path, dtype_name: str = "auto", device: str | torch.device | None = None) -> TargetModel:
    """load_target from a `--dtype` name: auto, bf16, fp32, or int8 (fp32 with the int8-activation linears); auto runs
    a GGUF in formats only the int8 kernel runs at speed as int8 (dtype.auto_dtype_name)."""
    device = placed(device)
    gguf = source_gguf(path)
    if gguf is not None:
        dtype_name = auto_dtype_name(dtype_name, device.type, GGUFWeights(gguf).linear_formats())
    return load_target(path, resolve_dtype(dtype_name, device.type), device,
                       int8_activations=int8_activations(dtype_name))
