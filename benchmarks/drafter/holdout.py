"""Score drafters on the held-out split of regenerated data, with the two numbers the training loop logs there.

    python benchmarks/drafter/holdout.py --data-dir runs/data/a runs/data/b --holdout 64 \
        --drafter runs/train/x/drafter runs/train/y/drafter --json docs/results/drafter/holdout.json

`holdout`: the expected full-block accept length at random anchors (the training curves' number); `decoded`: the
same responses walked as greedy decoding would, i.e. the tokens per target pass `generate` gives on those prompts.
The held-out split is the trainer's (the samples whose prompt ids hash lowest), so a drafter trained with
`holdout_samples = N` on the same directories is scored on samples it never saw. Drafters of any depth, block size
and draft vocabulary compare on the same samples and anchors.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import torch

from adaflash.models.drafters.draft_vocab import DraftHead
from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.models.targets.registry import resolve_target
from adaflash.models.targets.model import load_target
from adaflash.report import write_json
from adaflash.training.dataset import load_training_data
from adaflash.training.losses import build_loss
from adaflash.training.trainer import TeacherCache, TrainConfig, holdout_record
from adaflash.training.validation import split_holdout


def score_drafters(drafters: Sequence[str | Path], data_dirs: Sequence[str | Path], holdout: int,
                   model: str = "smollm2-135m", anchors: int = 32) -> dict[str, dict]:
    """{drafter path: {"holdout": {domain: ...}, "holdout_decoded": {domain: ...}}} on the held-out samples."""
    target = load_target(resolve_target(model), dtype=torch.float32)
    loaded = {str(path): load_drafter(path, dtype=torch.float32) for path in drafters}
    layers = {d.config.target_layer_ids for d in loaded.values()}
    if len(layers) != 1:
        raise ValueError(f"the drafters read different target layers {sorted(layers)}: one data set cannot score them")
    (layer_ids,) = layers
    dataset = load_training_data(list(map(str, data_dirs)), layer_ids)
    _, holdout_ids = split_holdout(dataset.keys, holdout)
    cfg = TrainConfig(data_dir=tuple(map(str, data_dirs)), out_dir="", model=model, holdout_anchors=anchors,
                      holdout_decoded=True)
    teachers = TeacherCache(target, layer_ids)
    return {path: holdout_record(drafter, target, DraftHead(target.lm_head, drafter.draft_vocab), dataset, holdout_ids,
                                 cfg, build_loss("ce"), teachers)
            for path, drafter in loaded.items()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", nargs="+", required=True, help="regenerated-data directories, as trained on")
    parser.add_argument("--holdout", type=int, required=True, help="the training run's holdout_samples")
    parser.add_argument("--drafter", nargs="+", required=True, help="drafter checkpoint directories")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--anchors", type=int, default=32, help="random anchors per held-out sample (holdout_anchors)")
    parser.add_argument("--json", default=None, help="also write the scores here")
    args = parser.parse_args(argv)
    scores = score_drafters(args.drafter, args.data_dir, args.holdout, args.model, args.anchors)
    for path, record in scores.items():
        for name, values in record.items():
            print(f"{path} {name}: " + ", ".join(f"{d} {v:.3f}" for d, v in values.items()))
    if args.json:
        write_json({"data_dirs": args.data_dir, "holdout": args.holdout, "anchors": args.anchors, "scores": scores},
                   args.json)


if __name__ == "__main__":
    main()
