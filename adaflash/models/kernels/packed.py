"""Our CPU kernel library and its linears: the packed fp32 linear and the quantized linear over GGUF blocks
(packed_linear.cpp, its AVX-512 paths in packed_linear_avx512.cpp), the int8-activation linear over GGUF blocks
(int8_linear.cpp, its AMX path in int8_amx.cpp; `--dtype int8`); the library also holds the ragged attention
(attention.cpp, wrapped in attention.py), the fused steps (fused.cpp, used by layers.py and kv_cache/ragged.py) and
the whole-layer step (layer_step.cpp / .py).

Built with the system C++ compiler on first use, once per sources/flags, into $ADAFLASH_CACHE/kernels (a second or
two), loaded with ctypes and linked against the OpenMP runtime torch has already loaded (same soname), so both
share one thread pool. Unavailable - and callers fall back to torch's kernels - where the CPU lacks AVX2/FMA/F16C
or no compiler is found (ADAFLASH_KERNELS=stock is the callers' switch).
"""

from __future__ import annotations

import contextlib
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

from adaflash.models.device.cpu import cpu_flags
from adaflash.models.files import cache_root
from adaflash.models.kernels import kquant, weight_arena
from adaflash.models.kernels.kquant import KQUANT_CODES
from adaflash.models.kernels.quant import BLOCK, QUANT_FORMATS, int8_formats

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("packed_linear.cpp")
SOURCES = (SOURCE, *(Path(__file__).with_name(f)  # one library
                     for f in ("packed_linear_avx512.cpp", "attention.cpp", "fused.cpp", "layer_step.cpp",
                               "int8_linear.cpp", "int8_amx.cpp", "kquant.cpp")))
HEADERS = tuple(Path(__file__).with_name(f) for f in ("simd_math.h", "int8_linear.h", "packed_linear.h"))
# -ffp-contract=off: the fused kernels round like torch's ops (a product, then a sum), never contracted behind our back.
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
PANEL = 16  # outputs per packed panel (the kernel needs n % PANEL == 0)


def build_library(out: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    """Compile `sources` (the library's own by default) into the shared library `out`, atomically."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, sources)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {', '.join(map(str, sources))}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent first uses (other processes too) never load a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def source_digest() -> str:
    """Names one build of the library: its sources and flags."""
    text = b"".join(src.read_bytes() for src in (*SOURCES, *HEADERS))
    return hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]


_BUILD_LOCK = threading.Lock()


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (with the reason logged once) where it cannot run here."""
    with _BUILD_LOCK:
        return _load()


@lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | None:
    missing = {"avx2", "fma", "f16c"} - cpu_flags()
    if missing:
        log.info("our CPU kernels are unavailable: the CPU lacks %s", sorted(missing))
        return None
    digest = source_digest()
    path = cache_root() / "kernels" / f"packed_linear-{digest}.so"
    try:
        if not path.is_file():
            build_library(path)
        lib = open_library(path)
        lib.adaflash_int8_limit_isa(_int8_default_limit())
        return lib
    except (RuntimeError, OSError) as exc:
        log.warning("our CPU kernels are unavailable, using torch's: %s", exc)
        return None


def open_library(path: Path) -> ctypes.CDLL:
    """Load a build of the kernel library and declare its functions' signatures."""
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.adaflash_pack.argtypes = [ptr, i64, i64, ptr, i32]
    lib.adaflash_pack.restype = None
    lib.adaflash_linear_allow_avx512.argtypes = [i32]
    lib.adaflash_linear_allow_avx512.restype = None
    lib.adaflash_packed_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i32]
    lib.adaflash_packed_linear.restype = None
    lib.adaflash_pack_quantized.argtypes = [ptr, i64, i64, i32, ptr, i32]
    lib.adaflash_pack_quantized.restype = None
    lib.adaflash_quantized_linear.argtypes = [ptr, i64, i64, ptr, i32, i64, ptr, ptr, i32]
    lib.adaflash_quantized_linear.restype = None
    lib.adaflash_int8_block_bytes.argtypes = [i32]
    lib.adaflash_int8_block_bytes.restype = i64
    lib.adaflash_pack_int8.argtypes = [ptr, i64, i64, i32, ptr, i32]
    lib.adaflash_pack_int8.restype = None
    lib.adaflash_int8_linear.argtypes = [ptr, i64, i64, ptr, i32, i64, ptr, ptr, i32]
    lib.adaflash_int8_linear.restype = None
    lib.adaflash_int8_isa.argtypes = []
    lib.adaflash_int8_isa.restype = i32
    lib.adaflash_int8_limit_isa.argtypes = [i32]
    lib.adaflash_int8_limit_isa.restype = None
    lib.adaflash_ragged_attention.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr,
                                              ptr, ctypes.c_float, ptr, i32, i32]
    lib.adaflash_ragged_attention.restype = None
    lib.adaflash_attention_allow_avx512.argtypes = [i32]
    lib.adaflash_attention_allow_avx512.restype = None
    lib.adaflash_rms_norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr, i32]
    lib.adaflash_rms_norm.restype = None
    lib.adaflash_rope_qkv.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr,
                                      ptr, i32]
    lib.adaflash_rope_qkv.restype = None
    lib.adaflash_silu_mul.argtypes = [ptr, i64, i64, ptr, i32]
    lib.adaflash_silu_mul.restype = None
    lib.adaflash_argmax_rows.argtypes = [ptr, i64, i64, ptr, i32]
    lib.adaflash_argmax_rows.restype = None
    lib.adaflash_stream_read.argtypes = [ptr, i64, i32]
    lib.adaflash_stream_read.restype = ctypes.c_uint64
    lib.adaflash_layer_scratch_floats.argtypes = [ptr, i64]
    lib.adaflash_layer_scratch_floats.restype = i64
    lib.adaflash_decoder_layer.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i32]
    lib.adaflash_decoder_layer.restype = None
    lib.adaflash_decoder_layers.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i32]
    lib.adaflash_decoder_layers.restype = None
    lib.adaflash_decoder_forward.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64,
                                             ptr, ptr, i32]
    lib.adaflash_decoder_forward.restype = ctypes.c_int
    lib.adaflash_context_scratch_floats.argtypes = [ptr, i64]
    lib.adaflash_context_scratch_floats.restype = i64
    lib.adaflash_drafter_context.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i32]
    lib.adaflash_drafter_context.restype = None
    return lib


def enabled_library() -> ctypes.CDLL | None:
    """The library, unless it cannot run here or ADAFLASH_KERNELS=stock asks for torch's kernels throughout (read
    per call: the linears fix their kernels at load, attention and the fused steps choose at each call)."""
    return None if os.environ.get("ADAFLASH_KERNELS") == "stock" else library()


def profiled(label: str):
    """A torch.profiler range named `label` while profiling (ctypes calls are otherwise invisible to it), else a
    no-op; cheap enough for every call."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()


def _check_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
        raise ValueError(f"bias must be a CPU tensor of shape ({n},), got {tuple(bias.shape)} on {bias.device}")
    return None if bias is None else bias.detach().float().contiguous()


def _check_blocks(blocks: torch.Tensor, fmt: str, k: int, formats) -> int:
    if fmt not in formats:
        raise ValueError(f"no kernel for {fmt!r} here (have {sorted(formats)})")
    n, spec = blocks.shape[0], QUANT_FORMATS[fmt]
    if k < spec.block_k or k % spec.block_k or n % PANEL or blocks.dtype != torch.uint8 \
            or blocks.shape != (n, spec.row_bytes(k)):
        raise ValueError(f"{fmt} blocks for {n} x {k} must be uint8 [{n}, {spec.row_bytes(k)}] with "
                         f"n % {PANEL} == 0 and k % {spec.block_k} == 0, got {blocks.dtype} {tuple(blocks.shape)}")
    return n


def _pack(pack_fn, blocks: torch.Tensor, fmt: str, n: int, k: int, out: torch.Tensor) -> torch.Tensor:
    """`blocks` packed into `out` (uint8, the kernel's size): by kquant.py for its formats, else by `pack_fn`."""
    if fmt in KQUANT_CODES:  # in slices of rows: numpy's temporaries stay small beside a 150K-row LM head
        src, step = blocks.numpy(), 4096
        per_row = out.numel() // blocks.shape[0]
        for r in range(0, blocks.shape[0], step):
            out[r * per_row:(r + step) * per_row] = torch.from_numpy(kquant.pack(fmt, src[r:r + step], k))
    else:
        src = blocks.detach().contiguous()
        pack_fn(src.data_ptr(), n, k, QUANT_FORMATS[fmt].code, out.data_ptr(), torch.get_num_threads())
    return out


class _Packed:
    """Shared by both packings: input checks, the output buffer, the profiler label."""

    n: int
    k: int
    label: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"expected [m, {self.k}] fp32 CPU rows, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32, device="cpu")
        if x.shape[0]:
            with profiled(self.label):
                self._run(x, y)
        return y

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """The packed weights' bytes: what a call streams."""
        return self.packed.numel() * self.packed.element_size()


class PackedLinear(_Packed):
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
        self._lib, self.n, self.k = lib, n, k
        self.format_code = 0  # layer_step.cpp's code for this kernel
        self.label = f"adaflash::packed_linear[{n}x{k}]"  # what torch.profiler shows for a call (ctypes is invisible)
        w = weight.detach().contiguous()
        self.packed = torch.empty(n * k, dtype=torch.float32, device="cpu")
        lib.adaflash_pack(w.data_ptr(), n, k, self.packed.data_ptr(), torch.get_num_threads())
        self.bias = _check_bias(bias, n)

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._lib.adaflash_packed_linear(x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self.n,
                                             None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                                             torch.get_num_threads())


class QuantizedLinear(_Packed):
    """GGUF blocks of an [n, k] weight ([n, k / block k * block bytes] uint8, one row per output, in the weight's row
    order) packed for the quantized kernel: the same outputs, bitwise, as PackedLinear on the dequantized weight."""

    def __init__(self, blocks: torch.Tensor, fmt: str, k: int, bias: torch.Tensor | None = None) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the packed kernels are unavailable on this machine")
        n = _check_blocks(blocks, fmt, k, QUANT_FORMATS)
        spec = QUANT_FORMATS[fmt]
        self._lib, self.n, self.k, self.fmt, self.format_code = lib, n, k, fmt, spec.code
        self.label = f"adaflash::packed_linear[{n}x{k} {fmt}]"  # runtime_profile buckets by this prefix
        self.packed = _pack(lib.adaflash_pack_quantized, blocks, fmt, n, k,
                            torch.empty(n // PANEL * (k // BLOCK) * spec.packed_block_bytes, dtype=torch.uint8))
        self.bias = _check_bias(bias, n)

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._lib.adaflash_quantized_linear(x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self.format_code,
                                            self.n, None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                                            torch.get_num_threads())


# The offset of the int8-activation kernel's format codes in layer_step.cpp's Linear.format.
INT8_CODE_OFFSET = 16


class Int8Linear(_Packed):
    """GGUF blocks of an [n, k] weight (an int8 format of quant.py) with 8-bit activations (int8_linear.cpp, kquant.cpp:
    llama.cpp's arithmetic). NOT the fp32 target: each row's activations are rounded to int8 per 32 k. A row's result
    is the same at every row count and row subset, so decode, verification and prefill agree (lossless against the
    target as it runs)."""

    def __init__(self, blocks: torch.Tensor, fmt: str, k: int, bias: torch.Tensor | None = None) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the int8 kernels are unavailable on this machine")
        n = _check_blocks(blocks, fmt, k, int8_formats())
        code = QUANT_FORMATS[fmt].code
        self._lib, self.n, self.k, self.fmt = lib, n, k, fmt
        self.format_code, self._code = INT8_CODE_OFFSET + code, code
        self.label = f"adaflash::packed_linear[{n}x{k} {fmt}xint8]"
        # In huge pages (weight_arena.py). Only here: the other kernels' copies may be dropped by the per-machine
        # choice, and a weight carved from a shared chunk frees no memory until the whole chunk does.
        self.packed = _pack(lib.adaflash_pack_int8, blocks, fmt, n, k, weight_arena.empty(
            n // PANEL * (k // BLOCK) * lib.adaflash_int8_block_bytes(code), torch.uint8))
        self.bias = _check_bias(bias, n)

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._lib.adaflash_int8_linear(x.data_ptr(), x.shape[0], self.k, self.packed.data_ptr(), self._code, self.n,
                                       None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                                       torch.get_num_threads())


INT8_ISAS = ("avx2", "avx512-vnni", "amx")  # the int8 kernel's paths, by adaflash_int8_isa's code


def _int8_default_limit() -> int:
    """The best int8 path a process runs: AMX only where ADAFLASH_INT8_AMX=1 asks for it. It is the one path whose
    fresh-process determinism under timing-driven draft lengths is unverified (docs/runtime.md says why), so it stays
    off until `benchmarks/runtime/determinism.py` runs clean with it on an AMX machine. The unit tests still compare its
    bits with the other paths wherever the CPU has it."""
    return INT8_ISAS.index("amx" if os.environ.get("ADAFLASH_INT8_AMX") == "1" else "avx512-vnni")


def int8_isa() -> str | None:
    """The instruction set the int8 kernel's integer dot runs on in this process (AMX, where the CPU has it and
    ADAFLASH_INT8_AMX=1: passes of several rows; one row runs AVX512-VNNI), or None without the library. Every path
    gives the same bits (tested)."""
    lib = library()
    return None if lib is None else INT8_ISAS[lib.adaflash_int8_isa()]


def int8_isa_supported() -> str | None:
    """The best int8 path the CPU has, AMX included whether or not this process runs it (None without the library)."""
    if library() is None:
        return None
    flags = cpu_flags()  # read from the CPU's flags: the library's limit is process state other threads run under
    if not {"avx512_vnni", "avx512vl", "avx512bw"} <= flags:
        return "avx2"
    return "amx" if {"amx_tile", "amx_int8"} <= flags else "avx512-vnni"


@contextlib.contextmanager
def int8_isa_limit(isa: str):
    """Runs the int8 kernel on no better path than `isa` inside the block (tests compare the paths' bits)."""
    lib = library()
    lib.adaflash_int8_limit_isa(INT8_ISAS.index(isa))
    try:
        yield
    finally:
        lib.adaflash_int8_limit_isa(_int8_default_limit())


class SplitLinear(_Packed):
    """Kernels over stacked parts of one fused weight (a quant.SplitWeight), each into its own outputs; the layer step
    runs them as one linear (layer_step.cpp's parts)."""

    def __init__(self, parts: list[_Packed]) -> None:
        if len({p.k for p in parts}) != 1:
            raise ValueError(f"split parts must share k, got {[p.k for p in parts]}")
        self.parts, self.n, self.k = parts, sum(p.n for p in parts), parts[0].k
        self.format_code, self.bias = -1, None
        self.label = f"adaflash::split_linear[{self.n}x{self.k}]"

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> None:
        col = 0
        for part in self.parts:
            y[:, col:col + part.n] = part(x)
            col += part.n

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)
