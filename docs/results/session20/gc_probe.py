"""How much time Python's cyclic GC takes during batch-1 engine generation (AR and fixed:1), with and without
gc.freeze() after loading, alternating per prompt."""
import gc, time, statistics, sys, collections
import torch
from adaflash.data import load_prompts
from adaflash.evaluation.step_profile import profile_generation
from adaflash.models.registry import resolve_drafter
from adaflash.pipeline import Pipeline
from adaflash.serving.engine_factory import EngineConfig, build_engine
p = Pipeline.load("smollm2-135m", resolve_drafter("smollm2-135m", None), "int8")
stop = list(p.stop_token_ids)
prompts = [p.encode(messages=x.messages) for x in load_prompts("gsm8k", "eval", limit=4)]
ml = max(map(len, prompts)) + 96 + p.proposer.block_size + 1
engines = {"ar": build_engine(EngineConfig("ar", None, max_batch=1, max_len=ml), p.engine_models()),
           "fixed:1": build_engine(EngineConfig("dflash", "fixed:1", max_batch=1, max_len=ml), p.engine_models())}
print("tracked objects", len(gc.get_objects()))
spent = collections.defaultdict(float); counts = collections.defaultdict(int); t0 = [0.0]
def cb(phase, info):
    if phase == "start": t0[0] = time.perf_counter()
    else:
        spent[(mode[0], info["generation"])] += time.perf_counter() - t0[0]; counts[(mode[0], info["generation"])] += 1
gc.callbacks.append(cb)
mode = [None]
steps = collections.defaultdict(list)
for rep in range(3):
    for frozen in (False, True):
        if frozen: gc.freeze()
        else: gc.unfreeze()
        for name, e in engines.items():
            mode[0] = (name, frozen)
            for ids in prompts:
                s, _ = profile_generation(e, ids, 96, stop)
                steps[mode[0]] += [x["wall_ms"] for x in s]
for k, v in steps.items():
    g = {gen: (counts[(k, gen)], round(1e3 * spent[(k, gen)], 1)) for gen in range(3)}
    print(k, len(v), "steps, median %.3f ms, mean %.3f ms; gc by generation (count, ms):" % (statistics.median(v), statistics.mean(v)), g)
