"""Safetensors files written atomically and read with errors that name the file (checkpoints, heads, outcomes)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """write(tmp) into a temporary file beside `path`, then rename it into place: readers see old or new, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    path = Path(path)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata or {"format": "pt"}))
    return path


def read_tensors(path: str | Path, what: str = "safetensors file") -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is corrupt or truncated: {exc}") from exc


def check_state(path: Path, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """The tensors of `path` are exactly the module's, with its shapes (else an error naming the file)."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{path} does not match its config: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, config implies {tuple(expected[name].shape)}")
