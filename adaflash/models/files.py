"""The files models are read from and written to: safetensors written atomically and read with errors that name the
file (checkpoints, heads, outcomes), a checkpoint's config.json, and the user cache where converted targets, built
kernels and measured profiles live."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

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


@contextmanager
def exclusive(lock_file: Path):
    """Hold an exclusive lock on `lock_file` (made if missing) for the block; released when the process dies too."""
    with lock_file.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cache_root() -> Path:
    """Where converted checkpoints live: $ADAFLASH_CACHE, else ~/.cache/adaflash."""
    return Path(os.environ.get("ADAFLASH_CACHE", Path.home() / ".cache" / "adaflash"))


def read_config_json(path: str | Path, what: str) -> dict[str, Any]:
    """`path/config.json` as a dict, with errors that name the file and say what was expected."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}: expected {what}")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
