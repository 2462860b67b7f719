"""The prepared GPU burst (`make gpu-drafter`): regenerate training data with the target and train the SmolLM2
drafter on it, inside one command's time budget, on a bare GPU machine (docs/gpu.md has the whole procedure).

Phases, each logged to OUT/burst.json with its time and rate:
1. unpack the staged payload (`make gpu-stage`: the target's GGUF, the prompt file, the gguf wheel; it travels in parts
   over back-to-back calls) and convert the GGUF once;
2. data: the target answers train-split prompts greedily on the engine (tokens only: features are recomputed inside the
   training step), until the data share of the budget is spent;
3. training: the drafter config (configs/smollm2-drafter-gpu.toml), the target's forward inside each step, sized from a
   short probe so its cosine schedule ends when the budget does; every checkpoint is also exported in bf16 to
   OUT/drafter (shards of at most 15 MiB), so a run cut off returns the last one.
`--tiny` runs every phase at toy scale (the CPU dry run `make test` holds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's package, not installed on the GPU machine

from gpu.machine import packages, report_machine  # noqa: E402

SHARD_BYTES = 15 << 20  # the device tool brings back files of at most 16 MiB
PAYLOAD = "payload.tar"
TINY_OVERRIDES = dict(max_steps=None, sequences_per_step=1, anchors_per_sequence=8, holdout_samples=2, log_every=1,
                      save_every=1, num_layers=1)


def unpack(stage: Path, work: Path) -> dict:
    """The staged payload (whole, or its parts payload.tar.part-*) into `work`; its wheels onto sys.path."""
    parts = sorted(stage.glob(f"{PAYLOAD}.part-*"))
    if not parts and not (stage / PAYLOAD).is_file():
        raise FileNotFoundError(f"{stage} holds neither {PAYLOAD} nor its parts: run `make gpu-stage` and carry them")
    work.mkdir(parents=True, exist_ok=True)
    tar_path = work / PAYLOAD
    with tar_path.open("wb") as out:
        for part in parts or [stage / PAYLOAD]:
            with part.open("rb") as f:
                shutil.copyfileobj(f, out)
    with tarfile.open(tar_path) as tar:
        tar.extractall(work, filter="data")
    tar_path.unlink()
    manifest = json.loads((work / "stage.json").read_text())
    # Installed beside the run even where a version is there already: the dry run takes the GPU machine's path.
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target",
                    str(site), *map(str, sorted((work / "wheels").glob("*.whl")))], check=True)
    sys.path.insert(0, str(site))
    return manifest


def export_checkpoint(checkpoint: Path, out: Path) -> None:
    """A training checkpoint (fp32) as the bf16 DFlash drafter the project ships, in shards the tool brings back."""
    import torch

    from adaflash.models.drafters.checkpoint import load_drafter, save_drafter

    save_drafter(load_drafter(checkpoint, dtype=torch.float32, device="cpu"), out, dtype=torch.bfloat16,
                 max_shard_bytes=SHARD_BYTES)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", required=True, help="folder with the staged payload (or its parts)")
    p.add_argument("--out", required=True, help="what comes back: burst.json, metrics.jsonl, drafter/")
    p.add_argument("--work", default="/tmp/adaflash-burst", help="scratch folder (data, checkpoints, converted target)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall seconds for the whole run, set-up included")
    p.add_argument("--data-share", type=float, default=0.4, help="of the budget left after set-up, the data phase's")
    p.add_argument("--config", default=str(ROOT / "configs" / "smollm2-drafter-gpu.toml"))
    p.add_argument("--batch-size", type=int, default=512, help="sequences the data engine keeps running")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--tiny", action="store_true", help="toy scale: the dry run")
    args = p.parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget_s
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ADAFLASH_CACHE", str(work / "cache"))
    report: dict = {"command": " ".join(["python", "gpu/drafter.py", *(argv if argv is not None else sys.argv[1:])]),
                    "phases": {}}
    # First, before any time is spent: the machine's packages (before the staged wheels) and GPUs, printed and logged.
    report["machine_at_start"] = report_machine({})
    (out / "burst.json").write_text(json.dumps(report, indent=2) + "\n")

    def log(phase: str, **facts) -> None:
        report["phases"][phase] = {"at_s": round(time.monotonic() - started, 1), **facts}
        (out / "burst.json").write_text(json.dumps(report, indent=2) + "\n")

    stage = unpack(Path(args.stage), work)
    import torch

    from adaflash.data.jsonl import read_prompts_file
    from adaflash.models.device.placement import describe, use_device
    from adaflash.models.targets.registry import resolve_target
    from adaflash.pipeline import Pipeline
    from adaflash.training.datagen import DataGenConfig, generate_dataset
    from adaflash.training.trainer import TrainConfig, train

    device = use_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the dry run's toy passes gain nothing from threads
    report["machine"] = {"device": describe(device), "torch": torch.__version__, "stage": stage,
                         "packages_with_stage": packages()}
    target_dir = resolve_target(str(work / stage["gguf"]))
    pipeline = Pipeline.load(str(target_dir), None, "auto")
    log("setup", target=str(target_dir), dtype=str(pipeline.target.dtype))

    # Data: greedy answers to train-split prompts, tokens only, until its share of the budget is spent.
    prompts = read_prompts_file(work / stage["prompts"])
    data_dir = work / "data"
    data_config = DataGenConfig(model=stage["gguf"], capture_layers=(), max_new_tokens=args.max_new_tokens,
                                max_prompt_tokens=512, batch_size=args.batch_size, shard_size=256, store_features=False)
    data_start = time.monotonic()
    stop_at = data_start + args.data_share * (deadline - data_start)
    manifest = generate_dataset(pipeline.target, lambda q: pipeline.encode(messages=q.messages), pipeline.stop_token_ids,
                                prompts, data_dir, data_config, stop_at=stop_at)
    tokens = sum(s["response_tokens"] for s in manifest["shards"])
    data_s = time.monotonic() - data_start
    log("data", samples=sum(s["num_samples"] for s in manifest["shards"]), response_tokens=tokens, seconds=round(data_s, 1),
        tokens_per_s=round(tokens / data_s), batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    del pipeline
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # Training: a probe of a few steps times a step, then the schedule is sized to end with the budget.
    overrides = dict(TINY_OVERRIDES) if args.tiny else {}
    cfg = TrainConfig.from_file(args.config, data_dir=str(data_dir), out_dir=str(work / "train"), model=str(target_dir),
                                **{k: v for k, v in overrides.items() if v is not None})
    drafter_out = out / "drafter"

    def exported(checkpoint: Path) -> None:
        export_checkpoint(checkpoint, drafter_out)
        shutil.copy(Path(cfg.out_dir) / "metrics.jsonl", out / "metrics.jsonl")

    probe_steps = 1 if args.tiny else 10
    probe_start = time.monotonic()
    train(replace(cfg, max_steps=10**6, save_every=10**6), progress=False, stop_after=probe_steps)
    step_s = (time.monotonic() - probe_start) / probe_steps  # an upper bound: the probe pays loading and warm-up
    margin = 30.0 if not args.tiny else 2.0  # the final held-out scoring and export
    total = probe_steps + max(1, int((deadline - time.monotonic() - margin) / step_s))
    if args.tiny:
        total = probe_steps + 1
    log("train_probe", seconds_per_step=round(step_s, 3), planned_steps=total)
    final = train(replace(cfg, max_steps=total, time_limit_s=max(1.0, deadline - time.monotonic() - margin),
                          save_every_s=60.0), progress=False, on_checkpoint=exported)
    export_checkpoint(final, drafter_out)
    shutil.copy(Path(cfg.out_dir) / "metrics.jsonl", out / "metrics.jsonl")
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    log("train", steps=last["step"], holdout=last.get("holdout"), tokens_seen=last.get("train_tokens_seen"),
        drafter_files=sorted(f.name for f in drafter_out.iterdir()))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
