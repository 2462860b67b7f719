"""Prompt lookups sized by expected throughput (the engine's `LookupLength`) against verifying every match whole,
simulated as prompt_lookup_sim.py does: 6 shards of runs/data/smollm2-v4 (the target's own greedy responses), the
profiled fp32 batch-1 verify costs; one request per response, the pooled lookup estimate carried across responses
as a server carries it. Run from the repo root: python benchmarks/serving/prompt_lookup_sim_sized.py
Output: docs/results/serving/prompt_lookup_sim_sized.txt (estimated speedup over AR per domain)."""
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, ".")  # run from the repo root; prompt_lookup_sim.py is beside this script
from prompt_lookup_sim import responses, step_cost  # noqa: E402

from adaflash.speculative.cost_model import CostModel  # noqa: E402
from adaflash.speculative.length_policy import LookupLength  # noqa: E402
from adaflash.engine.request import Request  # noqa: E402
from adaflash.speculative.prompt_lookup import PromptLookup  # noqa: E402

PROFILE = Path.home() / ".cache/adaflash/cost_models/smollm2-135m-float32-L2-B16-V4096-T16-th2-k2b688f0c68.json"
profile = json.loads(PROFILE.read_text())
cost = CostModel(tuple(profile["total_tokens"]), tuple(profile["verify_s"]), profile["draft_s"])
samples = list(responses(Path("runs/data/smollm2-v4"), 6))


def run(k: int, sized: bool) -> dict:
    lookup, policy = PromptLookup(k, 3, 2), LookupLength(cost) if sized else None
    per = defaultdict(lambda: [0, 0.0])
    for domain, tokens, prompt_len in samples:
        request, t = Request("r", tokens[:prompt_len], len(tokens)), prompt_len + 1
        while t < len(tokens):
            drafts = lookup.propose(tokens[:t], len(tokens) - t - 1)
            if drafts and policy is not None:
                drafts = drafts[: policy.decide([request], [drafts])[0]]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == tokens[t + accepted]:
                accepted += 1
            per[domain][0] += accepted + 1
            per[domain][1] += step_cost(profile, len(drafts) + 1)
            if drafts and policy is not None:
                policy.feedback(request, len(drafts), accepted)
            t += accepted + 1
    return {d: round(n * step_cost(profile, 1) / s, 3) for d, (n, s) in sorted(per.items())}


print(f"{len(samples)} responses; verify costs {PROFILE.name}: {profile['verify_s']}")
for k in (3, 8, 15):
    for sized in (False, True):
        print(f"K={k:<2} {'sized by throughput' if sized else 'all verified':<20}", run(k, sized), flush=True)
