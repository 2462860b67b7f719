"""The offline engine (no HTTP) at two concurrencies side by side: the same distinct six-mix prompts (int8 target,
AR, 64 new tokens each, prompt-prefix reuse on), max_batch = each concurrency, runs alternating (3 each, medians);
with the time in prefill passes and in decode passes, and the decode passes' mean rows and ms.

    python docs/results/session17/engine_concurrency.py [CONCURRENCIES=32,64] [NUM_REQUESTS=192]
"""
import statistics, sys, time

from adaflash.cli_args import set_threads

set_threads(None)
from adaflash.evaluation.serve_sweep import _fitting, prompt_pool  # noqa: E402
from adaflash.pipeline import Pipeline  # noqa: E402
from adaflash.serving.engine import Engine  # noqa: E402
from adaflash.serving.request import Request  # noqa: E402

levels = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "32,64").split(",")]
n_req = int(sys.argv[2]) if len(sys.argv) > 2 else 192
p = Pipeline.load("smollm2-135m", None, "int8", None)
ids = [p.encode(messages=m) for m in _fitting(prompt_pool("six-mix"), "smollm2-135m", 384)[:n_req]]
print(f"{len(ids)} prompts, {sum(map(len, ids)) / len(ids):.0f} tokens on average; int8 target, 2 threads")


def run(conc: int) -> dict:
    eng = Engine(p.target, max_batch=conc, max_queue=10_000, max_len=512)
    spent = {"prefill": 0.0, "decode": 0.0}
    decode_rows = []

    def timed(name, fn):
        def wrapper(batch):
            start = time.perf_counter()
            out = fn(batch)
            spent[name] += time.perf_counter() - start
            if name == "decode":
                decode_rows.append(len(batch))
            return out
        return wrapper

    eng._prefill, eng._decode = timed("prefill", eng._prefill), timed("decode", eng._decode)
    requests = [Request(f"r{i}", x, 64) for i, x in enumerate(ids)]
    for r in requests:
        eng.add_request(r)
    start = time.perf_counter()
    while eng.has_work():
        eng.step()
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in requests)
    return {"tok/s": tokens / elapsed, "s": elapsed, "prefill s": spent["prefill"], "decode s": spent["decode"],
            "decode rows": statistics.mean(decode_rows), "decode ms": 1e3 * spent["decode"] / len(decode_rows)}


results = {c: [] for c in levels}
for rep in range(3):
    for c in levels:
        results[c].append(run(c))
        r = results[c][-1]
        print(f"c={c}: {r['tok/s']:.1f} tok/s in {r['s']:.1f} s (prefill {r['prefill s']:.1f} s, decode {r['decode s']:.1f} "
              f"s; decode passes of {r['decode rows']:.1f} rows, {r['decode ms']:.1f} ms)", flush=True)
for c in levels:
    med = {k: statistics.median(r[k] for r in results[c]) for k in results[c][0]}
    print(f"median c={c}: {med['tok/s']:.1f} tok/s, prefill {med['prefill s']:.1f} s, decode {med['decode s']:.1f} s, "
          f"decode pass {med['decode rows']:.1f} rows in {med['decode ms']:.1f} ms")
