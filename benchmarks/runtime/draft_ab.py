"""The proposer's one-call draft (drafter layers, final norm and draft head in one kernel call) against the two-call
path before it (draft_hidden, then draft_tokens), alternating in one process: greedy speculative generation at batch 1
(reference loop, int8 target, the shipped drafter, DRAFTS drafted tokens a step) on the demo's four chat prompts;
median ms of the propose call and of a whole generation, and whether both give the same tokens.

    python benchmarks/runtime/draft_ab.py [DRAFTS=2] [ROUNDS=5]
"""
import statistics, sys, time

import torch

from adaflash.evaluation.demo import DEMO_PROMPTS
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.drafter_checkpoint import load_drafter
from adaflash.models.registry import load_tokenizer, resolve_target
from adaflash.models.targets import load_target_as
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import speculative_generate

drafts = int(sys.argv[1]) if len(sys.argv) > 1 else 2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
torch.set_num_threads(2)
path = resolve_target("smollm2-135m")
target = load_target_as(path, "int8")
proposer = DFlashProposer(load_drafter("adaflash/assets/drafters/smollm2-135m", dtype=torch.float32), target)
tok = load_tokenizer(path)
prompts = [tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for _, text in DEMO_PROMPTS]
real = DFlashDrafter.draft_logits
propose = proposer.propose
timed = {"one call": [], "two calls": []}
gen = {"one call": [], "two calls": []}
outs = {}
mode = ["one call"]


def timed_propose(*a, **k):
    t = time.perf_counter()
    out = propose(*a, **k)
    timed[mode[0]].append(time.perf_counter() - t)
    return out


proposer.propose = timed_propose
for _ in range(rounds):
    for name in ("one call", "two calls"):
        mode[0] = name
        DFlashDrafter.draft_logits = real if name == "one call" else (lambda self, *a: None)
        for i, p in enumerate(prompts):
            t = time.perf_counter()
            outs[name, i] = speculative_generate(target, proposer, p, 64, draft_length=drafts).token_ids
            gen[name].append(time.perf_counter() - t)
same = all(outs["one call", i] == outs["two calls", i] for i in range(len(prompts)))
one, two = (1e3 * statistics.median(timed[n]) for n in ("one call", "two calls"))
g1, g2 = (statistics.median(gen[n]) for n in ("one call", "two calls"))
print(f"int8 target, {drafts} drafts a step, {rounds} rounds x {len(prompts)} prompts x 64 tokens, 2 threads")
print(f"propose: one call {one:.3f} ms  two calls {two:.3f} ms  one/two {one / two:.3f}")
print(f"generation: one call {g1:.3f} s  two calls {g2:.3f} s  one/two {g1 / g2:.3f}  same tokens: {same}")
