"""Offline engine throughput at one concurrency on distinct six-mix prompts (int8, 64 new tokens each), then the same
run under cProfile: what the engine alone reaches (no HTTP), and where the wall time goes.

    python benchmarks/serving/engine_profile.py CONCURRENCY NUM_REQUESTS   (e.g. 32 96)

First the engine with and without prompt-prefix reuse, alternating (3 runs each, medians): what reuse buys with
fresh prompts that share only their template's system turn (and what else a benchmark's prompts share).
"""
import cProfile, pstats, sys, time
import torch
from adaflash.cli_args import set_threads
set_threads(None)
from adaflash.evaluation.serve_sweep import prompt_pool, _fitting
from adaflash.pipeline import Pipeline
from adaflash.engine.engine import Engine
from adaflash.engine.request import Request

conc = int(sys.argv[1]); n_req = int(sys.argv[2])
p = Pipeline.load("smollm2-135m", None, "int8", None)
prompts = _fitting(prompt_pool("six-mix"), "smollm2-135m", 384)[:n_req]
ids = [p.encode(messages=m) for m in prompts]
print("mean prompt tokens", sum(map(len, ids)) / len(ids))
def run(profile=False, reuse=True):
    eng = Engine(p.target, max_batch=conc, max_queue=10_000, max_len=512)
    if not reuse:
        eng.prefixes = None
    requests = [Request(f"r{i}", x, 64) for i, x in enumerate(ids)]
    for r in requests:
        eng.add_request(r)
    steps = 0
    t0 = time.perf_counter()
    prof = cProfile.Profile() if profile else None
    if prof: prof.enable()
    while eng.has_work():
        eng.step()
        steps += 1
    if prof: prof.disable()
    dt = time.perf_counter() - t0
    return dt, steps, sum(len(r.output_ids) for r in requests), prof, eng
import statistics
speeds = {True: [], False: []}
for rep in range(3):
    for reuse in (True, False):
        dt, steps, out_tok, _, eng = run(reuse=reuse)
        speeds[reuse].append(out_tok / dt)
        print(f"c={conc} reuse={reuse}: {n_req} requests, {steps} steps, {dt:.1f} s, {out_tok / dt:.1f} tok/s "
              f"({out_tok} tokens); prompt tokens {eng.prompt_tokens}, reused from slots {eng.prompt_tokens_reused}")
on, off = statistics.median(speeds[True]), statistics.median(speeds[False])
print(f"median tok/s: reuse {on:.1f}, no reuse {off:.1f}, ratio {on / off:.3f}")
dt, steps, out_tok, prof, _ = run(True)
print(f"profiled: {dt:.1f} s")
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
