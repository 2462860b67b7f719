"""`adaflash bench load --soak`: memory sampled through the run, lost requests and leaked slots reported,
client hang-ups exercised; and the checker does fail when requests are lost or memory keeps growing."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from adaflash.cli import main
from adaflash.evaluation.load_test import LoadReport, SoakConfig, Traffic, run_load, soak_figures
from adaflash.server.gate import ServerConfig
from tests.server.live import app_over_engine, live_server
from tests.server.test_server import MODEL, metric, pipeline, random_drafter  # noqa: F401

KEY = "sk-soak-test-3e9d0a"


def test_mixed_soak_samples_memory_hangs_up_and_finds_nothing_lost_or_leaked(pipeline):  # noqa: F811
    import httpx

    soak = SoakConfig(rss_interval_s=0.5, warmup_s=1.0, window_s=1.0)
    traffic = Traffic(max_tokens=12, disconnect_rate=0.3, mixed=True)
    with app_over_engine(pipeline, max_batch=2, max_queue=2, step_delay=0.005) as (app, _), live_server(app) as url:
        report = asyncio.run(run_load(url, MODEL, streams=6, duration_s=5.0, traffic=traffic, settle_s=10, soak=soak))
        disconnects = metric(httpx.Client(base_url=url), "adaflash_client_disconnects_total")
    assert report.completed > 0 and report.refused > 0 and report.hung_up > 0, report.statuses
    # Every kind of request ran and completed: chat and completions, streamed and not.
    assert set(report.kinds) == {"chat", "chat stream", "completions", "completions stream"}, report.kinds
    assert report.failed == 0 and report.lost_reasons == {} and report.duplicated == 0 and report.server_errors == 0
    assert report.leaked_slots == 0 and report.running_after == 0 and report.queued_after == 0
    assert report.completion_tokens >= report.completed
    assert len(report.rss_samples) >= 5 and report.rss_samples[-1][0] >= 5.0  # through the whole run, to its end
    assert report.rss_growth_pct is not None and report.p99_first_s is not None  # (soak_figures: the next test)
    assert disconnects >= 1  # some hang-ups reached the server while their request still ran: the abort path ran


def test_lost_requests_make_the_run_fail(pipeline):  # noqa: F811
    """A server whose deadline cuts every stream short: each such request is lost, not completed."""
    config = ServerConfig(request_timeout_s=0.05)
    with app_over_engine(pipeline, config, max_batch=2, step_delay=0.03) as (app, _), live_server(app) as url:
        report = asyncio.run(run_load(url, MODEL, streams=2, duration_s=1.0, traffic=Traffic(max_tokens=40), settle_s=5))
    assert report.failed > 0 and report.lost_reasons.get("error event request_timeout") == report.failed
    assert not report.clean


def test_soak_figures_and_verdict():
    soak = SoakConfig(warmup_s=20, window_s=30, max_rss_growth_pct=5.0, max_p99_drift_pct=20.0)
    bump_then_flat = [(t, 500.0 + (30.0 if t >= 10 else 0.0)) for t in range(0, 101, 10)]  # warm-up bump, then flat
    latencies = [(t, 1.0 if t < 70 else 1.5) for t in range(0, 100)]  # slower in the last 30 s
    figures = soak_figures(bump_then_flat, latencies, 100, soak)
    assert figures == {"rss_at_warmup_mb": 530.0, "rss_growth_pct": 0.0, "p99_first_s": 1.0, "p99_last_s": 1.5}
    rising = [(t, 500.0 + t) for t in range(0, 101, 10)]  # 1 MB/s for ever
    assert soak_figures(rising, [], 100, soak)["rss_growth_pct"] == pytest.approx(100 * (600 / 520 - 1))
    base = dict(streams=1, duration_s=100, statuses={"200": 3}, completed=3, refused=0, failed=0, running_after=0,
                queued_after=0, free_slots_after=2, max_slots=2, rss_before_mb=500, rss_after_mb=600, soak=soak)
    assert not LoadReport(**base, rss_growth_pct=15.4).clean
    assert LoadReport(**base, rss_growth_pct=0.0, p99_first_s=1.0, p99_last_s=1.1).clean
    slower = LoadReport(**base, rss_growth_pct=0.0, p99_first_s=1.0, p99_last_s=1.5)
    assert slower.p99_drift_pct == pytest.approx(50.0) and not slower.latency_steady and not slower.clean
    assert not LoadReport(**{**base, "free_slots_after": 1}).clean  # a slot leaked
    assert not LoadReport(**base, duplicated=1).clean  # one completion id answered twice


def test_bench_load_cli_with_a_key_writes_json_and_markdown(pipeline, tmp_path, capsys):  # noqa: F811
    out, md = tmp_path / "soak.json", tmp_path / "soak.md"
    with app_over_engine(pipeline, ServerConfig(api_key=KEY), step_delay=0.005) as (app, _), live_server(app) as url:
        rc = main(["bench", "load", "--base-url", url, "--streams", "2", "--duration", "1.5", "--max-tokens", "4",
                   "--mixed", "--soak", "--rss-interval", "0.5", "--warmup", "0.5", "--window", "0.5",
                   # Half-second windows in a shared test process measure noise: the bounds are judged in
                   # test_soak_figures_and_verdict; here only the plumbing is.
                   "--max-p99-drift-pct", "100000", "--max-rss-growth-pct", "100000",
                   "--server-pid", str(os.getpid()), "--api-key", KEY,
                   "--json", str(out), "--markdown", str(md), "--note", "a test run"])
    assert rc == 0, capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["clean"] and result["completed"] > 0 and result["leaked_slots"] == 0 and len(result["rss_samples"]) >= 3
    assert result["note"] == "a test run" and "--api-key ***" in result["command"]
    text = md.read_text()
    assert "**0 lost**" in text and "**0 duplicated**" in text and "**0 leaked**" in text and "a test run" in text
    assert "| window (s) | requests started | p50 latency (s) | p99 latency (s) |" in text  # where latency went
    assert len(result["latencies"]) == result["completed"] and result["load_samples"]
    assert KEY not in out.read_text() and KEY not in text
