"""Figures for the evaluation reports, the length-head calibration and online adaptation (matplotlib, headless
Agg backend; `pip install adaflash[plots]`). Training code returns numbers; the commands that want a figure call
these.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

DOMAIN_COLORS = {"math": "#1f77b4", "code": "#2ca02c", "chat": "#ff7f0e"}


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: plotting is an optional extra)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers or in tests
    import matplotlib.pyplot as plt

    return plt


def _color(domain: str) -> str:
    return DOMAIN_COLORS.get(domain, "#7f7f7f")


def plot_accept_length(rows: Sequence[dict], path: str | Path, title: str) -> Path:
    """Bars of mean accept length (± std) per benchmark, coloured by domain. Rows: benchmark, domain, mean, std."""
    plt = pyplot()
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
    plt = pyplot()
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


def plot_reliability(bins: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Reliability diagram: observed frequency per bin against the diagonal of perfect calibration."""
    plt = pyplot()
    rows = [r for r in bins if r["count"]]
    fig, ax = plt.subplots(figsize=(4.8, 4.8))
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    ax.bar([(r["bin_lo"] + r["bin_hi"]) / 2 for r in rows], [r["frac_pos"] for r in rows],
           width=[r["bin_hi"] - r["bin_lo"] for r in rows], alpha=0.3, edgecolor="C0", label="observed (bin)")
    ax.plot([r["mean_pred"] for r in rows], [r["frac_pos"] for r in rows], "o-", color="C0", label="mean prediction")
    for r in rows:
        ax.annotate(str(r["count"]), ((r["bin_lo"] + r["bin_hi"]) / 2, r["frac_pos"]), fontsize=7,
                    ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
    ax.set(xlim=(0, 1), ylim=(0, 1.05), xlabel="predicted", ylabel="observed", title=title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_online(rounds: list[dict], path: str | Path) -> Path:
    """Accept length per online round (`adaflash online`'s online.json rounds), rolled-back rounds marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["round"] for r in rounds]
    ax.plot(xs, [r["held_out_accept_len"] for r in rounds], marker="o", label="held-out slice (published version)")
    ax.plot(xs, [r["gsm8k_accept_len"] for r in rounds], marker="s", label="gsm8k eval (published version)")
    served = [(r["round"], r["served_accept_len"]) for r in rounds if "served_accept_len" in r]
    if served:
        ax.plot(*zip(*served), marker="^", linestyle="--", label="served during the round (policy lengths)")
    for r in rounds:
        if not r["promoted"]:
            ax.annotate("rolled back", (r["round"], r["held_out_accept_len"]), fontsize=8)
    ax.set_xlabel("online round")
    ax.set_ylabel("accept length (tokens / target pass)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
