"""Figures for the evaluation reports (matplotlib, headless Agg backend; `pip install adaflash[plots]`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

DOMAIN_COLORS = {"math": "#1f77b4", "code": "#2ca02c", "chat": "#ff7f0e"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers or in tests
    import matplotlib.pyplot as plt

    return plt


def _color(domain: str) -> str:
    return DOMAIN_COLORS.get(domain, "#7f7f7f")


def plot_accept_length(rows: Sequence[dict], path: str | Path, title: str) -> Path:
    """Bars of mean accept length (± std) per benchmark, coloured by domain. Rows: benchmark, domain, mean, std."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["benchmark"] for r in rows]
    means = [r["accept_len_mean"] or 0.0 for r in rows]
    stds = [r["accept_len_std"] or 0.0 for r in rows]
    ax.bar(names, means, yerr=stds, capsize=4, color=[_color(r["domain"]) for r in rows])
    for domain in dict.fromkeys(r["domain"] for r in rows):  # legend: one patch per domain, in order of appearance
        ax.bar([0], [0], width=0, color=_color(domain), label=domain)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")  # what AR commits per pass
    ax.set_ylabel("accept length (tokens / target pass)")
    ax.set_title(title)
    ax.legend()
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_per_position(curves: dict[str, Sequence[float | None]], path: str | Path, title: str) -> Path:
    """One acceptance-rate curve per domain over draft positions k = 1..K (gaps where nothing was eligible)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for domain, rates in curves.items():
        ys = [math.nan if r is None else r for r in rates]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", color=_color(domain), label=domain)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted | 1..k-1 accepted)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    if curves:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
