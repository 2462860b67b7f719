"""The packed fp32 linear (packed_linear.cpp): built with the system C++ compiler on first use, loaded with ctypes.

Built once per source/flags into $ADAFLASH_CACHE/kernels (a second), linked against the OpenMP runtime torch has
already loaded (same soname), so both share one thread pool. Unavailable - and callers fall back to torch's
kernels - where the CPU lacks AVX2/FMA, no compiler is found, or ADAFLASH_KERNELS=stock.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("packed_linear.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
PANEL = 16  # outputs per packed panel (the kernel needs n % PANEL == 0)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build(out: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} failed on {SOURCE}:\n{proc.stderr[-2000:]}")
    tmp.replace(out)  # atomic: concurrent first uses never load a half-written library


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (with the reason logged once) where it cannot run here."""
    if os.environ.get("ADAFLASH_KERNELS", "auto") == "stock":
        return None
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        log.info("packed fp32 linear unavailable: CPU lacks %s", sorted(missing))
        return None
    from adaflash.models.registry import cache_root

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"packed_linear-{digest}.so"
    try:
        if not path.is_file():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as exc:
        log.warning("packed fp32 linear unavailable, using torch's kernels: %s", exc)
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.adaflash_pack.argtypes = [ptr, i64, i64, ptr]
    lib.adaflash_pack.restype = None
    lib.adaflash_packed_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr]
    lib.adaflash_packed_linear.restype = None
    return lib


class PackedLinear:
    """An fp32 [n, k] weight (+ bias) packed for the kernel; call it on [m, k] fp32 rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the packed fp32 linear is unavailable on this machine")
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"packed linear needs a 2-D fp32 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        if n % PANEL:
            raise ValueError(f"packed linear needs out_features % {PANEL} == 0, got {n}")
        self._lib, self.n, self.k = lib, n, k
        w = weight.detach().contiguous()
        self.packed = torch.empty(n * k, dtype=torch.float32)
        lib.adaflash_pack(w.data_ptr(), n, k, self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.float32:
            raise ValueError(f"expected [m, {self.k}] fp32 rows, got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        if x.shape[0]:
            self._lib.adaflash_packed_linear(x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self.n,
                                             None if self.bias is None else self.bias.data_ptr(), y.data_ptr())
        return y
