"""A training run's checkpoint: fp32 weights, optimizer state and step, published whole or not at all.

`save_checkpoint` writes `OUT/checkpoint.tmp` and renames it over `OUT/checkpoint` (the previous one kept as
`checkpoint.old` between the two renames); `load_checkpoint` resumes from whichever is whole. A write that fails (a
full disk) stops the run naming the checkpoint that is still whole (`writing`).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from adaflash.models.drafters.dflash import DFlashDrafter
from adaflash.models.drafters.checkpoint import load_drafter, save_drafter


@contextlib.contextmanager
def writing(out_dir: Path, what: str):
    """A write that fails (a full disk, a quota) stops the run naming what it could not write and the checkpoint
    that is still whole, which the same command resumes from."""
    try:
        yield
    except (OSError, SafetensorError) as exc:  # safetensors reports the OS's error (ENOSPC) as its own
        state = out_dir / "checkpoint" / "trainer_state.pt"
        intact = (f"{state.parent} (step {torch.load(state, weights_only=False, mmap=True)['step']}) is intact: free "
                  "space and run the same command to resume from it" if state.is_file() else "no checkpoint yet")
        if isinstance(exc, OSError) and exc.errno:
            raise OSError(exc.errno, f"could not write {what}: {exc.strerror}; {intact}") from exc
        raise OSError(f"could not write {what}: {exc}; {intact}") from exc


def save_checkpoint(out_dir: Path, drafter: DFlashDrafter, optimizer, step: int, config: dict) -> None:
    """Weights (fp32, exact) + optimizer + step, published by an atomic directory rename."""
    tmp, final = out_dir / "checkpoint.tmp", out_dir / "checkpoint"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(out_dir, f"the step {step} checkpoint to {tmp}"):
        try:
            save_drafter(drafter, tmp, dtype=torch.float32)
            torch.save({"step": step, "optimizer": optimizer.state_dict(), "config": config}, tmp / "trainer_state.pt")
        except (OSError, SafetensorError):
            shutil.rmtree(tmp, ignore_errors=True)  # the half-written copy's space back
            raise
    old = out_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(out_dir: Path, optimizer_factory,
                    device: torch.device) -> tuple[DFlashDrafter, torch.optim.Optimizer, int] | None:
    """The whole checkpoint under OUT (drafter, its optimizer from `optimizer_factory(drafter)`, step); None if none."""
    ckpt, old = out_dir / "checkpoint", out_dir / "checkpoint.old"
    if not (ckpt / "trainer_state.pt").is_file() and (old / "trainer_state.pt").is_file():
        # A kill between save_checkpoint's two renames: the previous checkpoint is whole under its old name. Put it
        # back first, so the next save's clean-up of checkpoint.old cannot delete the only one. (Under torchrun every
        # rank gets here: the rename is atomic, and a rank that loses the race finds the checkpoint in place.)
        try:
            old.rename(ckpt)
        except OSError:
            pass
    if not (ckpt / "trainer_state.pt").is_file():
        return None
    drafter = load_drafter(ckpt, dtype=torch.float32, device=device).train()
    try:
        state = torch.load(ckpt / "trainer_state.pt", weights_only=False, map_location=device)
    except Exception as exc:
        raise ValueError(f"{ckpt / 'trainer_state.pt'} is corrupt: {exc}") from exc
    optimizer = optimizer_factory(drafter)
    optimizer.load_state_dict(state["optimizer"])
    return drafter, optimizer, int(state["step"])
