"""One load-test request against an OpenAI-compatible server, and what became of it.

A request ends `completed` (answered in full: 200, one completion id, one finish reason, usage within the asked
tokens, a stream's `data: [DONE]`), `refused` (429 / 503 carrying Retry-After: the server said when to come back),
`hung_up` (the client's own disconnect after the first token) or `lost: why` (anything else: the load test fails).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True)
class Call:
    """What one request asks for."""

    messages: tuple[dict, ...]
    max_tokens: int
    stream: bool = True
    chat: bool = True  # /v1/chat/completions; else /v1/completions with the messages' text as the prompt
    hang_up: bool = False  # streams only: leave after the first token


@dataclass(frozen=True)
class Outcome:
    status: str  # the HTTP status, or "error" when no response came
    kind: str  # completed | refused | hung_up | lost: why
    latency_s: float | None = None  # send to last byte, completed requests only
    completion_id: str | None = None
    tokens: int = 0  # completion tokens of a completed request (its usage)
    retry_after_s: float | None = None  # a refusal's Retry-After


def _body(model: str, call: Call) -> dict:
    body = {"model": model, "max_tokens": call.max_tokens, "temperature": 0.0, "stream": call.stream}
    if call.stream:
        body["stream_options"] = {"include_usage": True}
    if call.chat:
        body["messages"] = list(call.messages)
    else:
        body["prompt"] = "\n\n".join(m["content"] for m in call.messages)
    return body


def _refusal(resp: httpx.Response) -> Outcome:
    status = str(resp.status_code)
    if resp.status_code not in (429, 503):
        return Outcome(status, f"lost: HTTP {status}")
    try:
        return Outcome(status, "refused", retry_after_s=float(resp.headers["retry-after"]))
    except (KeyError, ValueError):
        return Outcome(status, f"lost: {status} without Retry-After in seconds")


def _finished(usage: dict | None, finishes: list[str], ids: set[str], max_tokens: int) -> str | None:
    """None when a response is whole, else why it is not."""
    if len(finishes) != 1:
        return f"{len(finishes)} finish reasons"
    if len(ids) != 1:
        return f"{len(ids)} completion ids"
    if usage is None or not 1 <= usage.get("completion_tokens", 0) <= max_tokens:
        return "missing or wrong usage"
    return None


async def _stream(resp: httpx.Response, call: Call) -> tuple[str, str | None, dict | None]:
    finishes: list[str] = []
    ids: set[str] = set()
    usage, done = None, False
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return f"lost: error event {event['error'].get('code')}", None, None
        ids.add(event.get("id"))
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
            if call.hang_up and (choice.get("delta", {}).get("content") or choice.get("text")):
                return "hung_up", None, None  # leaving the stream unread closes the connection
    if not done:
        return "lost: stream ended without [DONE]", None, None
    why = _finished(usage, finishes, ids, call.max_tokens)
    return (f"lost: {why}", None, None) if why else ("completed", ids.pop(), usage)


async def send(client: httpx.AsyncClient, model: str, call: Call) -> Outcome:
    start = time.perf_counter()
    path = CHAT if call.chat else COMPLETIONS
    try:
        if call.stream:
            async with client.stream("POST", path, json=_body(model, call)) as resp:
                status = str(resp.status_code)
                if resp.status_code != 200:
                    await resp.aread()
                    return _refusal(resp)
                kind, cid, usage = await _stream(resp, call)
        else:
            resp = await client.post(path, json=_body(model, call))
            status = str(resp.status_code)
            if resp.status_code != 200:
                return _refusal(resp)
            body = resp.json()
            finishes = [c["finish_reason"] for c in body.get("choices", []) if c.get("finish_reason")]
            usage = body.get("usage")
            why = _finished(usage, finishes, {body.get("id")}, call.max_tokens)
            kind, cid = (f"lost: {why}", None) if why else ("completed", body["id"])
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        return Outcome("error", f"lost: {type(exc).__name__}")
    if kind != "completed":
        return Outcome(status, kind)
    return Outcome(status, kind, time.perf_counter() - start, cid, int(usage["completion_tokens"]))
