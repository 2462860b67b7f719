"""Resident memory of a real `adaflash serve` on its paged KV cache: idle, then under load, against the KV tokens in
flight.

    python benchmarks/reliability/kv_memory.py --out docs/results/reliability/kv_memory

The server gets the model's whole context on every slot (`--max-len 32768 --max-batch 32` for Qwen2.5-Coder-1.5B):
a slot cache would reserve all of it (32 x 32K positions, ~28 GiB in fp16); the pool takes blocks as requests grow.
Load: one request with a ~16K-token prompt of real code (this repository's own Python source) beside 31 short chat
requests (six-mix prompts), all sent at once. The server's /metrics is sampled every second: its resident memory
(process_resident_memory_bytes) and the KV blocks requests hold (adaflash_kv_blocks_held). Every request must answer
200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from adaflash.evaluation.serve_sweep import SIX_MIX, fitting_prompts, launched_server
from adaflash.models.device.cpu import cpu_model
from adaflash.models.kv_cache.cache import DEFAULT_BLOCK_SIZE  # the server's: it runs with the default
from adaflash.report import markdown_table, write_json

ROOT = Path(__file__).resolve().parents[2]


def code_prompt(model: str, tokens: int) -> str:
    """About `tokens` tokens of this repository's Python source, as text."""
    from adaflash.models.targets.registry import load_tokenizer, resolve_target

    tokenizer = load_tokenizer(resolve_target(model))
    text = "\n\n".join(p.read_text() for p in sorted((ROOT / "adaflash").rglob("*.py")))
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return "Review this code and name its three most important modules:\n\n" + tokenizer.decode(ids)


def metrics(url: str) -> dict[str, float]:
    wanted = ("process_resident_memory_bytes", "adaflash_kv_blocks_held", "adaflash_kv_blocks",
              "adaflash_running_requests", "adaflash_queue_depth")
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[name] = float(value)
    return out


async def load(url: str, model: str, long_prompt: str, short: list, max_tokens: int, samples: list,
               started: float) -> list[tuple[str, int, float]]:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        async def one(kind: str, body: dict, path: str) -> tuple[str, int, float]:
            t0 = time.perf_counter()
            r = await client.post(path, json={"model": model, "max_tokens": max_tokens, "temperature": 0, **body})
            return kind, r.status_code, time.perf_counter() - t0

        async def sample() -> None:
            while True:
                m = await asyncio.to_thread(metrics, url)
                samples.append({"s": round(time.perf_counter() - started, 1), **m})
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        calls = [one("long", {"prompt": long_prompt}, "/v1/completions")]
        calls += [one("short", {"messages": list(m)}, "/v1/chat/completions") for m in short]
        results = await asyncio.gather(*calls)
        await asyncio.sleep(2.0)
        sampler.cancel()
        return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtype", default="int8")
    p.add_argument("--method", default="dflash")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-len", type=int, default=32768)
    p.add_argument("--long-tokens", type=int, default=16000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8441)
    p.add_argument("--out", type=Path, default=Path("docs/results/reliability/kv_memory"))
    p.add_argument("--report-only", action="store_true", help="rewrite OUT.md / OUT.png from OUT.json's measurement")
    args = p.parse_args(argv)
    if args.report_only:
        report(json.loads(args.out.with_suffix(".json").read_text()), args.out)
        return 0

    short = [m for m in fitting_prompts(SIX_MIX, args.model, 384)][: args.max_batch - 1]
    long_prompt = code_prompt(args.model, args.long_tokens)
    serve_args = ["--model", args.model, "--dtype", args.dtype, "--method", args.method, "--max-len",
                  str(args.max_len), "--max-queue", str(args.max_batch)]
    samples: list[dict] = []
    with launched_server("kv-memory", serve_args, args.port, args.max_batch, Path("runs/reliability"),
                         threads=args.threads) as url:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        started = time.perf_counter()
        idle = [metrics(url) for _ in range(3)]
        results = asyncio.run(load(url, model, long_prompt, short, args.max_tokens, samples, started))
        after = metrics(url)
    mib = 2 ** 20
    command = "python benchmarks/reliability/kv_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    serve = " ".join([f"OMP_NUM_THREADS={args.threads} adaflash serve", *serve_args, "--max-batch",
                      str(args.max_batch)])
    measured = {
        "command": command, "server": serve, "machine": f"{cpu_model()}, {args.threads} threads, --dtype {args.dtype}",
        "long_tokens": args.long_tokens, "short_requests": len(short),
        "statuses": sorted({code for _, code, _ in results}),
        "rss_start_mib": round(idle[-1]["process_resident_memory_bytes"] / mib, 1),
        "rss_after_mib": round(after["process_resident_memory_bytes"] / mib, 1),
        "long_request_s": round(next(t for k, _, t in results if k == "long"), 1),
        "samples": samples,
    }
    report(measured, args.out)
    return 0 if measured["statuses"] == [200] else 1


def report(measured: dict, out: Path, block: int = DEFAULT_BLOCK_SIZE) -> None:
    """OUT.json (the measurement and its summary), OUT.md and OUT.png from what `main` measured."""
    mib, samples = 2 ** 20, measured["samples"]
    for s in samples:
        s["kv_tokens_held"] = int(s.get("adaflash_kv_blocks_held", 0)) * block
    start_rss = measured["rss_start_mib"]
    peak = max(s["process_resident_memory_bytes"] for s in samples) / mib
    at_kv_peak = max(samples, key=lambda s: s["kv_tokens_held"])
    grown = at_kv_peak["process_resident_memory_bytes"] / mib - start_rss
    pool = max(s.get("adaflash_kv_blocks", 0) for s in samples)
    statuses, long_tokens, short = measured["statuses"], measured["long_tokens"], measured["short_requests"]
    summary = {
        "what": "resident memory of a real serve with the model's whole context on every slot, idle and under load "
                f"(1 request of ~{long_tokens} prompt tokens beside {short} short ones), against KV tokens held",
        "headline": f"{start_rss:.0f} MiB at start; {at_kv_peak['kv_tokens_held']} KV tokens held at most, memory "
                    f"then +{grown:.0f} MiB; peak {peak:.0f} MiB; HTTP {statuses}",
        **{k: v for k, v in measured.items() if k != "samples"},
        "kv_pool_blocks": pool, "block_size": block, "rss_peak_mib": round(peak, 1),
        "kv_tokens_peak": at_kv_peak["kv_tokens_held"], "rss_growth_at_kv_peak_mib": round(grown, 1),
        "samples": samples,
    }
    write_json(summary, out.with_suffix(".json"))
    plot(samples, out.with_suffix(".png"), start_rss)
    table = markdown_table(["", ""], [
        ["requests", f"1 of ~{long_tokens} prompt tokens (code) + {short} short chats, all at once; HTTP "
                     f"statuses {statuses}"],
        ["KV pool", f"{pool:.0f} blocks of {block} positions ({pool * block:.0f} tokens: half the free memory)"],
        ["resident memory at start", f"**{start_rss:.0f} MiB**"],
        ["peak", f"{peak:.0f} MiB"],
        ["KV tokens held at most", f"{at_kv_peak['kv_tokens_held']} (memory then {start_rss + grown:.0f} MiB: "
                                   f"+{grown:.0f} MiB)"],
        ["after the load", f"{measured['rss_after_mib']:.0f} MiB"],
        ["the long request", f"{measured['long_request_s']} s"],
    ])
    out.with_suffix(".md").write_text(
        f"# Resident memory on the paged KV cache\n\n`{measured['command']}`\n\nServer: `{measured['server']}`. "
        f"Machine: {measured['machine']}; the client on the same cores.\n\n{table}\n\n"
        f"![RSS against KV tokens held]({out.with_suffix('.png').name})\n")
    print(table)


def plot(samples: list[dict], path: Path, start_rss: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    t = [s["s"] for s in samples]
    ax.plot(t, [s["process_resident_memory_bytes"] / 2**20 for s in samples], label="resident memory (MiB)")
    ax.axhline(start_rss, color="grey", linestyle=":", label="at start")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    twin = ax.twinx()
    twin.plot(t, [s["kv_tokens_held"] for s in samples], color="tab:orange", label="KV tokens held")
    twin.set_ylabel("KV tokens held")
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
