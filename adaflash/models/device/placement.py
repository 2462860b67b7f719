"""The one device decision: where every model of this process runs (`--device cpu|cuda|auto`).

A command resolves `--device` once (`use_device`, called by `cli_args.configure_process`); every loader below it
(targets, drafters, length heads, the trainer's models) places its tensors on `current_device()` unless a caller
names another. The choice is also exported as $ADAFLASH_DEVICE, so the servers a benchmark launches run where it does.
On a CPU our own kernels (packed / quantized / int8 linears, the ragged attention kernel, the fused layer step) run
where they can; on CUDA the same model code runs torch's ops (bf16 by default, SDPA attention) and never calls them.
"""

from __future__ import annotations

import os

import torch

from adaflash.models.device import fake_cuda
from adaflash.models.device.cpu import cpu_model

DEVICES = ("auto", "cpu", "cuda")
_ENV = "ADAFLASH_DEVICE"
_current: torch.device | None = None


def resolve_device(name: str | None = "auto") -> torch.device:
    """auto: the first CUDA device when torch sees one, else the CPU. `cuda:N` picks a GPU."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICES)} (or cuda:N)")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda":
        if os.environ.get("ADAFLASH_FAKE_CUDA") == "1":  # the CUDA path on the CPU, device-checked (fake_cuda.py)
            fake_cuda.install()
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device here (this torch build: "
                             f"{torch.__version__}); use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device


def use_device(name: str | None) -> torch.device:
    """Decide this process's device (None: $ADAFLASH_DEVICE, else auto) and export it to child processes."""
    global _current
    _current = resolve_device(name if name is not None else os.environ.get(_ENV, "auto"))
    os.environ[_ENV] = str(_current)
    return _current


def current_device() -> torch.device:
    """Where models load by default: what `use_device` decided, else $ADAFLASH_DEVICE, else auto."""
    return _current if _current is not None else resolve_device(os.environ.get(_ENV, "auto"))


def placed(device: torch.device | str | None) -> torch.device:
    """A loader's `device` argument: the one named, else the process's."""
    return current_device() if device is None else torch.device(device)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU): what a wall-clock timing of a pass needs on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device | str) -> str:
    """The processor a result ran on, for reports and cache keys: the GPU's name, or the CPU's model."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()
