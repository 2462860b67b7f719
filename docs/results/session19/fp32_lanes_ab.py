"""The fp32 target's forwards of q tokens (`--dtype fp32`, the per-machine kernel choice) with the fp32 kernels'
16-lane paths on and off (packed_linear.cpp, adaflash_linear_allow_avx512), alternating forward by forward in one
process at a 256-token context; also the drafter-free greedy decode of the demo's prompts both ways. Prints medians
and whether the logits / tokens are identical.

    python docs/results/session19/fp32_lanes_ab.py [REPEATS] [QS]     # QS: comma-separated, default 1,2,4
"""
import statistics, sys, time

import torch

from adaflash.evaluation.demo import DEMO_PROMPTS
from adaflash.models.kernels import packed
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.registry import load_tokenizer, resolve_target
from adaflash.models.target import load_target_as
from adaflash.speculative.reference import autoregressive_generate

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
qs = [int(q) for q in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4").split(",")]
path = resolve_target("smollm2-135m")
model = load_target_as(path, "fp32")
lib = packed.library()
context = 256
cache = model.new_cache(1, context + max(qs))
model(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), cache)
times, logits = {}, {}
for _ in range(repeats):
    for q in qs:
        for wide in (0, 1):
            lib.adaflash_linear_allow_avx512(wide)
            t = time.perf_counter()
            out = model(torch.arange(q) + 100, RaggedBatch.build([0], [context], [q]), cache)
            times.setdefault((q, wide), []).append(time.perf_counter() - t)
            logits[(q, wide)] = out.logits
            cache.rollback(0, context)
lib.adaflash_linear_allow_avx512(1)
print(f"fp32 target, {torch.get_num_threads()} threads, context {context}, medians of {repeats}")
for q in qs:
    a, b = (1e3 * statistics.median(times[(q, w)]) for w in (0, 1))
    print(f"q={q}: 8-lane {a:.2f} ms  16-lane {b:.2f} ms  16/8 {b / a:.3f}  same logits: "
          f"{torch.equal(logits[(q, 0)], logits[(q, 1)])}")
tok = load_tokenizer(path)
prompts = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for _, text in DEMO_PROMPTS]
gen, outs = {0: [], 1: []}, {0: [], 1: []}
for _ in range(3):
    for ids in prompts:
        for wide in (0, 1):
            lib.adaflash_linear_allow_avx512(wide)
            t = time.perf_counter()
            outs[wide].append(autoregressive_generate(model, ids, max_new_tokens=64).token_ids)
            gen[wide].append(time.perf_counter() - t)
lib.adaflash_linear_allow_avx512(1)
a, b = (statistics.median(gen[w]) for w in (0, 1))
print(f"greedy 64-token generations (demo prompts, 3 rounds): 8-lane {1e3 * a:.0f} ms  16-lane {1e3 * b:.0f} ms  "
      f"16/8 {b / a:.3f}  same tokens: {outs[0] == outs[1]}")
