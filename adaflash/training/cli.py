"""`adaflash train drafter` (DFlash block training), `adaflash train distill` (AdaFlash distillation), `adaflash train
length-head` (a candidate-length head on recorded outcomes) and `adaflash online` (online adaptation)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from adaflash.cli_args import command_group
from adaflash.models.device.placement import current_device
from adaflash.report import write_json


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from adaflash.training.trainer import TrainConfig, train

    cfg = TrainConfig.from_file(args.config, data_dir=args.data_dir, out_dir=args.out_dir, max_steps=args.max_steps,
                                loss=args.loss, time_limit_s=args.time_limit, save_every_s=args.save_every_s,
                                model=args.model)
    print(f"drafter written to {train(cfg)}")
    return 0


def distill_config(args: argparse.Namespace):
    """TrainConfig of a distillation run: a config file's fields (optional), then the command line's."""
    from adaflash.training.trainer import TrainConfig

    overrides = dict(
        data_dir=args.data, out_dir=args.out, init_from=args.from_drafter, model=args.model, loss=args.loss,
        alpha=args.alpha, tau=args.tau, gamma=args.gamma, temperature=args.temperature, lr=args.lr,
        max_steps=args.max_steps, epochs=args.epochs, sequences_per_step=args.sequences_per_step,
        anchors_per_sequence=args.anchors_per_sequence,
    )
    if args.config:
        return TrainConfig.from_file(args.config, **overrides)
    return TrainConfig(**{k: v for k, v in overrides.items() if v is not None})


def _cmd_train_distill(args: argparse.Namespace) -> int:
    from adaflash.training.trainer import train

    cfg = distill_config(args)
    print(f"distilling {cfg.init_from} with {cfg.loss} (alpha {cfg.alpha}, tau {cfg.tau}, gamma {cfg.gamma}, "
          f"temperature {cfg.temperature}) on {cfg.data_dir}")
    print(f"drafter written to {train(cfg)}")
    return 0


def _cmd_online(args: argparse.Namespace) -> int:
    from adaflash.models.targets.registry import resolve_drafter
    from adaflash.plots import plot_online
    from adaflash.training.online import OnlineAdaptation, OnlineConfig

    start = resolve_drafter(args.model, args.drafter, "adaflash" if args.drafter is None else "dflash")
    cfg = OnlineConfig(out_dir=args.out, drafter=start, model=args.model, dtype=args.dtype, rounds=args.rounds,
                       prompts_per_round=args.prompts_per_round, held_out_prompts=args.held_out_prompts,
                       max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, distill_steps=args.distill_steps,
                       loss=args.loss, lr=args.lr, seed=args.seed)
    rounds = OnlineAdaptation(cfg).run()
    print(f"wrote {cfg.out_dir}/online.json and {plot_online(rounds, Path(cfg.out_dir) / 'online.png')}")
    return 0


def _cmd_train_length_head(args) -> int:
    from adaflash.formats.outcomes import load_outcomes
    from adaflash.models.drafters.checkpoint import load_drafter_config
    from adaflash.models.drafters.length_head import save_length_head
    from adaflash.plots import plot_reliability
    from adaflash.training.length_head import LengthHeadTrainConfig, summary_line, train_length_head

    drafter_cfg = load_drafter_config(args.drafter)
    if args.outcomes:
        outcomes = load_outcomes(args.outcomes)
    else:  # full-block greedy outcomes of this drafter along served trajectories (what verification would record)
        import torch

        from adaflash.formats.trajectories import read_trajectories
        from adaflash.models.drafters.checkpoint import load_drafter
        from adaflash.models.targets.registry import resolve_target
        from adaflash.models.targets.model import load_target
        from adaflash.training.block_outcomes import score_blocks

        target = load_target(resolve_target(args.model), dtype=torch.float32)
        outcomes = score_blocks(target, load_drafter(args.drafter, torch.float32, target.device),
                                read_trajectories(args.trajectories), args.anchors_per_sequence, args.seed).outcomes
    cfg = LengthHeadTrainConfig(
        kind=args.kind, head_dim=args.head_dim, lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
        held_out_frac=args.held_out_frac, seed=args.seed, rate=args.rate,
    )
    head, report = train_length_head(outcomes, cfg, drafter_cfg.hidden_size, drafter_cfg.block_size,
                                     device=current_device())
    out = Path(args.out)
    if not (out.exists() and out.resolve() == Path(args.drafter).resolve()):
        shutil.copytree(args.drafter, out, dirs_exist_ok=True)
    save_length_head(head, out)
    report["drafter"], report["out"] = str(args.drafter), str(out)
    if args.report:
        write_json(report, args.report)
    if args.plot and "reliability" in report:
        plot_reliability(report["reliability"], args.plot, f"{cfg.kind} length head, held-out")
    print(summary_line(report))
    print(f"saved {out}")
    return 0


def _register_length_head_cli(group) -> None:
    from adaflash.models.drafters.length_head import KINDS

    p = group.add_parser(
        "length-head", help="fit a candidate-length head on recorded outcomes; saved inside a copy of the drafter")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--outcomes", nargs="+", help="outcomes .safetensors files recorded by `serve --record` with --drafter")
    src.add_argument("--trajectories", help="served trajectories (*.jsonl): score --drafter's full blocks along them")
    p.add_argument("--drafter", required=True, help="drafter checkpoint dir the outcomes were recorded with")
    p.add_argument("--model", default="smollm2-135m", help="target (with --trajectories)")
    p.add_argument("--anchors-per-sequence", type=int, default=None, help="with --trajectories: default every anchor")
    p.add_argument("--out", required=True, help="output dir: a copy of the drafter with the head inside")
    p.add_argument("--kind", choices=KINDS, default="position")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--rate", type=float, default=1.0, help="block head: candidate length scale (1.0-1.3)")
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--held-out-frac", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write the held-out report here (JSON)")
    p.add_argument("--plot", default=None, help="write a reliability diagram here (PNG)")
    p.set_defaults(func=_cmd_train_length_head)


def register_cli(subparsers) -> None:
    group = command_group(subparsers, "train", help="train drafters and length heads")
    p = group.add_parser("drafter", help="DFlash block training (resumes from OUT/checkpoint; torchrun for DDP)")
    p.add_argument("--config", required=True, help="TOML or JSON with TrainConfig fields")
    p.add_argument("--data-dir", nargs="+", default=None,
                   help="override the config's data_dir (several directories train as one set)")
    p.add_argument("--out-dir", default=None, help="override the config's out_dir")
    p.add_argument("--model", default=None, help="override the config's target (registry name, checkpoint dir or .gguf)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--loss", default=None, choices=["ce", "ce+kl", "rkl", "fkl", "tv"], help="override the config's loss")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="end training after this long (checkpoint and exported drafter, as a finished run)")
    p.add_argument("--save-every-s", type=float, default=None, metavar="SECONDS",
                   help="also checkpoint whenever this long passed since the last save")
    p.set_defaults(func=_cmd_train_drafter)

    d = group.add_parser(
        "distill", help="on-policy distillation of a drafter toward the target (resumes from OUT/checkpoint)",
        description="alpha * CE(drafter, target argmax) + (1 - alpha) * sum_k w_k * clip(D(q_k || p_k), tau), "
        "teacher logits from the target on the same trajectories (recomputed on the fly).",
    )
    d.add_argument("--from", dest="from_drafter", required=True, help="drafter checkpoint to start from")
    d.add_argument("--data", required=True, help="trajectories (*.jsonl from the server) or a `data generate` dir")
    d.add_argument("--out", required=True, help="run directory (checkpoint, metrics.jsonl, drafter/)")
    d.add_argument("--config", default=None, help="optional TOML/JSON with more TrainConfig fields")
    d.add_argument("--model", default=None, help="target (default smollm2-135m)")
    d.add_argument("--loss", default="rkl", choices=["rkl", "fkl", "tv", "ce"])
    d.add_argument("--alpha", type=float, default=None, help="CE weight (default 0.8)")
    d.add_argument("--tau", type=float, default=None, help="per-token divergence floor (default 0.01)")
    d.add_argument("--gamma", type=float, default=None, help="position decay (default 7)")
    d.add_argument("--temperature", type=float, default=None, help="default 1")
    d.add_argument("--lr", type=float, default=3e-4)
    d.add_argument("--max-steps", type=int, default=None)
    d.add_argument("--epochs", type=int, default=None)
    d.add_argument("--sequences-per-step", type=int, default=None)
    d.add_argument("--anchors-per-sequence", type=int, default=None)
    d.set_defaults(func=_cmd_train_distill)
    _register_length_head_cli(group)  # train length-head

    o = subparsers.add_parser(
        "online", help="rounds of serve -> collect -> distill + head -> publish -> hot-swap on a GSM-Symbolic stream",
        description="Resumes at the last finished round. Versions land in OUT/versions (LATEST names the current "
        "one), so `adaflash serve --watch-versions OUT/versions` elsewhere hot-swaps them too.",
    )
    o.add_argument("--out", required=True)
    o.add_argument("--model", default="smollm2-135m")
    o.add_argument("--drafter", default=None, help="starting drafter (default: the shipped adaflash drafter)")
    o.add_argument("--dtype", default="auto")
    o.add_argument("--rounds", type=int, default=5)
    o.add_argument("--prompts-per-round", type=int, default=16)
    o.add_argument("--held-out-prompts", type=int, default=12)
    o.add_argument("--max-new-tokens", type=int, default=128)
    o.add_argument("--max-batch", type=int, default=8)
    o.add_argument("--distill-steps", type=int, default=40)
    o.add_argument("--loss", default="rkl", choices=["rkl", "fkl", "tv", "ce"])
    o.add_argument("--lr", type=float, default=3e-4)
    o.add_argument("--seed", type=int, default=0)
    o.set_defaults(func=_cmd_online)
