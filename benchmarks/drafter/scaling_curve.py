"""A training run's report: the summary (JSON + markdown) and its scaling curves (held-out accept length per domain
against training tokens seen; the decoded one too where the run logged it).

    python benchmarks/drafter/scaling_curve.py runs/train/smollm2-drafter --out docs/results/drafter/training
"""

from __future__ import annotations

import argparse
from pathlib import Path

from adaflash.plots import pyplot
from adaflash.report import write_report
from adaflash.training.summary import summarise, to_markdown


def plot_scaling_curve(curve: list[dict], path: str | Path, title: str,
                       ylabel: str = "held-out accept length (full block, greedy)") -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    domains = sorted({k for r in curve for k in r} - {"step", "train_tokens_seen"})
    for domain in domains:
        points = [(r["train_tokens_seen"], r[domain]) for r in curve
                  if domain in r and r.get("train_tokens_seen") is not None]  # 0: where a continued run starts
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=domain, linewidth=2.5 if domain == "all" else 1.2)
    ax.set_xlabel("training response tokens seen")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True, help="path prefix: writes OUT.json, OUT.md and OUT_scaling.png")
    args = parser.parse_args()
    summary = summarise(Path(args.run_dir))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # the figures go first: the markdown links them
    markdown = to_markdown(summary)
    if summary["holdout_curve"]:
        png = plot_scaling_curve(summary["holdout_curve"], f"{out}_scaling.png", "Drafter scaling curve")
        markdown += f"\n![scaling curve]({png.name})\n"
    if summary["decoded_curve"]:
        png = plot_scaling_curve(summary["decoded_curve"], f"{out}_decoded_scaling.png", "Drafter scaling curve, decoded",
                                 "held-out tokens per target pass (full-block greedy decoding)")
        markdown += f"\n![decoded scaling curve]({png.name})\n"
    write_report(out, summary, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
