"""SGLang's `return_meta_info`: each choice carries the request's counts under SGLang's names, equal to what the
engine did for it; and z-lab's reference benchmark client (dflash's `benchmark openai`) reports those numbers."""

from __future__ import annotations

import contextlib
import re

import httpx
import pytest
from fastapi.testclient import TestClient

from adaflash.engine.engine import Engine
from adaflash.engine.runner import EngineRunner
from adaflash.server.server import create_app
from adaflash.speculative.length_policy import FixedLength
from tests.helpers import scripted_dflash
from tests.server.live import live_server
from tests.server.test_server import CHAT, MODEL, PROMPT, metric, pipeline, random_drafter, sse_events  # noqa: F401

LOCAL_PROMPTS = ["one two three one two three one two", "The capital of France is", "def fibonacci(n):",
                 "a b a b a b a b", "Once upon a time", "Tell me a joke"]
MAX_NEW = 80  # dflash's warm-up asks min(64, this): the benchmark's own requests are told apart by their budget
SPEC_FIELDS = {"spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts", "spec_accept_length",
               "spec_accept_rate", "spec_correct_drafts_histogram"}


def _spy(runner) -> list:
    """The engine requests the server submits (the engine fills in their per-pass counts)."""
    submitted, submit = [], runner.submit

    async def spy(request):
        submitted.append(request)
        return await submit(request)

    runner.submit = spy
    return submitted


def _engine_counts(request) -> dict:
    accepted = [n - 1 for n in request.accept_lengths]
    return {"spec_verify_ct": len(request.accept_lengths), "spec_num_proposed_drafts": sum(request.draft_lengths),
            "spec_num_correct_drafts": sum(accepted), "completion_tokens": len(request.output_ids)}


@pytest.fixture(scope="module")
def scripts(pipeline) -> list[list[int]]:  # noqa: F811
    """Each prompt the tests send (raw and as a user message) with the target's greedy continuation: what the
    scripted drafter proposes, corrupted at random, so passes accept anywhere from none to all of their drafts
    (a random tiny drafter accepts none)."""
    prompts = [pipeline.encode(prompt=PROMPT), pipeline.encode(messages=CHAT)]
    prompts += [pipeline.encode(messages=[{"role": "user", "content": p}]) for p in LOCAL_PROMPTS]
    return [ids + pipeline.complete(ids, "ar", max_new_tokens=MAX_NEW).token_ids for ids in prompts]


@contextlib.contextmanager
def scripted_app(pipeline, scripts):  # noqa: F811
    """(app, runner): a DFlash engine whose drafter follows `scripts` (fixed 3 drafts a pass)."""
    engine = Engine(pipeline.target, scripted_dflash(pipeline.target, scripts), FixedLength(3), max_batch=2,
                    max_queue=8, max_len=512)
    runner = EngineRunner(engine).start()
    try:
        yield create_app(runner, pipeline.tokenizer, MODEL), runner
    finally:
        runner.stop()


@pytest.fixture
def speculative(pipeline, scripts):  # noqa: F811
    with scripted_app(pipeline, scripts) as (app, runner):
        yield TestClient(app), _spy(runner), runner


def test_meta_info_is_what_the_engine_did_for_the_request(speculative):
    client, submitted, runner = speculative
    body = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 40, "temperature": 0,
                                                     "return_meta_info": True}).json()
    meta = body["choices"][0]["meta_info"]
    assert body["meta_info"] == meta  # where z-lab's client reads it
    (request,) = submitted
    counts = _engine_counts(request)
    assert {k: meta[k] for k in counts} == counts
    assert meta["id"] == body["id"] and meta["prompt_tokens"] == body["usage"]["prompt_tokens"] == len(request.prompt_ids)
    assert meta["completion_tokens"] == body["usage"]["completion_tokens"]
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
    assert meta["spec_accept_rate"] == pytest.approx(meta["spec_num_correct_drafts"] / meta["spec_num_proposed_drafts"])
    assert meta["spec_num_correct_drafts"] > 0  # the counts are not trivially zero
    histogram = meta["spec_correct_drafts_histogram"]
    assert len(histogram) == runner.snapshot.max_verified + 1 and sum(histogram) == meta["spec_verify_ct"]
    assert sum(i * n for i, n in enumerate(histogram)) == meta["spec_num_correct_drafts"]
    finish = body["choices"][0]["finish_reason"]
    assert meta["finish_reason"] == ({"type": "length", "length": 40} if finish == "length" else
                                     {"type": "stop", "matched": request.output_ids[-1]})
    assert meta["e2e_latency"] > 0

    plain = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0}).json()
    assert "meta_info" not in plain and "meta_info" not in plain["choices"][0]  # only when asked


def test_a_stream_carries_meta_info_on_its_final_choice(speculative):
    client, submitted, _ = speculative
    req = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True, "return_meta_info": True,
           "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=req) as r:
        chunks = sse_events(r)
    with_meta = [c for c in chunks if c["choices"] and "meta_info" in c["choices"][0]]
    assert len(with_meta) == 1 and with_meta[0] is chunks[-2]  # the finish chunk, before the usage chunk
    final = with_meta[0]
    meta = final["choices"][0]["meta_info"]
    assert final["meta_info"] == meta and final["choices"][0]["finish_reason"] is not None
    counts = _engine_counts(submitted[0])
    assert {k: meta[k] for k in counts} == counts and counts["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"]


def test_a_stop_string_counts_the_passes_up_to_the_text_sent(speculative):
    client, submitted, _ = speculative
    full = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0}).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 4]
    body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop,
                                                "return_meta_info": True}).json()
    meta = body["choices"][0]["meta_info"]
    assert body["choices"][0]["finish_reason"] == "stop" and meta["finish_reason"] == {"type": "stop", "matched": stop}
    assert meta["completion_tokens"] == body["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]
    # The passes that produced the tokens sent: the first completion_tokens tokens came from these passes only.
    request = submitted[-1]
    passes, produced = 0, 1  # the prefill's token
    while produced < meta["completion_tokens"]:
        produced += request.accept_lengths[passes]
        passes += 1
    assert produced == meta["completion_tokens"] and meta["spec_verify_ct"] == passes
    assert meta["spec_num_proposed_drafts"] == sum(request.draft_lengths[:passes])


def test_plain_decoding_reports_no_spec_fields(pipeline):  # noqa: F811
    runner = EngineRunner(Engine(pipeline.target, max_batch=1, max_len=256)).start()
    try:
        client = TestClient(create_app(runner, pipeline.tokenizer, MODEL))
        body = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                    "return_meta_info": True}).json()
    finally:
        runner.stop()
    meta = body["choices"][0]["meta_info"]
    assert not SPEC_FIELDS & set(meta)  # as SGLang without a speculative algorithm
    assert meta["completion_tokens"] == 6 and meta["finish_reason"] == {"type": "length", "length": 6}


def test_dflash_benchmark_client_reports_what_the_server_measured(pipeline, scripts, monkeypatch, capsys):  # noqa: F811
    """z-lab's `dflash benchmark openai` as shipped, its dataset loader (which needs the hub) the only part
    replaced; its accept length and verify count are the engine's."""
    from dflash import benchmark
    from dflash.cli import main as dflash_main

    monkeypatch.setattr(benchmark, "load_and_process_dataset", lambda name: [{"turns": [p]} for p in LOCAL_PROMPTS])
    with scripted_app(pipeline, scripts) as (app, runner), live_server(app) as url:
        submitted = _spy(runner)
        dflash_main(["benchmark", "openai", "--model", MODEL, "--base-url", url, "--dataset", "local",
                     "--num-prompts", "4", "--concurrency", "2", "--max-new-tokens", str(MAX_NEW), "--timeout-s", "60"])
        with httpx.Client(base_url=url) as http:
            passes_in_metrics = metric(http, "adaflash_accept_length_count")
    report = capsys.readouterr().out

    measured = [_engine_counts(r) for r in submitted if r.max_new_tokens == MAX_NEW]
    assert len(measured) == 4 and len(submitted) == 6  # two warm-up requests besides
    accept = sum(m["completion_tokens"] / m["spec_verify_ct"] for m in measured) / len(measured)
    reported = dict(re.findall(r"^(Accept length|Spec verify ct|Output tokens):\s+(\S+)$", report, re.M))
    assert float(reported["Accept length"]) == pytest.approx(accept, abs=5e-4)
    assert int(reported["Spec verify ct"]) == sum(m["spec_verify_ct"] for m in measured)
    assert int(reported["Output tokens"]) == sum(m["completion_tokens"] for m in measured)
    assert accept > 1.2  # drafts were accepted: the numbers say something
    # /metrics counts the same passes (every request's, the warm-up's too).
    assert passes_in_metrics == sum(len(r.accept_lengths) for r in submitted)
