"""The engines `adaflash serve` builds, fed waves of concurrent requests in one process, the variants alternating wave
by wave: what a served sweep's cells compare, without the minutes between its servers' runs (over which this VM's speed
drifts by several percent) and without HTTP.

    .venv/bin/python benchmarks/adaflash/served_engines.py --concurrency 1,8,32,64 --rounds 3 \
        --out docs/results/adaflash/served_engines_fp32

Each variant is `serve`'s engine for its flags (`EngineConfig` with max batch 64 and a 512-position context, the
policy from the same factory, its drafting checks kept across requests as a server keeps them), fed the sweep's
six-mix prompts (chat-templated, at most 384 tokens) for 64 new tokens each. At concurrency c the prompts run in waves
of c requests admitted together; every wave runs under every variant back to back, the order rotated. Ratios are per
wave against the AR engine's run beside it (the same tokens: greedy decoding is lossless), medians over waves and
rounds; `verify` is drafted tokens verified per request per target pass, as the sweep reports it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from adaflash.cli_args import configure_process
from adaflash.engine.engine_factory import EngineConfig, build_engine
from adaflash.engine.request import Request
from adaflash.evaluation.serve_sweep import SIX_MIX, prompt_pool
from adaflash.models.device.cpu import cpu_model
from adaflash.models.targets.registry import shipped_drafter
from adaflash.pipeline import Pipeline
from adaflash.report import markdown_table, write_report
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.prompt_lookup import PromptLookup

MODEL = "smollm2-135m"
VARIANTS = {  # name -> (method, length policy, prompt lookup): the sweep's servers
    "ar": ("ar", None, None),
    "throughput": ("dflash", "throughput", None),
    "throughput-profiled": ("dflash", "throughput-profiled", None),
    "heuristic": ("dflash", "heuristic", None),
    "adaflash": ("adaflash", None, None),
    "throughput+lookup": ("dflash", "throughput", PromptLookup(8)),
}


def build(name: str, dtype: str, loaded: dict) -> tuple[Pipeline, object]:
    """(pipeline, engine) as `serve` builds them for the variant's flags; `loaded` keeps one pipeline per drafter, all
    over one copy of the target (engines share the models, each has its own caches, policy and checks)."""
    method, policy_name, lookup = VARIANTS[name]
    speculative = SpeculativeConfig.of(method, length_policy=policy_name, prompt_lookup=lookup)
    drafter = shipped_drafter(MODEL, speculative.drafter) if speculative.uses_drafter else None
    if drafter not in loaded:  # the first pipeline loads the target; the others put their drafter over it
        base = next(iter(loaded.values()), None)
        if base is None:
            loaded[drafter] = Pipeline.load(MODEL, drafter, dtype)
        else:
            loaded[drafter] = base if drafter is None else base.with_drafter(drafter)
    pipeline = loaded[drafter]
    # The policy, with its drafting checks, from the config's factory, as `serve` builds them.
    return pipeline, build_engine(EngineConfig(speculative=speculative, max_batch=64, max_len=512),
                                  pipeline.engine_models())


def run_wave(variant, prompts: list[list[int]], max_new_tokens: int, tag: str) -> tuple[float, list[Request]]:
    """Seconds from admitting the wave's requests together to the last one's last token, and the finished requests."""
    pipeline, engine = variant
    requests = [Request(f"{tag}-{i}", list(ids), max_new_tokens, stop_token_ids=pipeline.stop_token_ids)
                for i, ids in enumerate(prompts)]
    start = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start, requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "int8"])
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated wave sizes")
    p.add_argument("--prompts", type=int, default=16, help="six-mix prompts a concurrency runs at least (the "
                                                          "sweep's --min-prompts); waves of c cover max(this, c)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    threads = configure_process(args.threads, "cpu")
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if min(concurrencies) < 1 or max(concurrencies) > 64:
        raise SystemExit("--concurrency: every wave size within 1..64 (the engines' max batch)")
    loaded: dict = {}
    variants = {name: build(name, args.dtype, loaded) for name in VARIANTS}
    names = list(variants)
    encode = variants["ar"][0].encode
    pool = [ids for ids in (encode(messages=m) for m in prompt_pool(SIX_MIX)) if len(ids) <= 384]
    cells = {}
    for c in concurrencies:
        prompts = pool[: max(args.prompts, c)]
        waves = [prompts[i : i + c] for i in range(0, len(prompts), c)]
        for name in names:  # warm-up, untimed, as the sweep's --warmup 1
            for w, wave in enumerate(waves):
                run_wave(variants[name], wave, args.max_new_tokens, f"warm-{c}-{name}-{w}")
        ratios: dict[str, list[float]] = {n: [] for n in names}
        rates: dict[str, list[float]] = {n: [] for n in names}
        drafted: dict[str, list[int]] = {n: [] for n in names}
        for r in range(args.rounds):
            for w, wave in enumerate(waves):
                shift = (r * len(waves) + w) % len(names)
                seconds = {}
                for name in names[shift:] + names[:shift]:
                    seconds[name], done = run_wave(variants[name], wave, args.max_new_tokens, f"{c}-{name}-{r}-{w}")
                    rates[name].append(sum(len(q.output_ids) for q in done) / seconds[name])
                    drafted[name] += [k for q in done for k in q.draft_lengths]
                for name in names:
                    ratios[name].append(seconds["ar"] / seconds[name])
        cells[c] = {"waves": len(waves), "prompts": len(prompts),
                    "ratio_to_ar": {n: statistics.median(v) for n, v in ratios.items()}, "ratios": ratios,
                    "tokens_per_s": {n: statistics.median(v) for n, v in rates.items()},
                    "verify": {n: statistics.mean(v) for n, v in drafted.items()}}
        print(f"c={c}: " + ", ".join(f"{n} {cells[c]['ratio_to_ar'][n]:.3f}" for n in names), flush=True)
    command = ["python", "benchmarks/adaflash/served_engines.py", *(argv if argv is not None else sys.argv[1:])]
    report = {"command": " ".join(command),
              "machine": {"cpu": cpu_model(), "threads": threads, "dtype": args.dtype},
              "max_new_tokens": args.max_new_tokens, "rounds": args.rounds, "cells": cells}
    rows = []
    for c, cell in cells.items():
        for n in names:
            spread = ""
            if len(cell["ratios"][n]) > 1:
                low, _, high = statistics.quantiles(cell["ratios"][n], n=4)
                spread = f"{low:.3f}-{high:.3f}"
            rows.append([c, n, f"{cell['tokens_per_s'][n]:.1f}", f"{cell['ratio_to_ar'][n]:.3f}", spread,
                         f"{cell['verify'][n]:.2f}"])
    text = (f"`serve`'s engines fed waves of c concurrent requests in one process, the variants alternating wave by "
            f"wave: {report['machine']['cpu']}, {threads} threads, {args.dtype}; six-mix prompts, "
            f"{args.max_new_tokens} new tokens, {args.rounds} rounds. Command: `{report['command']}`\n\n"
            + markdown_table(["concurrency", "variant", "tok/s (median wave)", "ratio to AR (median)",
                              "ratio quartiles", "verify"], rows) + "\n")
    write_report(args.out, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
