"""A stack of decoder layers runs in one ctypes call (layer_step.cpp) instead of ~13 torch / ctypes calls a layer:
the target's, and the DFlash drafter's block pass; the drafter's context feed is one call too (`ContextStep`).

Only where every piece of the layer has our kernel: fp32 on CPU, at most attention.MAX_QUERIES new tokens per
sequence, and each linear's chosen kernel at this row count packed (not torch's). Elsewhere the caller runs its
Python loop, which calls the same kernels: for the target the two are bitwise equal (tested).
ADAFLASH_LAYER_STEP=0 keeps the Python loops (to measure what the fused step saves).
"""

from __future__ import annotations

import bisect
import ctypes
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from adaflash.models.kernels import attention as attention_kernel
from adaflash.models.kernels import packed
from adaflash.models.kernels.selection import ROW_BUCKETS, FastLinear, version_of

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
LINEARS = ("qkv", "o", "gate_up", "down")


class _Linear(ctypes.Structure):
    pass


_Linear._fields_ = [("packed", _p), ("format", _i64), ("bias", _p), ("n", _i64), ("k", _i64),
                    ("parts", ctypes.POINTER(_Linear)), ("num_parts", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p),
                *((name, _Linear) for name in LINEARS)]


class _ContextLayer(ctypes.Structure):
    _fields_ = [("k_norm", _p), ("kv", _Linear)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("eps", _f32), ("scale", _f32)]


class _Batch(ctypes.Structure):
    _fields_ = [("tokens", _i64), ("num_seqs", _i64), ("layer_stride", _i64), ("kv_type", _i64), ("block_shift", _i64),
                ("table_len", _i64), ("tables", _p), ("scale_stride", _i64), ("k_cache", _p), ("v_cache", _p),
                ("k_scale", _p), ("v_scale", _p), ("cos", _p), ("sin", _p), ("token_slot", _p), ("position", _p),
                ("token_start", _p), ("seq_slot", _p), ("key_len", _p)]


def enabled() -> bool:
    return os.environ.get("ADAFLASH_LAYER_STEP", "1") != "0" and packed.enabled_library() is not None


@dataclass(frozen=True)
class StepLayer:
    """One decoder layer as the step reads it: the two norms, the per-head q/k norms (or None) and the four fused
    linears by name (qkv = q, k, v stacked; gate_up = gate, up stacked)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    linears: dict[str, FastLinear]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear_struct(kernel) -> _Linear:
    if isinstance(kernel, packed.SplitLinear):
        parts = getattr(kernel, "_structs", None)
        if parts is None:  # kept on the kernel: the C structure points into it
            parts = kernel._structs = (_Linear * len(kernel.parts))(*map(_linear_struct, kernel.parts))
        return _Linear(None, -1, None, kernel.n, kernel.k, parts, len(kernel.parts))
    return _Linear(kernel.packed.data_ptr(), kernel.format_code, _ptr(kernel.bias), kernel.n, kernel.k, None, 0)


def _batch_struct(attention, cache, cos: torch.Tensor, sin: torch.Tensor, index: Sequence[torch.Tensor]) -> _Batch:
    """`index`: the attention's kernel_index (token slots, then token starts, sequence slots, key lengths; the
    context step passes the token slots only)."""
    k, v = cache.k, cache.v
    rest = [t.data_ptr() for t in index[1:]] + [None] * (4 - len(index))
    scales = cache.k_scale is not None
    return _Batch(cos.shape[0], len(attention.batch.slots), k[0].numel(), attention_kernel.kv_type(k.dtype),
                  *cache.paging(), cache.k_scale[0].numel() if scales else 0, k.data_ptr(), v.data_ptr(),
                  cache.k_scale.data_ptr() if scales else None, cache.v_scale.data_ptr() if scales else None,
                  cos.data_ptr(), sin.data_ptr(), index[0].data_ptr(), attention.batch.positions.data_ptr(), *rest)


def _cache_ok(cache) -> bool:
    return (cache.k.is_contiguous() and cache.v.is_contiguous() and cache.k.dtype == cache.v.dtype
            and cache.k.dtype in attention_kernel.KV_TYPES)


class LayerSteps:
    """The fused step over a stack of StepLayers, its ctypes structures kept per row bucket."""

    def __init__(self, layers: Sequence[StepLayer], hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float) -> None:
        for layer in layers:
            for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm):
                if t is not None and not (t.dtype == torch.float32 and t.is_contiguous()):
                    raise ValueError("the layer step reads contiguous fp32 norm weights")
        self.layers = list(layers)
        self.shape = _Shape(hidden, heads, kv_heads, head_dim, intermediate, eps, head_dim ** -0.5)
        self.head_dim = head_dim
        # bucket -> (structures, the weights and biases, their versions when packed)
        self._by_bucket: dict[int, tuple[ctypes.Array, list[torch.Tensor], list[int]]] = {}
        self._no_captures = (ctypes.c_void_p * len(self.layers))()  # all null: the common call captures nothing

    def _layers_at(self, rows: int) -> ctypes.Array | None:
        """The layers' structures for `rows` rows, or None if some linear runs torch's kernel there or has weights
        changed in place since they were packed (then FastLinear runs torch's kernel on the new values, and so must
        the caller's loop)."""
        bucket = bisect.bisect_left(ROW_BUCKETS, rows)
        if bucket >= len(ROW_BUCKETS):
            return None
        cached = self._by_bucket.get(bucket)
        if cached is not None:  # one version counter per weight: far cheaper than asking each FastLinear
            structs, tensors, versions = cached
            return structs if [t._version for t in tensors] == versions else None
        kernels = []
        for layer in self.layers:
            row = [layer.linears[name].kernel_for(rows) if name in layer.linears else None for name in LINEARS]
            if None in row:
                return None
            kernels.append(row)
        structs = (_Layer * len(self.layers))()
        for s, layer, row in zip(structs, self.layers, kernels):
            s.input_norm, s.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            s.q_norm, s.k_norm = _ptr(layer.q_norm), _ptr(layer.k_norm)
            for name, kernel in zip(LINEARS, row):
                setattr(s, name, _linear_struct(kernel))
        # (an inference tensor has no version counter: it cannot change outside inference mode, so it is not watched)
        tensors = [t for layer in self.layers for f in layer.linears.values() for t in (f.weight, f.bias)
                   if t is not None and version_of(t) is not None]
        self._by_bucket[bucket] = (structs, tensors, [t._version for t in tensors])
        return structs

    def run(self, h: torch.Tensor, attention, cache, cos: torch.Tensor, sin: torch.Tensor,
            capture: set[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer over the residual stream `h` [T, hidden] of a RaggedAttention batch (causal or not); returns
        the final stream and the streams after the layers in `capture` ([T, layers ascending * hidden]), or None where
        the step cannot run (the caller runs its Python loop)."""
        call = self._prepare(h.shape[0], h.dtype, h.device, attention, cache, cos, sin, capture)
        if call is None:
            return None
        h = h.clone()  # updated in place, layer by layer
        with packed.profiled("adaflash::decoder_layers"):
            packed.library().adaflash_decoder_layers(h.data_ptr(), *call.layer_args)
        return h, call.captured

    def forward(self, token_ids: torch.Tensor, embed: torch.Tensor, attention, cache, cos: torch.Tensor,
                sin: torch.Tensor, capture: set[int], head: "StepHead | None",
                logit_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
        """A target's forward in one kernel call: the embedding rows of `token_ids`, every layer, and - with `head`,
        where its linear has a packed kernel at that row count - the logits of rows `logit_rows` (all if None).
        Returns (the final stream, the logits or None, the captured streams), or None where the layers cannot run.
        The same bits as embedding, run() and the head's FastLinear called one by one (tested)."""
        t = token_ids.shape[0]
        if embed.dtype != torch.float32 or not embed.is_contiguous():
            return None
        call = self._prepare(t, embed.dtype, embed.device, attention, cache, cos, sin, capture)
        if call is None:
            return None
        rows, kernel = None, None
        if head is not None:
            rows = torch.arange(t) if logit_rows is None else logit_rows.to(torch.long).contiguous()
            # The head here where it has its packed kernel at this row count, its norm weight is contiguous fp32 and
            # the selected rows fit the call's scratch (no more than t); else the caller computes the logits from h.
            if rows.shape[0] <= t and head.norm.dtype == torch.float32 and head.norm.is_contiguous():
                kernel = head.linear.kernel_for(rows.shape[0])
        tokens = token_ids.to(torch.long).contiguous()
        h = torch.empty(t, self.shape.hidden, dtype=torch.float32)
        logits = torch.empty(rows.shape[0], kernel.n, dtype=torch.float32) if kernel is not None else None
        with packed.profiled("adaflash::decoder_forward"):
            status = packed.library().adaflash_decoder_forward(
                tokens.data_ptr(), embed.data_ptr(), embed.shape[0], h.data_ptr(), *call.layer_args[:-1],
                *((head.norm.data_ptr(), rows.data_ptr(), rows.shape[0], ctypes.byref(_linear_struct(kernel)),
                   logits.data_ptr()) if kernel is not None else (None, None, 0, None, None)),
                call.layer_args[-1])
        if status == -1:
            raise IndexError(f"token ids {token_ids.tolist()} out of the embedding's {embed.shape[0]} rows")
        if status == -2:
            raise IndexError(f"logit rows {rows.tolist()} out of the step's {t} tokens")
        return h, logits, call.captured

    def _prepare(self, t: int, dtype: torch.dtype, device: torch.device, attention, cache, cos: torch.Tensor,
                 sin: torch.Tensor, capture: set[int]) -> "_Call | None":
        if (not enabled() or dtype != torch.float32 or device.type != "cpu"
                or attention.qmax > attention_kernel.MAX_QUERIES
                or not attention_kernel.available(dtype, device, self.head_dim)):
            return None
        structs = self._layers_at(t)
        if structs is None or not _cache_ok(cache):
            return None
        cos, sin = cos.contiguous(), sin.contiguous()
        index = attention.kernel_index(cache)
        batch = _batch_struct(attention, cache, cos, sin, index)
        lib = packed.library()
        scratch = torch.empty(lib.adaflash_layer_scratch_floats(ctypes.byref(self.shape), t), dtype=torch.float32)
        wanted = sorted(i for i in capture if 0 <= i < len(structs))
        # Side by side, [T, layers * hidden]: the features as the drafter reads them, with no tensor op after the call.
        width = len(wanted) * self.shape.hidden
        captured = torch.empty(t, width, dtype=torch.float32)
        targets = self._no_captures
        if wanted:
            targets = (ctypes.c_void_p * len(structs))()
            for j, i in enumerate(wanted):
                targets[i] = captured.data_ptr() + j * self.shape.hidden * captured.element_size()
        # (the tensors and structures the pointers refer to stay referenced by the _Call until the call returns)
        return _Call((structs, len(structs), ctypes.byref(self.shape), ctypes.byref(batch), scratch.data_ptr(), targets,
                      width, torch.get_num_threads()), captured, (cos, sin, index, batch, scratch))


@dataclass(frozen=True)
class StepHead:
    """A target's logits as LayerSteps.forward computes them: the final RMSNorm weight, then the LM head."""

    norm: torch.Tensor
    linear: FastLinear


@dataclass(frozen=True)
class _Call:
    layer_args: tuple  # adaflash_decoder_layers' arguments after h
    captured: torch.Tensor  # [T, captured layers (ascending) * hidden]
    keep: tuple  # what the pointers in layer_args refer to


class ContextStep:
    """The DFlash drafter's context feed in one call (layer_step.cpp's adaflash_drafter_context): target features ->
    fc -> hidden norm -> each draft layer's k (k_norm, RoPE) and v into its cache. `layers`: per draft layer, its k and
    v projections stacked ([2 kv_heads head_dim, hidden]) and its k_norm weight (or None)."""

    def __init__(self, fc: FastLinear, hidden_norm: torch.Tensor,
                 layers: Sequence[tuple[FastLinear, torch.Tensor | None]], hidden: int, kv_heads: int, head_dim: int,
                 eps: float) -> None:
        for t in (hidden_norm, *(k_norm for _, k_norm in layers)):
            if t is not None and not (t.dtype == torch.float32 and t.is_contiguous()):
                raise ValueError("the context step reads contiguous fp32 norm weights")
        self.fc, self.hidden_norm, self.layers = fc, hidden_norm, list(layers)
        self.shape = _Shape(hidden, 0, kv_heads, head_dim, 0, eps, head_dim ** -0.5)

    def run(self, features: torch.Tensor, attention, cache, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Write the context of `features` [T, n * hidden] (a RaggedAttention batch's tokens); False, writing nothing,
        where the step cannot run here (the caller runs its Python loop)."""
        t = features.shape[0]
        if not enabled() or features.dtype != torch.float32 or features.device.type != "cpu" or not _cache_ok(cache):
            return False
        fc = self.fc.kernel_for(t)
        kvs = [kv.kernel_for(t) for kv, _ in self.layers]
        if fc is None or None in kvs:
            return False
        layers = (_ContextLayer * len(kvs))()
        for s, kernel, (_, k_norm) in zip(layers, kvs, self.layers):
            s.k_norm, s.kv = _ptr(k_norm), _linear_struct(kernel)
        features, cos, sin = features.contiguous(), cos.contiguous(), sin.contiguous()
        batch = _batch_struct(attention, cache, cos, sin, [attention.token_slots(cache)])
        lib = packed.library()
        scratch = torch.empty(lib.adaflash_context_scratch_floats(ctypes.byref(self.shape), t), dtype=torch.float32)
        with packed.profiled("adaflash::drafter_context"):
            lib.adaflash_drafter_context(features.data_ptr(), ctypes.byref(_linear_struct(fc)),
                                         self.hidden_norm.data_ptr(), layers, len(kvs), ctypes.byref(self.shape),
                                         ctypes.byref(batch), scratch.data_ptr(), torch.get_num_threads())
        return True
