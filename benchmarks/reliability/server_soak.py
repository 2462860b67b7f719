"""Soak: a real `adaflash serve` (the shipped drafter with prompt lookup first) under concurrent clients for a long
time, mixed streaming / non-streaming and chat / completions, a tenth of the streams hung up after their first token.

    .venv/bin/python benchmarks/reliability/server_soak.py --duration 1800 --streams 64 --out docs/results/reliability/soak
    .venv/bin/python benchmarks/reliability/server_soak.py --model qwen2.5-coder-1.5b --dtype int8 --max-len 32768 \
        --duration 1800 --streams 16 --out docs/results/reliability/soak_qwen15

Judged as the reliability issue asks: no 5xx, no lost or duplicated completion (load_client.py says what each is),
no request or slot left behind, resident memory growing under 5% after warm-up, and the p99 latency of the last
5 minutes within 20% of the first 5 after warm-up. The prompts are the sweep's six-mix (chat-templated, at most
384 tokens), so the drafter and prompt lookup both meet real text; the server is sized so that the clients all fit
(batch = queue = streams): a refusal here would be a fault, not back-pressure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import httpx

from adaflash.evaluation.load_test import SoakConfig, Traffic, run_load, soak_markdown
from adaflash.evaluation.serve_sweep import SIX_MIX, fitting_prompts, launched_server
from adaflash.models.kernels.dtype import resolve_dtype
from adaflash.models.device.cpu import cpu_model
from adaflash.report import write_json



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-len", type=int, default=512, help="KV positions a slot may hold (the pool is shared)")
    p.add_argument("--duration", type=float, default=1800.0)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--disconnect-rate", type=float, default=0.1)
    p.add_argument("--warmup", type=float, default=120.0)
    p.add_argument("--window", type=float, default=300.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--out", type=Path, default=Path("docs/results/reliability/soak"), help="writes OUT.json, OUT.md")
    args = p.parse_args(argv)

    prompts = tuple(tuple(m) for m in fitting_prompts(SIX_MIX, args.model, 384))
    serve_args = ["--model", args.model, "--method", "dflash", "--prompt-lookup", "8", "--dtype", args.dtype,
                  "--max-queue", str(args.streams), "--max-len", str(args.max_len)]
    traffic = Traffic(prompts, args.max_tokens, args.disconnect_rate, mixed=True)
    soak = SoakConfig(rss_interval_s=10.0, warmup_s=args.warmup, window_s=args.window)
    log_dir = Path("runs/reliability")  # the server log, kept out of the results
    with launched_server("soak", serve_args, args.port, args.streams, log_dir, threads=args.threads) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        report = asyncio.run(run_load(url, model, args.streams, args.duration, traffic, soak=soak))
    serve = " ".join([f"OMP_NUM_THREADS={args.threads} adaflash serve", *serve_args, "--max-batch", str(args.streams)])
    command = "python benchmarks/reliability/server_soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = (f"{cpu_model()}, {args.threads} threads, {str(resolve_dtype(args.dtype)).removeprefix('torch.')} "
               f"(--dtype {args.dtype}); the client on the same cores")
    note = (f"Server: `{serve}` ({len(prompts)} six-mix prompts). Machine: {machine}. 5xx answers of any kind: "
            f"{sum(v for k, v in report.statuses.items() if k.startswith('5'))}.")
    result = {**report.as_dict(), "command": command, "machine": machine, "note": note}
    write_json(result, args.out.with_suffix(".json"))
    args.out.with_suffix(".md").write_text(soak_markdown(report, command, note))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss_samples", "load_samples", "latencies")}, indent=2))
    return 0 if report.clean and report.refused == 0 and report.server_errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
