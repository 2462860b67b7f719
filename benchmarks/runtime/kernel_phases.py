"""Where a batch-1 forward's time goes inside its one kernel call: builds this checkout's kernel library with rdtsc
counters around each phase of adaflash_decoder_layer (layer_step.cpp) and the LM head, loads it in place of the
normal build (a private ADAFLASH_CACHE), and runs int8 forwards of q tokens at a given context. Prints the mean wall
time of a forward, the time inside the kernel call and its split (ms at the TSC rate given, 2.6 GHz by default).

    python benchmarks/runtime/kernel_phases.py [TSC_GHZ]      # QS=1,4,16 CTX=256,1024 CAP=1,14,27 (optional)
"""
import ctypes, os, shutil, statistics, sys, tempfile, time
from pathlib import Path

cache_dir = tempfile.mkdtemp()
os.environ["ADAFLASH_CACHE"] = cache_dir  # before adaflash reads it

import torch

from adaflash.models import registry
from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.targets import load_target_as

TIMED = [  # (anchor in layer_step.cpp, what to put before it)
    ("  adaflash_rms_norm(h, t, d, layer->input_norm, s->eps, x, threads);\n", "  unsigned long long t_ = __rdtsc();\n"),
    ("  run_linear(layer->qkv, x, t, qkv, threads);\n", "  TICK(0)\n"),
    ("  const int64_t width = (s->heads + 2 * s->kv_heads) * s->head_dim;\n", "  TICK(1)\n"),
    ("  adaflash_ragged_attention(q, s->heads,", "  TICK(2)\n"),
    ("  run_linear(layer->o, ctx, t, x, threads);\n", "  TICK(3)\n"),
    ("  add_into(h, x, t * d);\n  adaflash_rms_norm(h, t, d, layer->post_norm", "  TICK(4)\n"),
    ("  run_linear(layer->gate_up, x, t, gate_up, threads);\n", "  TICK(0)\n"),
    ("  adaflash_silu_mul(gate_up, t, s->intermediate, act, threads);\n", "  TICK(5)\n"),
    ("  run_linear(layer->down, act, t, x, threads);\n", "  TICK(0)\n"),
    ("  add_into(h, x, t * d);\n}\n", "  TICK(6)\n"),
    ("  run_linear(*head, normed, num_rows, logits, threads);\n", "  unsigned long long t_ = __rdtsc();\n"),
    ("  run_linear(*head, normed, num_rows, logits, threads);\n  return 0;", None),
]
NAMES = ["norms/silu/adds", "qkv", "rope + cache write", "attention", "o", "gate_up", "down", "lm head"]


def instrumented_source(src: str) -> str:
    src = src.replace("#include <cstdint>\n", "#include <cstdint>\n#include <x86intrin.h>\nstatic unsigned long long g_t[8];\n"
                      'extern "C" unsigned long long* adaflash_phase_counters() { return g_t; }\n'
                      "#define TICK(i) { unsigned long long n_ = __rdtsc(); g_t[i] += n_ - t_; t_ = n_; }\n", 1)
    for anchor, before in TIMED:
        assert anchor in src, anchor
        if before is None:  # after the head's linear
            src = src.replace(anchor, anchor.replace("  return 0;", "  TICK(7)\n  return 0;"), 1)
        else:
            src = src.replace(anchor, before + anchor, 1)
    return src


build = Path(tempfile.mkdtemp())
for f in (*packed.SOURCES, *packed.HEADERS):
    shutil.copy(f, build / f.name)
(build / "layer_step.cpp").write_text(instrumented_source((build / "layer_step.cpp").read_text()))
target = Path(cache_dir) / "kernels" / f"packed_linear-{packed.source_digest()}.so"
packed.build_library(target, tuple(build / f.name for f in packed.SOURCES))

ghz = float(sys.argv[1]) if len(sys.argv) > 1 else 2.6
qs = [int(x) for x in os.environ.get("QS", "1,4,16").split(",")]
contexts = [int(x) for x in os.environ.get("CTX", "256,1024").split(",")]
capture = [int(x) for x in os.environ.get("CAP", "").split(",") if x]
model = load_target_as(registry.resolve_target("smollm2-135m"), "int8")
lib = packed.library()
lib.adaflash_phase_counters.restype = ctypes.POINTER(ctypes.c_ulonglong)
counters = lib.adaflash_phase_counters()
print(f"{torch.get_num_threads()} threads, int8 path {packed.int8_isa()}, TSC {ghz} GHz; ms per forward")
for context in contexts:
    cache = model.new_cache(1, context + max(qs))
    model(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), cache)
    for q in qs:
        for i in range(8):
            counters[i] = 0
        n, wall = 30, []
        for _ in range(n):
            t = time.perf_counter()
            model(torch.arange(q) + 100, RaggedBatch.build([0], [context], [q]), cache, capture_layers=capture)
            wall.append(time.perf_counter() - t)
            cache.rollback(0, context)
        ms = [counters[i] / ghz / 1e6 / n for i in range(8)]
        print(f"context {context} q={q}: wall {1e3 * statistics.mean(wall):.2f}, in the kernel call {sum(ms):.2f}: "
              + ", ".join(f"{name} {v:.2f}" for name, v in zip(NAMES, ms)))
