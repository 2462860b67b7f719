"""Does any adaptive length policy lose to plain decoding? `generate`'s path at batch 1, every policy against our AR
in one process, alternating prompt by prompt (order rotated each round), per domain, held-out prompts.

    .venv/bin/python benchmarks/adaflash/adaptive_vs_ar.py --dtype fp32 --rounds 3 --out docs/results/adaflash/adaptive_vs_ar_fp32.json
    .venv/bin/python benchmarks/adaflash/adaptive_vs_ar.py --model qwen2.5-coder-1.5b --dtype int8 --rounds 2 \
        --out docs/results/adaflash/qwen15_vs_ar.json      # its shipped drafter and its 0.5B draft model

Variants: `ar` (the reference loop: what `generate --method ar` runs), `fixed:0` (the engine with a policy that never
drafts: the overhead a request kept at length 0 pays), the adaptive policies with the shipped drafters (`throughput`,
`throughput-profiled` and `heuristic` with the DFlash drafter, `adaflash` with the drafter carrying its length head), and
`throughput` with prompt lookup (`--prompt-lookup 8`); and `lookup whole`, the fixed way to verify lookups (every match
verified whole, `--prompt-lookup-length all`, the drafter kept at fixed:0): the gain the adaptive lookups should keep.
The policies' drafting check carries over prompts, as it does in a `generate --prompts-file` run or a server. Ratios
are per prompt against the AR run beside it, medians per domain.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from adaflash.cli_args import configure_process
from adaflash.data import load_prompts
from adaflash.models.device.cpu import cpu_model
from adaflash.models.targets.registry import paired_draft_model, shipped_drafter
from adaflash.pipeline import Pipeline
from adaflash.report import markdown_table, write_report
from adaflash.speculative.prompt_lookup import PromptLookup

DOMAINS = {"math": "gsm8k", "code": "humaneval", "chat": "mt-bench", "multilingual": "mgsm"}


def variants(model: str, dtype: str) -> dict[str, tuple[Pipeline, str]]:
    dflash = Pipeline.load(model, shipped_drafter(model, "dflash"), dtype, carry_policy_state=True)
    if shipped_drafter(model, "adaflash") is None:  # a drafter without a length head, and the target's draft model
        return real_model_variants(dflash, model, dtype)
    adaflash = dflash.with_drafter(shipped_drafter("smollm2-135m", "adaflash"))  # one copy of the target for all
    return {
        "ar": (dflash, "ar"),
        "fixed:0": (dflash.with_length_policy("fixed:0"), "dflash"),
        "throughput": (dflash.with_length_policy("throughput"), "dflash"),
        "throughput-profiled": (dflash.with_length_policy("throughput-profiled"), "dflash"),
        "heuristic": (dflash.with_length_policy("heuristic"), "dflash"),
        "adaflash": (adaflash.with_length_policy("adaflash"), "adaflash"),
        "throughput+lookup": (dflash.with_length_policy("throughput").with_prompt_lookup(PromptLookup(8)), "dflash"),
        # Fixed lookups: every match verified whole, the drafter never drafting, no drafting check.
        "lookup whole": (dflash.with_length_policy("fixed:0").with_prompt_lookup(PromptLookup(8, length="all")), "dflash"),
    }


def real_model_variants(dflash: Pipeline, model: str, dtype: str) -> dict[str, tuple[Pipeline, str]]:
    """The issue's variants on a real target: the drafter's whole block, the adaptive policy alone and behind prompt
    lookup, and the target's smaller sibling drafting under the same adaptive policy and at a fixed 3."""
    full = dflash.proposer.block_size - 1
    draft_model = dflash.with_draft_model(paired_draft_model(model), dtype, max_draft=4)
    return {
        "ar": (dflash, "ar"),
        f"fixed:{full}": (dflash.with_length_policy(f"fixed:{full}"), "dflash"),
        "throughput": (dflash.with_length_policy("throughput"), "dflash"),
        "throughput+lookup": (dflash.with_length_policy("throughput").with_prompt_lookup(PromptLookup(8)), "dflash"),
        "draft-model throughput": (draft_model.with_length_policy("throughput"), "dflash"),
        "draft-model fixed:3": (draft_model.with_length_policy("fixed:3"), "dflash"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="a registry target with a shipped drafter")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "int8"])
    p.add_argument("--per-domain", type=int, default=3, help="held-out prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--variants", default=None, help="comma-separated variant names to run (default: all; ar always)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    threads = configure_process(args.threads, "cpu")
    runs = variants(args.model, args.dtype)
    if args.variants:
        wanted = {"ar", *args.variants.split(",")}
        runs = {name: run for name, run in runs.items() if name in wanted}
    base = runs["ar"][0]
    prompts = [(domain, base.encode(messages=q.messages)) for domain, name in DOMAINS.items()
               for q in load_prompts(name, "eval", limit=args.per_domain)]
    names = list(runs)
    for name in names:  # warm-up, untimed: first-use costs (kernel choices, cost profiles, allocator) stay out
        pipeline, method = runs[name]
        pipeline.generate_ids(prompts[0][1], method, max_new_tokens=16)
    rates: dict[str, dict[int, list[float]]] = {n: {i: [] for i in range(len(prompts))} for n in names}
    tokens = {n: dict.fromkeys(DOMAINS, 0) for n in names}  # committed tokens and target passes, per domain
    passes = {n: dict.fromkeys(DOMAINS, 0) for n in names}
    differing = dict.fromkeys(names, 0)  # runs whose tokens are not the AR run's beside them (lossless: 0)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for i, (domain, ids) in enumerate(prompts):
            outputs = {}
            for name in order:
                pipeline, method = runs[name]
                result = pipeline.generate_ids(ids, method, max_new_tokens=args.max_new_tokens)
                rates[name][i].append(len(result.token_ids) / result.stats.elapsed_s)
                tokens[name][domain] += len(result.token_ids)
                passes[name][domain] += result.stats.target_passes
                outputs[name] = result.token_ids
            for name in names:
                differing[name] += outputs[name] != outputs["ar"]
    table: dict[str, dict[str, float]] = {}
    for name in names:
        table[name] = {}
        for domain in DOMAINS:
            idx = [i for i, (d, _) in enumerate(prompts) if d == domain]
            ratios = [rates[name][i][k] / rates["ar"][i][k] for i in idx for k in range(args.rounds)]
            table[name][domain] = statistics.median(ratios)
        table[name]["all"] = statistics.median(
            [rates[name][i][k] / rates["ar"][i][k] for i in range(len(prompts)) for k in range(args.rounds)])
    per_pass = {n: {d: tokens[n][d] / max(1, passes[n][d]) for d in DOMAINS} for n in names}
    report = {"command": " ".join(["python", "benchmarks/adaflash/adaptive_vs_ar.py", *(argv if argv is not None else sys.argv[1:])]),
              "model": args.model, "machine": {"cpu": cpu_model(), "threads": threads, "dtype": args.dtype},
              "ar_tokens_per_s": statistics.median(v for vs in rates["ar"].values() for v in vs),
              "ratio_to_ar": table, "tokens_per_target_pass": per_pass, "runs_differing_from_ar": differing}
    rows = [[name, *(f"{table[name][d]:.3f}" for d in DOMAINS), f"{table[name]['all']:.3f}",
             " / ".join(f"{per_pass[name][d]:.2f}" for d in DOMAINS), str(differing[name])] for name in names]
    text = (f"{args.model}: ratio to our AR (tokens a second, medians of per-prompt ratios), {report['machine']['cpu']}, {threads} "
            f"threads, {args.dtype}; AR {report['ar_tokens_per_s']:.1f} tok/s. Command: `{report['command']}`\n\n"
            + markdown_table(["variant", *DOMAINS, "all", f"tokens a target pass ({' / '.join(DOMAINS)})",
                              "runs differing from AR"], rows) + "\n")
    write_report(args.out, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
