"""Configuration of a Llama-family target, read from a Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaflash.models.files import read_config_json


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face architecture differs from Llama, as the runtime reads it. A new architecture is a row of
    `ARCHITECTURES` where these fields say all it changes; anything more is refused at load, by name."""

    hf_name: str  # config.json's `architectures` entry
    family: str  # our name, and llama.cpp's `general.architecture`
    qkv_bias: bool | None  # q/k/v projections carry a bias: always (True), never (False), or as `attention_bias`
    o_bias: bool | None  # the output projection carries a bias: likewise
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    moe: bool = False  # routed experts in place of the MLP in its sparse layers (moe.py)


# Qwen2 = Llama + q/k/v bias; Qwen3 = Llama + per-head q/k RMSNorm; Qwen3-MoE = Qwen3 with a routed mixture of experts.
ARCHITECTURES = {a.hf_name: a for a in (
    Architecture("LlamaForCausalLM", "llama", qkv_bias=None, o_bias=None, qk_norm=False),
    Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True, o_bias=False, qk_norm=False),
    Architecture("Qwen3ForCausalLM", "qwen3", qkv_bias=None, o_bias=None, qk_norm=True),
    Architecture("Qwen3MoeForCausalLM", "qwen3_moe", qkv_bias=None, o_bias=None, qk_norm=True, moe=True),
)}

# Mixture-of-experts features of other families (Qwen2-MoE's shared expert, DeepSeek's grouped routing...): a config
# that sets one is refused at load, by name, rather than run without it.
_UNSUPPORTED_MOE_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts",
                           "moe_shared_expert_intermediate_size", "n_group", "topk_group", "routed_scaling_factor",
                           "first_k_dense_replace", "moe_layer_freq")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model this runtime implements."""


def rope_theta_of(cfg: dict[str, Any]) -> float:
    # transformers 5 nests rope settings under `rope_parameters`; 4.x kept `rope_theta` at the top level.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported yet (only plain RoPE); found in rope_parameters={params}"
        )
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


@dataclass(frozen=True)
class TransformerConfig:
    family: str  # an Architecture's family: "llama" | "qwen2" | "qwen3" | "qwen3_moe"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    # Qwen3-MoE: the layers whose MLP is a mixture of `num_experts` experts (each of `moe_intermediate_size`), of which
    # a token's router picks `num_experts_per_tok` (softmax, then top-k, renormalised if `norm_topk_prob`); the other
    # layers keep the dense MLP of `intermediate_size`. Empty for a dense model.
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "TransformerConfig":
        archs = cfg.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(f"unsupported architecture {archs}; expected one of {sorted(ARCHITECTURES)}")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        attention_bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        num_layers = int(cfg["num_hidden_layers"])
        return cls(
            family=arch.family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta_of(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias if arch.qkv_bias is None else arch.qkv_bias,
            o_bias=attention_bias if arch.o_bias is None else arch.o_bias,
            qk_norm=arch.qk_norm,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            eos_token_ids=eos_ids,
            **(_moe_fields(cfg, num_layers) if arch.moe else {}),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "TransformerConfig":
        return cls.from_hf_dict(read_config_json(path, "a Hugging Face checkpoint directory"))


def _moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's routing fields (transformers' Qwen3MoeDecoderLayer): layer i is sparse unless it is in
    `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`, and only while there are experts."""
    for name in _UNSUPPORTED_MOE_FIELDS:
        if cfg.get(name):
            raise UnsupportedModelError(f"{name}={cfg[name]!r} is not supported (Qwen3-MoE routes to its experts only)")
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=True is not supported (full attention only)")
    # transformers 5 writes `num_local_experts` (its attribute map for num_experts); Qwen's own configs `num_experts`
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(num_layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
    if moe_layers and not 0 < top_k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    return dict(moe_layers=moe_layers, num_experts=experts if moe_layers else 0,
                num_experts_per_tok=top_k if moe_layers else 0,
                moe_intermediate_size=int(cfg["moe_intermediate_size"]) if moe_layers else 0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
