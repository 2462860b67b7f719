"""`adaflash bench load`: many concurrent streams for a fixed time, then check nothing leaked.

    adaflash bench load --base-url http://127.0.0.1:8000 --streams 128 --duration 120

Every request must end answered (200, full stream) or cleanly refused (429/503); afterwards the server's
/metrics must show no running or queued request, every slot free, and resident memory within a bound
of where it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from adaflash.cli_args import command_group
from adaflash.evaluation.serve_bench import _one_request


@dataclass(frozen=True)
class LoadReport:
    streams: int
    duration_s: float
    statuses: dict[str, int]
    completed: int
    refused: int
    failed: int
    running_after: float | None
    queued_after: float | None
    free_slots_after: float | None
    max_slots: float | None
    rss_before_mb: float | None
    rss_after_mb: float | None

    @property
    def clean(self) -> bool:
        leaked = self.running_after not in (None, 0) or self.queued_after not in (None, 0)
        slots_back = self.free_slots_after is None or self.free_slots_after == self.max_slots
        return self.failed == 0 and not leaked and slots_back


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


async def run_load(base_url: str, model: str, streams: int, duration_s: float, max_tokens: int, settle_s: float = 30.0) -> LoadReport:
    prompts = ["Explain caching in one paragraph.", "Write a haiku about GPUs.", "What is 17 * 23? Show the steps.",
               "List three prime numbers.", "Summarise the plot of Hamlet."]
    statuses: Counter = Counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=streams + 4)) as client:
        before = (await client.get("/metrics")).text
        deadline = time.perf_counter() + duration_s

        async def stream_loop(i: int) -> None:
            rng = random.Random(i)
            while time.perf_counter() < deadline:
                messages = [{"role": "user", "content": rng.choice(prompts)}]
                timing = await _one_request(client, model, messages, rng.randint(1, max_tokens))
                statuses[str(timing.status)] += 1
                if timing.status in (429, 503):
                    await asyncio.sleep(0.2)  # a well-behaved client backs off (Retry-After)

        start = time.perf_counter()
        await asyncio.gather(*(stream_loop(i) for i in range(streams)))
        duration = time.perf_counter() - start
        # Let the engine drain, then read the gauges that prove nothing leaked.
        settle_until = time.perf_counter() + settle_s
        while True:
            after = (await client.get("/metrics")).text
            if _gauge(after, "adaflash_running_requests") in (None, 0) or time.perf_counter() > settle_until:
                break
            await asyncio.sleep(0.5)
    refused = statuses["429"] + statuses["503"]
    rss = lambda text: (v / 2**20) if (v := _gauge(text, "process_resident_memory_bytes")) is not None else None
    max_slots = _gauge(before, "adaflash_free_slots")
    return LoadReport(
        streams=streams, duration_s=duration, statuses=dict(statuses), completed=statuses["200"], refused=refused,
        failed=sum(statuses.values()) - statuses["200"] - refused,
        running_after=_gauge(after, "adaflash_running_requests"), queued_after=_gauge(after, "adaflash_queue_depth"),
        free_slots_after=_gauge(after, "adaflash_free_slots"), max_slots=max_slots,
        rss_before_mb=rss(before), rss_after_mb=rss(after),
    )


def _cmd(args: argparse.Namespace) -> int:
    model = args.model or httpx.get(f"{args.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    report = asyncio.run(run_load(args.base_url, model, args.streams, args.duration, args.max_tokens))
    print(json.dumps({**asdict(report), "clean": report.clean}, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**asdict(report), "clean": report.clean}, indent=2) + "\n")
    return 0 if report.clean else 1


def register_cli(subparsers) -> None:
    p = command_group(subparsers, "bench", help="benchmarks").add_parser("load", help="soak a server and check for leaks")
    p.add_argument("--base-url", required=True)
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(func=_cmd)
