"""A DFlash drafter's configuration, read from and written to the public checkpoints' `config.json`.

The schema is z-lab's (`dflash` reference code, vLLM `method: "dflash"`, SGLang `DFLASH`): a Qwen3-style config with
`architectures: ["DFlashDraftModel"]` (or `["DFlash2DraftModel"]`), `num_target_layers`, `block_size` and a
`dflash_config` block. Every field public drafters carry that changes the drafter's math is read here and honoured by
models/drafters/dflash.py; a field or architecture this runtime does not implement is refused at load, by name, rather than
run without it (a drafter that silently drafts differently still verifies losslessly, but is not the drafter asked for).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.draft_vocab import VOCAB_FILE
from adaflash.models.layers import RopeSpec

ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
# dflash_config keys this runtime reads; the AdaFlash release's `thresh_head_*` keys describe a length head that lives
# beside the drafter (models/drafters/length_head.py), not in its math.
_DFLASH_KEYS = {"mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale", "output_multiplier",
                "final_logit_softcapping", "selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size"}
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Rotary variants whose frequencies do not depend on the sequence length (transformers computes them; "dynamic"
# rescales with the length seen so far, which a cached context cannot follow).
_ROPE_TYPES = {"default", "linear", "yarn", "llama3", "longrope"}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Capture layers spread evenly over [1, L-3] (one draft layer: the middle), as DFlash does."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclass(frozen=True)
class LayerAttention:
    """How one draft layer's block queries see keys: all of the context and the whole block (DFlash's default), or
    causally inside the block, optionally within a sliding window of `window` positions (context included)."""

    causal: bool = False
    window: int | None = None

    @property
    def plain(self) -> bool:
        return not self.causal and self.window is None


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    draft_vocab_size: int | None = None  # a trimmed draft vocabulary of this many ids (models/drafters/draft_vocab.py)
    # Public checkpoints' fields (defaults: DFlash as this project trains it).
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # rope_parameters beyond theta (yarn, linear, ...); () = plain
    layer_attention: tuple[LayerAttention, ...] = ()  # per layer; () = every layer plain
    input_embedding_scale: float = 1.0  # the block's token embeddings are scaled by this (Gemma's sqrt(d))
    output_multiplier: float = 1.0  # draft logits are multiplied by this ...
    final_logit_softcapping: float | None = None  # ... then soft-capped: tanh(x / c) * c
    # DFlash 2 (architectures ["DFlash2DraftModel"]): grouped dynamic causal convolutions and a candidate selector.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unknown keys, kept for round trips

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor + at least one draft), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if max(self.target_layer_ids) >= self.num_target_layers or min(self.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids {self.target_layer_ids} out of range for {self.num_target_layers} layers")
        if self.layer_attention and len(self.layer_attention) != self.num_layers:
            raise ValueError(f"{len(self.layer_attention)} layer attention kinds for {self.num_layers} layers")
        if self.dflash2:
            if min(self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k) < 1:
                raise ValueError(f"a DFlash 2 drafter needs {', '.join(_DFLASH2_KEYS)} >= 1")
            if self.hidden_size % self.conv_group_size:
                raise ValueError(f"conv_group_size {self.conv_group_size} does not divide hidden_size {self.hidden_size}")

    @property
    def dflash2(self) -> bool:
        return self.selector_top_k > 0 or self.conv_kernel_size > 0

    @property
    def rope(self) -> float | RopeSpec:
        """What models/layers.rope_cos_sin takes: the plain theta, or the scaled variant's spec."""
        return RopeSpec(self.rope_theta, self.rope_scaling, self.max_position_embeddings, self.head_dim) \
            if self.rope_scaling else self.rope_theta

    def attention_of(self, layer: int) -> LayerAttention:
        return self.layer_attention[layer] if self.layer_attention else LayerAttention()

    @property
    def plain_attention(self) -> bool:
        return all(a.plain for a in self.layer_attention)

    @property
    def plain_logits(self) -> bool:
        return self.output_multiplier == 1.0 and not self.final_logit_softcapping

    @classmethod
    def for_target(
        cls,
        target: TransformerConfig,
        mask_token_id: int,
        num_layers: int = 2,
        block_size: int = 16,
        intermediate_size: int | None = None,
        target_layer_ids: Sequence[int] | None = None,
        draft_vocab_size: int | None = None,
    ) -> "DrafterConfig":
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(target_layer_ids or build_target_layer_ids(target.num_layers, num_layers)),
            num_target_layers=target.num_layers,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            draft_vocab_size=draft_vocab_size,
        )

    def check_compatible(self, target: TransformerConfig) -> None:
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target's {target.hidden_size}")
        if self.num_target_layers != target.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target's {target.num_layers}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target's {target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the target vocabulary")
        if problems:
            raise ValueError("drafter does not fit this target: " + "; ".join(problems))

    def to_hf_dict(self) -> dict[str, Any]:
        """A Qwen3-style config in the DFlash schema that vLLM (`dflash`) and SGLang (`DFLASH`) read."""
        dflash = {**self.extra.get("dflash_config", {}), "mask_token_id": self.mask_token_id,
                  "target_layer_ids": list(self.target_layer_ids), "block_size": self.block_size}
        for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                             ("final_logit_softcapping", None)):
            if getattr(self, key) != default:
                dflash[key] = getattr(self, key)
        if self.dflash2:
            dflash.update({key: getattr(self, key) for key in _DFLASH2_KEYS})
        layer_types, is_causal, window = self._layer_fields()
        return {
            **self.extra,
            "architectures": ["DFlash2DraftModel" if self.dflash2 else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default", **dict(self.rope_scaling)},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "use_sliding_window": window is not None,
            "sliding_window": window,
            "layer_types": layer_types,
            "is_causal": is_causal,
            "dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": dflash,
            # Beside dflash_config, not in it: full-vocabulary loaders ignore it and load the same drafter.
            **({"draft_vocab": {"file": VOCAB_FILE, "size": self.draft_vocab_size}}
               if self.draft_vocab_size else {}),
        }

    def _layer_fields(self) -> tuple[list[str], bool | None, int | None]:
        """layer_types, is_causal and sliding_window that the reference reads back as these layers (_layer_attention):
        one `is_causal` for all when they agree, else sliding layers are the causal ones."""
        layers = [self.attention_of(i) for i in range(self.num_layers)]
        windows = {a.window for a in layers if a.window is not None}
        flags = {a.causal for a in layers}
        sliding = [a.window is not None if len(flags) == 1 else a.causal for a in layers]
        if len(windows) > 1 or (len(flags) > 1 and windows and any(s and a.window is None
                                                                   for s, a in zip(sliding, layers))):
            raise ValueError(f"draft layers {layers} have no config.json form the reference reads back")
        types = ["sliding_attention" if s else "full_attention" for s in sliding]
        return types, (flags.pop() if len(flags) == 1 else None), (windows.pop() if windows else None)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "DrafterConfig":
        archs = cfg.get("architectures") or []
        kinds = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if not kinds:
            raise ValueError(f"not a DFlash drafter config: architectures={archs}, expected one of "
                             f"{sorted(ARCHITECTURES)}")
        dflash = cfg.get("dflash_config") or {}
        _refuse_unknown(cfg, dflash)
        num_layers = int(cfg["num_hidden_layers"])
        num_target_layers = int(cfg["num_target_layers"])
        layer_ids = dflash.get("target_layer_ids") or build_target_layer_ids(num_target_layers, num_layers)
        if "mask_token_id" not in dflash:
            raise ValueError("dflash_config.mask_token_id is missing")
        num_heads = int(cfg["num_attention_heads"])

        def value(name: str, default: Any = None) -> Any:  # dflash_config first, then the top level (as the reference)
            return dflash.get(name, cfg.get(name, default))

        dflash2 = kinds[0] == "dflash2"
        softcap = value("final_logit_softcapping")
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads),
            vocab_size=int(cfg["vocab_size"]),
            block_size=int(cfg.get("block_size") or dflash.get("block_size") or 16),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=num_target_layers,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            draft_vocab_size=int(cfg["draft_vocab"]["size"]) if cfg.get("draft_vocab") else None,
            rope_scaling=_rope_scaling(cfg),
            layer_attention=_layer_attention(cfg, num_layers),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            **({key: int(value(key)) for key in _DFLASH2_KEYS} if dflash2 else {}),
            extra={k: v for k, v in cfg.items() if k not in ("block_size", "num_target_layers", "draft_vocab")},
        )


def _refuse_unknown(cfg: dict[str, Any], dflash: dict[str, Any]) -> None:
    """Fields that would change the math in a way this runtime does not implement: refused, by name."""
    unknown = [k for k in dflash if k not in _DFLASH_KEYS and not k.startswith("thresh_head_")]
    if unknown:
        raise ValueError(f"dflash_config has fields this runtime does not implement: {unknown}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not implemented for drafters (silu only)")
    for name in ("attention_bias", "mlp_bias"):
        if cfg.get(name):
            raise ValueError(f"{name}: true is not implemented for drafters")
    if cfg.get("architectures") and len(cfg["architectures"]) > 1:
        raise ValueError(f"a drafter config names one architecture, got {cfg['architectures']}")
    if "DFlash2DraftModel" in cfg.get("architectures", []):
        missing = [k for k in _DFLASH2_KEYS if k not in dflash and k not in cfg]
        if missing:
            raise ValueError(f"a DFlash 2 drafter config lacks {missing}")


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 nests rope settings under `rope_parameters`; 4.x kept them in `rope_scaling` / `rope_theta`.
    return dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_scaling(cfg: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    params = _rope_params(cfg)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not implemented for drafters (have {sorted(_ROPE_TYPES)}); "
                         f"found in rope_parameters={params}")
    if rope_type == "default":
        return ()
    rest = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in {**rest, "rope_type": rope_type}.items()))


def _layer_attention(cfg: dict[str, Any], num_layers: int) -> tuple[LayerAttention, ...]:
    """As the reference reads them: a `sliding_attention` layer is causal and sees `sliding_window` keys back (when
    the config enables windows); a full one sees everything; `is_causal`, when set, decides causality everywhere."""
    types = cfg.get("layer_types") or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the drafter has {num_layers}")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not implemented for drafters")
    is_causal = cfg.get("is_causal")
    # Qwen3Config (the reference's config class) drops sliding_window unless use_sliding_window says so.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    layers = []
    for kind in types:
        sliding = kind == "sliding_attention"
        layers.append(LayerAttention(causal=sliding if is_causal is None else bool(is_causal),
                                     window=int(window) if sliding and window else None))
    return () if all(a.plain for a in layers) else tuple(layers)
