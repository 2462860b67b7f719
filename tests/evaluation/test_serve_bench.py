"""The serving benchmark client against a scripted OpenAI-compatible server (no network)."""

from __future__ import annotations

import json

import httpx

from adaflash.evaluation.serve_bench import percentile, run_sweep

METRICS = ["adaflash_accept_length_sum 30\nadaflash_accept_length_count 10\n", "adaflash_accept_length_sum 90\nadaflash_accept_length_count 30\n"]


def _handler():
    scrapes = iter(METRICS * 4)

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=next(scrapes))
        body = json.loads(request.content)
        if body["messages"][0]["content"] == "fail":
            return httpx.Response(503, json={"error": {"message": "busy"}}, headers={"Retry-After": "1"})
        chunks = [{"choices": [{"delta": {"content": w}}]} for w in ("a", "b", "c")]
        chunks.append({"choices": [], "usage": {"completion_tokens": 3}})
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_sweep_counts_tokens_failures_and_scrapes_accept_length():
    prompts = [[{"role": "user", "content": "hi"}]] * 5 + [[{"role": "user", "content": "fail"}]]
    results = run_sweep("http://test", "m", prompts, [1, 3], 16, transport=_handler())
    for r in results:
        assert r.num_requests == 6 and r.failed == 1
        assert r.output_tokens_per_s > 0 and r.ttft_p50_s is not None
        assert r.accept_len_mean == 3.0  # (90 - 30) / (30 - 10): the window's own passes only


def test_percentile():
    assert percentile([3, 1, 2], 0.5) == 2 and percentile([], 0.5) is None
    assert percentile(list(range(101)), 0.99) == 99


def test_vllm_counters_give_the_window_accept_and_verify_length():
    """vLLM exports draft steps, drafted and accepted tokens as counters: per draft step in the window, accept
    length = 1 + accepted / drafts, verify length = drafted / drafts."""
    from adaflash.evaluation.serve_bench import _window_mean

    label = '{engine="0",model_name="m"}'

    def scrape(drafts, drafted, accepted):
        text = (f"vllm:spec_decode_num_drafts_total{label} {drafts}\n"
                f"vllm:spec_decode_num_draft_tokens_total{label} {drafted}\n"
                f"vllm:spec_decode_num_accepted_tokens_total{label} {accepted}\n")
        return httpx.MockTransport(lambda request: httpx.Response(200, text=text))

    import asyncio

    from adaflash.evaluation.serve_bench import _scrape

    async def read(transport):
        async with httpx.AsyncClient(base_url="http://test", transport=transport) as client:
            return await _scrape(client)

    before, after = asyncio.run(read(scrape(9, 135, 3))), asyncio.run(read(scrape(19, 285, 8)))
    assert _window_mean(before, after, "accept_length") == 1.5
    assert _window_mean(before, after, "verify_length") == 15.0
    assert _window_mean(before, before, "accept_length") is None  # no draft step in the window
