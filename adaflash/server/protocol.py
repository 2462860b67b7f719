"""OpenAI request and response shapes for /v1/completions and /v1/chat/completions (pydantic v2).

Requests are validated strictly (no "5" -> 5 coercion, as OpenAI does): a wrong type is a 400, never a
silent guess. Unknown fields are ignored, so current clients that send newer OpenAI fields keep working,
except the fields this server does not implement (`UNSUPPORTED`): set to anything but their no-op value
they are rejected, since ignoring e.g. `logprobs` would hand the client a response it did not ask for.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adaflash.speculative.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 128  # when the request gives none (clipped to the context left after the prompt)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy (lossless vs plain greedy decoding)
MAX_STOP_SEQUENCES = 4

# Field -> the values that mean "not used" (anything else is a 400).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}

StopSequence = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # extras are checked against UNSUPPORTED, then ignored

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # extension (vLLM's name); 0 = off
    stop: StopSequence | list[StopSequence] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    n: int | None = Field(None, ge=1)  # one choice per request: n > 1 is refused (_one_choice)
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n > 1:
            raise ValueError(f"n={n} is not supported: this server returns one choice per request (send n=1, or "
                             "several requests with different seeds)")
        return n

    @model_validator(mode="after")
    def _reject_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ValueError(f"{name} is not supported by this server")
        return self

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
        )

    def seed_or_random(self) -> int:
        # OpenAI semantics: without a seed every request samples independently.
        return secrets.randbits(63) if self.seed is None else self.seed

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    prompt: str  # one text prompt (token-id and batched prompts are not supported)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def for_template(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # "developer" is OpenAI's newer name for the system role; chat templates know only "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses ---------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    """A whole completion, and (with one text delta per choice) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, str]  # {"role": ...} first, then {"content": ...}, {} with the finish reason
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "adaflash"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---- the two endpoints' shapes ------------------------------------------------------------------------


class ResponseShape:
    """One endpoint's response body and stream chunks, so the server has a single generation path."""

    id_prefix = ""

    def __init__(self, request_id: str, model: str) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())

    def full(self, text: str, finish_reason: str, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def opening(self) -> BaseModel | None:
        """The chunk a stream starts with, if the endpoint has one."""
        return None

    def delta(self, text: str) -> BaseModel:
        raise NotImplementedError

    def finish(self, finish_reason: str) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    """/v1/completions: a stream chunk is a completion with a text delta."""

    id_prefix = "cmpl-"

    def _response(self, text: str, finish_reason: str | None, usage: Usage | None, choices: bool = True) -> BaseModel:
        chosen = [CompletionChoice(text=text, finish_reason=finish_reason)] if choices else []
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=chosen, usage=usage)

    def full(self, text: str, finish_reason: str, usage: Usage) -> BaseModel:
        return self._response(text, finish_reason, usage)

    def delta(self, text: str) -> BaseModel:
        return self._response(text, None, None)

    def finish(self, finish_reason: str) -> BaseModel:
        return self._response("", finish_reason, None)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._response("", None, usage, choices=False)


class ChatShape(ResponseShape):
    """/v1/chat/completions: chunks carry a delta, the role first, then the content."""

    id_prefix = "chatcmpl-"

    def _chunk(self, delta: dict[str, str], finish_reason: str | None = None, usage: Usage | None = None,
               choices: bool = True) -> BaseModel:
        chosen = [ChatChunkChoice(delta=delta, finish_reason=finish_reason)] if choices else []
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=chosen, usage=usage)

    def full(self, text: str, finish_reason: str, usage: Usage) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage)

    def opening(self) -> BaseModel | None:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, text: str) -> BaseModel:
        return self._chunk({"content": text})

    def finish(self, finish_reason: str) -> BaseModel:
        return self._chunk({}, finish_reason)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk({}, usage=usage, choices=False)
