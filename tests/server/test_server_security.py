"""`--api-key`: every /v1 request needs the bearer key (401 otherwise), /health stays open, /metrics is
protected unless opened, the key is compared in constant time and never shows in a repr or a response."""

from __future__ import annotations

import argparse

import openai
import pytest
from fastapi.testclient import TestClient

from adaflash.server import gate
from adaflash.server.cli import register_cli, server_config
from adaflash.server.gate import API_KEY_ENV, ServerConfig
from tests.server.live import app_over_engine, live_server
from tests.server.test_server import CHAT, MODEL, PROMPT, pipeline, random_drafter, reference  # noqa: F401

KEY = "sk-test-5b2f0c9e41d7a3"
WRONG = "sk-test-wrong-77e1aa0b"


@pytest.fixture
def keyed(pipeline):  # noqa: F811
    def make(**config):
        return app_over_engine(pipeline, ServerConfig(api_key=KEY, **config))
    return make


def _unauthorized(response, wrong_key: str | None = None) -> dict:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    assert KEY not in response.text and (wrong_key is None or wrong_key not in response.text)  # nothing echoed
    return err


def test_every_v1_request_needs_the_bearer_key(keyed, pipeline):  # noqa: F811
    with keyed() as (app, _):
        client = TestClient(app)
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        assert "provide an API key" in _unauthorized(client.post("/v1/completions", json=body))["message"]
        assert "Incorrect" in _unauthorized(client.post("/v1/completions", json=body,
                                                        headers={"Authorization": f"Bearer {WRONG}"}), WRONG)["message"]
        for header in (f"Basic {KEY}", KEY, "Bearer", "Bearer ", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}"):
            _unauthorized(client.get("/v1/models", headers={"Authorization": header}))
        _unauthorized(client.get("/v1/nothing"))  # no route discovery without the key: 401 before 404
        _unauthorized(client.get("/v1"))

        ok = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == MODEL
        assert client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200  # scheme is case-insensitive
        r = client.post("/v1/completions", json=body, headers=ok)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(pipeline, 6, prompt=PROMPT)[0]
        assert client.get("/v1/nothing", headers=ok).status_code == 404
        metrics = client.get("/metrics", headers=ok).text
        assert 'adaflash_requests_total{endpoint="/v1/completions",status="401"} 2.0' in metrics  # refusals are counted


def test_health_is_open_and_metrics_is_protected_unless_opened(keyed):
    with keyed() as (app, _):
        client = TestClient(app)
        assert client.get("/health").json() == {"status": "ok"}
        _unauthorized(client.get("/metrics"))
        _unauthorized(client.get("/metrics", headers={"Authorization": f"Bearer {WRONG}"}), WRONG)
        assert "adaflash_free_slots" in client.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    with keyed(metrics_open=True) as (app, _):
        client = TestClient(app)
        assert "adaflash_free_slots" in client.get("/metrics").text
        _unauthorized(client.get("/v1/models"))  # opening /metrics opens nothing else


def test_without_a_key_everything_stays_open(pipeline):  # noqa: F811
    with app_over_engine(pipeline) as (app, _):
        client = TestClient(app)
        assert client.get("/v1/models").status_code == 200 and client.get("/metrics").status_code == 200


def test_the_key_is_compared_in_constant_time(keyed, monkeypatch):
    seen = []

    def spy(a, b):
        seen.append((len(a), len(b)))
        return a == b

    monkeypatch.setattr(gate.hmac, "compare_digest", spy)
    with keyed() as (app, _):
        client = TestClient(app)
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
    assert seen == [(32, 32), (32, 32)]  # fixed-length digests: the time taken does not even reveal the key's length


def test_official_openai_client_with_right_and_wrong_key(keyed, pipeline):  # noqa: F811
    with keyed() as (app, _), live_server(app) as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=30)
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == reference(pipeline, 8, messages=CHAT)[0]
        bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key=WRONG, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_config_hides_the_key_and_reads_it_from_the_environment(monkeypatch):
    assert KEY not in repr(ServerConfig(api_key=KEY)) and KEY not in str(ServerConfig(api_key=KEY))
    with pytest.raises(ValueError, match="empty"):
        ServerConfig(api_key="  ")
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    parse = lambda *argv: parser.parse_args(["serve", *argv])  # noqa: E731
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert server_config(parse()).api_key is None
    monkeypatch.setenv(API_KEY_ENV, KEY)
    config = server_config(parse())
    assert config.api_key == KEY and not config.metrics_open
    assert server_config(parse("--api-key", WRONG, "--metrics-open")).api_key == WRONG  # the flag wins
    assert server_config(parse("--metrics-open")).metrics_open
