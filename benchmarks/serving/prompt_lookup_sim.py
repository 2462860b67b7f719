"""What prompt-lookup drafts would buy at batch 1, simulated along the target's own greedy responses.

    python benchmarks/serving/prompt_lookup_sim.py --data runs/data/smollm2-v4 --shards 12 \
        --cost-model ~/.cache/adaflash/cost_models/smollm2-135m-float32-L2-B16-V4096-T16-th2-k2b688f0c68.json

Regenerated data (`adaflash data generate`) holds each prompt and the target's greedy response, so replaying a
response step by step is exactly what greedy prompt-lookup decoding would do: at each step `PromptLookup.propose`
drafts from the committed tokens, the drafts agreeing with the response are accepted, plus one token from the
target. A step costs the profiled verify time of its width (the engine's cost model, interpolated), so the
estimated speedup = tokens x (1-token step) / sum of step costs; no drafter, no per-step overhead beyond the profile.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from safetensors import safe_open

from adaflash.speculative.prompt_lookup import PromptLookup


def responses(data: Path, shards: int):
    manifest = json.loads((data / "manifest.json").read_text())
    for shard in manifest["shards"][:shards]:
        with safe_open(str(data / shard["file"]), "pt") as f:  # token ids only, not the features
            tokens, offsets = f.get_tensor("tokens").tolist(), f.get_tensor("offsets").tolist()
            prompt_lens = f.get_tensor("prompt_lens").tolist()
        for j, domain in enumerate(shard["domains"]):
            yield domain, tokens[offsets[j] : offsets[j + 1]], prompt_lens[j]


def step_cost(profile: dict, width: int) -> float:
    xs, ys = profile["total_tokens"], profile["verify_s"]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if width <= x1:
            return y0 + (y1 - y0) * (width - x0) / (x1 - x0)
    return ys[-1] * width / xs[-1]


def simulate(samples, lookup: PromptLookup, profile: dict) -> dict:
    per = defaultdict(lambda: {"tokens": 0, "steps": 0, "seconds": 0.0, "lookup_steps": 0, "lookup_accepted": 0})
    for domain, tokens, prompt_len in samples:
        s, t = per[domain], prompt_len + 1  # the prefill's token is committed
        while t < len(tokens):
            drafts = lookup.propose(tokens[:t], len(tokens) - t - 1)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == tokens[t + accepted]:
                accepted += 1
            s["tokens"] += accepted + 1
            s["steps"] += 1
            s["seconds"] += step_cost(profile, len(drafts) + 1)
            s["lookup_steps"] += bool(drafts)
            s["lookup_accepted"] += accepted
            t += accepted + 1
    return {d: {**s, "tokens_per_step": s["tokens"] / s["steps"], "lookup_share": s["lookup_steps"] / s["steps"],
                "accepted_per_lookup": s["lookup_accepted"] / max(1, s["lookup_steps"]),
                "speedup": s["tokens"] * step_cost(profile, 1) / s["seconds"]} for d, s in sorted(per.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--shards", type=int, default=12)
    p.add_argument("--cost-model", required=True, help="a profiled cost model JSON (~/.cache/adaflash/cost_models/)")
    p.add_argument("--tokens", default="2,3,4,6,8")
    p.add_argument("--min-ngrams", default="2,3")
    p.add_argument("--out", default="docs/results/serving/prompt_lookup_sim")
    args = p.parse_args()
    profile = json.loads(Path(args.cost_model).expanduser().read_text())
    samples = list(responses(Path(args.data), args.shards))
    runs = []
    for k in map(int, args.tokens.split(",")):
        for n in map(int, args.min_ngrams.split(",")):
            runs.append({"num_tokens": k, "min_ngram": n, "by_domain": simulate(samples, PromptLookup(k, 3, n), profile)})
            print(k, n, {d: round(m["speedup"], 2) for d, m in runs[-1]["by_domain"].items()}, flush=True)
    report = {"command": " ".join(["python benchmarks/serving/prompt_lookup_sim.py", "--data", args.data, "--shards",
                                   str(args.shards), "--cost-model", args.cost_model]),
              "samples": len(samples), "profile": profile, "runs": runs}
    Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=1))
    domains = sorted(runs[0]["by_domain"])
    lines = ["| K | min n-gram | " + " | ".join(f"{d}: tokens/step, lookup steps, accepted/lookup, est. speedup" for d in domains) + " |",
             "|---|---|" + "---|" * len(domains)]
    for r in runs:
        cells = [f"{m['tokens_per_step']:.2f}, {m['lookup_share']:.0%}, {m['accepted_per_lookup']:.2f}, **{m['speedup']:.2f}x**"
                 for m in (r["by_domain"][d] for d in domains)]
        lines.append(f"| {r['num_tokens']} | {r['min_ngram']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))  # the table of prompt_lookup_sim.md


if __name__ == "__main__":
    main()
