"""Adaptive prompt-lookup lengths, simulated as prompt_lookup_sim.py does (6 shards of runs/data/smollm2-v4, the same
profiled fp32 verify costs): a per-request K moved by each rule after every lookup, starting at 3.
Run from the repo root: python docs/results/prompt_lookup_sim_adaptive.py; output: prompt_lookup_sim_adaptive.txt."""
import json
import sys
sys.path.insert(0, "."); sys.path.insert(0, "docs/results")  # run from the repo root
from pathlib import Path
from collections import defaultdict
from prompt_lookup_sim import responses, step_cost
from adaflash.speculative.prompt_lookup import PromptLookup
profile = json.loads((Path.home() / ".cache/adaflash/cost_models/smollm2-135m-float32-L2-B16-V4096-T16-th2-k2b688f0c68.json").read_text())
samples = list(responses(Path("runs/data/smollm2-v4"), 6))
look = PromptLookup(15, 3, 2)
def run(rule):
    per = defaultdict(lambda: [0, 0.0])
    for dom, toks, p in samples:
        t, L = p + 1, 3
        while t < len(toks):
            d = look.propose(toks[:t], min(L, len(toks) - t - 1))
            a = 0
            while a < len(d) and d[a] == toks[t + a]: a += 1
            per[dom][0] += a + 1; per[dom][1] += step_cost(profile, len(d) + 1)
            if d: L = rule(L, len(d), a)
            t += a + 1
    return {d: round(n * step_cost(profile, 1) / s, 2) for d, (n, s) in sorted(per.items())}
rules = {
 "fixed3": lambda L, d, a: 3,
 "+2/-1 (min 1)": lambda L, d, a: min(15, L + 2) if a == d else max(1, L - 1),
 "+2/-1 (min 2)": lambda L, d, a: min(15, L + 2) if a == d else max(2, L - 1),
 "x2 / accepted+1": lambda L, d, a: min(15, 2 * L) if a == d else max(2, a + 1),
 "+4 / 3": lambda L, d, a: min(15, L + 4) if a == d else 3,
}
for name, rule in rules.items():
    print(name, run(rule), flush=True)
