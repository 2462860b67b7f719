"""Two checkouts of AdaFlash timed on the same work, alternating process by process (the runtime's Python and C++
change together, so one process cannot hold both): each run loads the target and times 1-token decode steps and a
16-token verify at a CONTEXT-token cache. Prints each run, then medians and new / old.

    git worktree add /tmp/adaflash-old <rev>
    python docs/results/session17/step_ab.py /tmp/adaflash-old . [DTYPE=int8] [CONTEXT=64] [ROUNDS=5]
"""
import json, os, statistics, subprocess, sys

RUN = r'''
import json, statistics, sys, time, torch
from adaflash.models.kv_cache import RaggedBatch
from adaflash.models.registry import resolve_target
from adaflash.models.target import load_target_as
torch.set_num_threads(2)
dtype, context = sys.argv[1], int(sys.argv[2])
m = load_target_as(resolve_target("smollm2-135m"), dtype)
cache = m.new_cache(1, context + 16)
m(torch.arange(context) % 1000 + 100, RaggedBatch.build([0], [0], [context]), cache)
out = {}
for q, steps in ((1, 300), (16, 60)):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = m(torch.arange(q) + 123, RaggedBatch.build([0], [context], [q]), cache).logits
        times.append(time.perf_counter() - start)
        cache.rollback(0, context)
    out[q] = 1000 * statistics.median(times[5:])
out["argmax"] = logits.argmax(-1).tolist()
print(json.dumps(out))
'''

old, new = sys.argv[1], sys.argv[2]
dtype = sys.argv[3] if len(sys.argv) > 3 else "int8"
context = sys.argv[4] if len(sys.argv) > 4 else "64"
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 5
results = {"old": [], "new": []}
for r in range(rounds):
    for name, tree in (("old", old), ("new", new)):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        proc = subprocess.run([sys.executable, "-c", RUN, dtype, context], capture_output=True, text=True, env=env,
                              cwd=os.path.abspath(tree), check=True)
        results[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"round {r} {name}: 1 token {results[name][-1]['1']:.3f} ms, 16 tokens {results[name][-1]['16']:.3f} ms",
              flush=True)
for q in ("1", "16"):
    o, n = (statistics.median(x[q] for x in results[k]) for k in ("old", "new"))
    print(f"{q:>2} token(s): old {o:.3f} ms  new {n:.3f} ms  new/old {n / o:.3f}")
print(f"same argmax of the 16-token verify: {results['old'][-1]['argmax'] == results['new'][-1]['argmax']}; "
      f"{dtype}, context {context}, 2 threads, {rounds} rounds alternating")
