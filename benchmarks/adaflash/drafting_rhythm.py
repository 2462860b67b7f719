"""What a speculative engine's target pass costs in place, by how often the drafter runs around it (batch 1, int8,
4 gsm8k prompts x 2, 96 tokens): the AR engine; the speculative engine never drafting (fixed:0); drafting 2 tokens
every 4th step; drafting 2 every step - alternating per prompt. Prints each engine's target-pass and step medians by
query width / draft length.

    python benchmarks/adaflash/drafting_rhythm.py
"""
import collections, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for benchmarks/ (not installed)

from adaflash.data import load_prompts
from benchmarks.runtime.step_profile import profile_generation
from adaflash.models.registry import resolve_drafter
from adaflash.models.targets import TargetModel
from adaflash.pipeline import Pipeline
from adaflash.engine.engine_factory import EngineConfig, build_engine
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.length_policy import FixedLength


class Every:
    """k drafts every n-th step, none in between."""

    def __init__(self, n: int, k: int) -> None:
        self.n, self.k, self.i, self.name = n, k, 0, f"every{n}"

    def decide(self, requests, max_draft, hidden_of=None):
        self.i += 1
        return [self.k if self.i % self.n == 0 else 0 for _ in requests]

    def feedback(self, *args) -> None:
        pass

    def observe_step(self, *args) -> None:
        pass


p = Pipeline.load("smollm2-135m", resolve_drafter("smollm2-135m", None), "int8")
stop = list(p.stop_token_ids)
prompts = [p.encode(messages=x.messages) for x in load_prompts("gsm8k", "eval", limit=4)]
max_len = max(map(len, prompts)) + 96 + 17
engines = {"ar": build_engine(EngineConfig(max_batch=1, max_len=max_len), p.engine_models())}
for name, policy in (("fixed:0", FixedLength(0)), ("every4", Every(4, 2)), ("every1", Every(1, 2))):
    engine = build_engine(EngineConfig(SpeculativeConfig.of("dflash", "fixed:1"), max_batch=1, max_len=max_len), p.engine_models())
    engine.policy = policy
    engines[name] = engine
forward = TargetModel.forward
passes, tag = collections.defaultdict(list), [None]


def timed(self, ids, batch, cache, *args, **kwargs):
    start = time.perf_counter()
    out = forward(self, ids, batch, cache, *args, **kwargs)
    if batch.starts[0]:  # not a prefill
        passes[(tag[0], ids.shape[0])].append(time.perf_counter() - start)
    return out


TargetModel.forward = timed
walls = collections.defaultdict(list)
for _ in range(2):
    for ids in prompts:
        for name, engine in engines.items():
            tag[0] = name
            steps, _ = profile_generation(engine, ids, 96, stop)
            for s in steps:
                walls[(name, s["drafts"])].append(s["wall_ms"])
for key, v in sorted(passes.items()):
    if len(v) > 20:
        print(f"target pass {key} (engine, tokens): {len(v)}, median {1e3 * statistics.median(v):.3f} ms")
for key, v in sorted(walls.items()):
    if len(v) > 20:
        print(f"step {key} (engine, drafts): {len(v)}, median {statistics.median(v):.3f} ms")
