"""A real uvicorn server on a loopback port, driven by the official `openai` client."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import uvicorn
from openai import OpenAI

from adaflash.engine.engine import Engine
from adaflash.engine.runner import EngineRunner
from adaflash.server.server import create_app
from adaflash.speculative.length_policy import FixedLength
from tests.server.test_server import (  # noqa: F401  (fixtures)
    CHAT, MODEL, PROMPT, metric, pipeline, random_drafter, reference, slow_steps, wait_for,
)

MAX_BATCH = 2


@pytest.fixture
def base_url(pipeline):
    engine = Engine(pipeline.target, pipeline.proposer, FixedLength(3), max_batch=MAX_BATCH, max_queue=4, max_len=512)
    slow_steps(engine, 0.005)  # a long request stays in flight while the client disconnects
    runner = EngineRunner(engine).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a free port, held from the start: no race with other processes
    server = uvicorn.Server(uvicorn.Config(create_app(runner, pipeline.tokenizer, MODEL), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    runner.stop()
    sock.close()


def test_openai_client_chat_completions_streaming_and_disconnect(base_url, pipeline):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == [MODEL]

    text, finish, n_prompt, n_out = reference(pipeline, 16, messages=CHAT)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == text and chat.choices[0].finish_reason == finish
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (n_prompt, n_out)

    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == n_out

    text, finish, _, _ = reference(pipeline, 12, prompt=PROMPT)
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert done.choices[0].text == text and done.choices[0].finish_reason == finish

    # Read one chunk of a long stream, then hang up: the server must abort it and free the slot.
    http = httpx.Client(base_url=base_url)
    generated_before = metric(http, "adaflash_generation_tokens_total")
    passes_before = metric(http, "adaflash_accept_length_count")
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=400, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    assert wait_for(lambda: metric(http, "adaflash_client_disconnects_total") == 1)
    assert wait_for(lambda: metric(http, "adaflash_free_slots") == MAX_BATCH)
    assert metric(http, "adaflash_running_requests") == 0
    assert metric(http, "adaflash_generation_tokens_total") - generated_before < 400
    assert metric(http, "adaflash_accept_length_count") - passes_before < 200  # the engine stopped early, too

    # A non-streaming client that gives up (times out) is aborted too, not run to max_tokens.
    generated_before = metric(http, "adaflash_generation_tokens_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/v1/chat/completions", timeout=0.3,
                   json={"model": MODEL, "messages": CHAT, "max_tokens": 400, "temperature": 0})
    assert wait_for(lambda: metric(http, "adaflash_client_disconnects_total") == 2)
    assert wait_for(lambda: metric(http, "adaflash_free_slots") == MAX_BATCH)
    assert metric(http, "adaflash_generation_tokens_total") - generated_before < 400



def test_short_soak_every_request_answered_or_refused_and_no_slot_leaks(base_url):
    """A miniature of `adaflash bench load`: 12 streams on 2 slots + a queue of 4 for a few seconds."""
    import asyncio

    from adaflash.evaluation.load_test import Traffic, run_load

    report = asyncio.run(run_load(base_url, MODEL, streams=12, duration_s=4.0, traffic=Traffic(max_tokens=8)))
    assert report.completed > 0 and report.refused > 0  # the queue bound was hit and answered with 503
    assert report.failed == 0, report.statuses
    assert report.running_after == 0 and report.queued_after == 0
    assert report.free_slots_after == report.max_slots == MAX_BATCH
    assert report.clean


def test_openai_client_on_an_engine_with_prompt_lookup(pipeline):
    """n-gram drafts before the drafter's: a real client gets the target's own greedy text, concurrently too."""
    from concurrent.futures import ThreadPoolExecutor

    from adaflash.speculative.prompt_lookup import PromptLookup
    from tests.server.live import app_over_engine, live_server

    prompts = [PROMPT, PROMPT + " " + PROMPT, "one two one two one two"]
    expected = [reference(pipeline, 20, prompt=p)[0] for p in prompts]
    with app_over_engine(pipeline, prompt_lookup=PromptLookup(4, min_ngram=1, length="all")) as (app, runner), \
            live_server(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)

        def complete(prompt: str) -> str:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0).choices[0].text

        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(complete, prompts)) == expected
