"""`adaflash eval sensitivity`: how gsm8k accept length responds to the distillation's alpha, tau and gamma,
to the block head's rate and to the per-position head's threshold.

    adaflash eval sensitivity --config configs/smollm2-adaflash.toml --steps 30 --out docs/results/adaflash/sensitivity

Each distillation setting is one short run of the same recipe from the same starting drafter (one value
changed at a time, the others at the release's defaults), scored by full-block greedy accept length along the
target's gsm8k responses. The rate is an inference-time knob of the block head (`len = round(ratio x B x
rate)`) and the threshold one of the per-position head (verify the longest prefix whose predicted survival
reaches it): scored on the same anchors, each trades accept length against verify length. Runs resume.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from adaflash.cli_args import command_group
from adaflash.report import markdown_table, write_report

GRID = {"alpha": (0.5, 0.8, 1.0), "tau": (0.0, 0.01, 0.1), "gamma": (3.0, 7.0, 15.0)}
RATES = (0.8, 1.0, 1.15, 1.3)
THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7)


def block_rate_table(head, scores, rates=RATES) -> list[dict]:
    """Accept and verify length when the block head's length (scaled by each rate) is verified."""
    o = scores.outcomes
    with torch.no_grad():
        # the head where it was loaded (a GPU), the outcomes on the host
        ratio = head(o.hidden.float().to(next(head.parameters()).device)).cpu()
    rows = []
    for rate in rates:
        cut = (torch.round(ratio * o.block_size * rate).clamp(1, o.block_size) - 1).long()
        cut = torch.minimum(cut, o.drafted)
        kept = torch.minimum(o.accepted, cut)
        rows.append({"rate": rate, "accept_len": float((kept + 1).float().mean()),
                     "verify_len": float((cut + 1).float().mean())})
    return rows


def threshold_table(head, scores, thresholds=THRESHOLDS) -> list[dict]:
    """Accept and verify length when the per-position head's cut (longest prefix with survival >= threshold) is
    verified, for each threshold."""
    from adaflash.evaluation.drafter_eval import head_cut

    return [{"threshold": t, **head_cut(head, scores, t)} for t in thresholds]


def markdown(report: dict, limit: int) -> str:
    """The page of a sensitivity report scored on `limit` gsm8k prompts."""
    lines = [f"# Sensitivity on gsm8k\n\n`{report['command']}`\n",
             f"Full-block greedy accept length along the target's gsm8k responses ({limit} prompts); each distillation "
             f"run is {report['steps']} steps from the same drafter (accept length "
             f"{report['start_drafter_gsm8k_accept_len']:.3f} before).\n",
             markdown_table(["parameter", "value", "gsm8k accept length"],
                            [[p, r["value"], f"{r['gsm8k_accept_len']:.3f}"]
                             for p, rows in report["distillation"].items() for r in rows])]
    if "rate" in report:
        lines += ["", "Block head rate (inference only):", "",
                  markdown_table(["rate", "accept length", "verify length"],
                                 [[r["rate"], f"{r['accept_len']:.3f}", f"{r['verify_len']:.2f}"] for r in report["rate"]])]
    if "threshold" in report:
        lines += ["", "Per-position head threshold (inference only; verify the longest prefix with predicted survival >= "
                  "threshold, at least one draft):", "",
                  markdown_table(["threshold", "accept length", "verify length", "tokens per verified token"],
                                 [[r["threshold"], f"{r['accept_len']:.3f}", f"{r['verify_len']:.2f}",
                                   f"{r['tokens_per_verified_token']:.3f}"] for r in report["threshold"]])]
    return "\n".join(lines) + "\n"


def _cmd(args: argparse.Namespace) -> int:
    from adaflash.evaluation.drafter_eval import target_trajectories
    from adaflash.evaluation.offline import provenance
    from adaflash.models.drafters.checkpoint import load_drafter, load_drafter_config
    from adaflash.models.drafters.length_head import BlockLengthHead, PositionAcceptanceHead, load_length_head
    from adaflash.pipeline import Pipeline
    from adaflash.plots import pyplot
    from adaflash.training.block_outcomes import score_blocks
    from adaflash.training.trainer import TeacherCache, TrainConfig, train

    base = TrainConfig.from_file(args.config)
    pipeline = Pipeline.load(base.model, None, "fp32")
    device = pipeline.target.device  # every drafter and head scored beside the target (a GPU's features stay there)
    trajectories = target_trajectories(pipeline, "gsm8k", args.limit, args.max_new_tokens, Path(args.cache_dir))
    runs = Path(args.runs_dir)
    teachers = None  # target passes shared by every run (same data, same target)
    report = {**provenance("adaflash " + " ".join(f"{a}" for a in ["eval", "sensitivity", "--config", args.config,
                                                                     "--steps", str(args.steps), "--limit", str(args.limit)])),
              "steps": args.steps, "distillation": {}}
    for param, values in GRID.items():
        if param not in args.params.split(","):
            continue
        rows = []
        for value in values:
            cfg = dataclasses.replace(base, **{param: value}, max_steps=args.steps)
            # Named by the whole setting: the defaults' run is shared by the three rows that contain it.
            cfg = dataclasses.replace(cfg, out_dir=str(runs / f"alpha{cfg.alpha}-tau{cfg.tau}-gamma{cfg.gamma}"))
            if teachers is None:
                teachers = TeacherCache(pipeline.target, load_drafter_config(base.init_from).target_layer_ids)
            drafter = train(cfg, progress=False, teachers=teachers)
            accept = score_blocks(pipeline.target, load_drafter(drafter, dtype=torch.float32, device=device),
                                  trajectories).accept_length
            rows.append({"value": value, "gsm8k_accept_len": accept})
            print(f"{param}={value}: gsm8k accept length {accept:.3f}", flush=True)
        report["distillation"][param] = rows
    start = score_blocks(pipeline.target, load_drafter(base.init_from, dtype=torch.float32, device=device),
                         trajectories).accept_length
    report["start_drafter_gsm8k_accept_len"] = start

    def head_and_scores(drafter_dir: str, kind: type, what: str):
        """A drafter dir's length head (of the kind asked for) and its drafter's full blocks on the gsm8k anchors."""
        head = load_length_head(drafter_dir, device)
        if not isinstance(head, kind):
            raise ValueError(f"{drafter_dir} carries no {what} length head")
        return head, score_blocks(pipeline.target, load_drafter(drafter_dir, dtype=torch.float32, device=device),
                                  trajectories)

    if args.block_head:
        report["rate"] = block_rate_table(*head_and_scores(args.block_head, BlockLengthHead, "block"))
    if args.position_head:
        report["threshold"] = threshold_table(*head_and_scores(args.position_head, PositionAcceptanceHead, "per-position"))
    out = Path(args.out)
    write_report(out, report, markdown(report, args.limit))
    plt = pyplot()
    fig, axes = plt.subplots(1, max(1, len(report["distillation"])), figsize=(4 * max(1, len(report["distillation"])), 3.2),
                             squeeze=False)
    for ax, (param, rows) in zip(axes[0], report["distillation"].items()):
        ax.plot([r["value"] for r in rows], [r["gsm8k_accept_len"] for r in rows], marker="o")
        ax.axhline(start, color="gray", linestyle=":", label="before distillation")
        ax.set_xlabel(param)
        ax.set_ylabel("gsm8k accept length")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    print(out.with_suffix(".md").read_text())
    return 0


def register_cli(subparsers) -> None:
    p = command_group(subparsers, "eval", help="evaluations").add_parser(
        "sensitivity", help="gsm8k accept length vs the distillation's alpha, tau, gamma and the block head's rate")
    p.add_argument("--config", required=True, help="the distillation recipe (TOML) whose values are varied")
    p.add_argument("--steps", type=int, default=30, help="distillation steps per setting")
    p.add_argument("--params", default=",".join(GRID), help="which of the distillation knobs to vary")
    p.add_argument("--limit", type=int, default=12, help="gsm8k eval prompts scored")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-head", default=None, help="a drafter dir carrying a block length head (for the rate)")
    p.add_argument("--position-head", default=None, help="a drafter dir carrying a per-position head (for the threshold)")
    p.add_argument("--runs-dir", default="runs/sensitivity")
    p.add_argument("--cache-dir", default="runs/trajectories")
    p.add_argument("--out", required=True, help="path stem for .json, .md and .png")
    p.set_defaults(func=_cmd)
