"""The packed fp32 linear (packed_linear.cpp): built with the system C++ compiler on first use, loaded with ctypes.

Built once per source/flags into $ADAFLASH_CACHE/kernels (a second), linked against the OpenMP runtime torch has
already loaded (same soname), so both share one thread pool. Unavailable - and callers fall back to torch's
kernels - where the CPU lacks AVX2/FMA or no compiler is found (ADAFLASH_KERNELS=stock is the callers' switch).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
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
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent first uses (other processes too) never load a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_BUILD_LOCK = threading.Lock()


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (with the reason logged once) where it cannot run here."""
    with _BUILD_LOCK:
        return _load()


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
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
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.adaflash_pack.argtypes = [ptr, i64, i64, ptr, i32]
    lib.adaflash_pack.restype = None
    lib.adaflash_packed_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i32]
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
        if n % PANEL or k < 1:
            raise ValueError(f"packed linear needs out_features % {PANEL} == 0 and in_features >= 1, got {n} x {k}")
        if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
            raise ValueError(f"bias must be a CPU tensor of shape ({n},), got {tuple(bias.shape)} on {bias.device}")
        self._lib, self.n, self.k = lib, n, k
        self.label = f"adaflash::packed_linear[{n}x{k}]"  # what torch.profiler shows for a call (ctypes is invisible)
        w = weight.detach().contiguous()
        self.packed = torch.empty(n * k, dtype=torch.float32, device="cpu")
        lib.adaflash_pack(w.data_ptr(), n, k, self.packed.data_ptr(), torch.get_num_threads())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"expected [m, {self.k}] fp32 CPU rows, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32, device="cpu")
        if x.shape[0] and torch.autograd.profiler._is_profiler_enabled:
            with torch.profiler.record_function(self.label):
                self._run(x, y)
        elif x.shape[0]:
            self._run(x, y)
        return y

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._lib.adaflash_packed_linear(x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self.n,
                                             None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                                             torch.get_num_threads())
