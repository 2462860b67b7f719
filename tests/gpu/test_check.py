"""`make gpu-check` runs as it is on a bare GPU machine; its dry run at toy shapes on the CPU, under the fake CUDA device
(models/device/fake_cuda.py), catches here what would otherwise fail on first contact with the GPU (an import, a shape, a
tensor on the wrong device, a file the device tool cannot bring back)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# The `cuda` tests the dry run runs on the fake device: one of each kind of tests/test_device_path.py, so the staging,
# the run and its report are exercised. The device path itself is checked under the fake device in full by
# tests/test_device_discipline.py (generation greedy and sampled, the engine under every policy, training).
DRY_RUN_CUDA_TESTS = ("tests/test_device_path.py::test_models_land_on_the_device_and_skip_cpu_kernels",
                      "tests/test_device_path.py::test_greedy_equals_transformers[cuda-qwen3]",
                      "tests/test_device_path.py::test_engine_batch_equals_reference[cuda-heuristic]",
                      "tests/test_device_path.py::test_trainer_steps_on_the_device")


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["make", "-s", "gpu-check", "FAKE_CUDA=1", "TINY=1", f"GPU_OUT={out}",
                          f"CUDA_TESTS={' '.join(DRY_RUN_CUDA_TESTS)}"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=600)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["cost_model.json", "gpu_check.json", "machine.json", "pytest_cuda.txt", "verify_cost.json",
                     "verify_cost.md"]
    # The machine first: its packages and GPUs are the run's first lines, before any time is spent.
    assert run.stdout.startswith("python ") and run.stdout.splitlines()[1].startswith("packages: torch ")
    machine = json.loads((out / "machine.json").read_text())
    assert machine["packages"]["torch"] == torch.__version__ and "nvidia_smi" in machine
    assert all(p.stat().st_size < 16 << 20 for p in out.iterdir())  # what the device tool brings back
    report = json.loads((out / "gpu_check.json").read_text())
    cells = report["verify_cost"]["cells"]
    assert {(c["batch"], c["new_tokens"]) for c in cells} == {(b, n) for b in (1, 2) for n in (1, 2, 4)}
    assert all(c["ms"] > 0 for c in cells)
    model = json.loads((out / "cost_model.json").read_text())
    assert model["total_tokens"][0] == 1 and len(model["draft_widths"]) == len(model["draft_width_s"]) > 0
    ar = report["ar_vs_transformers"]
    assert ar["greedy_tokens_agree_first"] == ar["new_tokens"]  # the same tokens as transformers
    assert ar["graphs_vs_eager"] == {"same_tokens": True, "first_difference": None}
    assert report["machine"]["device_name"].startswith("fake CUDA") and report["dtype"] == "bfloat16"
    pytest_cuda = (out / "pytest_cuda.txt").read_text()  # the `cuda` tests ran on the fake device, and passed
    assert f"{len(DRY_RUN_CUDA_TESTS)} passed" in pytest_cuda and " failed" not in pytest_cuda and " error" not in pytest_cuda
