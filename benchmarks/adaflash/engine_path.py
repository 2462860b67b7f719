"""The engine's path at batch 1 against the reference AR loop: what a request kept from drafting pays for going through
the engine (scheduler, draft-source chain, the drafter's target features captured at every position) rather than the
plain loop.

    .venv/bin/python benchmarks/adaflash/engine_path.py > docs/results/adaflash/engine_path.txt
    .venv/bin/python benchmarks/adaflash/engine_path.py --dtype int8 --threads 1 --prompts humaneval \\
        --new-tokens 1,96 --rounds 3 > docs/results/adaflash/engine_path_int8.txt

Three runs alternate prompt by prompt, their order rotated: the reference loop (`generate --method ar`), the engine
without a drafter (`serve --method ar`) and the engine with the shipped drafter under `fixed:0` (never drafting). Per
count of new tokens (1: the prefill alone): median generation times, and the median over prompts and rounds of the
reference loop's time over each run's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from adaflash.cli_args import configure_process
from adaflash.data import load_prompts
from adaflash.engine.engine_factory import EngineConfig, build_engine
from adaflash.engine.request import Request
from adaflash.evaluation.demo import DEMO_PROMPTS
from adaflash.models.kernels.selection import cpu_model
from adaflash.models.registry import shipped_drafter
from adaflash.pipeline import Pipeline
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.reference import autoregressive_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["fp32", "int8"], default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", choices=["demo-code", "humaneval"], default="demo-code",
                        help="`make demo`'s code prompt, or six humaneval eval prompts")
    parser.add_argument("--new-tokens", default="48", help="comma-separated counts of new tokens")
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    threads = configure_process(args.threads, "cpu")
    pipeline = Pipeline.load("smollm2-135m", str(shipped_drafter("smollm2-135m")), args.dtype)
    if args.prompts == "demo-code":
        prompts = [pipeline.encode(messages=[{"role": "user", "content": dict(DEMO_PROMPTS)["code"]}])]
    else:
        prompts = [pipeline.encode(messages=q.messages) for q in load_prompts("humaneval", "eval", limit=6)]

    def reference(ids: list[int], new_tokens: int) -> float:
        return autoregressive_generate(pipeline.target, ids, new_tokens,
                                       stop_token_ids=pipeline.stop_token_ids).stats.elapsed_s

    def engine(speculative: SpeculativeConfig):
        def run(ids: list[int], new_tokens: int) -> float:
            config = EngineConfig(speculative, max_batch=1, max_len=len(ids) + new_tokens + 16)
            built = build_engine(config, pipeline.engine_models())
            request = Request("g", list(ids), new_tokens, stop_token_ids=pipeline.stop_token_ids)
            start = time.perf_counter()
            built.add_request(request)
            while built.has_work():
                built.step()
            return time.perf_counter() - start
        return run

    runs = {"reference loop": reference, "engine, AR": engine(SpeculativeConfig.of("ar")),
            "engine, drafter at fixed:0": engine(SpeculativeConfig.of("dflash", length_policy="fixed:0"))}
    names = list(runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {cpu_model()}, {threads} thread(s), {args.dtype}; commit {commit}; {args.prompts} prompts of "
          f"{[len(p) for p in prompts]} tokens, {args.rounds} rounds")
    for new_tokens in (int(n) for n in args.new_tokens.split(",")):
        times: dict[str, list[float]] = {n: [] for n in names}
        for k in range(args.rounds):
            for j, ids in enumerate(prompts):
                turn = (k + j) % len(names)
                for name in names[turn:] + names[:turn]:
                    times[name].append(runs[name](ids, new_tokens))
        print(f"{new_tokens} new tokens:")
        for name in names:
            ratio = statistics.median(r / t for r, t in zip(times["reference loop"], times[name]))
            print(f"  {name:28s} median {1e3 * statistics.median(times[name]):7.2f} ms  reference / this {ratio:.3f}")


if __name__ == "__main__":
    main()
