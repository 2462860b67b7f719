"""Summarise a training run's metrics.jsonl into docs-ready numbers and markdown (no plotting here).

The script that writes them, with the scaling-curve figure: `python benchmarks/drafter/scaling_curve.py RUN --out OUT`.
"""

from __future__ import annotations

import json
from pathlib import Path

from adaflash.report import markdown_table


def summarise(run_dir: Path) -> dict:
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # A run killed between checkpoints logs some steps twice (before the kill and after the resume): keep the last.
    every = sorted({r["step"]: r for r in logged}.values(), key=lambda r: r["step"])
    records = [r for r in every if "loss" in r]  # holdout-only records carry no training window
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    config = json.loads((run_dir / "drafter" / "config.json").read_text()) if (run_dir / "drafter").is_dir() else None
    tail = records[-5:]  # average the last windows: single windows are noisy
    mean = lambda key: sum(r[key] for r in tail) / len(tail)
    positions = len(tail[0]["accuracy"])
    return {
        "run_dir": str(run_dir),
        "steps": records[-1]["step"],
        "elapsed_s": records[-1]["elapsed_s"],
        "first_loss": records[0]["loss"],
        "final_loss": mean("loss"),
        "final_accuracy_by_position": [sum(r["accuracy"][k] for r in tail) / len(tail) for k in range(positions)],
        "final_expected_accept_len": mean("expected_accept_len"),
        "curve": [{"step": r["step"], "loss": r["loss"], "accuracy_1": r["accuracy"][0],
                   "expected_accept_len": r["expected_accept_len"]} for r in records],
        # Held-out accept length per domain at each checkpoint, against the training tokens seen so far.
        "holdout_curve": _curve(every, "holdout"),
        # The same held-out responses walked as greedy decoding would: tokens per target pass (validation.py).
        "decoded_curve": _curve(every, "holdout_decoded"),
        "drafter_config": config,
    }


def to_markdown(s: dict) -> str:
    acc = ", ".join(f"{a:.2f}" for a in s["final_accuracy_by_position"][:8])
    return "\n".join([
        "# Drafter training log summary",
        "",
        f"Run: `{s['run_dir']}`, {s['steps']} steps ({s['elapsed_s'] / 60:.0f} min in its last resumed invocation).",
        "",
        markdown_table(["", "value"], [
            ["loss (first window -> mean of last 5 windows)", f"{s['first_loss']:.2f} -> {s['final_loss']:.2f}"],
            ["training accuracy, block positions 1-8 (last windows)", acc],
            ["expected accept length on training anchors (greedy, incl. bonus)", f"{s['final_expected_accept_len']:.3f}"]]),
        "",
        "The full curve (loss, position-1 accuracy, expected accept length per logged window) is in the JSON.",
        "",
        *_holdout_table(s["holdout_curve"], "Held-out teacher-forced full-block accept length at random anchors "
                        "(greedy, incl. bonus) per domain, by training tokens seen:"),
        *_holdout_table(s.get("decoded_curve", []), "Held-out decoded accept length (the same responses walked as "
                        "full-block greedy decoding would: tokens per target pass) per domain, by training tokens seen:"),
    ])


def _curve(records: list[dict], key: str) -> list[dict]:
    return [{"step": r["step"], "train_tokens_seen": r.get("train_tokens_seen"), **r[key]} for r in records if r.get(key)]


def _holdout_table(curve: list[dict], title: str) -> list[str]:
    if not curve:
        return []
    domains = sorted({k for r in curve for k in r} - {"step", "train_tokens_seen"})
    rows = [[r["step"], f"{r['train_tokens_seen'] / 1e3:.0f}K" if r.get("train_tokens_seen") is not None else "-",
             *(f"{r[d]:.3f}" if d in r else "-" for d in domains)] for r in curve]
    return [title, "", markdown_table(["step", "training tokens seen", *domains], rows), ""]
