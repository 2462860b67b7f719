"""Property-based fuzzing of the request bodies: whatever a client sends, the server never answers 5xx."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_server import MODEL  # noqa: F401  (fixtures below come from test_server)
from tests.server.test_server import pipeline, random_drafter, serve  # noqa: F401

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x", 3]), "content": st.one_of(st.text(max_size=30), JSON_VALUES)})
FIELDS = {
    "model": st.one_of(st.just("tiny-chat"), JSON_VALUES),
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON_VALUES),
    "prompt": st.one_of(st.text(max_size=30), JSON_VALUES),
    "max_tokens": st.one_of(st.integers(-5, 6), JSON_VALUES),
    "temperature": st.one_of(st.floats(-1, 3), JSON_VALUES),
    "top_p": st.one_of(st.floats(-0.5, 1.5), JSON_VALUES),
    "top_k": st.one_of(st.integers(-3, 5), JSON_VALUES),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), JSON_VALUES),
    "seed": st.one_of(st.integers(-(2**70), 2**70), JSON_VALUES),
    "n": st.one_of(st.integers(-1, 3), JSON_VALUES),
    "stream": st.one_of(st.booleans(), JSON_VALUES),
}
BODIES = st.fixed_dictionaries({}, optional=FIELDS)


@pytest.fixture(scope="module")
def fuzz_client(pipeline):  # noqa: F811
    from adaflash.engine.engine import Engine
    from adaflash.engine.runner import EngineRunner
    from adaflash.server.server import create_app
    from adaflash.speculative.length_policy import FixedLength

    runner = EngineRunner(Engine(pipeline.target, pipeline.proposer, FixedLength(3), max_batch=2, max_len=256)).start()
    yield TestClient(create_app(runner, pipeline.tokenizer, MODEL))
    runner.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_no_body_makes_the_server_fail(fuzz_client, path):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=BODIES)
    def check(body):
        response = fuzz_client.post(path, json=body)
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            assert "error" in response.json() and "message" in response.json()["error"]

    check()


def test_raw_garbage_bodies(fuzz_client):
    for raw in [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"messages": [}', b"1e999"]:
        response = fuzz_client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (raw, response.status_code)
