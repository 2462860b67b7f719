"""The engine's path at batch 1 against the reference AR loop: what a request kept from drafting pays for going through
the engine (scheduler, draft-source chain, feature capture for the drafter) rather than the plain loop.

    .venv/bin/python docs/results/adaflash/engine_path.py > docs/results/adaflash/engine_path.txt

`make demo`'s code prompt, 48 new tokens, fp32, 2 threads; three runs alternate 40 times (the order rotated): the
reference loop (`generate --method ar`), the engine without a drafter (`serve --method ar`), and the engine with the
shipped drafter under `fixed:0` (never drafting). Times are medians: the prefill step, the whole generation, and the
mean decode step after the prefill.
"""

from __future__ import annotations

import statistics
import subprocess
import time

from adaflash.cli_args import configure_process
from adaflash.engine.engine_factory import EngineConfig, build_engine
from adaflash.engine.request import Request
from adaflash.evaluation.demo import DEMO_PROMPTS
from adaflash.models.kernels.selection import cpu_model
from adaflash.models.registry import shipped_drafter
from adaflash.pipeline import Pipeline
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.reference import autoregressive_generate

NEW_TOKENS = 48


def main() -> None:
    threads = configure_process(2, "cpu")
    pipeline = Pipeline.load("smollm2-135m", str(shipped_drafter("smollm2-135m")), "fp32")
    ids = pipeline.encode(messages=[{"role": "user", "content": dict(DEMO_PROMPTS)["code"]}])

    def reference() -> tuple[float, float]:
        stats = autoregressive_generate(pipeline.target, ids, NEW_TOKENS, stop_token_ids=pipeline.stop_token_ids).stats
        return stats.first_token_s, stats.elapsed_s

    def engine(speculative: SpeculativeConfig):
        def run() -> tuple[float, float]:
            config = EngineConfig(speculative, max_batch=1, max_len=len(ids) + NEW_TOKENS + 16)
            built = build_engine(config, pipeline.engine_models())
            request = Request("g", list(ids), NEW_TOKENS, stop_token_ids=pipeline.stop_token_ids)
            start = time.perf_counter()
            built.add_request(request)
            built.step()
            prefill = time.perf_counter() - start
            while built.has_work():
                built.step()
            return prefill, time.perf_counter() - start
        return run

    runs = {"reference loop": reference, "engine, AR": engine(SpeculativeConfig.of("ar")),
            "engine, drafter at fixed:0": engine(SpeculativeConfig.of("dflash", length_policy="fixed:0"))}
    names = list(runs)
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for k in range(40):
        for name in names[k % 3:] + names[: k % 3]:
            times[name].append(runs[name]())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {cpu_model()}, {threads} threads, fp32; commit {commit}; {NEW_TOKENS} new tokens, 40 alternations")
    base = statistics.median(t for _, t in times["reference loop"])
    for name in names:
        prefill = statistics.median(p for p, _ in times[name])
        total = statistics.median(t for _, t in times[name])
        print(f"{name:28s} prefill {1e3 * prefill:6.2f} ms  total {1e3 * total:7.2f} ms  "
              f"decode step {1e3 * (total - prefill) / (NEW_TOKENS - 1):.3f} ms  reference / this {base / total:.3f}")


if __name__ == "__main__":
    main()
