"""`make gpu-drafter` runs as it is on a bare GPU machine: its dry run stages the real payload (the target's GGUF in
parts, a prompt file, the gguf wheel), unpacks and converts it, generates data with the target, probes and trains,
and leaves a loadable drafter where the device tool brings files back from; here on the fake CUDA device
(models/device/fake_cuda.py), so a tensor left on the host fails the dry run as it would fail the GPU's first step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from adaflash.models.drafters.checkpoint import load_drafter

ROOT = Path(__file__).resolve().parents[2]


def _make(*args: str) -> None:
    run = subprocess.run(["make", "-s", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"make {' '.join(args)} exited {run.returncode}:\n{(run.stdout + run.stderr)[-3000:]}"


def test_gpu_drafter_dry_run(tmp_path):
    stage, out = tmp_path / "stage", tmp_path / "out"
    _make("gpu-stage", "TINY=1", f"STAGE={stage}")
    parts = sorted(stage.iterdir())
    assert len(parts) >= 4 and all(p.stat().st_size <= 25e6 for p in parts)  # each travels beside the working tree
    assert any(w.name.startswith("pytest-") for w in (stage / "check-wheels").iterdir())  # for `make gpu-check`
    _make("gpu-drafter", "FAKE_CUDA=1", "TINY=1", f"STAGE={stage}", f"GPU_OUT={out}", "BUDGET_S=300")
    report = json.loads((out / "burst.json").read_text())
    assert report["machine_at_start"]["packages"]["torch"] == torch.__version__  # logged before the payload's unpacking
    assert report["phases"]["data"]["response_tokens"] > 0
    assert report["phases"]["train"]["steps"] == report["phases"]["train_probe"]["planned_steps"]
    returned = [p for p in out.rglob("*") if p.is_file() and "work" not in p.relative_to(out).parts]
    assert len(returned) <= 8 and all(p.stat().st_size <= 16 << 20 for p in returned)
    drafter = load_drafter(out / "drafter", dtype=torch.float32, device="cpu")
    assert drafter.config.block_size == 16 and drafter.draft_vocab is not None
