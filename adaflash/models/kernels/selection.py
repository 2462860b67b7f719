"""Which linear kernel runs a weight shape at a row count: timed once per machine, kept in a JSON cache.

Candidates: torch's stock kernel (`stock.linear`: oneDNN where it works), the packed fp32 kernel (packed.py) and,
where the target came from a GGUF, the quantized kernel over the GGUF's own blocks (bitwise the packed kernel's
outputs, fewer bytes). Each is timed with its weights evicted from the caches first, as a decode step meets them
(the model is far larger than the L3). Row counts are bucketed (a count runs with the choice of the next bucket
up); past the largest bucket (prefill, training teacher passes) the stock kernel runs. The cache key is the CPU
model, the thread count and the kernel source, so a different machine or --threads measures again (a second or two
per shape). ADAFLASH_KERNELS=stock, =packed or =quantized forces one kernel for every bucket without timing
(quantized: where the weight has blocks, else packed).

`exact` (the target's choice): timing picks only among kernels that give the same bits - the packed fp32 kernel and
the quantized one, which is bitwise it - at every row count, past the buckets too. torch's kernel sums in another
order, so a target that took it at some row counts would compute a verification's rows differently from a decode
step's, and which counts took it would depend on how the timing fell in the process that measured (greedy output
depending on the run). Drafters choose freely: their numbers shape drafts, never what verification keeps.

`int8_activations` (the target's `--dtype int8`) is another numeric definition, not a kernel choice: a weight with
blocks of quant.int8_formats() runs the int8-activation kernel at every row count, prefill included (one model for
every pass); weights without such blocks choose as above.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from adaflash.models.device.cpu import cpu_model
from adaflash.models.files import cache_root
from adaflash.models.kernels import packed
from adaflash.models.kernels.quant import QuantizedWeight, SplitWeight, int8_formats
from adaflash.models.kernels.stock import linear as stock_linear

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STOCK, PACKED, QUANTIZED = "stock", "packed", "quantized"
_EVICT_BYTES = 64 << 20  # read between timed calls: more than any L3 here, so a timed call streams its weights


def kernel_fingerprint() -> str:
    """What the speed of a forward pass depends on besides the model and threads: the CPU, the kernel build and the
    ADAFLASH_KERNELS mode (cached timings of whole passes, like the cost models, key on it)."""
    key = f"{cpu_model()}|{packed.source_digest()}|{os.environ.get('ADAFLASH_KERNELS', 'auto')}"
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def cache_file() -> Path:
    key = f"{cpu_model()}|threads={torch.get_num_threads()}|{packed.source_digest()}"
    return cache_root() / "kernels" / f"choices-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _min_ms_each(fns: dict[str, Callable[[], object]], evict: torch.Tensor, repeats: int = 5) -> dict[str, float]:
    """The minimum ms per call of each candidate, timed round-robin: every repeat times each candidate once, so a slow
    stretch of a shared machine (another process, a disk write-back) falls on all of them alike. Timed one candidate
    after another, a stretch once fell on all five calls of the Q4_1 kernel at one row, and the decode step streamed an
    fp32 copy seven times its size (a 1-token forward slower than a 2-token one). The minimum: robust to a preempted
    call."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            evict.sum()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) * 1e3 for name, t in times.items()}


def time_shape(weight: torch.Tensor, kernels: dict[str, object]) -> dict[str, dict[str, float]]:
    """ms per call of torch's kernel and each of `kernels` (name -> callable) at each row bucket, cold weights."""
    evict = torch.ones(_EVICT_BYTES // 4)
    out = {}
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, weight.shape[1])
        fns = {STOCK: lambda: stock_linear(x, weight), **{name: partial(kernel, x) for name, kernel in kernels.items()}}
        out[str(rows)] = _min_ms_each(fns, evict)
    return out


_CACHE_LOCK = threading.Lock()  # the hot-swap watcher builds proposers on its own thread


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text())["shapes"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # absent or damaged: measured again


NEAR_TIE = 1.1


def _bytes(kernel, weight: torch.Tensor) -> int:
    return kernel.nbytes if kernel is not None else weight.numel() * weight.element_size()


def _pick(by_bytes: list[str], ms: dict[str, float]) -> str:
    """The first of `by_bytes` (fewest bytes first) whose time is within NEAR_TIE of the fastest."""
    best = min(ms[name] for name in by_bytes)
    return next(name for name in by_bytes if ms[name] <= NEAR_TIE * best)


class KernelChoice:
    """Per (n, k) shape, the kernel for each row bucket. `exact`: only kernels with the packed kernel's bits, at every
    row count (a target's numbers never depend on timing; see the module's docstring)."""

    def __init__(self, int8_activations: bool = False, exact: bool = False) -> None:
        self.int8_activations = int8_activations
        self.exact = exact
        self.mode = os.environ.get("ADAFLASH_KERNELS", "auto")
        if self.mode not in ("auto", STOCK, PACKED, QUANTIZED):
            raise ValueError(f"ADAFLASH_KERNELS must be auto, stock, packed or quantized, got {self.mode!r}")
        self._file = cache_file()

    def buckets(self, weight: torch.Tensor, kernels: dict[str, object]) -> tuple[str, ...]:
        """For each bucket of ROW_BUCKETS, the name of the kernel that runs it: STOCK or a key of `kernels`
        (PACKED, and a GGUF format name where the weight has quantized blocks)."""
        if self.mode != "auto":
            quantized = [name for name in kernels if name != PACKED]
            forced = STOCK if self.mode == STOCK else quantized[0] if self.mode == QUANTIZED and quantized else PACKED
            return (forced,) * len(ROW_BUCKETS)
        key = f"{weight.shape[0]}x{weight.shape[1]}"
        with _CACHE_LOCK:
            times = _read_cache(self._file).get(key)
            if times is None or any(str(r) not in times or not set(kernels) <= set(times[str(r)]) for r in ROW_BUCKETS):
                # Merged with what other weights of this shape measured (a target's Q4_1, a drafter's BF16), so
                # neither re-times at every load.
                new = time_shape(weight, kernels)
                times = {r: {**(times or {}).get(r, {}), **new[r]} for r in new}
                self._save(key, times)
        # Fewest bytes first: a kernel within NEAR_TIE of the fastest wins over one streaming more bytes (timings on a
        # shared machine wobble by ~10%, and a real step shares the memory bus with the other cores).
        # (torch's last among equals: ours give a row the same result at every row count)
        candidates = list(kernels) if self.exact else [STOCK, *kernels]
        by_bytes = sorted(candidates, key=lambda name: (_bytes(kernels.get(name), weight), name == STOCK))
        return tuple(_pick(by_bytes, times[str(r)]) for r in ROW_BUCKETS)

    def _save(self, key: str, times: dict) -> None:
        """Merge into what is on disk now (another process may have added shapes), then replace atomically."""
        shapes = {**_read_cache(self._file), key: times}
        self._file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._file.parent, suffix=".json.tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"cpu": cpu_model(), "threads": torch.get_num_threads(), "shapes": shapes}, f, indent=1)
        os.replace(tmp, self._file)


class FastLinear:
    """One weight's linear: at each row bucket, the kernel that measured fastest; past the buckets torch's, or for an
    exact choice the largest bucket's (the same bits at every row count).

    `quantized`: the weight's own GGUF blocks (targets/gguf_weights.py; a SplitWeight: a kernel per part), for the
    quantized kernel. Kernels no bucket chose are dropped (their packed copy freed).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: KernelChoice,
                 quantized: QuantizedWeight | SplitWeight | None = None) -> None:
        self.weight, self.bias = weight, bias
        self._all_rows = None  # the int8 kernel, which runs every row count
        self._past_buckets = None  # what runs past the largest bucket (None: torch's)
        if quantized is not None and _rows(quantized) != weight.shape[0]:
            raise ValueError(f"{quantized.fmt} blocks for {_rows(quantized)} rows, weight has {weight.shape[0]}")
        if choice.int8_activations and quantized is not None and runs_int8(quantized):
            self._all_rows = _kernel(packed.Int8Linear, quantized, weight.shape[1], bias)
            self.choices = (f"{quantized.fmt}xint8",) * len(ROW_BUCKETS)
            self._bucket_kernels = (self._all_rows,) * len(ROW_BUCKETS)
            self._packed_from = self._source()
            return
        kernels: dict[str, object] = {PACKED: packed.PackedLinear(weight, bias)}
        if quantized is not None:
            kernels[quantized.fmt] = _kernel(packed.QuantizedLinear, quantized, weight.shape[1], bias)
        self.choices = choice.buckets(weight, kernels)  # kernel name per bucket, for the record
        self._bucket_kernels = tuple(kernels.get(name) for name in self.choices)  # None: torch's
        if choice.exact:
            self._past_buckets = self._bucket_kernels[-1]
        self._packed_from = self._source()

    def _kernel_at(self, rows: int):
        """The kernel chosen for `rows` rows' bucket; past the largest bucket, `_past_buckets` (None: torch's)."""
        if self._all_rows is not None:
            return self._all_rows
        bucket = bisect.bisect_left(ROW_BUCKETS, rows)
        return self._bucket_kernels[bucket] if bucket < len(ROW_BUCKETS) else self._past_buckets

    def streamed_bytes(self, rows: int) -> int:
        """Weight bytes a call on `rows` rows reads: the packed copy of the kernel that runs there, else torch's."""
        return _bytes(self._kernel_at(rows), self.weight)

    def _source(self) -> tuple:
        """What the packed copy was made from: any in-place change bumps a version, a move changes the storage."""
        parts = [self.weight] + ([self.bias] if self.bias is not None else [])
        return tuple((version_of(t), t.data_ptr(), t.dtype, t.device) for t in parts)

    def kernel_for(self, rows: int):
        """The packed kernel that runs `rows` rows, or None where torch's does (past the buckets, a bucket that chose
        it, or weights changed in place since they were packed)."""
        kernel = self._kernel_at(rows)
        return kernel if kernel is not None and self._source() == self._packed_from else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel_for(x.shape[0])
        if kernel is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
            return kernel(x)
        return stock_linear(x, self.weight, self.bias)  # also once the weights changed after packing


def _rows(quantized: QuantizedWeight | SplitWeight) -> int:
    return quantized.rows_total if isinstance(quantized, SplitWeight) else quantized.blocks.shape[0]


def runs_int8(quantized: QuantizedWeight | SplitWeight) -> bool:
    parts = quantized.parts if isinstance(quantized, SplitWeight) else (quantized,)
    return all(p.fmt in int8_formats() for p in parts)


def _kernel(kind, quantized: QuantizedWeight | SplitWeight, k: int, bias: torch.Tensor | None):
    """`kind` (a packed quantized linear class) over the weight's blocks; over each part of a split one, stacked."""
    if isinstance(quantized, QuantizedWeight):
        return kind(quantized.blocks, quantized.fmt, k, bias)
    kernels, row = [], 0
    for part in quantized.parts:
        rows = part.blocks.shape[0]
        kernels.append(kind(part.blocks, part.fmt, k, None if bias is None else bias[row:row + rows]))
        row += rows
    return packed.SplitLinear(kernels)


def version_of(t: torch.Tensor) -> int | None:
    """The in-place change counter of `t` (None for an inference tensor, which cannot change outside one)."""
    try:
        return t._version
    except RuntimeError:
        return None


def fast_linears_available(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and packed.enabled_library() is not None


def packable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] % packed.PANEL == 0
