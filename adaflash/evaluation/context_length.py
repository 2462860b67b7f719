"""Accept length vs context length, per domain, with and without the length head (teacher-forced).

    adaflash eval context-length --drafter dflash=DIR --drafter adaflash=DIR2 \
        --benchmarks gsm8k,humaneval,sharegpt-chat,mgsm --levels 0,512,1024,2048 --limit 6 \
        --out docs/results/adaflash/context_length

A long context is built the way a user builds one: a conversation whose earlier turns are other eval prompts
of the same benchmark, each followed by the target's own greedy answer, before the prompt being answered.
Turns are added until the chat-templated prompt reaches the level's token count (math and code prompts are
short, so no prompt set reaches 2K tokens on its own). The target's greedy answer to every (prompt, level)
is generated once (batched plain decoding) and cached; each drafter is then scored at every anchor of those
answers (`score_blocks`, the same anchors for every drafter), full blocks and its per-position head's cut.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Sequence

import torch

from adaflash.cli_args import command_group
from adaflash.data import load_prompts
from adaflash.evaluation.drafter_eval import greedy_trajectories, head_cut, target_trajectories
from adaflash.formats.trajectories import Trajectory, append_trajectories, read_trajectories
from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.models.drafters.length_head import PositionAcceptanceHead, load_length_head
from adaflash.report import markdown_table, write_report
from adaflash.training.block_outcomes import score_blocks

DEFAULT_BENCHMARKS = "gsm8k,humaneval,sharegpt-chat,mgsm"  # one per domain: math, code, chat, multilingual


def with_history(encode, final: Sequence[dict], history: Sequence[Sequence[dict]], level: int) -> list[dict] | None:
    """`final`'s messages after as many earlier exchanges (from `history`, in order) as it takes for the encoded
    prompt to reach `level` tokens without passing 1.25x it; None if the pool cannot reach the level."""
    system = [m for m in final if m["role"] == "system"]
    turns = [m for m in final if m["role"] != "system"]
    earlier: list[dict] = []
    length = len(encode([*system, *turns]))
    for exchange in history:
        if length >= level:
            break
        trial = [*earlier, *exchange]
        n = len(encode([*system, *trial, *turns]))
        if n <= max(level * 1.25, level + 64):
            earlier, length = trial, n
    return [*system, *earlier, *turns] if length >= level else None


def long_context_trajectories(pipeline, benchmark: str, levels: Sequence[int], limit: int, pool: int,
                              max_new_tokens: int, cache_dir: Path) -> dict[int, list[Trajectory]]:
    """The target's greedy answers to `limit` eval prompts of a benchmark at each context level (cached)."""
    path = cache_dir / f"context-{benchmark}-{limit}-{pool}-{'_'.join(map(str, levels))}-{max_new_tokens}.jsonl"
    if not path.is_file():
        prompts = load_prompts(benchmark, "eval", limit=pool)
        answers = target_trajectories(pipeline, benchmark, pool, max_new_tokens, cache_dir)
        exchanges = [[*(m for m in p.messages if m["role"] != "system"),
                      {"role": "assistant", "content": pipeline.decode(t.output_ids)}] for p, t in zip(prompts, answers)]
        encode = lambda messages: pipeline.encode(messages=messages)  # noqa: E731
        ids, sources = [], []
        for i, p in enumerate(prompts[:limit]):
            others = exchanges[i + 1:] + exchanges[:i]  # every other prompt of the set, a fixed order per prompt
            for level in levels:
                messages = with_history(encode, p.messages, others, level)
                if messages is not None:
                    ids.append(encode(messages))
                    sources.append(f"{benchmark}@{level}")
        append_trajectories(path, greedy_trajectories(pipeline, ids, sources, max_new_tokens))
    by_level: dict[int, list[Trajectory]] = {}
    for t in read_trajectories(path):
        by_level.setdefault(int(t.source.rsplit("@", 1)[1]), []).append(t)
    return by_level


def score_levels(target, drafter_dir: str, trajectories: dict[str, dict[int, list[Trajectory]]],
                 anchors: int | None) -> dict[str, list[dict]]:
    """Per benchmark, one row per context level: prompt length, full-block accept length, the head's cut."""
    # both where the target runs (a GPU): score_blocks feeds the drafter the target's features there, and head_cut
    # moves the host-side outcomes to the head
    drafter = load_drafter(drafter_dir, dtype=torch.float32, device=target.device)
    head = load_length_head(drafter_dir, target.device)
    out: dict[str, list[dict]] = {}
    for name, by_level in trajectories.items():
        rows = []
        for level, trajs in sorted(by_level.items()):
            scores = score_blocks(target, drafter, trajs, anchors_per_sequence=anchors)
            row = {"level": level, "prompts": len(trajs), "anchors": len(scores.outcomes),
                   "context_tokens_mean": statistics.fmean(len(t.prompt_ids) for t in trajs),
                   "accept_len": scores.accept_length, "per_position": scores.per_position_acceptance()[:4]}
            if isinstance(head, PositionAcceptanceHead):
                row["head"] = head_cut(head, scores)
            rows.append(row)
        out[name] = rows
    return out


def markdown(report: dict) -> str:
    lines = [f"# Accept length vs context length\n\n`{report['command']}`\n",
             f"Machine: {report['machine'].get('cpu', '?')}; fp32. Teacher-forced full-block greedy accept length "
             "(tokens per target pass) along the target's greedy answers; a level's context is earlier same-benchmark "
             "exchanges (prompt + the target's answer) before the prompt. Cells: full block / the per-position head's "
             "cut (accept length, verify length) where the drafter has one.\n"]
    for name, by_bench in report["drafters"].items():
        levels = sorted({r["level"] for rows in by_bench.values() for r in rows})
        table = []
        for bench, rows in by_bench.items():
            cells = {r["level"]: r for r in rows}
            table.append([f"{bench} ({report['domains'][bench]})",
                          *(_cell(cells[lv]) if lv in cells else "-" for lv in levels)])
        lines += [f"## {name}\n", markdown_table(["benchmark (domain)", *(f"level {lv}" for lv in levels)], table), ""]
    return "\n".join(lines)


def _cell(r: dict) -> str:
    """A level's full-block accept length, and the head's cut where the drafter has one."""
    text = f"{r['accept_len']:.3f} (ctx {r['context_tokens_mean']:.0f}, n={r['prompts']})"
    if "head" in r:
        text += f" / head {r['head']['accept_len']:.3f} @ {r['head']['verify_len']:.2f}"
    return text


def plot(report: dict, path: Path) -> None:
    from adaflash.plots import pyplot

    plt = pyplot()
    benches = list(next(iter(report["drafters"].values())))
    fig, axes = plt.subplots(1, len(benches), figsize=(4 * len(benches), 3.4), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        for i, (name, by_bench) in enumerate(report["drafters"].items()):
            rows = by_bench[bench]
            x = [r["context_tokens_mean"] for r in rows]
            color = f"C{i}"
            ax.plot(x, [r["accept_len"] for r in rows], "o-", color=color, label=f"{name} full block")
            if rows and "head" in rows[0]:
                ax.plot(x, [r["head"]["accept_len"] for r in rows], "s--", color=color, label=f"{name} head cut")
        ax.set_title(f"{bench} ({report['domains'][bench]})")
        ax.set_xlabel("prompt tokens (mean)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accept length (tokens / pass)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cmd(args: argparse.Namespace) -> int:
    from adaflash.evaluation.offline import command_line, provenance
    from adaflash.pipeline import Pipeline

    drafters = dict(d.split("=", 1) for d in args.drafter)
    levels = [int(x) for x in args.levels.split(",")]
    benchmarks = args.benchmarks.split(",")
    pipeline = Pipeline.load(args.model, None, "fp32")
    cache = Path(args.cache_dir)
    trajectories = {b: long_context_trajectories(pipeline, b, levels, args.limit, args.pool, args.max_new_tokens, cache)
                    for b in benchmarks}
    command = command_line(["adaflash", "eval", "context-length"], [
        ("--benchmarks", args.benchmarks), ("--levels", args.levels), ("--limit", args.limit), ("--pool", args.pool),
        ("--max-new-tokens", args.max_new_tokens), ("--anchors", args.anchors)])
    report = {**provenance(command + " " + " ".join(f"--drafter {n}={p}" for n, p in drafters.items())),
              "levels": levels, "domains": {b: load_prompts(b, "eval", limit=1)[0].domain for b in benchmarks},
              "drafters": {n: score_levels(pipeline.target, p, trajectories, args.anchors) for n, p in drafters.items()}}
    write_report(args.out, report, markdown(report))
    plot(report, Path(args.out).with_suffix(".png"))
    print(markdown(report))
    return 0


def register_cli(subparsers) -> None:
    p = command_group(subparsers, "eval", help="evaluations").add_parser(
        "context-length", help="accept length vs context length per domain, full blocks and the length head's cut")
    p.add_argument("--drafter", action="append", required=True, help="NAME=DIR (repeat)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--benchmarks", default=DEFAULT_BENCHMARKS)
    p.add_argument("--levels", default="0,512,1024,2048", help="context lengths (prompt tokens) to build")
    p.add_argument("--limit", type=int, default=6, help="eval prompts answered per benchmark and level")
    p.add_argument("--pool", type=int, default=16, help="eval prompts whose exchanges make up the earlier turns")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--anchors", type=int, default=None, help="random anchors per answer (default: every one)")
    p.add_argument("--cache-dir", default="runs/trajectories", help="where the target's answers are cached")
    p.add_argument("--out", required=True, help="path stem for .json, .md and .png")
    p.set_defaults(func=_cmd)
