"""`adaflash train drafter` (DFlash block training) and `adaflash train distill` (AdaFlash distillation)."""

from __future__ import annotations

import argparse
from pathlib import Path

from adaflash.cli_args import command_group


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from adaflash.training.trainer import TrainConfig, train

    cfg = TrainConfig.from_file(args.config, data_dir=args.data_dir, out_dir=args.out_dir, max_steps=args.max_steps,
                                loss=args.loss)
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
    from adaflash.models.registry import resolve_drafter
    from adaflash.training.online import OnlineAdaptation, OnlineConfig, plot_online

    start = resolve_drafter(args.model, args.drafter, "adaflash" if args.drafter is None else "dflash")
    cfg = OnlineConfig(out_dir=args.out, drafter=start, model=args.model, dtype=args.dtype, rounds=args.rounds,
                       prompts_per_round=args.prompts_per_round, held_out_prompts=args.held_out_prompts,
                       max_new_tokens=args.max_new_tokens, max_batch=args.max_batch, distill_steps=args.distill_steps,
                       loss=args.loss, lr=args.lr, seed=args.seed)
    rounds = OnlineAdaptation(cfg).run()
    print(f"wrote {cfg.out_dir}/online.json and {plot_online(rounds, Path(cfg.out_dir) / 'online.png')}")
    return 0


def register_cli(subparsers) -> None:
    from adaflash.training.length_head import register_cli as register_length_head_cli

    group = command_group(subparsers, "train", help="train drafters and length heads")
    p = group.add_parser("drafter", help="DFlash block training (resumes from OUT/checkpoint; torchrun for DDP)")
    p.add_argument("--config", required=True, help="TOML or JSON with TrainConfig fields")
    p.add_argument("--data-dir", default=None, help="override the config's data_dir")
    p.add_argument("--out-dir", default=None, help="override the config's out_dir")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--loss", default=None, choices=["ce", "ce+kl", "rkl", "fkl", "tv"], help="override the config's loss")
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
    register_length_head_cli(subparsers)  # train length-head

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
