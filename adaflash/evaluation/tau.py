"""τ evaluation: DFlash's accept length on the seven evaluation benchmarks (math, code, chat, multilingual), vs AR.

    adaflash eval tau --limit 10 --max-new-tokens 128          # uses the shipped drafter
    -> docs/results/drafter/tau.json, tau.md, tau_accept_length.png, tau_per_position.png

A thin layer over `run_offline_bench`: it loads each benchmark's eval split, runs AR and DFlash side by
side (greedy, checked lossless) and lays the per-benchmark and per-domain numbers out as a table and plots.
The domain spread (std of the per-benchmark mean accept lengths) says how domain-dependent the drafter is.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from adaflash.cli_args import add_model_args, add_policy_state_arg, command_group
from adaflash.data import EVAL_BENCHMARKS, DatasetUnavailableError, Prompt, load_prompts
from adaflash.evaluation.offline import (
    command_line,
    cpu_label,
    fmt,
    policy_state_label,
    provenance,
    run_offline_bench,
)
from adaflash.models.targets.registry import resolve_drafter
from adaflash.report import markdown_table, write_report
from adaflash.speculative.config import SpeculativeConfig, length_policy_of, shared_drafter

METHODS = ("ar", "dflash")
SPECULATIVE = "dflash"
TABLE_POSITIONS = 5  # per-position acceptance columns k = 1..5 in the markdown table
FILES = ("tau.json", "tau.md", "tau_accept_length.png", "tau_per_position.png")


def load_benchmarks(limit: int | None) -> list[Prompt]:
    """The first `limit` eval prompts of every benchmark, labelled with the benchmark's name."""
    prompts: list[Prompt] = []
    for name in EVAL_BENCHMARKS:
        got = load_prompts(name, "eval", limit=limit)
        if not got:
            raise ValueError(f"benchmark {name!r} has no eval prompts")
        # Group by the benchmark name even where a loader labels its prompts differently.
        prompts += [p if p.dataset == name else dataclasses.replace(p, dataset=name) for p in got]
    return prompts


def tau_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Per-benchmark rows, per-domain curves and the domain spread of the speculative method."""
    res = report["results"][SPECULATIVE]
    rows = []
    for name, m in res["by_dataset"].items():
        rows.append({
            "benchmark": name,
            "domain": report["datasets"][name],
            "num_prompts": m["num_prompts"],
            "accept_len_mean": m["accept_len_mean"],
            "accept_len_std": m["accept_len_std"],
            "speedup_aggregate": m["speedup_aggregate"],
            "speedup_median": m["speedup_median"],
            "per_position_acceptance": m["per_position_acceptance"],
            "lossless": m["lossless"],
        })
    means = [r["accept_len_mean"] for r in rows if r["accept_len_mean"] is not None]
    return {
        "method": SPECULATIVE,
        "benchmarks": rows,
        "overall": {k: res["overall"][k] for k in ("accept_len_mean", "accept_len_std", "speedup_aggregate", "speedup_median")},
        # Population std: the benchmarks are the whole set being described, not a sample.
        "domain_spread": statistics.pstdev(means) if means else None,
        "by_domain": {
            d: {"accept_len_mean": m["accept_len_mean"], "per_position_acceptance": m["per_position_acceptance"]}
            for d, m in res["by_domain"].items()
        },
    }


def _positions(rates: list[float | None]) -> list[str]:
    return [fmt(r) for r in (rates + [None] * TABLE_POSITIONS)[:TABLE_POSITIONS]]


def _accept(mean: float | None, std: float | None) -> str:
    return "-" if mean is None else f"{mean:.2f} ± {std:.2f}"


def format_markdown(report: dict[str, Any]) -> str:
    tau = report["tau"]
    o = report["results"][SPECULATIVE]["overall"]
    rows = [[r["benchmark"], r["domain"], r["num_prompts"], _accept(r["accept_len_mean"], r["accept_len_std"]),
             f"{fmt(r['speedup_aggregate'])}x", f"{fmt(r['speedup_median'])}x", *_positions(r["per_position_acceptance"])]
            for r in tau["benchmarks"]]
    rows.append(["**all**", "", o["num_prompts"], _accept(o["accept_len_mean"], o["accept_len_std"]),
                 f"{fmt(o['speedup_aggregate'])}x", f"{fmt(o['speedup_median'])}x", *_positions(o["per_position_acceptance"])])
    lines = [
        "# τ: DFlash accept length on the evaluation benchmarks",
        "",
        f"Target `{report['model']}` ({report['dtype']}), drafter block size {report['block_size']}, "
        f"draft length {report['draft_length'] or 'block size - 1'}, greedy, up to {report['max_new_tokens']} new tokens, "
        f"{report['num_prompts']} prompts in all. Accept length = tokens committed per target pass, incl. the bonus "
        "token (AR: 1); acc@k = P(draft k accepted | drafts 1..k-1 accepted).",
        "",
        f"Lossless (every DFlash output equals AR's tokens): **{'yes' if report['lossless'] else 'NO'}**",
        "",
        markdown_table(["benchmark", "domain", "prompts", "accept length (mean ± std)", "speedup (aggregate)",
                        "speedup (median)", *(f"acc@{k}" for k in range(1, TABLE_POSITIONS + 1))],
                       rows, align="ll" + "r" * (4 + TABLE_POSITIONS)),
    ]
    per_domain = ", ".join(f"{d} {fmt(m['accept_len_mean'])}" for d, m in tau["by_domain"].items())
    machine = report["machine"]
    lines += [
        "",
        f"Domain spread (std of the per-benchmark mean accept lengths): **{fmt(tau['domain_spread'], '.3f')}**; "
        f"mean accept length per domain: {per_domain}.",
        "",
        "![accept length per benchmark](tau_accept_length.png)",
        "",
        "![per-position acceptance per domain](tau_per_position.png)",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {cpu_label(machine)}, {machine['threads']} threads, torch {machine['torch']}; {report['timestamp']}.",
        "",
    ]
    return "\n".join(lines)


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    from adaflash.plots import plot_accept_length, plot_per_position

    tau = report["tau"]
    curves = {d: m["per_position_acceptance"] for d, m in tau["by_domain"].items()}
    return [
        plot_accept_length(tau["benchmarks"], out_dir / FILES[2], f"DFlash accept length ({report['model']})"),
        plot_per_position(curves, out_dir / FILES[3], f"Per-position acceptance by domain ({report['model']})"),
    ]


def run_tau_eval(
    pipeline,
    out_dir: str | Path = "docs/results/drafter",
    limit: int | None = 10,
    max_new_tokens: int = 128,
    draft_length: int | None = None,
    command: str | None = None,
    progress: bool = True,
    prompts: Sequence[Prompt] | None = None,
) -> dict[str, Any]:
    """Run AR and DFlash on the seven benchmarks and write tau.json, tau.md and the two plots into `out_dir`.

    `prompts` defaults to `load_benchmarks(limit)`; the CLI loads them before the model to fail fast.
    """
    if prompts is None:
        prompts = load_benchmarks(limit)
    report = run_offline_bench(pipeline, prompts, METHODS, max_new_tokens, draft_length, progress=progress)
    if command is None:  # called as a library: record the call itself
        command = f"run_tau_eval(limit={limit}, max_new_tokens={max_new_tokens}, draft_length={draft_length})"
    report = {**provenance(command), **report}
    report["tau"] = tau_summary(report)
    report["length_policy_state"] = policy_state_label(pipeline.carry_policy_state)
    out = Path(out_dir)
    write_report(out / FILES[0], report, format_markdown(report))  # tau.json and tau.md beside it
    write_plots(report, out)
    return report


def _cmd_tau(args: argparse.Namespace) -> int:
    from adaflash.pipeline import Pipeline

    # Before the (slow) load: a flag a method cannot honour is an error (the pipeline makes the same configs from
    # these flags: Pipeline.speculative).
    policy = length_policy_of(args.length_policy)
    configs = [SpeculativeConfig.among(m, policy, args.draft_length) for m in METHODS]
    drafter = None if args.draft_model else resolve_drafter(args.model, args.drafter, shared_drafter(configs))
    command = command_line(
        ["adaflash", "eval", "tau"],
        [("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens), ("--draft-length", args.draft_length),
         ("--model", args.model), ("--drafter", drafter), ("--dtype", args.dtype), ("--draft-vocab", args.draft_vocab),
         ("--length-policy", args.length_policy), ("--carry-policy-state", args.carry_policy_state),
         ("--out-dir", args.out_dir)],
    )
    try:
        prompts = load_benchmarks(args.limit)
    except DatasetUnavailableError as exc:  # a RuntimeError: say which package to install, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pipeline = Pipeline.load(args.model, drafter, args.dtype, policy, args.draft_vocab,
                             carry_policy_state=args.carry_policy_state, draft_model=args.draft_model,
                             draft_max=args.draft_max)
    report = run_tau_eval(pipeline, args.out_dir, args.limit, args.max_new_tokens, args.draft_length, command, prompts=prompts)
    print(format_markdown(report))
    print(f"wrote {', '.join(str(Path(args.out_dir) / f) for f in FILES)}", file=sys.stderr)
    return 0 if report["lossless"] else 1


def register_cli(subparsers) -> None:
    """Add `eval tau` to the top-level subparsers of the adaflash CLI."""
    group = command_group(subparsers, "eval", help="evaluations that write result files")
    p = group.add_parser("tau", help="DFlash accept length on the seven eval benchmarks (json, markdown, plots)")
    p.add_argument("--limit", type=int, default=10, help="prompts per benchmark (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-length", type=int, default=None, help="drafted tokens verified per step (default block_size-1)")
    add_model_args(p)
    add_policy_state_arg(p)
    p.add_argument("--out-dir", default="docs/results/drafter", help="where tau.json, tau.md and the plots go (default docs/results/drafter)")
    p.set_defaults(func=_cmd_tau)
