"""`adaflash bench load`: many concurrent streams for a fixed time, then check nothing leaked.

    adaflash bench load --base-url http://127.0.0.1:8000 --streams 128 --duration 120
    adaflash bench load --base-url http://127.0.0.1:8000 --streams 8 --duration 600 --max-tokens 32 --soak \
        --disconnect-rate 0.1 --json docs/results/serving/soak.json --markdown docs/results/serving/soak.md

Every request must end answered in full (200, a finish reason, usage, `data: [DONE]`, no error event) or
cleanly refused (429/503); anything else is a lost request. Afterwards the server's /metrics must show no
running or queued request and every slot free. `--soak` also samples the server's resident memory through
the run (its own `process_resident_memory_bytes` from /metrics, or /proc/PID with `--server-pid`) and fails
if it still grows over the last half of the run by more than `--max-rss-growth-mb`: a memory plateau.
`--disconnect-rate P` makes that fraction of requests hang up after their first token (the abort path).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from adaflash.cli_args import command_group
from adaflash.report import markdown_table, write_json

PROMPTS = ["Explain caching in one paragraph.", "Write a haiku about GPUs.", "What is 17 * 23? Show the steps.",
           "List three prime numbers.", "Summarise the plot of Hamlet."]


@dataclass(frozen=True)
class SoakConfig:
    rss_interval_s: float = 10.0
    server_pid: int | None = None  # read /proc/PID/status instead of the server's /metrics
    max_rss_growth_mb: float = 64.0  # allowed growth over the last half of the run


@dataclass(frozen=True)
class LoadReport:
    streams: int
    duration_s: float
    statuses: dict[str, int]
    completed: int
    refused: int
    failed: int  # lost: neither answered in full nor cleanly refused
    running_after: float | None
    queued_after: float | None
    free_slots_after: float | None
    max_slots: float | None
    rss_before_mb: float | None
    rss_after_mb: float | None
    hung_up: int = 0  # the client's own disconnects (--disconnect-rate), not failures
    lost_reasons: dict[str, int] = field(default_factory=dict)
    rss_samples: tuple[tuple[float, float], ...] = ()  # (seconds since the start, MB), soak only
    rss_peak_mb: float | None = None
    rss_growth_last_half_mb: float | None = None
    rss_slope_last_half_mb_per_min: float | None = None
    max_rss_growth_mb: float | None = None

    @property
    def leaked_slots(self) -> float | None:
        if self.free_slots_after is None or self.max_slots is None:
            return None
        return self.max_slots - self.free_slots_after

    @property
    def plateaued(self) -> bool | None:
        if self.rss_growth_last_half_mb is None or self.max_rss_growth_mb is None:
            return None
        return self.rss_growth_last_half_mb <= self.max_rss_growth_mb

    @property
    def clean(self) -> bool:
        leaked = self.running_after not in (None, 0) or self.queued_after not in (None, 0)
        slots_back = self.leaked_slots in (None, 0)
        return self.failed == 0 and not leaked and slots_back and self.plateaued is not False

    def as_dict(self) -> dict:
        return {**asdict(self), "leaked_slots": self.leaked_slots, "plateaued": self.plateaued, "clean": self.clean}


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


async def _request(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int,
                   hang_up: bool) -> tuple[str, str]:
    """(status, outcome): outcome is completed, refused, hung_up, or `lost: why`."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            status = str(resp.status_code)
            if resp.status_code != 200:
                await resp.aread()
                return status, "refused" if resp.status_code in (429, 503) else f"lost: HTTP {status}"
            finish = usage = None
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return status, f"lost: error event {event['error'].get('code')}"
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                    if hang_up and choice.get("delta", {}).get("content"):
                        return status, "hung_up"  # leaving the stream unread closes the connection
        if not done or finish is None:
            return status, "lost: stream ended without " + ("[DONE]" if not done else "a finish reason")
        if usage is None or not 1 <= usage.get("completion_tokens", 0) <= max_tokens:
            return status, "lost: missing or wrong usage"
        return status, "completed"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return "error", f"lost: {type(exc).__name__}"


async def _rss_mb(client: httpx.AsyncClient, server_pid: int | None) -> float | None:
    if server_pid is not None:
        for line in Path(f"/proc/{server_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return None
    v = _gauge((await client.get("/metrics")).text, "process_resident_memory_bytes")
    return v / 2**20 if v is not None else None


def _last_half(samples: list[tuple[float, float]], duration_s: float) -> tuple[float | None, float | None]:
    """(growth in MB, least-squares slope in MB/min) over the samples of the run's second half."""
    half = [(t, mb) for t, mb in samples if duration_s / 2 <= t <= duration_s]
    if len(half) < 2:
        return None, None
    n, mt, mm = len(half), sum(t for t, _ in half) / len(half), sum(mb for _, mb in half) / len(half)
    var = sum((t - mt) ** 2 for t, _ in half)
    slope = sum((t - mt) * (mb - mm) for t, mb in half) / var * 60 if var > 0 else 0.0
    return half[-1][1] - half[0][1], slope


async def run_load(base_url: str, model: str, streams: int, duration_s: float, max_tokens: int, settle_s: float = 30.0,
                   *, soak: SoakConfig | None = None, api_key: str | None = None,
                   disconnect_rate: float = 0.0) -> LoadReport:
    statuses: Counter = Counter()
    outcomes: Counter = Counter()
    samples: list[tuple[float, float]] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits, headers=headers) as client:
        before = (await client.get("/metrics")).text
        start = time.perf_counter()
        deadline = start + duration_s

        async def stream_loop(i: int) -> None:
            rng = random.Random(i)
            while time.perf_counter() < deadline:
                messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
                hang_up = rng.random() < disconnect_rate
                status, outcome = await _request(client, model, messages, rng.randint(1, max_tokens), hang_up)
                statuses[status] += 1
                outcomes[outcome] += 1
                if outcome == "refused":
                    await asyncio.sleep(0.2)  # a well-behaved client backs off (Retry-After)

        async def sample_rss() -> None:
            while True:
                t = time.perf_counter() - start
                if (mb := await _rss_mb(client, soak.server_pid)) is not None:
                    samples.append((round(t, 1), round(mb, 1)))
                if t >= duration_s:
                    return
                await asyncio.sleep(min(soak.rss_interval_s, max(0.0, deadline - time.perf_counter())))

        tasks = [stream_loop(i) for i in range(streams)] + ([sample_rss()] if soak else [])
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        # Let the engine drain, then read the gauges that prove nothing leaked.
        settle_until = time.perf_counter() + settle_s
        while True:
            after = (await client.get("/metrics")).text
            idle = _gauge(after, "adaflash_running_requests") in (None, 0) and _gauge(after, "adaflash_queue_depth") in (None, 0)
            if idle or time.perf_counter() > settle_until:
                break
            await asyncio.sleep(0.5)
        rss_after = await _rss_mb(client, soak.server_pid) if soak else None
    rss = lambda text: (v / 2**20) if (v := _gauge(text, "process_resident_memory_bytes")) is not None else None  # noqa: E731
    lost = {k[len("lost: "):]: v for k, v in outcomes.items() if k.startswith("lost: ")}
    growth, slope = _last_half(samples, duration_s)
    return LoadReport(
        streams=streams, duration_s=duration, statuses=dict(statuses), completed=outcomes["completed"],
        refused=outcomes["refused"], failed=sum(lost.values()),
        running_after=_gauge(after, "adaflash_running_requests"), queued_after=_gauge(after, "adaflash_queue_depth"),
        free_slots_after=_gauge(after, "adaflash_free_slots"),
        max_slots=_gauge(before, "adaflash_batch_slots") or _gauge(before, "adaflash_free_slots"),
        rss_before_mb=samples[0][1] if samples else rss(before),
        rss_after_mb=rss_after if rss_after is not None else rss(after),
        hung_up=outcomes["hung_up"], lost_reasons=lost, rss_samples=tuple(samples),
        rss_peak_mb=max((mb for _, mb in samples), default=None), rss_growth_last_half_mb=growth,
        rss_slope_last_half_mb_per_min=slope, max_rss_growth_mb=soak.max_rss_growth_mb if soak else None,
    )


def soak_markdown(report: LoadReport, command: str, note: str = "") -> str:
    f = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["# Soak test", "", f"`{command}`", ""]
    if note:
        lines += [note, ""]
    lines += [markdown_table(["", ""], [
        ["duration", f"{report.duration_s:.0f} s, {report.streams} streams"],
        ["requests", f"{report.completed} completed, {report.refused} refused (503/429), {report.hung_up} hung up "
                     f"by the client, **{report.failed} lost**"],
        ["after the run", f"{f(report.running_after, 'g')} running, {f(report.queued_after, 'g')} queued, "
                          f"{f(report.free_slots_after, 'g')} of {f(report.max_slots, 'g')} slots free "
                          f"(**{f(report.leaked_slots, 'g')} leaked**)"],
        ["resident memory", f"{f(report.rss_before_mb)} MB first sample, {f(report.rss_peak_mb)} MB peak, "
                            f"{f(report.rss_after_mb)} MB after"],
        ["growth over the last half", f"**{f(report.rss_growth_last_half_mb)} MB** "
                                      f"({f(report.rss_slope_last_half_mb_per_min, '.2f')} MB/min; bound "
                                      f"{f(report.max_rss_growth_mb)} MB)"],
        ["verdict", "clean" if report.clean else "NOT clean"]]), ""]
    if report.lost_reasons:
        lines += ["Lost: " + ", ".join(f"{k} x{v}" for k, v in report.lost_reasons.items()), ""]
    if report.rss_samples:
        lines += ["RSS samples (s: MB): " + ", ".join(f"{t:.0f}: {mb:.0f}" for t, mb in report.rss_samples), ""]
    return "\n".join(lines)


def _command_line(args: argparse.Namespace, keyed: bool) -> str:
    """The run's settings as a command line; the API key masked (it never goes into a file)."""
    parts = ["adaflash bench load", f"--base-url {args.base_url}", f"--streams {args.streams}",
             f"--duration {args.duration:g}", f"--max-tokens {args.max_tokens}"]
    if args.disconnect_rate:
        parts.append(f"--disconnect-rate {args.disconnect_rate:g}")
    if args.soak:
        parts += ["--soak", f"--rss-interval {args.rss_interval:g}", f"--max-rss-growth-mb {args.max_rss_growth_mb:g}"]
    if args.server_pid is not None:
        parts.append("--server-pid PID")
    if keyed:
        parts.append("--api-key ***")
    return " ".join(parts)


def _cmd(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("ADAFLASH_API_KEY") or None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = args.model or httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    soak = SoakConfig(args.rss_interval, args.server_pid, args.max_rss_growth_mb) if args.soak else None
    report = asyncio.run(run_load(args.base_url, model, args.streams, args.duration, args.max_tokens, soak=soak,
                                  api_key=api_key, disconnect_rate=args.disconnect_rate))
    result = report.as_dict()
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=2))
    if args.json:
        write_json({**result, "command": _command_line(args, bool(api_key)), "note": args.note}, args.json)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(soak_markdown(report, _command_line(args, bool(api_key)), args.note))
    return 0 if report.clean else 1


def register_cli(subparsers) -> None:
    p = command_group(subparsers, "bench", help="benchmarks").add_parser("load", help="soak a server and check for leaks")
    p.add_argument("--base-url", required=True)
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=64, help="each request asks for 1..this many tokens")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None, help="bearer key of the server (default: $ADAFLASH_API_KEY)")
    p.add_argument("--disconnect-rate", type=float, default=0.0,
                   help="fraction of requests whose client hangs up after the first token")
    p.add_argument("--soak", action="store_true", help="sample the server's resident memory and require a plateau")
    p.add_argument("--rss-interval", type=float, default=10.0, help="seconds between memory samples (--soak)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="read the server's memory from /proc/PID (same machine) instead of its /metrics")
    p.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                   help="--soak fails if memory grows more than this over the last half of the run")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None, help="also write a short markdown summary here")
    p.add_argument("--note", default="", help="a line on the conditions, kept in the JSON and the markdown")
    p.set_defaults(func=_cmd)
