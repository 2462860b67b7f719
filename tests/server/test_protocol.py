"""The OpenAI request/response models by themselves: defaults, what is refused, and the two endpoints' shapes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from adaflash.server.protocol import (
    DEFAULT_TEMPERATURE,
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    ChatMessage,
    ChatShape,
    CompletionRequest,
    CompletionShape,
    Usage,
)
from adaflash.speculative.sampling import SamplingParams


def test_defaults_follow_openai():
    body = CompletionRequest(prompt="hi")
    assert body.sampling() == SamplingParams(temperature=DEFAULT_TEMPERATURE, top_k=0, top_p=1.0)
    assert body.stop_sequences() == () and body.requested_max_tokens() is None and not body.include_usage
    assert body.seed_or_random() != body.seed_or_random()  # no seed: independent draws
    assert CompletionRequest(prompt="hi", seed=7).seed_or_random() == 7


def test_greedy_and_stop_strings():
    body = CompletionRequest(prompt="hi", temperature=0.0, top_k=5, top_p=0.5, stop="\n")
    assert body.sampling() == SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    assert body.stop_sequences() == ("\n",)
    assert CompletionRequest(prompt="hi", stop=["a", "b"]).stop_sequences() == ("a", "b")


@pytest.mark.parametrize("fields", [
    {"n": 2},
    {"logprobs": True},
    {"temperature": 2.5},
    {"max_tokens": 0},
    {"stop": [""]},
    {"stop": ["x"] * (MAX_STOP_SEQUENCES + 1)},
    {"temperature": "0.5"},  # strict: no coercion from strings
])
def test_refused_fields(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="hi", **fields)


def test_unknown_fields_are_ignored_and_unused_ones_accepted():
    body = CompletionRequest(prompt="hi", user="someone", logprobs=None, presence_penalty=0, n=1)
    assert body.prompt == "hi"


def test_chat_max_completion_tokens_wins_and_developer_is_system():
    body = ChatCompletionRequest(messages=[{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                                              {"type": "text", "text": "brief"}]}],
                                 max_tokens=5, max_completion_tokens=9, stream=True,
                                 stream_options={"include_usage": True})
    assert body.requested_max_tokens() == 9 and body.include_usage
    assert body.messages[0].for_template() == {"role": "system", "content": "be brief"}
    assert ChatMessage(role="user", content="x").for_template() == {"role": "user", "content": "x"}
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[])


def test_completion_shape_full_stream_and_usage():
    shape, usage = CompletionShape("cmpl-1", "m"), Usage.of(3, 4)
    assert usage.total_tokens == 7
    full = shape.full("text", "stop", usage).model_dump()
    assert full["object"] == "text_completion" and full["choices"][0]["text"] == "text" and full["usage"]["total_tokens"] == 7
    assert shape.opening() is None
    assert shape.delta("te").model_dump()["choices"][0] == {"index": 0, "text": "te", "logprobs": None, "finish_reason": None}
    assert shape.finish("length").model_dump()["choices"][0]["finish_reason"] == "length"
    assert shape.usage_chunk(usage).model_dump()["choices"] == []


def test_chat_shape_role_first_then_content_then_finish():
    shape = ChatShape("chatcmpl-1", "m")
    assert shape.opening().model_dump()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert shape.delta("hi").model_dump()["choices"][0]["delta"] == {"content": "hi"}
    finish = shape.finish("stop").model_dump()["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "stop"
    full = shape.full("hi", "stop", Usage.of(1, 1)).model_dump()
    assert full["object"] == "chat.completion" and full["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert shape.usage_chunk(Usage.of(1, 1)).model_dump()["object"] == "chat.completion.chunk"
