"""A real `adaflash serve` process: SIGTERM / Ctrl-C stop admitting (503), let the stream in flight finish
(or abort it cleanly past --drain-timeout), exit 0; the API key never reaches its log."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from adaflash.server.gate import ServerConfig
from tests.server.live import app_over_engine
from tests.server.test_server import CHAT, pipeline, random_drafter, wait_for  # noqa: F401
from tests.helpers import free_port, private_cache

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-shutdown-test-90c4e1f2b7"
WRONG = "sk-shutdown-wrong-1d8e33"
MODEL = "tiny"
STEP_S = 0.02  # per engine step (AR: one token): a 150-token stream takes 3+ s


@pytest.fixture(scope="module")
def serve_cache(tmp_path_factory) -> Path:
    """One private ADAFLASH_CACHE for this file's servers, its kernels/ the user cache's (tests/helpers.py): the kernel
    library is compiled and the kernel choices timed once, not once a server."""
    return private_cache(tmp_path_factory.mktemp("serve-cache"))


@contextlib.contextmanager
def serve_process(tmp_path: Path, cache: Path, checkpoint: str, *extra: str):
    """`adaflash serve --method ar` on the tiny checkpoint, every step slowed; yields (process, base URL, log path)."""
    port, log_path = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "ADAFLASH_TEST_STEP_DELAY": str(STEP_S), "ADAFLASH_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("ADAFLASH_API_KEY", None)
    cmd = [sys.executable, "-m", "tests.server.slow_serve", "serve", "--model", checkpoint, "--method", "ar",
           "--dtype", "fp32", "--max-batch", "2", "--max-len", "512", "--port", str(port), "--served-model-name", MODEL,
           *extra]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            base_url = f"http://127.0.0.1:{port}"

            def healthy() -> bool:
                assert proc.poll() is None, f"adaflash serve exited with {proc.returncode}:\n{log_path.read_text()}"
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
                return False

            assert wait_for(healthy, timeout=180), log_path.read_text()
            yield proc, base_url, log_path
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _stream(client: httpx.Client, max_tokens: int):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    return client.stream("POST", "/v1/chat/completions", json=body)


def _events(lines) -> list[dict | str]:
    return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):]) for line in lines if line]


def _content(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e.get("choices"))


def test_sigterm_drains_the_stream_in_flight_refuses_new_requests_and_exits_0(tmp_path, serve_cache,
                                                                             tiny_chat_checkpoint):
    auth = {"Authorization": f"Bearer {KEY}"}
    with serve_process(tmp_path, serve_cache, tiny_chat_checkpoint, "--api-key", KEY, "--log-level", "debug") as (
            proc, url, log_path):
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {WRONG}"}).status_code == 401
        with httpx.Client(base_url=url, headers=auth, timeout=60) as client, _stream(client, 150) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = []
            while not _content(_events(first)):  # the stream is under way
                first.append(next(lines))
            proc.send_signal(signal.SIGTERM)

            # Draining: the listener stays up, but says so and admits nothing new.
            assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, timeout=10)
            assert httpx.get(f"{url}/health").json() == {"status": "draining"}
            refused = httpx.post(f"{url}/v1/chat/completions", headers=auth, json={"messages": CHAT, "max_tokens": 4})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
            assert proc.poll() is None  # still serving the stream in flight

            events = _events(first + list(lines))  # ... which runs to its end
        assert events[-1] == "[DONE]"
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")]
        assert finish[-1] == "length" and events[-2]["usage"]["completion_tokens"] == 150
        assert proc.wait(timeout=30) == 0

    log = log_path.read_text()
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log and '"GET /v1/models HTTP/1.1" 401' in log  # the access log ran
    assert "auth bearer key required" in log and "draining 1 request(s) in flight" in log
    assert KEY not in log and WRONG not in log and "Bearer" not in log


def test_ctrl_c_past_the_drain_timeout_aborts_the_stream_cleanly_and_exits_0(tmp_path, serve_cache,
                                                                              tiny_chat_checkpoint):
    with serve_process(tmp_path, serve_cache, tiny_chat_checkpoint, "--drain-timeout", "1") as (proc, url, log_path):
        with httpx.Client(base_url=url, timeout=60) as client, _stream(client, 450) as r:  # 9+ s of decoding
            assert r.status_code == 200
            lines = r.iter_lines()
            first = []
            while not _content(_events(first)):
                first.append(next(lines))
            proc.send_signal(signal.SIGINT)
            events = _events(first + list(lines))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down"
        # Cut short at the drain's end, not run to it: every step sleeps STEP_S, so the 1 s drain has room for ~50
        # tokens, the stream for 450. A busy machine only makes fewer; no wall-clock bound is needed.
        streamed = sum(1 for e in events[:-1] if e.get("choices") and e["choices"][0]["delta"].get("content"))
        assert 0 < streamed < 150
        assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events[:-1])
        assert proc.wait(timeout=30) == 0
    assert "aborted 1 request(s) still running" in log_path.read_text()


def test_draining_app_refuses_v1_but_serves_metrics(pipeline):  # noqa: F811
    with app_over_engine(pipeline, ServerConfig()) as (app, _):
        client = TestClient(app)
        app.state.admission.draining = True
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_shutting_down" and set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert client.get("/health").status_code == 503 and client.get("/metrics").status_code == 200
        assert app.state.admission.in_flight == 0


@pytest.mark.parametrize("signals", [1, 2])
def test_draining_server_aborts_only_when_the_drain_time_is_up(signals):
    """DrainingServer's tick logic without a process: wait while requests run, abort at the deadline."""
    import asyncio

    import uvicorn

    from adaflash.server.gate import Admission
    from adaflash.server.shutdown import DrainingServer

    admission = Admission()
    aborted = []
    admission.on_abort_all(lambda: aborted.append(admission.in_flight) or 1)
    server = DrainingServer(uvicorn.Config(app=None), admission, drain_timeout_s=0.3)

    async def ticks():
        assert await server.on_tick(1) is False  # no signal: serve on
        admission.in_flight = 1
        for _ in range(signals):
            server.handle_exit(signal.SIGTERM, None)
        assert admission.draining and not server.should_exit
        if signals == 1:
            assert await server.on_tick(1) is False and not aborted  # within the drain time: wait
            await asyncio.sleep(0.35)
        assert await server.on_tick(1) is False and aborted == [1]  # the deadline (or a 2nd signal): abort
        admission.in_flight = 0
        assert await server.on_tick(1) is True  # nothing left: stop

    asyncio.run(ticks())
    assert server._captured_signals == []  # uvicorn would re-raise these after shutdown (the process would die by them)
