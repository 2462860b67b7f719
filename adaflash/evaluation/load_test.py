"""`adaflash bench load`: many concurrent clients for a fixed time, then check nothing was lost or leaked.

    adaflash bench load --base-url http://127.0.0.1:8000 --streams 128 --duration 120
    adaflash bench load --base-url http://127.0.0.1:8000 --streams 64 --duration 1800 --mixed --disconnect-rate 0.1 \
        --soak --json soak.json --markdown soak.md

Every request must end answered in full or cleanly refused (429/503 with Retry-After, which its client then waits),
see load_client.py; anything else is a lost request, and a completion id seen twice is a duplicated one. Afterwards the server's /metrics must
show no running or queued request and every slot free. `--mixed` draws each request's kind at random: streaming or
not, chat or completions. `--disconnect-rate P` makes that fraction of streams hang up after their first token (the
abort path). `--soak` also samples the server's resident memory (its `process_resident_memory_bytes`, or /proc/PID
with `--server-pid`) and compares the first and the last windows after warm-up: the run fails if memory grew more
than `--max-rss-growth-pct` after warm-up or the last window's p99 latency is more than `--max-p99-drift-pct` above
the first's.
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
from typing import Sequence

import httpx

from adaflash.cli_args import command_group
from adaflash.evaluation.load_client import Call, Outcome, send
from adaflash.evaluation.serve_bench import percentile
from adaflash.report import markdown_table, write_json

MAX_BACKOFF_S = 5.0  # a client waits what Retry-After says, up to this
PROMPTS = ["Explain caching in one paragraph.", "Write a haiku about GPUs.", "What is 17 * 23? Show the steps.",
           "List three prime numbers.", "Summarise the plot of Hamlet."]


@dataclass(frozen=True)
class Traffic:
    """What the clients send: each request a prompt drawn from `prompts` (message lists) and 1..max_tokens."""

    prompts: tuple[tuple[dict, ...], ...] = tuple(({"role": "user", "content": p},) for p in PROMPTS)
    max_tokens: int = 64
    disconnect_rate: float = 0.0  # of streams, hung up after the first token
    mixed: bool = False  # streaming or not, chat or completions, at random; else chat streams only

    def call(self, rng: random.Random) -> Call:
        stream = not self.mixed or rng.random() < 0.5
        chat = not self.mixed or rng.random() < 0.5
        return Call(rng.choice(self.prompts), rng.randint(1, self.max_tokens), stream, chat,
                    stream and rng.random() < self.disconnect_rate)


@dataclass(frozen=True)
class SoakConfig:
    rss_interval_s: float = 10.0
    server_pid: int | None = None  # read /proc/PID/status instead of the server's /metrics
    warmup_s: float = 120.0  # the allocator meets new shapes at first: memory and latency are compared after this
    window_s: float = 300.0  # the first and the last windows after warm-up whose p99 latencies are compared
    max_rss_growth_pct: float = 5.0
    max_p99_drift_pct: float = 20.0


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
    duplicated: int = 0  # completions whose id an earlier one had
    server_errors: int = 0  # 5xx answers that were not a refusal with Retry-After
    lost_reasons: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)  # completed requests by kind (chat/completions, stream or not)
    completion_tokens: int = 0  # of the completed requests, as their usage says
    rss_samples: tuple[tuple[float, float], ...] = ()  # (seconds since the start, MB), soak only
    # soak only: (s, running, queued) from /metrics beside each memory sample, and per completed request (start s,
    # latency s): where latency goes when it drifts
    load_samples: tuple[tuple[float, float | None, float | None], ...] = ()
    latencies: tuple[tuple[float, float], ...] = ()
    rss_peak_mb: float | None = None
    rss_at_warmup_mb: float | None = None
    rss_growth_pct: float | None = None  # from the end of warm-up to the end of the run
    p99_first_s: float | None = None  # latency of the requests started in the first window after warm-up
    p99_last_s: float | None = None  # ... and in the run's last window
    soak: SoakConfig | None = None

    @property
    def leaked_slots(self) -> float | None:
        if self.free_slots_after is None or self.max_slots is None:
            return None
        return self.max_slots - self.free_slots_after

    @property
    def p99_drift_pct(self) -> float | None:
        if self.p99_first_s is None or self.p99_last_s is None or self.p99_first_s <= 0:
            return None
        return 100.0 * (self.p99_last_s / self.p99_first_s - 1.0)

    @property
    def plateaued(self) -> bool | None:
        if self.rss_growth_pct is None or self.soak is None:
            return None
        return self.rss_growth_pct <= self.soak.max_rss_growth_pct

    @property
    def latency_steady(self) -> bool | None:
        if self.p99_drift_pct is None or self.soak is None:
            return None
        return self.p99_drift_pct <= self.soak.max_p99_drift_pct

    @property
    def clean(self) -> bool:
        leaked = self.running_after not in (None, 0) or self.queued_after not in (None, 0)
        slots_back = self.leaked_slots in (None, 0)
        return (self.failed == 0 and self.duplicated == 0 and not leaked and slots_back
                and self.plateaued is not False and self.latency_steady is not False)

    def as_dict(self) -> dict:
        return {**asdict(self), "leaked_slots": self.leaked_slots, "p99_drift_pct": self.p99_drift_pct,
                "plateaued": self.plateaued, "latency_steady": self.latency_steady, "clean": self.clean}


def gauge(text: str, name: str) -> float | None:
    """A metric's value in a Prometheus text page (its first sample, labels ignored); None if absent."""
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def _rss_mb(metrics: str, server_pid: int | None) -> float | None:
    """The server's resident memory: /proc/PID with a pid, else its own gauge in the /metrics page `metrics`."""
    if server_pid is not None:
        for line in Path(f"/proc/{server_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return None
    v = gauge(metrics, "process_resident_memory_bytes")
    return v / 2**20 if v is not None else None


def soak_figures(samples: Sequence[tuple[float, float]], latencies: Sequence[tuple[float, float]], duration_s: float,
                 soak: SoakConfig) -> dict:
    """Memory at the end of warm-up and its growth to the run's last sample (%); the p99 latency of the requests
    started in the first window after warm-up and in the run's last window (`latencies`: (start s, latency s))."""
    after = [(t, mb) for t, mb in samples if t >= soak.warmup_s]
    at_warmup = after[0][1] if after else None
    growth = 100.0 * (after[-1][1] / at_warmup - 1.0) if len(after) >= 2 and at_warmup else None
    window = min(soak.window_s, max(0.0, (duration_s - soak.warmup_s) / 2))
    first = [lat for t, lat in latencies if soak.warmup_s <= t < soak.warmup_s + window]
    last = [lat for t, lat in latencies if t >= duration_s - window]
    return {"rss_at_warmup_mb": at_warmup, "rss_growth_pct": growth,
            "p99_first_s": percentile(first, 0.99) if window > 0 else None,
            "p99_last_s": percentile(last, 0.99) if window > 0 else None}


async def run_load(base_url: str, model: str, streams: int, duration_s: float, traffic: Traffic = Traffic(),
                   settle_s: float = 30.0, *, soak: SoakConfig | None = None, api_key: str | None = None) -> LoadReport:
    statuses: Counter = Counter()
    outcomes: Counter = Counter()
    kinds: Counter = Counter()
    ids: set[str] = set()
    duplicated = server_errors = tokens = 0
    samples: list[tuple[float, float]] = []
    gauges: list[tuple[float, float | None, float | None]] = []
    latencies: list[tuple[float, float]] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits, headers=headers) as client:
        before = (await client.get("/metrics")).text
        start = time.perf_counter()
        deadline = start + duration_s

        def tally(call: Call, sent_at: float, out: Outcome) -> None:
            nonlocal duplicated, server_errors, tokens
            statuses[out.status] += 1
            outcomes[out.kind] += 1
            server_errors += out.status.startswith("5") and out.kind != "refused"
            if out.kind == "completed":
                duplicated += out.completion_id in ids
                tokens += out.tokens
                ids.add(out.completion_id)
                latencies.append((round(sent_at - start, 3), out.latency_s))
                kinds[("chat" if call.chat else "completions") + (" stream" if call.stream else "")] += 1

        async def client_loop(i: int) -> None:
            rng = random.Random(i)
            while time.perf_counter() < deadline:
                call = traffic.call(rng)
                sent_at = time.perf_counter()
                out = await send(client, model, call)
                tally(call, sent_at, out)
                if out.kind == "refused":  # a well-behaved client comes back when the server said
                    await asyncio.sleep(min(out.retry_after_s, MAX_BACKOFF_S))

        async def sample_rss() -> None:
            while True:
                t = time.perf_counter() - start
                text = (await client.get("/metrics")).text
                if (mb := _rss_mb(text, soak.server_pid)) is not None:
                    samples.append((round(t, 1), round(mb, 1)))
                gauges.append((round(t, 1), gauge(text, "adaflash_running_requests"), gauge(text, "adaflash_queue_depth")))
                if t >= duration_s:
                    return
                await asyncio.sleep(min(soak.rss_interval_s, max(0.0, deadline - time.perf_counter())))

        tasks = [client_loop(i) for i in range(streams)] + ([sample_rss()] if soak else [])
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        # Let the engine drain, then read the gauges that prove nothing leaked.
        settle_until = time.perf_counter() + settle_s
        while True:
            after = (await client.get("/metrics")).text
            idle = gauge(after, "adaflash_running_requests") in (None, 0) and gauge(after, "adaflash_queue_depth") in (None, 0)
            if idle or time.perf_counter() > settle_until:
                break
            await asyncio.sleep(0.5)
        rss_after = _rss_mb(after, soak.server_pid) if soak else None
    lost = {k[len("lost: "):]: v for k, v in outcomes.items() if k.startswith("lost: ")}
    return LoadReport(
        streams=streams, duration_s=duration, statuses=dict(statuses), completed=outcomes["completed"],
        refused=outcomes["refused"], failed=sum(lost.values()),
        running_after=gauge(after, "adaflash_running_requests"), queued_after=gauge(after, "adaflash_queue_depth"),
        free_slots_after=gauge(after, "adaflash_free_slots"),
        max_slots=gauge(before, "adaflash_batch_slots") or gauge(before, "adaflash_free_slots"),
        rss_before_mb=samples[0][1] if samples else _rss_mb(before, None),
        rss_after_mb=rss_after if rss_after is not None else _rss_mb(after, None),
        hung_up=outcomes["hung_up"], duplicated=duplicated, server_errors=server_errors, lost_reasons=lost,
        kinds=dict(kinds), completion_tokens=tokens, rss_samples=tuple(samples),
        load_samples=tuple(gauges) if soak else (), latencies=tuple((t, round(x, 3)) for t, x in latencies) if soak else (),
        rss_peak_mb=max((mb for _, mb in samples), default=None), soak=soak,
        **(soak_figures(samples, latencies, duration_s, soak) if soak else {}),
    )


def windows_table(report: LoadReport, width_s: float = 300.0) -> str:
    """Per window of the run: requests started there, their p50 / p99 latency, and the server's mean running and
    queued requests there (its gauges, sampled with memory)."""
    rows = []
    for k in range(int(report.duration_s // width_s) + 1):
        lo, hi = k * width_s, (k + 1) * width_s
        lat = [x for t, x in report.latencies if lo <= t < hi]
        gauges = [(r, q) for t, r, q in report.load_samples if lo <= t < hi and r is not None and q is not None]
        if not lat:
            continue
        mean = lambda xs: f"{sum(xs) / len(xs):.1f}" if xs else "-"  # noqa: E731
        rows.append([f"{lo:.0f}-{hi:.0f}", len(lat), f"{percentile(lat, 0.5):.1f}", f"{percentile(lat, 0.99):.1f}",
                     mean([r for r, _ in gauges]), mean([q for _, q in gauges])])
    return markdown_table(["window (s)", "requests started", "p50 latency (s)", "p99 latency (s)", "running",
                           "queued"], rows, "lrrrrr")


def soak_markdown(report: LoadReport, command: str, note: str = "") -> str:
    f = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["# Load test" + (" (soak)" if report.soak else ""), "", f"`{command}`", ""]
    if note:
        lines += [note, ""]
    rows = [
        ["duration", f"{report.duration_s:.0f} s, {report.streams} concurrent clients"],
        ["requests", f"{report.completed} completed ({report.completion_tokens} tokens), {report.refused} refused "
                     f"(429/503 with Retry-After), {report.hung_up} hung up by the client, **{report.failed} lost**, "
                     f"**{report.duplicated} duplicated**"],
        ["completed by kind", ", ".join(f"{k} {v}" for k, v in sorted(report.kinds.items())) or "-"],
        ["HTTP statuses", ", ".join(f"{k} x{v}" for k, v in sorted(report.statuses.items())) +
                          f" (**{report.server_errors} server errors**)"],
        ["after the run", f"{f(report.running_after, 'g')} running, {f(report.queued_after, 'g')} queued, "
                          f"{f(report.free_slots_after, 'g')} of {f(report.max_slots, 'g')} slots free "
                          f"(**{f(report.leaked_slots, 'g')} leaked**)"],
    ]
    if report.soak:
        s = report.soak
        rows += [
            ["resident memory", f"{f(report.rss_before_mb)} MB first sample, {f(report.rss_at_warmup_mb)} MB after "
                                f"{s.warmup_s:.0f} s of warm-up, {f(report.rss_peak_mb)} MB peak, "
                                f"{f(report.rss_after_mb)} MB after"],
            ["growth after warm-up", f"**{f(report.rss_growth_pct, '.2f')}%** (bound {s.max_rss_growth_pct:g}%)"],
            ["p99 latency", f"{f(report.p99_first_s, '.2f')} s in the first {s.window_s:.0f} s after warm-up, "
                            f"{f(report.p99_last_s, '.2f')} s in the last: **{f(report.p99_drift_pct, '+.1f')}%** "
                            f"(bound +{s.max_p99_drift_pct:g}%)"],
        ]
    rows.append(["verdict", "clean" if report.clean else "NOT clean"])
    lines += [markdown_table(["", ""], rows), ""]
    if report.lost_reasons:
        lines += ["Lost: " + ", ".join(f"{k} x{v}" for k, v in report.lost_reasons.items()), ""]
    if report.latencies:
        lines += [windows_table(report), ""]
    if report.rss_samples:
        lines += ["RSS samples (s: MB): " + ", ".join(f"{t:.0f}: {mb:.0f}" for t, mb in report.rss_samples), ""]
    return "\n".join(lines)


def _command_line(args: argparse.Namespace, keyed: bool) -> str:
    """The run's settings as a command line; the API key masked (it never goes into a file)."""
    parts = ["adaflash bench load", f"--base-url {args.base_url}", f"--streams {args.streams}",
             f"--duration {args.duration:g}", f"--max-tokens {args.max_tokens}"]
    if args.prompt_set:
        parts.append(f"--prompt-set {args.prompt_set}")
    if args.mixed:
        parts.append("--mixed")
    if args.disconnect_rate:
        parts.append(f"--disconnect-rate {args.disconnect_rate:g}")
    if args.soak:
        parts += ["--soak", f"--rss-interval {args.rss_interval:g}", f"--warmup {args.warmup:g}",
                  f"--window {args.window:g}", f"--max-rss-growth-pct {args.max_rss_growth_pct:g}",
                  f"--max-p99-drift-pct {args.max_p99_drift_pct:g}"]
    if args.server_pid is not None:
        parts.append("--server-pid PID")
    if keyed:
        parts.append("--api-key ***")
    return " ".join(parts)


def _cmd(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get("ADAFLASH_API_KEY") or None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = args.model or httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    traffic = Traffic(max_tokens=args.max_tokens, disconnect_rate=args.disconnect_rate, mixed=args.mixed)
    if args.prompt_set:
        from adaflash.evaluation.serve_sweep import prompt_pool

        traffic = Traffic(tuple(tuple(m) for m in prompt_pool(args.prompt_set)), args.max_tokens, args.disconnect_rate,
                          args.mixed)
    soak = SoakConfig(args.rss_interval, args.server_pid, args.warmup, args.window, args.max_rss_growth_pct,
                      args.max_p99_drift_pct) if args.soak else None
    report = asyncio.run(run_load(args.base_url, model, args.streams, args.duration, traffic, soak=soak,
                                  api_key=api_key))
    result = report.as_dict()
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss_samples", "load_samples", "latencies")}, indent=2))
    if args.json:
        write_json({**result, "command": _command_line(args, bool(api_key)), "note": args.note}, args.json)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(soak_markdown(report, _command_line(args, bool(api_key)), args.note))
    return 0 if report.clean else 1


def register_cli(subparsers) -> None:
    p = command_group(subparsers, "bench", help="benchmarks").add_parser("load", help="soak a server and check for leaks")
    p.add_argument("--base-url", required=True)
    p.add_argument("--streams", type=int, default=128, help="concurrent clients, each sending its next request "
                   "when the last one ends")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=64, help="each request asks for 1..this many tokens")
    p.add_argument("--prompt-set", default=None, metavar="NAME",
                   help="a registered dataset's eval prompts, or six-mix (default: five short chat prompts)")
    p.add_argument("--mixed", action="store_true",
                   help="each request streaming or not, chat or completions, at random (default: chat streams)")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None, help="bearer key of the server (default: $ADAFLASH_API_KEY)")
    p.add_argument("--disconnect-rate", type=float, default=0.0,
                   help="fraction of streams whose client hangs up after the first token")
    p.add_argument("--soak", action="store_true",
                   help="sample the server's resident memory and compare the first and last windows after warm-up")
    p.add_argument("--rss-interval", type=float, default=10.0, help="seconds between memory samples (--soak)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="read the server's memory from /proc/PID (same machine) instead of its /metrics")
    p.add_argument("--warmup", type=float, default=120.0, help="seconds before memory and latency are compared (--soak)")
    p.add_argument("--window", type=float, default=300.0,
                   help="the first and last windows (s) whose p99 latencies --soak compares")
    p.add_argument("--max-rss-growth-pct", type=float, default=5.0,
                   help="--soak fails if memory grows more than this after warm-up")
    p.add_argument("--max-p99-drift-pct", type=float, default=20.0,
                   help="--soak fails if the last window's p99 latency is more than this above the first's")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None, help="also write a short markdown summary here")
    p.add_argument("--note", default="", help="a line on the conditions, kept in the JSON and the markdown")
    p.set_defaults(func=_cmd)
