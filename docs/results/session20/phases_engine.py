"""Where a batch-1 speculative step's target pass spends its time in place: builds the rdtsc-instrumented kernel
library of docs/results/session19/kernel_phases.py (a private ADAFLASH_CACHE), then runs the AR engine, the fixed:1
engine and a fixed:1 engine whose drafter is knocked out (fake drafts, no context feed) on 4 gsm8k prompts, 96 tokens,
alternating per prompt, twice; prints per (engine, query width) the pass's wall time and its kernel phases (ms).

    python docs/results/session20/phases_engine.py
"""
import collections, ctypes, statistics, time
from pathlib import Path

# session 19's kernel_phases.py up to its measurement: a private ADAFLASH_CACHE, the rdtsc-instrumented library built
# into it, its NAMES of the phases (run here rather than copied)
_phases = Path(__file__).resolve().parents[1] / "session19" / "kernel_phases.py"
_source = _phases.read_text()
exec(compile(_source[: _source.index("ghz = float")], str(_phases), "exec"))

ghz = 2.6
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
