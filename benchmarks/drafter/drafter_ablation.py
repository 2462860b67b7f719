"""Issue 52's drafter ablation: each arm is today's v9 recipe (configs/smollm2-drafter-v9.toml) with one change, trained
on the same data for the same steps and sequences, and scored on the same held-out samples.

    python benchmarks/drafter/drafter_ablation.py --data-dir runs/data/ablation --steps 150 --jobs 2 \
        --out docs/results/drafter/ablation            # write configs, train every arm (resumable), score, report
    python benchmarks/drafter/drafter_ablation.py ... --arms baseline,dpace --stage score   # one stage, some arms
    python benchmarks/drafter/drafter_ablation.py ... --combine anchors_dpace=anchors_all+dpace   # an arm merging others'
    python benchmarks/drafter/drafter_ablation.py ... --stage score --watch   # (another process) score arms as they finish

A rerun on a bigger budget is the same command with another --steps / --data-dir (arms live under
runs/ablation/<steps>/<arm>, so budgets never mix). Each arm's config is written to configs/ablation/<steps>/<arm>.toml
and run by `adaflash train drafter --config`; a killed run resumes from its checkpoint, a finished one is skipped.

Scores (per domain + all, on the trainer's held-out split, `holdout_samples` of the data):
- `decoded`: tokens per target pass of greedy decoding walked over each held-out response, full block
  (training/validation.py's decoded accept length);
- `decoded_k3` / `decoded_k7`: the same walk with at most 3 / 7 drafts a pass (the block's later drafts dropped; greedy
  acceptance is a prefix, so this is exact for a drafter that drafts the whole block at once): fixed lengths standing in
  for the throughput policy's, which picks a length per step from live costs and is measured live
  (benchmarks/adaflash/adaptive_vs_ar.py), not here;
- `holdout`: the expected accept length at 32 random anchors a sample (the training curves' number).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
V9 = ROOT / "configs" / "smollm2-drafter-v9.toml"
SHIPPED = "adaflash/assets/drafters/smollm2-135m"

# name -> (overrides of the v9 recipe, what the arm tests)
ARMS: dict[str, tuple[dict, str]] = {
    "baseline": ({}, "v9 recipe unchanged, continued from the shipped drafter (what every arm compares against)"),
    "baseline_seed2": ({"seed": 2}, "v9 recipe, another data-order / anchor seed: the noise of the comparison"),
    "anchors_all": ({"anchors_per_sequence": 0}, "every valid position of a sequence is an anchor (v9: 32 sampled)"),
    "gamma4": ({"gamma": 4.0}, "loss decay gamma 4 (v9: 7): weight moves to the first block positions"),
    "dpace": ({"position_weighting": "dpace", "dpace_alpha": 0.5},
              "D-PACE position weights (Model-Optimizer's dflash_loss_objective = dpace, alpha 0.5) instead of decay"),
    "block8": ({"block_size": 8}, "block size 8 (v9: 16), the shipped weights re-blocked"),
    "sel64": ({"selector_rank": 64, "conv_kernel_size": 2},
              "DFlash 2: convolutions (kernel 2, identity-initialised) + selector rank 64"),
    "sel64_noconv": ({"selector_rank": 64, "conv_kernel_size": 0},
                     "DFlash 2 selector rank 64 without convolutions: sel64 minus this is the convolutions' effect "
                     "(the drafter config refuses it today: DFlash 2 needs conv_kernel_size, conv_group_size, "
                     "selector_rank, selector_top_k >= 1)"),
    "sel256": ({"selector_rank": 256, "conv_kernel_size": 2}, "DFlash 2: convolutions + selector rank 256"),
    "init_target": ({"init_from": None, "init_from_target": True, "lr": 6e-4},
                    "a new drafter whose layers start from the target's top 2 layers (not the shipped drafter); "
                    "lr 6e-4, the trainer's default for a new drafter (v9's 1.5e-4 is a continuation's)"),
}


def arm_config(arm: str, data_dirs: list[str], steps: int, holdout: int, overrides: dict | None = None) -> dict:
    raw = tomllib.loads(V9.read_text())
    raw.update(data_dir=data_dirs, out_dir=f"runs/ablation/{steps}/{arm}", max_steps=steps, holdout_samples=holdout,
               save_every=max(25, steps // 2), log_every=10)
    raw.update(overrides if overrides is not None else ARMS[arm][0])
    return {k: v for k, v in raw.items() if v is not None}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def write_config(arm: str, cfg: dict, steps: int) -> Path:
    path = ROOT / "configs" / "ablation" / str(steps) / f"{arm}.toml"
    if path.is_file():
        return path  # an arm keeps the config it started with (a resumed run must not change recipe): delete to redo
    path.parent.mkdir(parents=True, exist_ok=True)
    note = ARMS[arm][1] if arm in ARMS else "combination"
    lines = [f"# Issue 52 ablation arm {arm!r}: {note}.", "# Written by benchmarks/drafter/drafter_ablation.py; the v9 recipe otherwise."]
    lines += [f"{k} = {_toml_value(v)}" for k, v in cfg.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def train_arm(arm: str, config: Path, threads: int) -> dict:
    out = ROOT / tomllib.loads(config.read_text())["out_dir"]
    if (out / "drafter" / "config.json").is_file():
        return {"arm": arm, "skipped": True}
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["nice", "-n", "10", sys.executable, "-m", "adaflash.cli", "--threads", str(threads), "train", "drafter",
           "--config", str(config.relative_to(ROOT))]
    started = time.perf_counter()
    with (out / "train.log").open("a") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:  # one arm's failure (e.g. a combination the model refuses) does not stop the others
        return {"arm": arm, "failed": f"rc {rc}: see {out / 'train.log'}"}
    return {"arm": arm, "train_s": time.perf_counter() - started}


def _walk(runs, k: int | None) -> dict[str, float]:
    from adaflash.training.validation import DecodedRun, decoded_walk

    sums: dict[str, list[int]] = {}
    for domain, run in runs:
        capped = DecodedRun([min(r, k) if k else r for r in run.run_lengths], run.first, run.prompt_len, run.length)
        tokens, passes = decoded_walk(capped)
        for key in (domain, "all"):
            total = sums.setdefault(key, [0, 0])
            total[0] += tokens
            total[1] += passes
    return {key: t / max(1, p) for key, (t, p) in sorted(sums.items())}


def score(drafters, data_dirs: list[str], holdout: int, threads: int, on_score=None) -> dict[str, dict]:
    """{name: {decoded, decoded_k3, decoded_k7}} on the trainer's held-out split of data_dirs. `drafters`: {name:
    path}, or a callable returning the next such dict ({} to stop) so arms are scored as they finish training;
    on_score(name, result) after each."""
    import torch

    from adaflash.models.drafters.draft_vocab import DraftHead
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.models.targets.registry import resolve_target
    from adaflash.models.targets.model import load_target
    from adaflash.training.dataset import first_anchor, load_training_data
    from adaflash.training.losses import build_loss
    from adaflash.training.trainer import TeacherCache, TrainConfig, _sequence_loss
    from adaflash.training.validation import DecodedRun, split_holdout

    torch.set_num_threads(threads)
    target = load_target(resolve_target("smollm2-135m"), dtype=torch.float32)
    dataset = load_training_data(data_dirs, (1, 14, 27))
    _, ids = split_holdout(dataset.keys, holdout)
    cfg = TrainConfig(data_dir=tuple(data_dirs), out_dir="")
    teachers, loss = TeacherCache(target, (1, 14, 27)), build_loss("ce")
    results = {}
    pending = (lambda: drafters) if isinstance(drafters, dict) else drafters
    while batch := {n: p for n, p in pending().items() if n not in results}:
        for name, path in batch.items():
            drafter = load_drafter(path, dtype=torch.float32).eval()
            head = DraftHead(target.lm_head, drafter.draft_vocab)
            runs = []
            with torch.no_grad():
                for i in ids:
                    s = dataset.samples[i]
                    _, stats = _sequence_loss(drafter, drafter.config, target, head, i, s, cfg, loss,
                                              torch.Generator(), teachers, len(s.tokens))  # every anchor
                    runs.append((s.domain, DecodedRun(stats["run_lengths"], first_anchor(s), s.prompt_len,
                                                      len(s.tokens))))
            results[name] = {"decoded": _walk(runs, None), "decoded_k3": _walk(runs, 3), "decoded_k7": _walk(runs, 7),
                             "samples": {d: sum(1 for dom, _ in runs if dom == d) for d in sorted({d for d, _ in runs})}}
            print(name, {k: round(v, 3) for k, v in results[name]["decoded"].items()}, flush=True)
            if on_score:
                on_score(name, results[name])
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", nargs="+", default=["runs/data/ablation"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--holdout", type=int, default=64)
    parser.add_argument("--arms", default="all", help="comma-separated arm names, or all")
    parser.add_argument("--combine", default="", help="a combination arm: name=arm1+arm2 (their overrides merged)")
    parser.add_argument("--stage", choices=["configs", "train", "score", "report", "all"], default="all")
    parser.add_argument("--jobs", type=int, default=1, help="arms trained at once (each with --threads threads)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--watch", action="store_true", help="score arms as they finish training (another process)")
    parser.add_argument("--out", default="docs/results/drafter/ablation", help="scores: OUT.scores.json (merged)")
    args = parser.parse_args(argv)
    arms = dict(ARMS) if args.arms == "all" else {a: ARMS[a] for a in args.arms.split(",") if a}
    overrides = {a: spec[0] for a, spec in arms.items()}
    if args.combine:
        name, parts = args.combine.split("=")
        merged: dict = {}
        for part in parts.split("+"):
            merged.update(ARMS[part][0])
        overrides[name] = merged
        ARMS[name] = (merged, "combination of " + " + ".join(parts.split("+")))
    configs = {a: write_config(a, arm_config(a, args.data_dir, args.steps, args.holdout, o), args.steps)
               for a, o in overrides.items()}
    if args.stage in ("train", "all"):
        with ThreadPoolExecutor(args.jobs) as pool:
            for done in pool.map(lambda a: train_arm(a, configs[a], args.threads), configs):
                print(json.dumps(done), flush=True)
    if args.stage in ("score", "all"):
        out = ROOT / f"{args.out}.scores.json"
        held = json.loads(out.read_text()) if out.is_file() else {}
        runs = {f"{args.steps}/{a}": ROOT / f"runs/ablation/{args.steps}/{a}" for a in configs}

        def todo() -> dict:
            """Arms trained and not yet scored; with --watch, waits while arms are still training."""
            while True:
                ready = {k: str(r / "drafter") for k, r in runs.items() if k not in held and (r / "drafter").is_dir()}
                if "shipped" not in held:
                    ready["shipped"] = SHIPPED
                if ready or not args.watch or all(k in held for k in runs):
                    return ready
                time.sleep(20)

        def save(name: str, result: dict) -> None:
            held[name] = result
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(held, indent=1, sort_keys=True) + "\n")

        score(todo, args.data_dir, args.holdout, max(1, args.threads * args.jobs), save)
    if args.stage in ("report", "all"):
        from drafter_ablation_report import write_report  # (its own directory is on sys.path)

        write_report(args.steps, args.data_dir, args.holdout, ARMS, args.out, sys.argv)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
