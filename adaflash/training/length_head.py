"""Train and calibrate a candidate-length head on recorded verification outcomes (its command, `adaflash train
length-head`, is in `training/cli.py`; its reliability diagram in `plots.py`).

Outcomes are censored: when the target verified only `drafted` < B-1 drafts and accepted all of them, we
do not know how many more it would have accepted. The block head trains only on uncensored outcomes; the
position head uses every observed position and masks the unknown ones. The position head's temperature
is then fitted on the held-out split, because its probabilities feed an expected-throughput scheduler
where a systematic over- or under-confidence directly mis-sizes the drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from adaflash.formats.outcomes import Outcomes
from adaflash.models.drafters.length_head import (KINDS, LengthHead, LengthHeadConfig, build_length_head,
    save_length_head)


@dataclass(frozen=True)
class LengthHeadTrainConfig:
    kind: str
    head_dim: int = 256
    lr: float = 2e-4
    epochs: int = 20
    batch_size: int = 256
    weight_decay: float = 0.0
    held_out_frac: float = 0.2
    seed: int = 0
    rate: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown length head kind {self.kind!r}; allowed kinds: {', '.join(KINDS)}")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")


# ---------------------------------------------------------------- labels


def uncensored(drafted: Tensor, accepted: Tensor, block_size: int) -> Tensor:
    """[N] bool: the full accepted length is known (whole block verified, or a rejection was observed)."""
    return (drafted == block_size - 1) | (accepted < drafted)


def block_labels(drafted: Tensor, accepted: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """(label [N] = clamp((accepted+1)/B, 0, 1), keep [N] bool = uncensored)."""
    label = ((accepted.float() + 1.0) / block_size).clamp(0.0, 1.0)
    return label, uncensored(drafted, accepted, block_size)


def position_labels(drafted: Tensor, accepted: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """(labels [N, B-1], mask [N, B-1]): 1 up to `accepted`, 0 at the first rejection if seen, rest unknown."""
    k = torch.arange(1, block_size, device=drafted.device).unsqueeze(0)
    a, d = accepted.unsqueeze(1), drafted.unsqueeze(1)
    labels = (k <= a).float()
    mask = k <= torch.minimum(a + 1, d)
    return labels, mask


# ---------------------------------------------------------------- calibration metrics


def reliability_bins(pred: Tensor, label: Tensor, bins: int = 10) -> list[dict[str, Any]]:
    """Equal-width bins over [0, 1] by prediction; empty bins have count 0 and None means."""
    pred, label = pred.detach().flatten().double().cpu(), label.detach().flatten().double().cpu()
    if pred.shape != label.shape:
        raise ValueError(f"pred and label differ in size: {pred.numel()} vs {label.numel()}")
    index = (pred * bins).floor().long().clamp(0, bins - 1)
    rows = []
    for b in range(bins):
        sel = index == b
        count = int(sel.sum())
        rows.append({
            "bin_lo": b / bins, "bin_hi": (b + 1) / bins,
            "mean_pred": float(pred[sel].mean()) if count else None,
            "frac_pos": float(label[sel].mean()) if count else None,
            "count": count,
        })
    return rows


def expected_calibration_error(pred: Tensor, label: Tensor, bins: int = 10) -> float:
    """Sum over bins of (bin share) x |mean prediction - mean label|."""
    rows = reliability_bins(pred, label, bins)
    total = sum(r["count"] for r in rows)
    if total == 0:
        raise ValueError("expected_calibration_error of no predictions")
    return sum(r["count"] / total * abs(r["mean_pred"] - r["frac_pos"]) for r in rows if r["count"])


def fit_temperature(logits: Tensor, labels: Tensor, lo: float = 0.05, hi: float = 20.0) -> float:
    """T minimising the BCE of sigmoid(logits / T): a log-spaced grid, then golden-section refinement.

    The NLL is convex in 1/T, hence unimodal in log T, so the bracket around the best grid point holds the optimum.
    """
    z, y = logits.detach().flatten().double().cpu(), labels.detach().flatten().double().cpu()
    if z.numel() == 0:
        return 1.0

    def nll(log_t: float) -> float:
        return float(F.binary_cross_entropy_with_logits(z / math.exp(log_t), y))

    grid = torch.linspace(math.log(lo), math.log(hi), 61).tolist()
    values = [nll(g) for g in grid]
    i = min(range(len(grid)), key=values.__getitem__)
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = nll(c), nll(d)
    for _ in range(40):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = nll(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = nll(d)
    return math.exp((a + b) / 2.0)


# ---------------------------------------------------------------- training


def _loss(head: LengthHead, kind: str, batch: Outcomes, device: str | torch.device) -> Tensor:
    hidden = batch.hidden.to(device)
    drafted, accepted = batch.drafted.to(device), batch.accepted.to(device)
    if kind == "block":
        label, _ = block_labels(drafted, accepted, batch.block_size)
        # The release fits the ratio with MSE; cross-entropy on the same fractional label has the same
        # minimiser (the label's conditional mean) but no vanishing gradient once the sigmoid saturates,
        # which stalled MSE at all-zero ratios on SmolLM2's drafter states (large-norm inputs).
        return F.binary_cross_entropy_with_logits(head.logit(hidden), label)
    labels, mask = position_labels(drafted, accepted, batch.block_size)
    bce = F.binary_cross_entropy_with_logits(head(hidden), labels, reduction="none")
    return (bce * mask).sum() / mask.sum().clamp(min=1)


@torch.inference_mode()
def _predict(head: LengthHead, hidden: Tensor, batch_size: int, device: str | torch.device) -> Tensor:
    """Raw head output (ratio [N] or logits [N, B-1]) on CPU, in batches so big hidden tensors stay bf16."""
    outs = [head(hidden[i:i + batch_size].to(device)).float().cpu() for i in range(0, len(hidden), batch_size)]
    return torch.cat(outs)


def _evaluate_position(head: LengthHead, train: Outcomes, held: Outcomes, cfg: LengthHeadTrainConfig,
                       device: str | torch.device) -> dict[str, Any]:
    b = held.block_size
    logits = _predict(head, held.hidden, cfg.batch_size, device)
    labels, mask = position_labels(held.drafted, held.accepted, b)
    z, y = logits[mask], labels[mask]
    if z.numel() == 0:
        return {"temperature": 1.0, "note": "no observed positions in the held-out split: not calibrated"}
    temperature = fit_temperature(z, y)
    head.set_temperature(temperature)
    p_before, p_after = torch.sigmoid(z), torch.sigmoid(z / temperature)
    train_labels, train_mask = position_labels(train.drafted, train.accepted, b)
    base_rate = float(train_labels[train_mask].mean()) if train_mask.any() else float(y.mean())
    report: dict[str, Any] = {
        "temperature": temperature,
        "ece_before": expected_calibration_error(p_before, y),
        "ece_after": expected_calibration_error(p_after, y),
        "brier_before": float(((p_before - y) ** 2).mean()),
        "brier": float(((p_after - y) ** 2).mean()),
        "brier_constant": float(((base_rate - y) ** 2).mean()),
        "n_held_out_positions": int(z.numel()),
        "reliability": reliability_bins(p_after, y),
    }
    keep = uncensored(held.drafted, held.accepted, b)
    if keep.any():
        expected = torch.cumprod(torch.sigmoid(logits[keep] / temperature), dim=-1).sum(-1)
        observed = held.accepted[keep].float()
        train_keep = uncensored(train.drafted, train.accepted, b)
        mean_train = float(train.accepted[train_keep].float().mean()) if train_keep.any() else float(observed.mean())
        report.update(
            n_held_out_uncensored=int(keep.sum()),
            expected_accepted_mean=float(expected.mean()),
            observed_accepted_mean=float(observed.mean()),
            accepted_mae=float((expected - observed).abs().mean()),
            accepted_mae_constant=float((mean_train - observed).abs().mean()),
        )
    return report


def _evaluate_block(head: LengthHead, train: Outcomes, held: Outcomes, cfg: LengthHeadTrainConfig,
                    device: str | torch.device) -> dict[str, Any]:
    b = held.block_size
    label, keep = block_labels(held.drafted, held.accepted, b)
    if not keep.any():
        return {"note": "no uncensored outcomes in the held-out split: not evaluated"}
    ratio = _predict(head, held.hidden, cfg.batch_size, device)[keep]
    y = label[keep]
    observed = held.accepted[keep].float()
    train_label, train_keep = block_labels(train.drafted, train.accepted, b)
    mean_label = float(train_label[train_keep].mean()) if train_keep.any() else float(y.mean())
    mean_accepted = float(train.accepted[train_keep].float().mean()) if train_keep.any() else float(observed.mean())
    drafts = (torch.round(ratio * b * cfg.rate).clamp(1, b) - 1).float()
    return {
        "n_held_out_uncensored": int(keep.sum()),
        "mse": float(((ratio - y) ** 2).mean()),
        "mse_constant": float(((mean_label - y) ** 2).mean()),
        "ece": expected_calibration_error(ratio, y),
        "expected_accepted_mean": float((ratio * b - 1).mean()),
        "observed_accepted_mean": float(observed.mean()),
        "accepted_mae": float((ratio * b - 1 - observed).abs().mean()),
        "accepted_mae_constant": float((mean_accepted - observed).abs().mean()),
        "draft_length_mae": float((drafts - observed).abs().mean()),
        "reliability": reliability_bins(ratio, y),
    }


def train_length_head(outcomes: Outcomes, cfg: LengthHeadTrainConfig, hidden_size: int, block_size: int,
                      device: str | torch.device = "cpu") -> tuple[LengthHead, dict[str, Any]]:
    """AdamW on the train split (seeded init and shuffles), then held-out calibration and metrics."""
    if (outcomes.block_size, outcomes.hidden_size) != (block_size, hidden_size):
        raise ValueError(
            f"outcomes were recorded with [B, d] = [{outcomes.block_size}, {outcomes.hidden_size}], "
            f"the drafter has [{block_size}, {hidden_size}]"
        )
    train, held = outcomes.split(cfg.held_out_frac, cfg.seed)
    fit_set = train
    if cfg.kind == "block":
        fit_set = train.select(uncensored(train.drafted, train.accepted, block_size).nonzero().squeeze(-1))
    if len(fit_set) == 0:
        raise ValueError(f"no usable training outcomes for a {cfg.kind} head ({len(train)} in the train split)")
    head_cfg = LengthHeadConfig(kind=cfg.kind, hidden_size=hidden_size, block_size=block_size,
                                head_dim=cfg.head_dim, rate=cfg.rate)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        head = build_length_head(head_cfg)
    head.to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    shuffle = torch.Generator().manual_seed(cfg.seed + 1)
    epoch_losses = []
    for _ in range(cfg.epochs):
        total, count = 0.0, 0
        for index in torch.randperm(len(fit_set), generator=shuffle).split(cfg.batch_size):
            loss = _loss(head, cfg.kind, fit_set.select(index), device)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total, count = total + float(loss.detach()) * len(index), count + len(index)
        epoch_losses.append(total / count)
    head.eval()
    report: dict[str, Any] = {
        "kind": cfg.kind, "n_train": len(train), "n_fit": len(fit_set), "n_held_out": len(held),
        "block_size": block_size, "hidden_size": hidden_size, "train_loss": epoch_losses,
    }
    if len(held):
        evaluate = _evaluate_position if cfg.kind == "position" else _evaluate_block
        report.update(evaluate(head, train, held, cfg, device))
    return head, report


def summary_line(report: dict[str, Any]) -> str:
    parts = [f"{report['kind']} head: {report['n_train']} train / {report['n_held_out']} held-out outcomes"]
    if "ece_after" in report:
        parts.append(f"ECE {report['ece_before']:.3f} -> {report['ece_after']:.3f} (T={report['temperature']:.2f})")
        parts.append(f"Brier {report['brier']:.4f} (constant {report['brier_constant']:.4f})")
    if "ece" in report:
        parts.append(f"ECE {report['ece']:.3f}, MSE {report['mse']:.4f} (constant {report['mse_constant']:.4f})")
    if "accepted_mae" in report:
        parts.append(f"accepted-drafts MAE {report['accepted_mae']:.2f} (constant {report['accepted_mae_constant']:.2f})")
    if "note" in report:
        parts.append(report["note"])
    return "; ".join(parts)
