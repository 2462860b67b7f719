"""The drafter's RoPE rows for one sequence as views of the table (session 18) against a gather (before), alternating
generation by generation in one process: greedy speculative generation at batch 1 (int8 target, the shipped drafter,
2 drafts a step, the demo's four chat prompts); median ms of the drafter's calls (context feeds and proposes mixed).

    python docs/results/session18/drafter_rope_ab.py [ROUNDS=6]
"""
import statistics, sys, time, torch
from adaflash.evaluation.demo import DEMO_PROMPTS
from adaflash.models.drafter import DFlashDrafter
from adaflash.models.drafter_checkpoint import load_drafter
from adaflash.models.layers import rope_cos_sin
from adaflash.models.registry import load_tokenizer, resolve_target
from adaflash.models.target import load_target_as
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import speculative_generate
torch.set_num_threads(2)
path = resolve_target("smollm2-135m")
target = load_target_as(path, "int8")
prop = DFlashProposer(load_drafter("adaflash/assets/drafters/smollm2-135m", dtype=torch.float32), target)
tok = load_tokenizer(path)
prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False) for _, t in DEMO_PROMPTS]
new = DFlashDrafter._rope
def old(self, batch):
    return rope_cos_sin(batch.positions.to(self.device), self.config.head_dim, self.config.rope_theta, self.dtype)
T = {"old": [], "new": []}; mode = ["new"]
add, propose = prop.add_context, prop.propose
def timed(fn):
    def g(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k); T[mode[0]].append(time.perf_counter() - t); return r
    return g
prop.add_context, prop.propose = timed(add), timed(propose)
outs = {}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for name, fn in (("old", old), ("new", new)):
        mode[0] = name; DFlashDrafter._rope = fn
        for i, p in enumerate(prompts):
            outs[name, i] = speculative_generate(target, prop, p, 64, draft_length=2).token_ids
o, n = (1e3 * statistics.median(T[k]) for k in ("old", "new"))
print(f"drafter calls (context feed + propose): old {o:.3f} ms  new {n:.3f} ms  new/old {n/o:.3f}  same tokens: {all(outs['old', i] == outs['new', i] for i in range(len(prompts)))}")
