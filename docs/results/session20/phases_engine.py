"""Where a batch-1 speculative step's target pass spends its time in place: builds the rdtsc-instrumented kernel
library of docs/results/session19/kernel_phases.py (a private ADAFLASH_CACHE), then runs the AR engine, the fixed:1
engine and a fixed:1 engine whose drafter is knocked out (fake drafts, no context feed) on 4 gsm8k prompts, 96 tokens,
alternating per prompt, twice; prints per (engine, query width) the pass's wall time and its kernel phases (ms).

    python docs/results/session20/phases_engine.py
"""
import ctypes, os, shutil, statistics, sys, tempfile, time
from pathlib import Path

cache_dir = tempfile.mkdtemp()
os.environ["ADAFLASH_CACHE"] = cache_dir  # before adaflash reads it

import torch

from adaflash.models import registry
from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.target import load_target_as

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


ghz = 2.6
import collections
from adaflash.data import load_prompts
from adaflash.evaluation.step_profile import profile_generation
from adaflash.models.registry import resolve_drafter
from adaflash.models.target import TargetModel
from adaflash.pipeline import Pipeline
from adaflash.serving.engine_factory import EngineConfig, build_engine
from adaflash.speculative.proposer import Drafts
lib = packed.library()
lib.adaflash_phase_counters.restype = ctypes.POINTER(ctypes.c_ulonglong)
counters = lib.adaflash_phase_counters()
p = Pipeline.load("smollm2-135m", resolve_drafter("smollm2-135m", None), "int8")
stop = list(p.stop_token_ids)
prompts = [p.encode(messages=x.messages) for x in load_prompts("gsm8k", "eval", limit=4)]
ml = max(map(len, prompts)) + 96 + p.proposer.block_size + 1
ar = build_engine(EngineConfig("ar", None, max_batch=1, max_len=ml), p.engine_models())
sp = build_engine(EngineConfig("dflash", "fixed:1", max_batch=1, max_len=ml), p.engine_models())
fake = build_engine(EngineConfig("dflash", "fixed:1", max_batch=1, max_len=ml), p.engine_models())
object.__setattr__(fake, "feed_context", lambda s: 0)
object.__setattr__(fake.proposer, "propose", lambda c, s, a, n, *x: Drafts(torch.tensor([100] * sum(n)), tuple(None for _ in n), tuple(n)))
fwd = TargetModel.forward
acc = collections.defaultdict(lambda: [0.0] * 8)
walls = collections.defaultdict(list)
tag = [None]
def spy(self, ids, batch, cache, *a, **k):
    for i in range(8): counters[i] = 0
    t = time.perf_counter(); r = fwd(self, ids, batch, cache, *a, **k); w = time.perf_counter() - t
    if batch.starts[0]:
        key = (tag[0], ids.shape[0])
        walls[key].append(w)
        for i in range(8): acc[key][i] += counters[i]
    return r
TargetModel.forward = spy
for _ in range(2):
    for ids in prompts:
        for name, e in (("ar", ar), ("spec", sp), ("fake", fake)):
            tag[0] = name
            e._pending.clear()
            profile_generation(e, ids, 96, stop)
for key, w in sorted(walls.items()):
    n = len(w)
    if n < 20: continue
    ms = [acc[key][i] / ghz / 1e6 / n for i in range(8)]
    print(key, n, f"wall median {1e3 * statistics.median(w):.2f} mean {1e3 * statistics.mean(w):.2f}, kernel {sum(ms):.2f}: " + ", ".join(f"{nm} {v:.2f}" for nm, v in zip(NAMES, ms)))
