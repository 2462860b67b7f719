"""The A/B behind throughput_policy_ab.md (session 10), run from the repo root with the old tree checked out at
/tmp/old (`git worktree add /tmp/old e7d15b6`): the throughput policy before and after the optimistic per-request
estimate, served side by side with AR and fixed:1; each cell alternates via measure_cell. Extra args go to every
server (e.g. --dtype int8)."""
import asyncio, json, subprocess, sys, time
from dataclasses import asdict
from pathlib import Path
import httpx
from adaflash.evaluation.serve_bench import run_level
from adaflash.evaluation.serve_sweep import measure_cell, prompt_pool

PY, HERE = sys.executable, str(Path.cwd())
Path("runs/s10").mkdir(parents=True, exist_ok=True)
servers = {  # name: (cwd, serve args)
    "ar": (HERE, ["--method", "ar"]),
    "throughput-old": ("/tmp/old", ["--method", "dflash", "--length-policy", "throughput"]),
    "throughput-new": (HERE, ["--method", "dflash", "--length-policy", "throughput"]),
    "fixed-1": (HERE, ["--method", "dflash", "--length-policy", "fixed:1"]),
}
extra = sys.argv[1:]  # e.g. --dtype int8
procs, urls = [], {}
for i, (name, (cwd, args)) in enumerate(servers.items()):
    port = 8500 + i
    log = open(f"runs/s10/{name}.log", "w")
    procs.append(subprocess.Popen([PY, "-m", "adaflash.cli", "serve", *args, *extra, "--port", str(port), "--max-batch", "8",
                                   "--log-level", "warning"], cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(2)
    urls[name] = url
model = httpx.get(urls["ar"] + "/v1/models").json()["data"][0]["id"]
cells = []
try:
    for ds, n in (("six-mix", 12), ("gsm8k", 8)):
        pool = prompt_pool(ds)[:n]
        def run(name):
            r = asyncio.run(run_level(urls[name], model, pool, 1, 64))
            print(f"{ds} {name:>16}: {r.output_tokens_per_s:6.1f} tok/s accept {r.accept_len_mean} verify {r.verify_len_mean}", flush=True)
            return asdict(r)
        cells.append({"dataset": ds, "concurrency": 1, "num_prompts": n, "results": measure_cell(list(servers), run)})
        Path("runs/s10/ab_policy.json").write_text(json.dumps({"extra_args": extra, "cells": cells}, indent=1))
finally:
    for p in procs:
        p.terminate()
