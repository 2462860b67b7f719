"""`adaflash bench serve`: load an OpenAI-compatible server at several concurrency levels.

    adaflash bench serve --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --dataset gsm8k --num-prompts 32

Works against any OpenAI-compatible server (ours, vLLM, SGLang): streaming chat completions, greedy.
Reports output tokens/s, requests/s, TTFT and time-per-output-token p50/p99 per concurrency level; when
the server exposes our Prometheus metrics (or vLLM's speculative-decoding counters), also the accept length and mean
verify length of the window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import httpx

from adaflash.cli_args import command_group
from adaflash.report import write_json


@dataclass(frozen=True)
class RequestTiming:
    ok: bool
    output_tokens: int
    ttft_s: float | None
    latency_s: float
    status: int


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    num_requests: int
    failed: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    accept_len_mean: float | None
    verify_len_mean: float | None


def percentile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _one_request(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int) -> RequestTiming:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, tokens, chunks = time.perf_counter(), None, None, 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return RequestTiming(False, 0, None, time.perf_counter() - start, resp.status_code)
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"].get("completion_tokens", tokens)
                for choice in event.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - start
    except httpx.HTTPError:
        return RequestTiming(False, 0, ttft, time.perf_counter() - start, 0)
    # Servers that send no usage: count content chunks (a lower bound when a chunk carries several tokens).
    return RequestTiming(True, tokens if tokens is not None else chunks, ttft, time.perf_counter() - start, 200)


# vLLM's speculative-decoding counters: draft steps, drafted tokens, accepted drafts.
_VLLM_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total", "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                  "accepted": "vllm:spec_decode_num_accepted_tokens_total"}


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Sums and counts of our accept / verify length histograms, and vLLM's draft counters (absent elsewhere)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    found = {}
    for name in ("accept_length", "verify_length"):
        for kind in ("sum", "count"):
            m = re.search(rf"^\S*{name}\S*_{kind}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
            if m:
                found[f"{name}_{kind}"] = float(m.group(1))
    for key, metric in _VLLM_COUNTERS.items():
        m = re.search(rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
        if m:
            found[f"vllm_{key}"] = float(m.group(1))
    return found


def _window_mean(before: dict, after: dict, name: str) -> float | None:
    """The window's mean accept or verify length: from our histograms, else from vLLM's counters (per draft step:
    1 + accepted drafts, and drafted tokens; vLLM's steps without drafts are not counted)."""
    count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    if count > 0:
        return (after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)) / count
    delta = {k: after.get(f"vllm_{k}", 0) - before.get(f"vllm_{k}", 0) for k in _VLLM_COUNTERS}
    if delta["drafts"] <= 0:
        return None
    if name == "accept_length":  # the drafts kept and the target's own token
        return 1 + delta["accepted"] / delta["drafts"]
    return delta["draft_tokens"] / delta["drafts"]


async def run_level(
    base_url: str, model: str, prompts: list[list[dict]], concurrency: int, max_tokens: int, transport=None
) -> LevelResult:
    # No keep-alive: llama-server closes a connection after a streamed response, and a request sent on such a
    # pooled connection fails unread ("Server disconnected without sending a response"). A fresh local TCP
    # connection per request costs well under a millisecond.
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits, transport=transport) as client:
        before = await _scrape(client)
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        timings: list[RequestTiming] = []

        async def worker() -> None:
            while not queue.empty():
                timings.append(await _one_request(client, model, queue.get_nowait(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
        after = await _scrape(client)
    ok = [t for t in timings if t.ok]
    tokens = sum(t.output_tokens for t in ok)
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    tpots = [(t.latency_s - t.ttft_s) / (t.output_tokens - 1) for t in ok if t.ttft_s is not None and t.output_tokens > 1]
    return LevelResult(
        concurrency=concurrency, num_requests=len(timings), failed=len(timings) - len(ok), duration_s=duration,
        output_tokens_per_s=tokens / duration, requests_per_s=len(ok) / duration,
        ttft_p50_s=percentile(ttfts, 0.5), ttft_p99_s=percentile(ttfts, 0.99),
        tpot_p50_s=percentile(tpots, 0.5), tpot_p99_s=percentile(tpots, 0.99),
        accept_len_mean=_window_mean(before, after, "accept_length"),
        verify_len_mean=_window_mean(before, after, "verify_length"),
    )


def run_sweep(
    base_url: str, model: str, prompts: list[list[dict]], levels: Sequence[int], max_tokens: int, transport=None
) -> list[LevelResult]:
    return [asyncio.run(run_level(base_url, model, prompts, c, max_tokens, transport)) for c in levels]


def _load_messages(args: argparse.Namespace) -> list[list[dict]]:
    if args.prompts_file:
        from adaflash.data.jsonl import read_prompts_file

        prompts = read_prompts_file(args.prompts_file)
    else:
        from adaflash.data import load_prompts

        prompts = load_prompts(args.dataset, args.split, limit=args.num_prompts)
    if not prompts:
        raise ValueError("no prompts to send")
    return [list(p.messages) for p in prompts[: args.num_prompts]]


def _cmd(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    model = args.model
    if model is None:
        model = httpx.get(f"{args.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    results = run_sweep(args.base_url, model, _load_messages(args), levels, args.max_tokens)
    print(f"{'conc':>5}{'req':>6}{'fail':>6}{'out tok/s':>11}{'req/s':>8}{'TTFT p50':>10}{'TPOT p50':>10}{'accept':>8}{'verify':>8}")
    for r in results:
        fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"
        print(f"{r.concurrency:>5}{r.num_requests:>6}{r.failed:>6}{r.output_tokens_per_s:>11.1f}{r.requests_per_s:>8.2f}"
              f"{fmt(r.ttft_p50_s):>10}{fmt(r.tpot_p50_s):>10}{fmt(r.accept_len_mean, 2):>8}{fmt(r.verify_len_mean, 2):>8}")
    if args.json:
        write_json({"base_url": args.base_url, "model": model, "max_tokens": args.max_tokens, "dataset": args.dataset,
                    "levels": [asdict(r) for r in results]}, args.json)
    return 0 if all(r.failed == 0 for r in results) else 1


def register_cli(subparsers) -> None:
    p = command_group(subparsers, "bench", help="benchmarks").add_parser("serve", help="load an OpenAI-compatible server")
    p.add_argument("--base-url", required=True)
    p.add_argument("--concurrency", default="1,8,32,64")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--dataset", default="gsm8k")
    src.add_argument("--prompts-file", default=None)
    p.add_argument("--split", default="eval", choices=["eval", "train"],
                   help="train: drive a recording server (`serve --record`) without touching eval prompts")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--json", default=None)
    p.set_defaults(func=_cmd)
