"""CE vs CE+KL (the stored top-32 soft targets) at equal steps from the shipped v9 drafter.

Both runs: runs/scratch/s13/v10-{ce,cekl}.toml = configs/smollm2-drafter-v9.toml's data (runs/data/smollm2-v4 + v5,
1.32M response tokens) and held-out split, init_from v9, lr 5e-5 (3% warm-up, cosine to 0), 1400 steps of 2 sequences x
32 anchors, seed 2 (the same sample order for both), fp32 on AMD EPYC Zen 3 (2 cores). Run from the repo root after
both trainings: python benchmarks/drafter/loss_ab.py -> loss_ab.{json,md}."""
import json
from pathlib import Path

RUNS = {"ce": "runs/train/smollm2-drafter-v10-ce", "ce+kl": "runs/train/smollm2-drafter-v10-cekl"}
curves = {}
for name, run in RUNS.items():
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curves[name] = {r["step"]: r["holdout"] for r in rows if "holdout" in r}
steps = sorted(set(curves["ce"]) & set(curves["ce+kl"]))
last = steps[-1]
domains = sorted(curves["ce"][last])
winner = max(curves, key=lambda n: curves[n][last]["all"])
report = {"what": __doc__.split("\n\n")[0], "steps": steps, "holdout": curves, "final_step": last, "winner": winner}
Path("docs/results/drafter/loss_ab.json").write_text(json.dumps(report, indent=1) + "\n")
lines = ["# Drafter loss A/B at equal steps from v9: CE vs CE+KL", "", __doc__.split("\n\n")[1], "",
         "Held-out teacher-forced full-block accept length (greedy, incl. bonus), 64 held-out samples:", "",
         "| step | " + " | ".join(f"{n} {d}" for n in curves for d in domains) + " |",
         "|---|" + "---|" * (len(curves) * len(domains))]
for s in steps:
    lines.append(f"| {s} | " + " | ".join(f"{curves[n][s][d]:.3f}" for n in curves for d in domains) + " |")
Path("docs/results/drafter/loss_ab.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
