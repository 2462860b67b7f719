"""`adaflash demo`: AR vs DFlash speculative decoding on a few chat, code and math prompts.

Checks that every method produces the same tokens (greedy) and prints tokens/s, accept length and speedup: medians
over rounds in which the methods alternate prompt by prompt (this CPU's speed drifts by tens of percent a minute).
Where the target has a smaller sibling of its tokenizer (registry.DRAFT_MODELS; or --draft-model), that draft model
drafting autoregressively is one more variant: the classic CPU setup (llama.cpp's -md) beside the block drafter.
"""

from __future__ import annotations

import statistics
import sys
from tqdm import tqdm

from adaflash.models.targets.registry import paired_draft_model, shipped_drafter
from adaflash.pipeline import Pipeline
from adaflash.speculative.prompt_lookup import PromptLookup

DEMO_PROMPTS = [
    ("chat", "Give me three tips for staying focused while working from home."),
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively."),
    ("math", "A shop sells pencils at 3 for $1. How much do 12 pencils cost? Explain step by step."),
    ("multilingual", "Löse Schritt für Schritt: Ein Zug fährt 3 Stunden mit 80 km/h. Wie weit fährt er?"),
]

# Prompt-lookup drafts a step: 3 paid best here on every domain of the target's own responses, since a 5-token
# verify already costs ~2x a decode step on a 2-core CPU (docs/results/serving/prompt_lookup_sim.md).
DEMO_LOOKUP_TOKENS = 3


def run_demo(model: str, drafter: str | None, dtype: str, max_new_tokens: int, draft_vocab: str | None = None,
             rounds: int = 5, draft_model: str | None = None, draft_max: int = 4) -> int:
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    draft_model = draft_model or paired_draft_model(model)
    shipped = shipped_drafter(model)
    if drafter is None and shipped is not None:
        drafter = str(shipped)
    pipeline = Pipeline.load(model, drafter, dtype, draft_vocab=draft_vocab)
    if pipeline.proposer is None:
        print(
            "NOTE: no trained drafter is available for this target yet; using an UNTRAINED (random) drafter.\n"
            "      Output stays identical to AR (lossless), but almost nothing is accepted, so expect a slowdown.",
            file=sys.stderr,
        )
        pipeline = pipeline.with_untrained_drafter()
    else:
        print(f"drafter: {drafter}", file=sys.stderr)
    print(f"target: {model} ({pipeline.target.dtype}), max_new_tokens={max_new_tokens}", file=sys.stderr)

    # Fixed full-block drafting (DFlash as published), a fixed short draft (what pays on a CPU where the drafter's
    # acceptance is modest), the throughput-aware length policy, which drafts only as far as this machine's verify
    # cost and the drafter's running acceptance make worthwhile, and that policy behind prompt-lookup drafts (free
    # where the text repeats itself).
    def with_policy(spec: str, lookup: PromptLookup | None = None) -> Pipeline:
        return Pipeline(pipeline.target, pipeline.tokenizer, pipeline.proposer, model, spec, prompt_lookup=lookup)

    variants = {
        "ar": (pipeline, "ar"),
        "dflash-full": (pipeline, "dflash"),
        "dflash-2": (with_policy("fixed:2"), "dflash"),
        "dflash-adaptive": (with_policy("throughput"), "dflash"),
        "dflash-adaptive-lookup": (with_policy("throughput", PromptLookup(DEMO_LOOKUP_TOKENS)), "dflash"),
    }
    speculative = {"dflash-full": "full-block", "dflash-2": "2 drafts", "dflash-adaptive": "adaptive",
                   "dflash-adaptive-lookup": "adaptive+lookup"}
    if draft_model is not None:  # under the same adaptive policy as the drafter's
        drafting = pipeline.with_draft_model(draft_model, dtype, draft_max).with_length_policy("throughput")
        variants["draft-model"] = (drafting, "dflash")
        speculative["draft-model"] = f"{draft_model} adaptive"
        print(f"draft model: {draft_model} (up to {draft_max} drafts a step)", file=sys.stderr)
    # Every round runs each prompt under every variant back to back, the variants' order rotated round by round, so
    # a drift of the machine's speed falls on all of them; a speedup is the median over rounds of a run's tok/s over
    # the same round's AR run.
    runs: dict[str, dict[str, list[dict]]] = {domain: {name: [] for name in variants} for domain, _ in DEMO_PROMPTS}
    all_identical = True
    names = list(variants)
    with tqdm(total=rounds * len(variants) * len(DEMO_PROMPTS), desc="demo", unit="run", file=sys.stderr) as bar:
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for domain, text in DEMO_PROMPTS:
                ids = pipeline.encode(messages=[{"role": "user", "content": text}])
                results = {}
                for name in order:
                    runner, method = variants[name]
                    bar.set_postfix_str(f"{domain}/{name}")
                    results[name] = runner.complete(ids, method=method, max_new_tokens=max_new_tokens)
                    bar.update(1)
                all_identical &= all(res.token_ids == results["ar"].token_ids for res in results.values())
                for name, res in results.items():
                    runs[domain][name].append(res.stats)

    header = "".join(f"{label + ' tok/s':>{len(label) + 8}}{'accept':>8}{'speedup':>9}"
                     for label in speculative.values())
    print(f"\n{'domain':<13}{'AR tok/s':>10}{header}   (medians of {rounds} round(s))")
    speedups: dict[str, list[float]] = {v: [] for v in speculative}
    for domain, by_name in runs.items():
        ar_runs = [x["tokens_per_s"] for x in by_name["ar"]]
        cells = ""
        for v, label in speculative.items():
            ratio = statistics.median(x["tokens_per_s"] / a for x, a in zip(by_name[v], ar_runs))
            speedups[v].append(ratio)
            cells += (f"{statistics.median(x['tokens_per_s'] for x in by_name[v]):>{len(label) + 8}.1f}"
                      f"{statistics.median(x['accept_len_mean'] for x in by_name[v]):>8.2f}{ratio:>8.2f}x")
        print(f"{domain:<13}{statistics.median(ar_runs):>10.1f}{cells}")
    for v in speculative:
        print(f"{v}: median speedup {statistics.median(speedups[v]):.2f}x")
    print(f"outputs identical to AR: {'yes' if all_identical else 'NO'}")
    return 0 if all_identical else 1
