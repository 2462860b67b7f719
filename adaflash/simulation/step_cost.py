"""What a pass costs on a machine this process is not running on: the target's and the drafter's passes priced from
a model shape and a GPU (an analytic roofline), from this machine's measured profile, or from a measured step-cost
table (`make gpu-check`'s, `TableCost`).

A pass reads the weights it needs once (a dense model all of them; a mixture of experts the attention, the router and
the experts its tokens route to, which grow with the batch), every request's KV cache, and does 2 FLOPs a weight a
token plus the attention's. It takes the longer of its bytes at the GPU's achievable bandwidth and its FLOPs at the
achievable compute, plus a fixed cost a pass, a layer and a request (launches, the scheduler, sampling). The achievable compute
grows with the tokens of the pass (a GEMM of 8 rows runs far below peak; one of thousands near the prefill MFU):
`mfu_max * T / (T + half_tokens)`, 32 tokens to half (a decode step stays bandwidth-bound, as it is).

The constants are BLIS's roofline defaults (inference-sim: bandwidth efficiency 0.72, 500 us a step + 20 us a layer,
MFU 0.65 prefill), 25 us a request, one constant fitted per GPU to one published AR figure, and a mixture layer's
28 us fitted to B200's Qwen3-Coder-30B-A3B AR figure (sources in `GPUS`; `benchmarks/simulation/simulation_calibration.py`
reports the error against every published figure, the fitted ones included).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from adaflash.speculative.cost_model import CostModel, axis_point, bilinear


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth: float  # HBM bytes a second
    bf16_flops: float  # dense bf16 peak, FLOPs a second
    memory_efficiency: float = 0.72
    mfu_max: float = 0.65
    half_tokens: float = 32.0  # tokens of a pass at which the achievable compute is half mfu_max
    pass_overhead_s: float = 500e-6
    layer_overhead_s: float = 20e-6
    request_overhead_s: float = 25e-6  # a sequence's share of a pass (its metadata, sampling, ragged attention)
    expert_layer_overhead_s: float = 28e-6  # a mixture layer's routing and grouped-GEMM launches
    # A verify pass's cost beyond its forward, a pass and a verified token: the serving engine's speculative path
    # (its verify kernels and masks outside the decode's CUDA graphs, acceptance, the drafter's hand-off).
    verify_pass_s: float = 0.0
    verify_token_s: float = 0.0
    source: str = ""


# Peaks: NVIDIA's datasheets (H100 SXM 3.35 TB/s, 989 TFLOPs dense bf16; H200 4.8 TB/s; B200 8 TB/s, 2.25 PFLOPs).
# A verify pass's own cost (700 us a pass, 6 us a verified token) was fitted to the DFlash paper's five Qwen3-8B Math500
# speedups on B200 (SGLang, c = 1-32); taken as the serving engine's speculative path, not the chip's, the H100 and H200
# carry it too (no published speculative figure of theirs to fit it to).
VERIFY_PASS_S, VERIFY_TOKEN_S = 700e-6, 6e-6
GPUS = {
    "h100": GPU("H100 SXM", 3.35e12, 989e12, memory_efficiency=0.75, verify_pass_s=VERIFY_PASS_S,
                verify_token_s=VERIFY_TOKEN_S,
                source="memory_efficiency fitted to vLLM 0.11's Qwen3-8B TPOT of 7.28 ms at c=1 (gpustack); the verify "
                       "pass's own cost: B200's"),
    "h200": GPU("H200", 4.8e12, 989e12, memory_efficiency=0.75, verify_pass_s=VERIFY_PASS_S,
                verify_token_s=VERIFY_TOKEN_S,
                source="H100's fitted efficiency (the same Hopper chip with faster HBM); no H200 figure fitted; the "
                       "verify pass's own cost: B200's"),
    "b200": GPU("B200", 8.0e12, 2.25e15, pass_overhead_s=960e-6, verify_pass_s=VERIFY_PASS_S,
                verify_token_s=VERIFY_TOKEN_S,
                source="pass_overhead_s fitted to SGLang's AR Qwen3-8B 230 tok/s at c=1, expert_layer_overhead_s to "
                       "its Qwen3-Coder-30B-A3B 229 tok/s at c=1, the verify pass's own cost to its Qwen3-8B Math500 "
                       "DFlash speedups at c=1-32 (DFlash paper)"),
}


@dataclass(frozen=True)
class ModelShape:
    """A decoder's shape; `experts` > 0: a mixture of experts (`active` of them a token, each of `expert_inter`)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0
    active: int = 0
    expert_inter: int = 0
    bytes_per_weight: int = 2  # bf16

    @property
    def attention_weights(self) -> int:
        q = self.heads * self.head_dim
        return self.hidden * (2 * q + 2 * self.kv_heads * self.head_dim)

    @property
    def expert_weights(self) -> int:
        return 3 * self.hidden * self.expert_inter

    def layer_weights(self, tokens: int) -> float:
        """Weights one layer reads in a pass of `tokens`: a mixture reads the experts its tokens route to (expected
        distinct experts under uniform routing)."""
        if not self.experts:
            return self.attention_weights + 3 * self.hidden * self.intermediate
        touched = self.experts * (1 - (1 - self.active / self.experts) ** max(tokens, 1))
        return self.attention_weights + self.hidden * self.experts + touched * self.expert_weights

    def active_weights(self) -> float:
        """Weights a token multiplies (FLOPs / 2), LM head included."""
        ffn = self.active * self.expert_weights if self.experts else 3 * self.hidden * self.intermediate
        return self.layers * (self.attention_weights + ffn) + self.hidden * self.vocab

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_weight

    def drafter(self, layers: int) -> "ModelShape":
        """A DFlash drafter of this target: `layers` of its dense layer shape (a mixture's drafter is dense, at the
        active FFN width), the target's LM head."""
        inter = self.intermediate if not self.experts else self.active * self.expert_inter
        return ModelShape(f"{self.name} drafter", layers, self.hidden, self.heads, self.kv_heads, self.head_dim, inter,
                          self.vocab)


SHAPES = {
    "qwen3-8b": ModelShape("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936),
    "qwen3-coder-30b-a3b": ModelShape("Qwen3-Coder-30B-A3B", 48, 2048, 32, 4, 128, 0, 151936, experts=128, active=8,
                                      expert_inter=768),
}


@dataclass(frozen=True)
class Roofline:
    """Seconds of a pass of `model` on `gpu`; `query_lens` / `contexts`: per request, its new tokens and the positions
    its cache holds before the pass; `logits`: rows projected to the vocabulary (default: every new token)."""

    gpu: GPU
    model: ModelShape

    def pass_s(self, query_lens: Sequence[int], contexts: Sequence[int], logits: int | None = None) -> float:
        m, g = self.model, self.gpu
        tokens = sum(query_lens)
        logits = tokens if logits is None else logits
        weights = m.layers * m.layer_weights(tokens) + m.hidden * m.vocab  # the LM head is read once
        kv = sum((c + q) for q, c in zip(query_lens, contexts)) * m.kv_bytes_per_token
        memory = (weights * m.bytes_per_weight + kv) / (g.bandwidth * g.memory_efficiency)
        attention = 4 * m.layers * m.heads * m.head_dim * sum(q * (c + q) for q, c in zip(query_lens, contexts))
        flops = 2 * (m.active_weights() - m.hidden * m.vocab) * tokens + 2 * m.hidden * m.vocab * logits + attention
        compute = flops / (g.bf16_flops * g.mfu_max * tokens / (tokens + g.half_tokens))
        per_layer = g.layer_overhead_s + (g.expert_layer_overhead_s if m.experts else 0.0)
        fixed = g.pass_overhead_s + m.layers * per_layer + len(query_lens) * g.request_overhead_s
        return max(memory, compute) + fixed


def is_prefill(tokens: int, logits: int) -> bool:
    """A pass that projects only its last rows to the vocabulary is a prefill; a decode or verify pass projects every
    row (what the virtual clock sees of a pass: its new tokens and its logits)."""
    return logits < tokens


class StepCost:
    """Prices the engine's passes (the simulated clock charges them): the target's, over ragged new tokens and
    contexts, the drafter's, one block of `width` positions a drafting request, and the drafter's context feed (the
    target's features of `tokens` committed positions; not modelled unless a measured fit says what it costs)."""

    def target_s(self, query_lens: Sequence[int], contexts: Sequence[int], logits: int) -> float:
        raise NotImplementedError

    def drafter_s(self, width: int, contexts: Sequence[int], logits: int) -> float:
        raise NotImplementedError

    def feed_s(self, tokens: int) -> float:
        return 0.0


@dataclass(frozen=True)
class RooflineCost(StepCost):
    target: Roofline
    drafter: Roofline

    @classmethod
    def of(cls, gpu: str, shape: str, drafter_layers: int = 5) -> "RooflineCost":
        if gpu not in GPUS or shape not in SHAPES:
            raise ValueError(f"unknown gpu:shape {gpu}:{shape}; gpus: {', '.join(GPUS)}; shapes: {', '.join(SHAPES)}")
        model = SHAPES[shape]
        return cls(Roofline(GPUS[gpu], model), Roofline(GPUS[gpu], model.drafter(drafter_layers)))

    def target_s(self, query_lens, contexts, logits):
        tokens, g = sum(query_lens), self.target.gpu
        verify = len(query_lens) < tokens and not is_prefill(tokens, logits)  # drafts in it
        extra = g.verify_pass_s + g.verify_token_s * tokens if verify else 0.0
        return self.target.pass_s(query_lens, contexts, logits) + extra

    def drafter_s(self, width, contexts, logits):
        return self.drafter.pass_s([width] * len(contexts), contexts, logits)

    def describe(self) -> str:
        g, m = self.target.gpu, self.target.model
        return f"roofline {g.name} x {m.name} (bf16; drafter {self.drafter.model.layers} layers)"


@dataclass(frozen=True)
class ProfileCost(StepCost):
    """This machine's measured profile (the throughput policy's `CostModel`): a verify by its total tokens, a drafter
    pass by its width; contexts are not in the profile."""

    profile: CostModel
    machine: str = ""  # what was profiled, where (the report's label)

    def target_s(self, query_lens, contexts, logits):
        return self.profile.verify(sum(query_lens))

    def drafter_s(self, width, contexts, logits):
        return sum(self.profile.draft(width - 1) for _ in contexts)

    def describe(self) -> str:
        return "this machine's measured profile" + (f" ({self.machine})" if self.machine else "")


@dataclass(frozen=True)
class EngineFit:
    """What a standalone table misses of the engine's own run, fitted from a timed run of the real engine
    (`step_table.fit_engine`): each pass's seconds in place over the table's (`step_scale` for decode and verify
    passes, `prefill_scale`, `drafter_scale`: caches, threads and the passes before it make a pass in the engine cost
    other than alone), and the engine's own seconds around a target pass (scheduling,
    the drafting checks, verifying, committing, rolling caches back): `pass_s` a pass, `request_s` a request in it,
    `draft_token_s` a drafted token it verifies (none in a prefill); and the drafter's context feeds, which no table
    times: `feed_call_s` a feed and `feed_token_s` a fed position."""

    pass_s: float = 0.0
    request_s: float = 0.0
    draft_token_s: float = 0.0
    step_scale: float = 1.0
    prefill_scale: float = 1.0
    drafter_scale: float = 1.0
    feed_call_s: float = 0.0
    feed_token_s: float = 0.0
    steps: int = 0  # the timed steps it was fitted on
    # The decode / verify scale by the pass's requests, where fitted: (requests, scale) points, linear in log2 of the
    # requests between them and flat past them (a CPU engine's batched step reads scattered slots' caches, which a
    # table's contiguous rows do not). Empty: `step_scale` at every batch.
    step_scales: tuple[tuple[int, float], ...] = ()

    def host_s(self, requests: int, drafted: int) -> float:
        return self.pass_s + self.request_s * requests + self.draft_token_s * drafted

    def step_scale_at(self, requests: int) -> float:
        points = self.step_scales
        if not points:
            return self.step_scale
        if requests <= points[0][0]:
            return points[0][1]
        for (b0, s0), (b1, s1) in zip(points, points[1:]):
            if requests <= b1:
                w = (math.log2(requests) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
                return s0 + w * (s1 - s0)
        return points[-1][1]

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("pass_s", "request_s", "draft_token_s", "step_scale", "prefill_scale",
                                              "drafter_scale", "feed_call_s", "feed_token_s", "steps")} | {
            "step_scales": [list(p) for p in self.step_scales]}

    @classmethod
    def from_dict(cls, d: dict) -> "EngineFit":
        points = tuple((int(b), float(x)) for b, x in d.get("step_scales", ()))
        fit = cls(**{k: (int if k == "steps" else float)(v) for k, v in d.items() if k != "step_scales"},
                  step_scales=points)
        if any(b1 <= b0 for (b0, _), (b1, _) in zip(points, points[1:])) or any(b < 1 or x <= 0 for b, x in points):
            raise ValueError("the step scales must be positive, at ascending request counts from 1")
        if min(fit.pass_s, fit.request_s, fit.draft_token_s, fit.feed_call_s, fit.feed_token_s) < 0:
            raise ValueError("the host's and the feeds' seconds must not be negative")
        if min(fit.step_scale, fit.prefill_scale, fit.drafter_scale) <= 0:
            raise ValueError("the in-engine scales must be positive")
        return fit


@dataclass(frozen=True)
class TableCost(StepCost):
    """A measured step-cost table, as `make gpu-check` writes it (gpu/check.py: `verify_cost.json` or
    `gpu_check.json`) or `benchmarks/simulation/simulation_validation.py` measures on this machine: the target's forward ms over a
    grid of batch sizes x new tokens a sequence at one context or more, and the batch-1 profile with its drafter
    (`cost_model`: the drafter's pass by width and, where timed, by drafting requests); optionally what the engine's
    own run adds (`engine_fit`).

    A target pass is priced at its number of sequences and their mean new tokens, bilinear between the grid's points
    (exact at them), linear past its edges from the last two points, and linear in the sequences' mean context between
    the table's contexts (the table's one context, whatever the requests hold, where it has one); a prefill (a pass
    whose logits are its last rows only) from the table's prefill grid where it has one (batch x prompt tokens, from
    an empty cache), else as any pass (hundreds of tokens extrapolated from the widest two columns); then scaled and
    plus the host's seconds as `engine_fit` says. A drafter pass is the profile's (`CostModel.draft_pass` where it
    batches requests, else per request), scaled; a context feed as `engine_fit` says."""

    batches: tuple[int, ...]
    new_tokens: tuple[int, ...]
    ms: tuple[tuple[tuple[float, ...], ...], ...]  # [context][batch][new tokens]
    drafter: CostModel
    source: str = ""
    contexts: tuple[int, ...] = (0,)
    engine_fit: EngineFit = EngineFit()
    # A prefill grid ([batch][prompt tokens] ms over these axes), or none.
    prefill_batches: tuple[int, ...] = ()
    prefill_tokens: tuple[int, ...] = ()
    prefill_ms: tuple[tuple[float, ...], ...] = ()

    def target_s(self, query_lens, contexts, logits):
        b, tokens = len(query_lens), sum(query_lens)
        fit = self.engine_fit
        prefill = is_prefill(tokens, logits)
        scale, host = ((fit.prefill_scale, fit.host_s(b, 0)) if prefill
                       else (fit.step_scale_at(b), fit.host_s(b, tokens - b)))
        return scale * self.standalone_target_s(query_lens, contexts, prefill) + host

    def standalone_target_s(self, query_lens, contexts, prefill: bool = False) -> float:
        """The table's own seconds for a target pass (no in-engine fit)."""
        b, n = len(query_lens), sum(query_lens) / len(query_lens)
        if prefill and self.prefill_ms:
            return bilinear(self.prefill_batches, self.prefill_tokens, self.prefill_ms, b, n) / 1e3
        k0, k1, wc = axis_point(self.contexts, sum(contexts) / b)
        at = [bilinear(self.batches, self.new_tokens, self.ms[k], b, n) for k in (k0, k1)]
        return max(0.0, (1 - wc) * at[0] + wc * at[1]) / 1e3

    def drafter_s(self, width, contexts, logits):
        return self.engine_fit.drafter_scale * self.standalone_drafter_s(width, len(contexts))

    def feed_s(self, tokens):
        return self.engine_fit.feed_call_s + self.engine_fit.feed_token_s * tokens if tokens > 0 else 0.0

    def standalone_drafter_s(self, width: int, requests: int) -> float:
        """The profile's own seconds for a drafter pass of `requests` blocks `width` wide (no in-engine fit)."""
        if self.drafter.batched_drafter:
            return self.drafter.draft_pass(requests, width - 1)
        return requests * self.drafter.draft(width - 1)

    def describe(self) -> str:
        return f"measured step-cost table {self.source}"

    @classmethod
    def load(cls, path: str | Path) -> "TableCost":
        """From a `make gpu-check` JSON file (its top-level, Qwen3-8B-shaped table); a malformed file is an error
        naming it."""
        path = Path(path)
        try:
            report = json.loads(path.read_text())
            table = report["verify_cost"]
            context = int(table["context"])
            ms = {(int(c.get("context", context)), int(c["batch"]), int(c["new_tokens"])): float(c["ms"])
                  for c in table["cells"]}
            contexts, batches, widths = _grid_axes(ms, "the grid", "(context, batch, new tokens)")
            if "cost_model" not in report:
                raise ValueError("no drafter costs (its 'cost_model')")
            drafter = CostModel.from_json(json.dumps(report["cost_model"]))
            if drafter.draft_s <= 0 and not drafter.draft_widths:
                raise ValueError("the 'cost_model' has no drafter pass")
            fit = EngineFit.from_dict(report.get("engine_fit", {}))
            prefill = {(int(c["batch"]), int(c["new_tokens"])): float(c["ms"]) for c in table.get("prefill", [])}
            prefill_batches, prefill_tokens = (_grid_axes(prefill, "the prefill grid", "(batch, prompt tokens)")
                                               if prefill else ([], []))
        except FileNotFoundError:
            raise FileNotFoundError(f"no step-cost table at {path}") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: not a step-cost table as `make gpu-check` writes it ({exc})") from None
        grid = tuple(tuple(tuple(ms[c, b, n] for n in widths) for b in batches) for c in contexts)
        prefill_grid = tuple(tuple(prefill[b, n] for n in prefill_tokens) for b in prefill_batches)
        return cls(tuple(batches), tuple(widths), grid, drafter, str(path), tuple(contexts), fit,
                   tuple(prefill_batches), tuple(prefill_tokens), prefill_grid)


def _grid_axes(ms: dict[tuple[int, ...], float], name: str, axes: str) -> list[list[int]]:
    """The sorted points of each axis of a grid of cells (key: a point on each axis; value: ms); an error naming the
    grid unless every combination of points has a cell, the ms and points are positive and the last two axes (batch,
    new tokens) have two points or more."""
    points = [sorted({key[i] for key in ms}) for i in range(len(next(iter(ms))))]
    if len(points[-2]) < 2 or len(points[-1]) < 2:
        raise ValueError(f"{name} needs at least two batch sizes and two new-token counts")
    missing = [key for key in itertools.product(*points) if key not in ms]
    if missing:
        raise ValueError(f"{name} lacks cells {axes} {missing[:4]}")
    if min(ms.values()) <= 0 or min(min(p) for p in points[-2:]) < 1:
        raise ValueError(f"{name}: batches, new tokens and ms must be positive")
    return points
