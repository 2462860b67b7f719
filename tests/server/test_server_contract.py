"""/openapi.json describes the server: schemathesis' checks, every one, find nothing against the app in process; and
the schema itself names every status, media type and bound."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from adaflash.engine.engine import Engine
from adaflash.engine.runner import EngineRunner
from adaflash.models.targets.text_codec import TextCodec
from adaflash.server.gate import ServerConfig
from adaflash.server.server import create_app
from tests.server.contract import run_in_process
from tests.server.test_server import CHAT, MODEL, pipeline, random_drafter  # noqa: F401  (fixtures)

KEY = "sk-contract-7c1d0e"
MAX_LEN = 48  # a short context: generations stay short, and schema-valid bodies that overflow it do occur
GENERATION = ("POST /v1/completions", "POST /v1/chat/completions")


@pytest.fixture
def runner(pipeline):  # noqa: F811
    # Plain decoding: the contract is the HTTP API's, the same with a drafter (whose random drafts only slow the
    # hundreds of generations schemathesis asks for)
    runner = EngineRunner(Engine(pipeline.target, max_batch=2, max_len=MAX_LEN)).start()
    yield runner
    runner.stop()


def _spec(runner, pipeline, config: ServerConfig = ServerConfig()) -> dict:  # noqa: F811
    return TestClient(create_app(runner, pipeline.tokenizer, MODEL, config=config)).get("/openapi.json").json()


def test_schemathesis_finds_no_failure_and_no_server_error(runner, pipeline):  # noqa: F811
    # A key and a deadline: the 401s (and the bearer scheme, probed by ignored_auth) and 504s are documented too.
    app = create_app(runner, pipeline.tokenizer, MODEL, config=ServerConfig(api_key=KEY, request_timeout_s=30))
    codec = TextCodec(pipeline.tokenizer, runner.snapshot.target.config.eos_token_ids)
    config = {"generation": {"max-examples": 12, "database": "none"}, "continue-on-failure": True, "seed": 53,
              "headers": {"Authorization": f"Bearer {KEY}"}}
    outcome = run_in_process(app, config, codec, runner.context_tokens)

    assert not outcome.errors
    assert not outcome.failures, "\n".join(map(repr, outcome.failures[:10]))
    assert not [key for key in outcome.statuses if key[1] >= 500]
    for operation in GENERATION:  # it generated, streamed and refused, and each answer was checked
        assert outcome.statuses.get((operation, 200), 0) > 0
        assert outcome.statuses.get((operation, 400), 0) > 0
        assert outcome.statuses.get((operation, 401), 0) > 0
        assert {(operation, "application/json"), (operation, "text/event-stream")} <= outcome.media_types
    assert ("GET /metrics", "text/plain") in outcome.media_types


def test_the_schema_names_each_status_media_type_and_bound(runner, pipeline):  # noqa: F811
    spec = _spec(runner, pipeline)
    paths, schemas = spec["paths"], spec["components"]["schemas"]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "500", "503"}  # no key, no deadline: no 401, no 504
        assert all(responses[s]["content"]["application/json"]["schema"] == error for s in ("400", "404", "500", "503"))
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "Retry-After" in responses["503"]["headers"]
    assert set(paths["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "404", "500", "503"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(paths["/health"]["get"]["responses"]) == {"200", "503"}
    assert "HTTPValidationError" not in schemas and "securitySchemes" not in spec["components"]
    assert not [p for p, ops in paths.items() for op in ops.values() if "422" in op["responses"] or "security" in op]

    # The largest budget the shortest prompt leaves: one token of text, one empty system message in a chat.
    codec = TextCodec(pipeline.tokenizer, runner.snapshot.target.config.eos_token_ids)
    context = runner.context_tokens

    def bound(model: str, field: str) -> int:
        return next(b["maximum"] for b in schemas[model]["properties"][field]["anyOf"] if b.get("type") == "integer")

    assert bound("CompletionRequest", "max_tokens") == context - len(codec.encode(prompt="a"))
    chat = context - len(codec.encode(messages=[{"role": "system", "content": ""}]))
    assert bound("ChatCompletionRequest", "max_tokens") == bound("ChatCompletionRequest", "max_completion_tokens") == chat
    props = schemas["CompletionRequest"]["properties"]
    assert props["prompt"]["minLength"] == 1 and props["n"]["maximum"] == 1
    assert props["logprobs"]["enum"] == [None, False] and props["return_meta_info"]["type"] == "boolean"
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1


def test_a_key_and_a_deadline_are_in_the_schema(runner, pipeline):  # noqa: F811
    spec = _spec(runner, pipeline, ServerConfig(api_key=KEY, request_timeout_s=5, metrics_open=True))
    assert spec["components"]["securitySchemes"] == {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearerAuth": []}] and {"401", "504"} <= set(chat["responses"])
    assert "WWW-Authenticate" in chat["responses"]["401"]["headers"]
    assert "security" not in spec["paths"]["/metrics"]["get"]  # --metrics-open
    assert "security" not in spec["paths"]["/health"]["get"] and "401" not in spec["paths"]["/health"]["get"]["responses"]


@pytest.mark.parametrize("body, status", [
    ({"messages": CHAT, "max_tokens": 3.0}, 200),  # a JSON integer written with a fraction point
    ({"messages": CHAT, "max_tokens": 3, "stop": "a stop string longer than four characters"}, 200),
    ({"messages": CHAT, "max_tokens": 3, "presence_penalty": 0.0, "logit_bias": {}, "tools": []}, 200),  # no-op values
    ({"messages": CHAT, "max_tokens": 3.5}, 400),
    ({"messages": CHAT, "presence_penalty": False}, 400),  # false is not the number 0 (the schema's enum)
    ({"messages": CHAT, "seed": 2**53}, 400),  # beyond JSON's exact integers
    ({"messages": CHAT, "max_tokens": 1, "max_completion_tokens": 2, "n": 1.0}, 200),
])
def test_what_the_schema_admits_is_served_and_what_it_refuses_is_a_400(runner, pipeline, body, status):  # noqa: F811
    client = TestClient(create_app(runner, pipeline.tokenizer, MODEL))
    response = client.post("/v1/chat/completions", json={**body, "temperature": 0})
    assert response.status_code == status, response.text


def test_each_token_bound_must_fit_even_the_one_that_does_not_decide(runner, pipeline):  # noqa: F811
    client = TestClient(create_app(runner, pipeline.tokenizer, MODEL))
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 2, "max_tokens": 10**6})
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("max_tokens", "context_length_exceeded")
