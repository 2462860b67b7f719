"""Offline benchmark: every method on every prompt, side by side, greedy, with a losslessness check.

    adaflash bench offline --dataset gsm8k --limit 20 --methods ar,dflash --drafter DIR --json out.json

For each prompt AR runs first (it is the reference), then every other method, so slow phases of this
noisy machine hit all methods alike. Every method must reproduce AR's tokens exactly; a mismatch is
recorded per prompt and flips the top-level `lossless` to False (exit code 1 on the CLI).

Reported per method, overall and per dataset and domain: tokens/s (median of per-prompt rates, and
aggregate = total tokens / total time), speedup vs AR (aggregate ratio, median of per-prompt ratios),
accept length (tokens committed per target pass incl. the bonus token) mean, std and histogram, and
per-position acceptance: for k = 1..K, P(draft k accepted | drafts 1..k-1 accepted and >= k drafted).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from tqdm import tqdm

from adaflash.data.prompt import DatasetUnavailableError, Prompt
from adaflash.cli_args import WITH_ADAFLASH_DEFAULT, add_model_args, add_policy_state_arg, command_group
from adaflash.models.targets.registry import resolve_drafter
from adaflash.report import write_json
from adaflash.speculative.config import METHODS, SpeculativeConfig, length_policy_of, shared_drafter
from adaflash.speculative.sampling import SamplingParams

REFERENCE = "ar"
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Run:
    """One method on one prompt."""

    num_tokens: int
    elapsed_s: float
    accept_lengths: tuple[int, ...]  # per target pass, incl. the bonus token
    draft_lengths: tuple[int, ...]  # drafted tokens verified per target pass
    identical: bool  # same tokens as AR

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """(accepted drafts, drafted) per target pass."""
        return [(a - 1, d) for a, d in zip(self.accept_lengths, self.draft_lengths)]


# ---- metrics (pure functions) ----------------------------------------------------------------------


def per_position_counts(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(accepted, eligible) for k = 1..K, K = the most drafts any pass verified.

    A pass is eligible at position k when it drafted >= k tokens and accepted drafts 1..k-1; counts
    (not rates) are returned so groups can be pooled exactly.
    """
    pairs = list(pairs)
    for accepted, drafted in pairs:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"bad (accepted, drafted) pair ({accepted}, {drafted})")
    max_draft = max((d for _, d in pairs), default=0)
    counts = []
    for k in range(1, max_draft + 1):
        eligible = [a for a, d in pairs if d >= k and a >= k - 1]
        counts.append((sum(a >= k for a in eligible), len(eligible)))
    return counts


def per_position_acceptance(pairs: Iterable[tuple[int, int]]) -> list[float | None]:
    """P(draft k accepted | drafts 1..k-1 accepted and >= k drafted) for k = 1..K; None where nothing was eligible."""
    return [acc / n if n else None for acc, n in per_position_counts(pairs)]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: Sequence[Run], ar_runs: Sequence[Run]) -> dict[str, Any]:
    """Metrics of one method over a group of prompts; `ar_runs` are AR's runs on the same prompts, in order."""
    tokens, elapsed = sum(r.num_tokens for r in runs), sum(r.elapsed_s for r in runs)
    ar_tokens, ar_elapsed = sum(r.num_tokens for r in ar_runs), sum(r.elapsed_s for r in ar_runs)
    agg = tokens / elapsed if elapsed > 0 else 0.0
    ar_agg = ar_tokens / ar_elapsed if ar_elapsed > 0 else 0.0
    lengths = [a for r in runs for a in r.accept_lengths]
    pairs = [p for r in runs for p in r.pairs]
    hist = Counter(lengths)
    counts = per_position_counts(pairs)
    return {
        "num_prompts": len(runs),
        "identical_prompts": sum(r.identical for r in runs),
        "lossless": all(r.identical for r in runs),
        "num_tokens": tokens,
        "elapsed_s": elapsed,
        "target_passes": len(lengths),
        "tokens_per_s_median": _median([r.tokens_per_s for r in runs]),
        "tokens_per_s_aggregate": agg,
        "speedup_aggregate": agg / ar_agg if ar_agg > 0 else None,
        "speedup_median": _median([r.tokens_per_s / a.tokens_per_s for r, a in zip(runs, ar_runs) if a.tokens_per_s > 0]),
        "accept_len_mean": statistics.fmean(lengths) if lengths else None,
        "accept_len_std": statistics.pstdev(lengths) if lengths else None,
        "accept_len_hist": {str(n): hist[n] for n in sorted(hist)},
        "accept_len_dist": {str(n): hist[n] / len(lengths) for n in sorted(hist)},
        "per_position_acceptance": [acc / n if n else None for acc, n in counts],
        "per_position_counts": [list(c) for c in counts],
    }


# ---- the benchmark ---------------------------------------------------------------------------------


def check_methods(methods: Sequence[str], batch_size: int = 1) -> tuple[str, ...]:
    """Validated methods, AR first (always run: it is the reference for losslessness and speedup)."""
    if batch_size != 1:
        raise ValueError(
            f"batch_size={batch_size}: bench offline decodes one prompt at a time; batched decoding is the serving "
            "engine's, measured by `bench serve` and `bench load` against `adaflash serve`; use batch_size=1"
        )
    for method in methods:
        SpeculativeConfig.of(method)  # an unknown name fails here, named
    return (REFERENCE, *dict.fromkeys(m for m in methods if m != REFERENCE))


def _run(pipeline, ids: list[int], method: str, max_new_tokens: int, draft_length: int | None) -> tuple[list[int], Run]:
    result = pipeline.generate_ids(ids, method, max_new_tokens, SamplingParams(), draft_length, seed=0)
    s = result.stats
    run = Run(len(result.token_ids), s.elapsed_s, tuple(s.accept_lengths), tuple(s.draft_lengths), identical=True)
    return list(result.token_ids), run


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _groups(prompts: Sequence[Prompt]) -> dict[str, dict[str, list[int]]]:
    """Prompt indices by dataset and by domain (insertion order)."""
    out: dict[str, dict[str, list[int]]] = {"by_dataset": {}, "by_domain": {}}
    for i, p in enumerate(prompts):
        out["by_dataset"].setdefault(p.dataset, []).append(i)
        out["by_domain"].setdefault(p.domain, []).append(i)
    return out


def run_offline_bench(
    pipeline,
    prompts: Sequence[Prompt],
    methods: Sequence[str],
    max_new_tokens: int,
    draft_length: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
    warmup: bool = True,
) -> dict[str, Any]:
    """Run `methods` (AR is always included, first) greedily on every prompt; see the module docstring."""
    methods = check_methods(methods, batch_size)
    if not prompts:
        raise ValueError("no prompts to evaluate")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(methods) > 1 and getattr(pipeline, "proposer", None) is None:
        raise ValueError(f"method(s) {', '.join(methods[1:])} need a drafter (--drafter PATH)")

    encoded = [pipeline.encode(messages=p.messages) for p in prompts]
    if warmup:  # one-off costs (allocator, first kernels) would otherwise all land on AR's first prompt
        for method in methods:
            _run(pipeline, encoded[0], method, min(WARMUP_TOKENS, max_new_tokens), draft_length)

    runs: dict[str, list[Run]] = {m: [] for m in methods}
    records, mismatches = [], []
    with tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", file=sys.stderr, disable=not progress) as bar:
        for prompt, ids in zip(prompts, encoded):
            record = {"id": prompt.id, "dataset": prompt.dataset, "domain": prompt.domain, "prompt_tokens": len(ids), "methods": {}}
            ar_tokens: list[int] = []
            for method in methods:
                bar.set_postfix_str(f"{prompt.dataset}/{method}")
                tokens, run = _run(pipeline, ids, method, max_new_tokens, draft_length)
                if method == REFERENCE:
                    ar_tokens = tokens
                elif tokens != ar_tokens:
                    run = Run(run.num_tokens, run.elapsed_s, run.accept_lengths, run.draft_lengths, identical=False)
                    mismatches.append({"id": prompt.id, "dataset": prompt.dataset, "method": method,
                                       "first_difference": _first_difference(tokens, ar_tokens),
                                       "num_tokens": len(tokens), "ar_num_tokens": len(ar_tokens)})
                runs[method].append(run)
                record["methods"][method] = {
                    "num_tokens": run.num_tokens, "elapsed_s": run.elapsed_s, "tokens_per_s": run.tokens_per_s,
                    "accept_len_mean": statistics.fmean(run.accept_lengths) if run.accept_lengths else None,
                    "identical": run.identical,
                }
                bar.update(1)
            records.append(record)

    groups = _groups(prompts)
    results = {}
    for m in methods:
        results[m] = {"overall": summarize(runs[m], runs[REFERENCE])}
        for kind, by_key in groups.items():
            results[m][kind] = {
                key: summarize([runs[m][i] for i in idx], [runs[REFERENCE][i] for i in idx]) for key, idx in by_key.items()
            }
    proposer = getattr(pipeline, "proposer", None)
    dtype = getattr(getattr(pipeline, "target", None), "dtype", None)
    return {
        "lossless": not mismatches,
        "methods": list(methods),
        "model": getattr(pipeline, "model_name", None),
        "dtype": None if dtype is None else str(dtype),
        "block_size": getattr(proposer, "block_size", None),
        "max_new_tokens": max_new_tokens,
        "draft_length": draft_length,
        "batch_size": batch_size,
        "num_prompts": len(prompts),
        "datasets": {ds: "/".join(sorted({prompts[i].domain for i in idx})) for ds, idx in groups["by_dataset"].items()},
        "mismatches": mismatches,
        "results": results,
        "prompts": records,
    }


# ---- reporting -------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import torch

    from adaflash.models.device.cpu import cpu_model

    return {
        "cpu": cpu_model(),
        "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


@contextlib.contextmanager
def environment(settings: dict[str, str]):
    """Environment variables set for the block, restored after (kernel switches read at load or at each call)."""
    old = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def cpu_label(machine: dict[str, Any]) -> str:
    """The CPU a result ran on, as its machine_info names it (older files have no "cpu")."""
    return machine.get("cpu") or machine["processor"]


def policy_state_label(carry: bool) -> str:
    """How a result file's learning length policy treated its prompts (what makes it order-dependent or not)."""
    return "carried across prompts (order-dependent)" if carry else "reset per prompt (order-independent)"


def provenance(command: str) -> dict[str, Any]:
    """What makes a result file reproducible and comparable: the command, the machine and when."""
    return {
        "command": command,
        "argv": list(sys.argv),
        "machine": machine_info(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(report: dict[str, Any], positions: int = 3) -> str:
    """One row per method x dataset, plus an `all` row per method when there are several datasets."""
    pos_cols = "".join(f"{f'acc@{k}':>7}" for k in range(1, positions + 1))
    lines = [f"{'method':<8}{'dataset':<16}{'domain':<8}{'n':>4}{'tokens':>8}{'tok/s med':>10}{'tok/s agg':>10}"
             f"{'spdup agg':>10}{'spdup med':>10}{'accept len':>14}{pos_cols}  lossless"]
    for method, res in report["results"].items():
        rows = [(ds, report["datasets"][ds], m) for ds, m in res["by_dataset"].items()]
        if len(rows) > 1:
            rows.append(("all", "", res["overall"]))
        for ds, domain, m in rows:
            accept = "-" if m["accept_len_mean"] is None else f"{m['accept_len_mean']:.2f}±{m['accept_len_std']:.2f}"
            pos = (m["per_position_acceptance"] + [None] * positions)[:positions]
            lines.append(
                f"{method:<8}{ds:<16}{domain:<8}{m['num_prompts']:>4}{m['num_tokens']:>8}"
                f"{fmt(m['tokens_per_s_median'], '.1f'):>10}{fmt(m['tokens_per_s_aggregate'], '.1f'):>10}"
                f"{fmt(m['speedup_aggregate']):>10}{fmt(m['speedup_median']):>10}{accept:>14}"
                + "".join(f"{fmt(p):>7}" for p in pos)
                + f"  {'yes' if m['lossless'] else 'NO'}"
            )
    verdict = "all methods reproduced AR exactly" if report["lossless"] else f"NOT LOSSLESS: {len(report['mismatches'])} mismatch(es)"
    return "\n".join(lines + [verdict])


# ---- CLI -------------------------------------------------------------------------------------------


def command_line(words: Sequence[str], options: Sequence[tuple[str, Any]]) -> str:
    """A shell command reproducing a run with every effective setting spelled out (None options are left out;
    True is a bare switch, False leaves it out)."""
    parts = list(words)
    for flag, value in options:
        if value is True:  # a switch
            parts.append(flag)
        elif value is not None and value is not False:
            parts += [flag, str(value)]
    return shlex.join(parts)


def _load_prompts(args: argparse.Namespace) -> list[Prompt]:
    from adaflash.data import load_prompts, read_prompts_file

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.prompts_file:
        prompts = read_prompts_file(args.prompts_file)
        return prompts if args.limit is None else prompts[: args.limit]
    return load_prompts(args.dataset, "eval", limit=args.limit)


def _cmd_offline(args: argparse.Namespace) -> int:
    from adaflash.pipeline import Pipeline

    methods = check_methods([m.strip() for m in args.methods.split(",") if m.strip()], args.batch_size)
    # Before the (slow) load: a flag a method cannot honour is an error (the pipeline makes the same configs from
    # these flags: Pipeline.speculative).
    policy = length_policy_of(args.length_policy)
    configs = [SpeculativeConfig.among(m, policy, args.draft_length) for m in methods]
    drafter = None if args.draft_model else resolve_drafter(args.model, args.drafter, shared_drafter(configs))
    try:
        prompts = _load_prompts(args)
    except DatasetUnavailableError as exc:  # a RuntimeError: say which package to install, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pipeline = Pipeline.load(args.model, drafter, args.dtype, policy, args.draft_vocab,
                             carry_policy_state=args.carry_policy_state, draft_model=args.draft_model,
                             draft_max=args.draft_max)
    report = run_offline_bench(pipeline, prompts, methods, args.max_new_tokens, args.draft_length, args.batch_size)
    report["length_policy_state"] = policy_state_label(pipeline.carry_policy_state)
    print(format_table(report))
    if args.json:
        command = command_line(
            ["adaflash", "bench", "offline"],
            [("--dataset", args.dataset), ("--prompts-file", args.prompts_file), ("--methods", ",".join(methods)),
             ("--batch-size", args.batch_size), ("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens),
             ("--draft-length", args.draft_length), ("--model", args.model), ("--drafter", drafter),
             ("--dtype", args.dtype), ("--draft-vocab", args.draft_vocab), ("--length-policy", args.length_policy),
             ("--carry-policy-state", args.carry_policy_state), ("--json", args.json)],
        )
        print(f"wrote {write_json({**provenance(command), **report}, args.json)}", file=sys.stderr)
    return 0 if report["lossless"] else 1


def register_cli(subparsers) -> None:
    """Add `bench offline` to the top-level subparsers of the adaflash CLI."""
    bench = command_group(subparsers, "bench", help="benchmarks")
    p = bench.add_parser("offline", help="every method on every prompt, side by side, with a losslessness check")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="a prompt set's eval split (see `adaflash data list`)")
    src.add_argument("--prompts-file", help='JSONL with {"prompt": ...} or {"messages": [...]}')
    p.add_argument("--methods", default="ar,dflash", help=f"comma-separated, from {','.join(METHODS)} (ar always runs)")
    p.add_argument("--batch-size", type=int, default=1, help="only 1 (batched decoding: `bench serve` against `adaflash serve`)")
    p.add_argument("--limit", type=int, default=None, help="first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-length", type=int, default=None, help="drafted tokens verified per step (default block_size-1)")
    add_model_args(p, length_policy_default=WITH_ADAFLASH_DEFAULT)
    add_policy_state_arg(p)
    p.add_argument("--json", default=None, metavar="OUT", help="write the full report (with command and machine) here")
    p.set_defaults(func=_cmd_offline)
