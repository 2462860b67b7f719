"""What the GPU machine is, printed before a prepared run spends its time (`make gpu-check` runs it first; `make
gpu-drafter` prints it and logs it first in burst.json): the python packages the runs import, with their versions or
"missing", then nvidia-smi's view of the GPUs, then torch's. A lease is 15 minutes: a missing wheel or another card
than expected should be read off the first lines, not found after a run has failed.

Standard library only until torch's section (an absent or broken torch is itself reported).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# What the prepared runs import (gpu/check.py, gpu/drafter.py, `pytest -m cuda`), or transformers' GGUF loading does.
PACKAGES = ("torch", "transformers", "safetensors", "tokenizers", "gguf", "accelerate", "psutil", "numpy", "pytest",
            "scipy", "tqdm", "pyyaml")
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,memory.used,memory.free,"
              "utilization.gpu,temperature.gpu,compute_cap", "--format=csv"]


def packages(names=PACKAGES) -> dict[str, str]:
    """name -> installed version, or "missing"."""
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def nvidia_smi() -> str:
    """nvidia-smi's table of the GPUs (index, name, driver, memory, use, compute capability), or why there is none."""
    try:
        run = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi: {exc}"
    return (run.stdout or run.stderr).strip() or f"nvidia-smi exited {run.returncode}"


def torch_devices() -> dict:
    """torch's build and each CUDA device it sees (name, capability, total and free memory)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 (whatever stops torch importing is what to read first)
        return {"error": repr(exc)}
    info = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "devices": []}
    if torch.cuda.is_available():
        info["cudnn"] = torch.backends.cudnn.version()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            info["devices"].append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                                    "total_gib": round(total / 2**30, 2), "free_gib": round(free / 2**30, 2),
                                    "bf16": torch.cuda.is_bf16_supported()})
    return info


def report_machine(report: dict) -> dict:
    """Fill `report` section by section, printing each as it comes (flushed): the packages and nvidia-smi before torch
    is imported (seconds, or a crash). Returns `report`."""
    report["python"] = f"{platform.python_version()} ({sys.executable}); {platform.platform()}"
    report["packages"] = packages()
    print(f"python {report['python']}")
    print("packages: " + ", ".join(f"{k} {v}" for k, v in report["packages"].items()), flush=True)
    report["nvidia_smi"] = nvidia_smi()
    print(report["nvidia_smi"], flush=True)
    report["torch"] = torch_devices()
    print("torch: " + json.dumps(report["torch"]), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write machine.json into this folder")
    args = p.parse_args(argv)
    report = report_machine({})
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "machine.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
