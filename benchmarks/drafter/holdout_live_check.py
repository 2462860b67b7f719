"""Live full-block greedy decoding of the v9 drafter's 64 held-out training-distribution prompts (never trained on),
to check the trainer's teacher-forced held-out numbers against real decoding (docs/drafter.md, "Held-out accept length").

    python benchmarks/drafter/holdout_live_check.py int8 64   # -> docs/results/drafter/holdout_live_check_int8.json

Needs the regenerated data (runs/data/smollm2-v4, -v5) and the v9 run (runs/train/smollm2-drafter-v9) of this machine.
"""
import json, sys, time, statistics
from pathlib import Path
import torch
from adaflash.training.datagen import load_manifest, read_shard
from adaflash.training.validation import split_holdout
from adaflash.models.registry import resolve_target
from adaflash.models.targets import load_target_as
from adaflash.models.drafter_checkpoint import load_drafter
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import speculative_generate

dtype = sys.argv[1] if len(sys.argv) > 1 else "int8"
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 64
torch.set_num_threads(2)
dirs = ["runs/data/smollm2-v4", "runs/data/smollm2-v5"]
entries = []
for d in dirs:
    m = load_manifest(d)
    for sh in m["shards"]:
        for j, (pid, dom) in enumerate(zip(sh["prompt_ids"], sh["domains"])):
            entries.append((d, sh["file"], j, pid, dom))
# the dataset drops samples with a response < 2 tokens; ignore that (rare) and split on all keys
_, held = split_holdout([e[3] for e in entries], 64)
held = [entries[i] for i in held][:limit]
target = load_target_as(resolve_target("smollm2-135m"), dtype)
proposer = DFlashProposer(load_drafter("runs/train/smollm2-drafter-v9/drafter", dtype=torch.float32), target)
eos = target.config.eos_token_ids
by_file = {}
for e in held:
    by_file.setdefault((e[0], e[1]), []).append(e)
rows = []
for (d, f), es in by_file.items():
    samples = list(read_shard(Path(d) / f))
    for e in es:
        s = samples[e[2]]
        prompt, resp = s.tokens[: s.prompt_len], s.tokens[s.prompt_len:]
        t0 = time.time()
        r = speculative_generate(target, proposer, prompt, len(resp), stop_token_ids=eos)
        match = next((i for i, (a, b) in enumerate(zip(r.token_ids, resp)) if a != b), min(len(r.token_ids), len(resp)))
        al = r.stats.accept_lengths
        n96 = 0; cut = []
        for a in al:
            if n96 >= 96: break
            cut.append(a); n96 += a
        rows.append({"domain": e[4], "key": e[3], "resp": len(resp), "match_prefix": match,
                     "tau": sum(al) / len(al), "tau96": sum(cut) / len(cut), "passes": len(al),
                     "s": time.time() - t0})
        print(json.dumps(rows[-1]), flush=True)
out = {"dtype": dtype, "rows": rows}
for dom in sorted({r["domain"] for r in rows}) + ["all"]:
    rs = [r for r in rows if dom == "all" or r["domain"] == dom]
    tok = sum(r["resp"] for r in rs); passes = sum(r["passes"] for r in rs)
    out[dom] = {"n": len(rs), "tau_tokens_per_pass": tok / passes, "tau_mean": statistics.mean(r["tau"] for r in rs),
                "tau96_mean": statistics.mean(r["tau96"] for r in rs)}
    print(dom, out[dom])
(Path("docs/results/drafter") / f"holdout_live_check_{dtype}.json").write_text(json.dumps(out, indent=1))
