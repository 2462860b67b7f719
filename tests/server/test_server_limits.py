"""Request limits: n > 1 is refused with a clear 400; `--request-timeout` aborts a request in the engine,
frees its slot and tells the client (504, or an error event that ends the stream)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from adaflash.server.gate import ServerConfig
from tests.server.live import app_over_engine, live_server
from tests.server.test_server import CHAT, PROMPT, metric, pipeline, random_drafter, wait_for  # noqa: F401

TIMEOUT_S = 0.4
STEP_S = 0.01  # 400 tokens at 3 committed per >= 10 ms step: well past the deadline


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": PROMPT})])
def test_n_above_one_is_refused_clearly(pipeline, path, body):  # noqa: F811
    with app_over_engine(pipeline) as (app, _):
        client = TestClient(app)
        r = client.post(path, json={**body, "n": 3, "max_tokens": 2})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "n" and "n=3 is not supported" in err["message"] and "one choice per request" in err["message"]
        assert client.post(path, json={**body, "n": 1, "max_tokens": 2}).status_code == 200
        assert client.post(path, json={**body, "n": 0, "max_tokens": 2}).status_code == 400


@pytest.fixture
def deadline_app(pipeline):  # noqa: F811
    with app_over_engine(pipeline, ServerConfig(request_timeout_s=TIMEOUT_S), max_batch=1, max_queue=4,
                         step_delay=STEP_S) as (app, runner):
        yield app, runner


def _slots_back(client) -> bool:
    return wait_for(lambda: metric(client, "adaflash_free_slots") == 1 and metric(client, "adaflash_running_requests") == 0)


def test_request_timeout_aborts_a_long_request_and_frees_its_slot(deadline_app):
    app, _ = deadline_app
    client = TestClient(app)
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 400, "temperature": 0})
    assert r.status_code == 504  # (no bound on the call's wall time: the engine's token count below says it stopped)
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("timeout_error", "request_timeout") and f"{TIMEOUT_S:g} s" in err["message"]
    assert _slots_back(client)
    assert metric(client, "adaflash_request_timeouts_total") == 1
    assert metric(client, "adaflash_client_disconnects_total") == 0  # the server's abort, not the client's
    assert 0 < metric(client, "adaflash_generation_tokens_total") < 400  # the engine stopped, it did not run on

    # A request within the deadline is untouched, and the freed slot serves it.
    short = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    assert metric(client, "adaflash_request_timeouts_total") == 1


def test_request_timeout_ends_a_stream_with_an_error_event(deadline_app):
    app, _ = deadline_app
    with live_server(app) as base_url, httpx.Client(base_url=base_url, timeout=30) as client:
        body = {"messages": CHAT, "max_tokens": 400, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
        assert any(e.get("choices") and e["choices"][0]["delta"].get("content") for e in events)  # it streamed first
        assert events[-1]["error"]["code"] == "request_timeout"
        assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)  # no fake finish
        assert _slots_back(client)
        assert metric(client, "adaflash_request_timeouts_total") == 1


def test_the_deadline_runs_while_queued_too(deadline_app):
    app, _ = deadline_app

    async def scenario():  # two long requests, one slot: the second times out in the queue
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await asyncio.gather(*[
                c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0}) for _ in range(2)
            ])

    replies = asyncio.run(scenario())
    assert [r.status_code for r in replies] == [504, 504]
    client = TestClient(app)
    assert _slots_back(client) and metric(client, "adaflash_queue_depth") == 0
    assert metric(client, "adaflash_request_timeouts_total") == 2


def test_request_timeout_must_be_positive():
    with pytest.raises(ValueError, match="> 0"):
        ServerConfig(request_timeout_s=0)
