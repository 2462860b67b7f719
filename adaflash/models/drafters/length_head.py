"""Candidate-length heads: predict from detached drafter hidden states how many drafts are worth verifying.

Two kinds, both reading the drafter's block hidden states [N, B, d] (position 0 = anchor):
- `BlockLengthHead` (the AdaFlash paper's head): one ratio per block, candidate length = round(ratio * B * rate).
- `PositionAcceptanceHead` (DSpark / SpecDec++ style): a calibrated conditional acceptance probability per
  draft position, whose cumulative product (survival) gives the expected accepted drafts for any length.

The head is stored inside the drafter checkpoint dir (`length_head.safetensors` + an `adaflash_length_head`
key in config.json), so a drafter and its head travel together and vLLM/SGLang ignore the extra key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor, nn

from adaflash.models.files import read_config_json
from adaflash.models.device.placement import placed
from adaflash.models.files import atomic_write, check_state, read_tensors, save_tensors

KINDS = ("block", "position")
CONFIG_KEY = "adaflash_length_head"
HEAD_FILE = "length_head.safetensors"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class LengthHeadConfig:
    kind: str
    hidden_size: int
    block_size: int
    head_dim: int = 256
    rate: float = 1.0  # block head: candidate length is scaled by this (the paper uses 1.0-1.3)
    temperature: float = 1.0  # position head: logits are divided by this (fitted on held-out data)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown length head kind {self.kind!r}; allowed kinds: {', '.join(KINDS)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor + at least one draft), got {self.block_size}")
        if self.hidden_size < 1 or self.head_dim < 1:
            raise ValueError(f"hidden_size and head_dim must be positive, got {self.hidden_size}, {self.head_dim}")
        if not self.rate > 0 or not self.temperature > 0:
            raise ValueError(f"rate and temperature must be > 0, got {self.rate}, {self.temperature}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LengthHeadConfig":
        """Unknown keys are ignored so that a newer writer's extra fields do not break this reader."""
        if not isinstance(raw, dict):
            raise ValueError(f"length head config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        missing = [k for k in ("kind", "hidden_size", "block_size") if k not in raw]
        if missing:
            raise ValueError(f"length head config lacks {missing}")
        kwargs = {k: v for k, v in raw.items() if k in known}
        for key in ("hidden_size", "block_size", "head_dim"):
            if key in kwargs:
                kwargs[key] = int(kwargs[key])
        for key in ("rate", "temperature"):
            if key in kwargs:
                kwargs[key] = float(kwargs[key])
        return cls(**kwargs)


def _check_hidden(hidden: Tensor, config: LengthHeadConfig) -> None:
    want = (config.block_size, config.hidden_size)
    if hidden.dim() != 3 or tuple(hidden.shape[1:]) != want:
        raise ValueError(f"length head expects hidden [N, {want[0]}, {want[1]}], got {tuple(hidden.shape)}")


class BlockLengthHead(nn.Module):
    """[mean over the block ; last position] -> MLP with one residual block -> sigmoid ratio per block."""

    def __init__(self, config: LengthHeadConfig) -> None:
        super().__init__()
        if config.kind != "block":
            raise ValueError(f"BlockLengthHead needs kind='block', got {config.kind!r}")
        self.config = config
        self.inp = nn.Linear(2 * config.hidden_size, config.head_dim)
        self.res = nn.Linear(config.head_dim, config.head_dim)
        self.out = nn.Linear(config.head_dim, 1)

    def logit(self, hidden: Tensor) -> Tensor:
        """The ratio's logit, [N] (training uses it: a saturated sigmoid would stop the gradient)."""
        _check_hidden(hidden, self.config)
        hidden = hidden.to(self.inp.weight.dtype)
        x = torch.cat([hidden.mean(dim=1), hidden[:, -1]], dim=-1)
        x = nn.functional.silu(self.inp(x))
        x = x + nn.functional.silu(self.res(x))
        return self.out(x).squeeze(-1)

    def forward(self, hidden: Tensor) -> Tensor:
        """Ratio in (0, 1), [N]: the predicted (accepted + 1) / B."""
        return torch.sigmoid(self.logit(hidden))

    def draft_lengths(self, hidden: Tensor) -> Tensor:
        """Drafts to verify, [N] long in [0, B-1]: the candidate length counts the anchor, drafts do not."""
        b = self.config.block_size
        candidate = torch.round(self.forward(hidden) * b * self.config.rate).clamp(1, b).long()
        return candidate - 1


class PositionAcceptanceHead(nn.Module):
    """Per draft position k=1..B-1: shared MLP on hidden[:, k] + a learned per-position bias -> logit."""

    def __init__(self, config: LengthHeadConfig) -> None:
        super().__init__()
        if config.kind != "position":
            raise ValueError(f"PositionAcceptanceHead needs kind='position', got {config.kind!r}")
        self.config = config
        self.fc1 = nn.Linear(config.hidden_size, config.head_dim)
        self.fc2 = nn.Linear(config.head_dim, 1)
        self.position_bias = nn.Parameter(torch.zeros(config.block_size - 1))

    def forward(self, hidden: Tensor) -> Tensor:
        """Uncalibrated logits [N, B-1] of P(draft k accepted | drafts 1..k-1 accepted)."""
        _check_hidden(hidden, self.config)
        x = hidden[:, 1:].to(self.fc1.weight.dtype)
        return self.fc2(nn.functional.silu(self.fc1(x))).squeeze(-1) + self.position_bias

    def accept_probs(self, hidden: Tensor) -> Tensor:
        """Calibrated conditional acceptance probabilities [N, B-1]."""
        return torch.sigmoid(self.forward(hidden) / self.config.temperature)

    def survival(self, hidden: Tensor) -> Tensor:
        """P(drafts 1..k all accepted), [N, B-1]; survival[:, :L].sum(-1) = expected accepted drafts at length L."""
        return torch.cumprod(self.accept_probs(hidden), dim=-1)

    def set_temperature(self, temperature: float) -> None:
        """Calibration is part of the config so it is saved with the head."""
        self.config = replace(self.config, temperature=float(temperature))


LengthHead = Union[BlockLengthHead, PositionAcceptanceHead]


def build_length_head(config: LengthHeadConfig) -> LengthHead:
    return BlockLengthHead(config) if config.kind == "block" else PositionAcceptanceHead(config)


def save_length_head(head: LengthHead, drafter_dir: str | Path) -> Path:
    """Weights first, then the config key, so config.json never points at a head that is not there yet."""
    drafter_dir = Path(drafter_dir)
    raw = read_config_json(drafter_dir, "a DFlash drafter checkpoint (config.json + model.safetensors)")
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in head.state_dict().items()}
    save_tensors(drafter_dir / HEAD_FILE, state)
    raw[CONFIG_KEY] = head.config.to_dict()
    atomic_write(drafter_dir / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(raw, indent=2) + "\n"))
    return drafter_dir / HEAD_FILE


def load_length_head(drafter_dir: str | Path, device: str | torch.device | None = None) -> LengthHead | None:
    """The head saved beside a drafter, in fp32 eval mode, or None if the drafter has none. `device`: default the
    process's (models/device/placement.py)."""
    drafter_dir = Path(drafter_dir)
    raw = read_config_json(drafter_dir, "a DFlash drafter checkpoint (config.json + model.safetensors)")
    if CONFIG_KEY not in raw:
        return None
    try:
        config = LengthHeadConfig.from_dict(raw[CONFIG_KEY])
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{drafter_dir / CONFIG_FILE}: bad {CONFIG_KEY}: {exc}") from exc
    head_file = drafter_dir / HEAD_FILE
    if not head_file.is_file():
        raise FileNotFoundError(f"{drafter_dir / CONFIG_FILE} declares a length head but {head_file} is missing")
    state = read_tensors(head_file)
    head = build_length_head(config)
    check_state(head_file, state, head.state_dict())
    head.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    return head.to(placed(device)).eval()
