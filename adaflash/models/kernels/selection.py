"""Which fp32 linear kernel runs a weight shape at a row count: timed once per machine, kept in a JSON cache.

Candidates: torch's stock kernel (`layers.linear`: oneDNN where it works) and the packed kernel (packed.py).
Row counts are bucketed (a count runs with the choice of the next bucket up); past the largest bucket (prefill,
training teacher passes) the stock kernel runs. The cache key is the CPU model, the thread count and the
kernel source, so a different machine or --threads measures again (about a second per shape).
ADAFLASH_KERNELS=stock or =packed forces one kernel for every bucket without timing.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import torch

from adaflash.models.kernels import packed
from adaflash.models.layers import linear as stock_linear

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STOCK, PACKED = "stock", "packed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_file() -> Path:
    from adaflash.models.registry import cache_root

    key = f"{_cpu_model()}|threads={torch.get_num_threads()}|{hashlib.sha256(packed.SOURCE.read_bytes()).hexdigest()[:12]}"
    return cache_root() / "kernels" / f"choices-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _min_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3  # the minimum: robust to a preempted run when other work shares the cores


def time_shape(weight: torch.Tensor, kernel: packed.PackedLinear) -> dict[str, dict[str, float]]:
    """ms per call of each kernel at each row bucket (for the record and the choice)."""
    out = {}
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, weight.shape[1])
        out[str(rows)] = {STOCK: _min_ms(lambda: stock_linear(x, weight)), PACKED: _min_ms(lambda: kernel(x))}
    return out


_CACHE_LOCK = threading.Lock()  # the hot-swap watcher builds proposers on its own thread


def _read_cache(path: Path) -> dict[str, dict]:
    try:
        return json.loads(path.read_text())["shapes"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # absent or damaged: measured again


class KernelChoice:
    """Per (n, k) shape, the kernel for each row bucket."""

    def __init__(self) -> None:
        self.mode = os.environ.get("ADAFLASH_KERNELS", "auto")
        if self.mode not in ("auto", STOCK, PACKED):
            raise ValueError(f"ADAFLASH_KERNELS must be auto, stock or packed, got {self.mode!r}")
        self._file = cache_file()

    def buckets(self, weight: torch.Tensor, kernel: packed.PackedLinear) -> tuple[bool, ...]:
        """For each bucket of ROW_BUCKETS: does the packed kernel run it."""
        if self.mode != "auto":
            return tuple(self.mode == PACKED for _ in ROW_BUCKETS)
        key = f"{weight.shape[0]}x{weight.shape[1]}"
        with _CACHE_LOCK:
            times = _read_cache(self._file).get(key)
            if times is None or any(str(r) not in times for r in ROW_BUCKETS):
                times = time_shape(weight, kernel)
                self._save(key, times)
        return tuple(times[str(r)][PACKED] <= times[str(r)][STOCK] for r in ROW_BUCKETS)

    def _save(self, key: str, times: dict) -> None:
        """Merge into what is on disk now (another process may have added shapes), then replace atomically."""
        shapes = {**_read_cache(self._file), key: times}
        self._file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._file.parent, suffix=".json.tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"cpu": _cpu_model(), "threads": torch.get_num_threads(), "shapes": shapes}, f, indent=1)
        os.replace(tmp, self._file)


class FastLinear:
    """One weight's linear: the packed kernel at the row counts where it measured faster, torch's elsewhere."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, choice: KernelChoice) -> None:
        self.weight, self.bias = weight, bias
        self.kernel = packed.PackedLinear(weight, bias)
        self.use_packed = choice.buckets(weight, self.kernel)
        self._packed_from = self._source()

    def _source(self) -> tuple:
        """What the packed copy was made from: any in-place change bumps a version, a move changes the storage."""
        parts = [self.weight] + ([self.bias] if self.bias is not None else [])
        return tuple((_version(t), t.data_ptr(), t.dtype, t.device) for t in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        bucket = bisect.bisect_left(ROW_BUCKETS, rows)
        if (bucket < len(ROW_BUCKETS) and self.use_packed[bucket] and x.dtype == torch.float32
                and x.device.type == "cpu" and x.dim() == 2 and self._source() == self._packed_from):
            return self.kernel(x)
        return stock_linear(x, self.weight, self.bias)  # also once the weights changed after packing


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot be changed in place outside one)
        return None


def fast_linears_available(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and os.environ.get("ADAFLASH_KERNELS") != STOCK
            and packed.library() is not None)


def packable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] % packed.PANEL == 0
