"""The OpenAI-compatible server in process: lossless through HTTP, streaming, stop strings, every 4xx, metrics."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.engine.runner import EngineRunner
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, save_drafter
from adaflash.pipeline import Pipeline
from adaflash.server.server import TextStream, create_app
from adaflash.speculative.length_policy import FixedLength

MODEL = "tiny-chat"
CHAT = [{"role": "user", "content": "Tell me a joke"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def random_drafter(tiny_chat_checkpoint, tmp_path_factory) -> str:
    cfg = DrafterConfig.for_target(TransformerConfig.from_dir(tiny_chat_checkpoint), mask_token_id=16, num_layers=1, block_size=8)
    return str(save_drafter(init_drafter(cfg, seed=3), tmp_path_factory.mktemp("drafter")))


@pytest.fixture(scope="session")
def pipeline(tiny_chat_checkpoint, random_drafter) -> Pipeline:
    return Pipeline.load(tiny_chat_checkpoint, random_drafter, "fp32")


def slow_steps(engine: Engine, seconds: float) -> None:
    """Make every engine step take a while, so a request is reliably still running when a test acts."""
    step = engine.step

    def slowed():
        time.sleep(seconds)
        return step()

    engine.step = slowed


@pytest.fixture
def serve(pipeline):
    """serve(max_batch=..., ...) -> (app, runner): a dflash engine on its own started runner."""
    runners = []

    def make(max_batch=2, max_queue=8, max_len=256, policy=FixedLength(3), step_delay=0.0, **kv):
        engine = Engine(pipeline.target, pipeline.proposer, policy, max_batch=max_batch, max_queue=max_queue, max_len=max_len,
                        **kv)
        if step_delay:
            slow_steps(engine, step_delay)
        runner = EngineRunner(engine).start()
        runners.append(runner)
        return create_app(runner, pipeline.tokenizer, MODEL), runner

    yield make
    for runner in runners:
        runner.stop()


@pytest.fixture
def client(serve) -> TestClient:
    return TestClient(serve()[0])


def reference(pipeline: Pipeline, max_tokens: int, prompt: str | None = None, messages=None):
    """Plain greedy AR decoding through the library: what the server must return token for token."""
    ids = pipeline.encode(prompt=prompt, messages=messages)
    done = pipeline.complete(ids, "ar", max_new_tokens=max_tokens)
    finish = "stop" if done.token_ids[-1] in pipeline.stop_token_ids else "length"
    return done.text, finish, len(ids), len(done.token_ids)


def sse_events(response) -> list:
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_completions_and_chat_are_lossless_with_usage(client, pipeline):
    text, finish, n_prompt, n_out = reference(pipeline, 24, prompt=PROMPT)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == finish
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    text, finish, n_prompt, n_out = reference(pipeline, 20, messages=CHAT)
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 20, "temperature": 0.0})
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == finish
    assert body["usage"]["prompt_tokens"] == n_prompt and body["usage"]["completion_tokens"] == n_out


def test_concurrent_requests_batch_and_stay_lossless(serve, pipeline):
    app, _ = serve(max_batch=2)  # three requests, two slots: batching, queueing and slot reuse
    prompts = [PROMPT, "Once upon a time", "def fibonacci(n):"]
    expected = [reference(pipeline, 12 + 3 * i, prompt=p)[0] for i, p in enumerate(prompts)]

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            replies = await asyncio.gather(*[
                c.post("/v1/completions", json={"prompt": p, "max_tokens": 12 + 3 * i, "temperature": 0})
                for i, p in enumerate(prompts)
            ])
        return [r.json()["choices"][0]["text"] for r in replies]

    assert asyncio.run(scenario()) == expected


def test_sampling_parameters_reach_the_engine(client, pipeline):
    greedy = reference(pipeline, 10, prompt=PROMPT)[0]
    post = lambda **kw: client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, **kw}).json()["choices"][0]["text"]
    assert post(temperature=1.0, top_k=1) == greedy  # top-k 1 leaves only the argmax
    assert post(temperature=1.5, seed=7) == post(temperature=1.5, seed=7) != greedy


def test_streaming_chunks_concatenate_to_the_same_text(client, pipeline):
    text, finish, n_prompt, n_out = reference(pipeline, 20, messages=CHAT)
    req = {"model": MODEL, "messages": CHAT, "max_tokens": 20, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_events(r)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]]
    assert "".join(deltas) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-2:] == [None, finish]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == n_out

    text, finish, _, _ = reference(pipeline, 16, prompt=PROMPT)
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        chunks = sse_events(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == finish and chunks[-1]["usage"] is None


def test_stop_strings_cut_the_text_and_free_the_slot(serve, pipeline):
    app, runner = serve(max_batch=1)
    client = TestClient(app)
    full, _, _, _ = reference(pipeline, 32, prompt=PROMPT)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[: full.find(stop)]
    req = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stop": [stop, "\u2603never"]}
    body = client.post("/v1/completions", json=req).json()
    assert body["choices"][0] == {"index": 0, "text": expected, "logprobs": None, "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] < 32
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        chunks = sse_events(r)
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert wait_for(lambda: metric(client, "adaflash_free_slots") == 1)


def test_text_stream_holds_back_possible_stop_prefixes_and_partial_characters():
    decoded = {1: "ab", 2: "abc", 3: "abcX", 4: "abcXY\ufffd"}
    stream = TextStream(lambda ids: decoded[len(ids)], ["XYZ"])
    assert [stream.push([0], False) for _ in range(3)] == ["", "a", "b"]  # two characters held back
    assert stream.push([0], False) == "c"  # "X", "Y" and the partial character wait
    assert stream.push([], True) == "XY\ufffd" and stream.sent == stream.text


def _error(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code)
    return err


LONG = "word " * 300  # more tokens than the 256-token test context


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        ("/v1/chat/completions", b'{"messages": [', 400, None, None),  # invalid JSON
        ("/v1/chat/completions", b'[1, 2]', 400, None, None),  # JSON, but not an object
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages", None),  # missing messages
        ("/v1/chat/completions", {"messages": []}, 400, "messages", None),  # empty messages
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),  # wrong type
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", None),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "5"}, 400, "max_tokens", None),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -1}, 400, "max_tokens", None),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**9}, 400, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", {"messages": CHAT, "temperature": 3}, 400, "temperature", None),
        ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p", None),
        ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n", None),
        ("/v1/chat/completions", {"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, 400, None, None),
        ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "context_length_exceeded"),
        ("/v1/completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 400, "prompt", None),  # token-id prompts are not supported
        ("/v1/completions", {"prompt": ""}, 400, "prompt", None),  # encodes to no tokens
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed", None),
    ],
)
def test_bad_requests_get_openai_errors(client, path, body, status, param, code):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    _error(client.post(path, **kwargs), status, param, code)


def test_models_health_metrics_and_unknown_routes(serve):
    app, runner = serve()
    client = TestClient(app)
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    _error(client.get("/v1/models/nope"), 404, "model", "model_not_found")
    assert client.get("/health").json() == {"status": "ok"}
    _error(client.get("/v1/nothing"), 404)
    _error(client.get("/v1/completions"), 405)
    client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    text = client.get("/metrics").text
    for name in ("adaflash_requests_total", "adaflash_prompt_tokens_total", "adaflash_generation_tokens_total",
                 "adaflash_accept_length_bucket", "adaflash_verify_length_bucket", "adaflash_running_requests",
                 "adaflash_queue_depth", "adaflash_free_slots", "adaflash_client_disconnects_total",
                 "adaflash_prompt_tokens_reused_total"):
        assert name in text
    assert 'adaflash_length_policy_info{method="dflash",policy="fixed:3"} 1.0' in text
    assert 'adaflash_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'adaflash_requests_total{endpoint="/v1/models",status="404"} 1.0' in text
    assert 'adaflash_requests_total{endpoint="other",status="404"} 1.0' in text
    assert metric(client, "adaflash_verify_length_count") >= 1  # 3 decode passes after the prefill
    runner.stop()
    assert client.get("/health").status_code == 503
    _error(client.post("/v1/completions", json={"prompt": PROMPT}), 503, None, "engine_stopped")


def test_full_queue_answers_503_with_retry_after(serve):
    app, runner = serve(max_batch=1, max_queue=1, step_delay=0.01)

    async def scenario():
        # Engine-level requests without stop tokens: "a" holds the only slot, "b" the only queue place.
        a = await runner.submit(Request("a", [5, 6, 7], 200))
        await a.__anext__()  # prefilled, so admitted
        b = await runner.submit(Request("b", [5, 6, 7], 200))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            full = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            a.close(), b.close()
            await asyncio.sleep(0)
            after = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        return full, after

    full, after = asyncio.run(scenario())
    err = _error(full, 503, None, "queue_full")
    assert err["type"] == "server_overloaded" and full.headers["retry-after"] == "1"
    assert after.status_code == 200  # capacity is back once the two are aborted


def test_more_than_the_kv_pool_holds_waits_then_is_served_in_full(serve, pipeline):
    """Eight concurrent requests on four slots whose pool holds two of them at once: each waits for memory and
    answers 200 with the target's own text; once the queue bound is passed the rest get 503 + Retry-After, never a
    500; the pool's blocks all come back."""
    app, runner = serve(max_batch=4, max_queue=4, kv_pool_tokens=128, kv_block_size=16)
    body = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(10)))

    responses = asyncio.run(scenario())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503} and codes.count(200) >= 8, codes
    expected = reference(pipeline, 48, prompt=PROMPT)[0]
    assert all(r.json()["choices"][0]["text"] == expected for r in responses if r.status_code == 200)
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    client = TestClient(app)
    assert wait_for(lambda: metric(client, "adaflash_kv_blocks_held") == 0 and
                    metric(client, "adaflash_kv_blocks_reserved") == 0)
    assert metric(client, "adaflash_kv_blocks") == 8


def metric(client, name: str) -> float:
    """A sample's value from /metrics (client: a TestClient or an httpx.Client with a base_url)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
