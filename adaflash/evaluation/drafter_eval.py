"""Drafters compared along the same target trajectories (teacher forcing): accept length per benchmark and per
block position, with and without their length heads (by context length: `context_length.py`).

    adaflash eval drafters --drafter dflash=DIR --drafter dflash+rkl=DIR2 --limit 8 --out docs/results/adaflash/drafters

Greedy verification of a full block keeps exactly the drafts that equal the target's own continuation, so
scoring every anchor of the target's greedy responses (`score_blocks`) measures what serving with full
blocks would measure, at every position at once and without a decode loop per drafter. The target's
responses are generated once (batched, plain decoding) and cached. Reported per drafter: mean accept length
per benchmark and its std across the six (the domain variance AdaFlash attacks), per-position acceptance
and its std across positions, and, for a drafter with a per-position head, what the head's own cut (the
longest length whose survival stays >= 0.5) verifies and keeps.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Sequence

import torch

from adaflash.cli_args import command_group
from adaflash.data import EVAL_BENCHMARKS, load_prompts
from adaflash.engine.engine_factory import EngineConfig, build_engine
from adaflash.engine.request import Request
from adaflash.formats.outcomes import Outcomes
from adaflash.formats.trajectories import Trajectory, append_trajectories, read_trajectories
from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.models.drafters.length_head import PositionAcceptanceHead, load_length_head
from adaflash.report import markdown_table, write_json, write_report
from adaflash.training.block_outcomes import BlockScores, score_blocks


def greedy_trajectories(pipeline, ids: Sequence[Sequence[int]], sources: Sequence[str], max_new_tokens: int,
                        max_batch: int = 32) -> list[Trajectory]:
    """The target's greedy answers to prompts given as token ids (continuous batching, plain decoding)."""
    engine = build_engine(EngineConfig(max_batch=min(max_batch, len(ids)), max_len=max(map(len, ids)) + max_new_tokens + 1),
                          pipeline.engine_models())
    requests = [Request(f"r{i}", list(x), max_new_tokens, stop_token_ids=pipeline.stop_token_ids) for i, x in enumerate(ids)]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    return [Trajectory(tuple(r.prompt_ids), tuple(r.output_ids), source=s) for r, s in zip(requests, sources)]


def target_trajectories(pipeline, dataset: str, limit: int, max_new_tokens: int, cache_dir: Path) -> list[Trajectory]:
    """The target's greedy responses to a benchmark's first `limit` eval prompts (batched; cached on disk)."""
    path = cache_dir / f"{dataset}-{limit}-{max_new_tokens}.jsonl"
    if path.is_file():
        return read_trajectories(path)
    prompts = load_prompts(dataset, "eval", limit=limit)
    ids = [pipeline.encode(messages=p.messages) for p in prompts]
    append_trajectories(path, greedy_trajectories(pipeline, ids, [dataset] * len(ids), max_new_tokens))
    return read_trajectories(path)


def head_cut(head: PositionAcceptanceHead, scores: BlockScores, threshold: float = 0.5) -> dict:
    """Verify the longest prefix whose predicted survival >= threshold (at least one draft): accept length and
    tokens per verified token, against full blocks, on the same anchors."""
    o = scores.outcomes
    with torch.no_grad():
        # the head where it was loaded (a GPU), the outcomes on the host
        survival = head.survival(o.hidden.float().to(next(head.parameters()).device)).cpu()
    cut = ((survival >= threshold).sum(-1)).clamp(min=1)
    cut = torch.minimum(cut, o.drafted.clamp(min=1))
    kept = torch.minimum(o.accepted, cut)
    return {"accept_len": float((kept + 1).float().mean()), "verify_len": float((cut + 1).float().mean()),
            "tokens_per_verified_token": float(((kept + 1) / (cut + 1)).mean()),
            "predicted_accepted": float(survival.sum(-1).mean()), "observed_accepted": float(o.accepted.float().mean())}


def evaluate_drafter(target, drafter_dir: str, trajectories: dict[str, list[Trajectory]], anchors: int | None) -> dict:
    drafter = load_drafter(drafter_dir, dtype=torch.float32, device=target.device)
    head = load_length_head(drafter_dir, target.device)
    rows, all_scores = {}, []
    for name, trajs in trajectories.items():
        scores = score_blocks(target, drafter, trajs, anchors_per_sequence=anchors)
        all_scores.append(scores)
        rows[name] = {"accept_len": scores.accept_length, "per_position": scores.per_position_acceptance(),
                      "anchors": len(scores.outcomes),
                      "first_position_rkl": float(torch.cat(scores.divergence).mean())}
        if isinstance(head, PositionAcceptanceHead):
            rows[name]["head"] = head_cut(head, scores)
    means = [r["accept_len"] for r in rows.values()]
    pooled = BlockScores(Outcomes.concat([s.outcomes for s in all_scores]), (), ())
    positions = [p for p in pooled.per_position_acceptance() if p == p]  # drop nan
    return {"drafter": drafter_dir, "benchmarks": rows, "accept_len_mean": statistics.fmean(means),
            "accept_len_std_across_benchmarks": statistics.pstdev(means),
            "per_position": pooled.per_position_acceptance(),
            "acceptance_std_across_positions": statistics.pstdev(positions) if len(positions) > 1 else 0.0}


def markdown(report: dict) -> str:
    names = list(report["drafters"])
    benches = list(next(iter(report["drafters"].values()))["benchmarks"])
    lines = [f"# Drafters along the target's greedy responses\n\n`{report['command']}`\n",
             "Full-block greedy accept length (tokens per target pass, incl. the target's own token), teacher-forced at "
             "every anchor of the target's responses.\n"]
    rows = []
    for n in names:
        d = report["drafters"][n]
        rows.append([n, *(f"{d['benchmarks'][b]['accept_len']:.3f}" for b in benches), f"{d['accept_len_mean']:.3f}",
                     f"{d['accept_len_std_across_benchmarks']:.4f}", f"{d['acceptance_std_across_positions']:.4f}"])
    lines.append(markdown_table(["drafter", *benches, "mean", "std across benchmarks", "std across positions"], rows))
    heads = [n for n in names if "head" in next(iter(report["drafters"][n]["benchmarks"].values()))]
    if heads:
        lines += ["", "With the per-position head's cut (survival >= 0.5): accept length / verify length / "
                  "tokens per verified token (full block verifies 16).", ""]
        rows = []
        for n in heads:
            cells = [report["drafters"][n]["benchmarks"][b]["head"] for b in benches]
            rows.append([n, *(f"{c['accept_len']:.2f} / {c['verify_len']:.2f} / {c['tokens_per_verified_token']:.2f}"
                              for c in cells)])
        lines.append(markdown_table(["drafter", *benches], rows))
    return "\n".join(lines) + "\n"


def _cmd(args: argparse.Namespace) -> int:
    from adaflash.evaluation.offline import command_line, provenance
    from adaflash.pipeline import Pipeline

    drafters = dict(d.split("=", 1) for d in args.drafter)
    pipeline = Pipeline.load(args.model, None, "fp32")
    cache = Path(args.cache_dir)
    trajectories = {b: target_trajectories(pipeline, b, args.limit, args.max_new_tokens, cache) for b in args.benchmarks.split(",")}
    report = {**provenance(command_line(["adaflash", "eval", "drafters"], [("--limit", args.limit),
              ("--max-new-tokens", args.max_new_tokens), ("--benchmarks", args.benchmarks)])
              + " " + " ".join(f"--drafter {n}={p}" for n, p in drafters.items())),
              "drafters": {n: evaluate_drafter(pipeline.target, p, trajectories, args.anchors) for n, p in drafters.items()}}
    write_report(args.out, report, markdown(report))
    print(markdown(report))
    return 0


def token_divergence(pipeline, drafter_dir: str, trajectory: Trajectory, label: str):
    """Reverse KL(q || p) of the drafter's first draft position for every response token (teacher forcing)."""
    from adaflash.evaluation.token_picture import TokenScores

    scores = score_blocks(pipeline.target, load_drafter(drafter_dir, dtype=torch.float32), [trajectory])
    by_anchor = dict(zip(scores.anchors[0].tolist(), scores.divergence[0].tolist()))
    start = len(trajectory.prompt_ids)
    tokens = trajectory.tokens
    values = [by_anchor[i - 1] for i in range(start, len(tokens))]
    return TokenScores(tuple(pipeline.decode([t]) for t in tokens[start:]), tuple(values), label)


def _cmd_rkl_picture(args: argparse.Namespace) -> int:
    from adaflash.evaluation.token_picture import render_html, render_png
    from adaflash.pipeline import Pipeline

    pipeline = Pipeline.load(args.model, None, "fp32")
    trajectory = target_trajectories(pipeline, args.dataset, args.index + 1, args.max_new_tokens, Path(args.cache_dir))[args.index]
    rows = [token_divergence(pipeline, args.before, trajectory, f"before distillation ({args.before})"),
            token_divergence(pipeline, args.after, trajectory, f"after distillation ({args.after})")]
    out = Path(args.out)
    title = f"Drafter vs target, reverse KL per token of one {args.dataset} response (first draft position)"
    render_png(rows, out.with_suffix(".png"), title)
    render_html(rows, out.with_suffix(".html"), title)
    write_json({"dataset": args.dataset, "index": args.index, "rows": [
        {"label": r.label, "mean": r.mean, "tokens": list(r.tokens), "values": list(r.values)} for r in rows]},
        out.with_suffix(".json"))
    print("  ".join(f"{r.label}: mean reverse KL {r.mean:.3f}" for r in rows))
    return 0


def register_cli(subparsers) -> None:
    q = command_group(subparsers, "eval", help="evaluations").add_parser(
        "rkl-picture", help="one response's tokens coloured by the drafter's reverse KL to the target, before/after")
    q.add_argument("--before", required=True, help="drafter checkpoint before distillation")
    q.add_argument("--after", required=True, help="drafter checkpoint after distillation")
    q.add_argument("--model", default="smollm2-135m")
    q.add_argument("--dataset", default="gsm8k")
    q.add_argument("--index", type=int, default=0, help="which eval prompt")
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument("--cache-dir", default="runs/trajectories")
    q.add_argument("--out", required=True, help="path stem for .png, .html and .json")
    q.set_defaults(func=_cmd_rkl_picture)

    p = command_group(subparsers, "eval", help="evaluations").add_parser(
        "drafters", help="drafters side by side along the target's greedy responses (accept length, variance, heads)")
    p.add_argument("--drafter", action="append", required=True, help="NAME=DIR (repeat)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--benchmarks", default=",".join(EVAL_BENCHMARKS))
    p.add_argument("--limit", type=int, default=8, help="eval prompts per benchmark")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--anchors", type=int, default=None, help="random anchors per response (default: every one)")
    p.add_argument("--cache-dir", default="runs/trajectories", help="where the target's responses are cached")
    p.add_argument("--out", required=True, help="path stem for .json and .md")
    p.set_defaults(func=_cmd)
