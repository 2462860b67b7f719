"""OpenAI request and response shapes for /v1/completions and /v1/chat/completions (pydantic v2).

Requests are validated strictly (no "5" -> 5 coercion, as OpenAI does): a wrong type is a 400, never a
silent guess. Unknown fields are ignored, so current clients that send newer OpenAI fields keep working,
except the fields this server does not implement (`UNSUPPORTED`): set to anything but their no-op value
they are rejected, since ignoring e.g. `logprobs` would hand the client a response it did not ask for.

Every bound the server enforces is stated in the models, so the OpenAPI schema (/openapi.json) says which requests
are accepted; the one bound no JSON schema can state is the context: prompt tokens + max_tokens must fit it
(server/openapi.py puts the largest max_tokens any prompt leaves room for into the published schema).
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_serializer, model_validator

from adaflash.speculative.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 128  # when the request gives none (clipped to the context left after the prompt)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send 0 for greedy (lossless vs plain greedy decoding)
MAX_STOP_SEQUENCES = 4
# JSON's interoperable integers (RFC 7493: beyond 2**53 a parser may round, and a schema's bound read as a double
# names a different integer); well within torch.Generator's range.
SEED_RANGE = (-(2**53 - 1), 2**53 - 1)

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


def _same_json(value: Any, allowed: Any) -> bool:
    """JSON equality: 0 == 0.0, but false is not 0 (Python's `False == 0` would let `presence_penalty: false` in,
    which the schema's enum refuses)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    if isinstance(value, (int, float)) and isinstance(allowed, (int, float)):
        return value == allowed
    if isinstance(value, dict) and isinstance(allowed, dict):
        return value.keys() == allowed.keys() and all(_same_json(value[k], allowed[k]) for k in value)
    if isinstance(value, list) and isinstance(allowed, list):
        return len(value) == len(allowed) and all(map(_same_json, value, allowed))
    return type(value) is type(allowed) and value == allowed


def _document_unsupported(schema: dict[str, Any]) -> None:
    # The schema names the refused fields and the one value each accepts, so a client (or a contract tester) reads
    # from /openapi.json what the model_validator below enforces.
    props = schema.setdefault("properties", {})
    for name, allowed in UNSUPPORTED.items():
        props[name] = {"enum": list(allowed), "default": None,
                       "description": "not supported by this server: only its no-op value is accepted"}


def _integral(value: Any) -> Any:
    # JSON has one number type: 10.0 is the integer 10 to a JSON schema (and to OpenAI), so it is taken as one; 10.5,
    # "10" and true stay refused by the strict int check that follows.
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def Integer(**bounds) -> Any:  # noqa: N802 (a type)
    """A JSON integer within `bounds` (pydantic's ge / le, stated in the schema as minimum / maximum)."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]
StopSequence = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="end the stream with a chunk that carries the usage (no choices)")


class _GenerationRequest(_Strict):
    # extras are checked against UNSUPPORTED, then ignored
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra=_document_unsupported)

    model: str | None = Field(None, description="the served model's name (GET /v1/models); another name is a 404; "
                              "leave it out for the served model")
    max_tokens: Integer(ge=1) | None = Field(None, description=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}, "
                                   "or what the context leaves); prompt + max_tokens must fit the context, else 400 "
                                   "context_length_exceeded")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy (lossless against plain greedy "
                                      f"decoding); default {DEFAULT_TEMPERATURE}")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Integer(ge=0) | None = Field(None, description="extension (vLLM's name): sample among the k likeliest; 0 = off")
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)] | None = Field(
        None, description=f"up to {MAX_STOP_SEQUENCES} non-empty strings that end the text (not included in it)")
    seed: Integer(ge=SEED_RANGE[0], le=SEED_RANGE[1]) | None = Field(None, description="the same seed and request give "
                             "the same text; without one every request samples independently")
    # One choice per request: n > 1 is refused by _one_choice (with a clearer message than a bound's), so the schema's
    # maximum is stated beside it.
    n: Integer(ge=1) | None = Field(None, json_schema_extra={"maximum": 1}, description="1 only: one choice per request")
    stream: bool | None = Field(False, description="server-sent events (text/event-stream), ending with `data: [DONE]`")
    stream_options: StreamOptions | None = None
    return_meta_info: bool = Field(False, description="SGLang's extension: each choice (and the response) carries "
                                   "`meta_info`, the request's token counts and speculative-decoding statistics")

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
            if name in UNSUPPORTED and not any(_same_json(value, ok) for ok in UNSUPPORTED[name]):
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

    def token_limits(self) -> dict[str, int]:
        """The token bounds the request gives, by field (each must fit the context)."""
        return {} if self.max_tokens is None else {"max_tokens": self.max_tokens}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    # One non-empty text prompt (token-id and batched prompts are not supported; an empty one encodes to nothing).
    prompt: str = Field(min_length=1)


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
    max_completion_tokens: Integer(ge=1) | None = Field(None, description="OpenAI's newer name for max_tokens (wins "
                                              "over it)")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def token_limits(self) -> dict[str, int]:
        limits = super().token_limits()
        if self.max_completion_tokens is not None:
            limits["max_completion_tokens"] = self.max_completion_tokens
        return limits


# ---- responses ---------------------------------------------------------------------------------------


class _OmitsMetaInfo(BaseModel):
    """`meta_info` appears only where the request asked for it (return_meta_info), not as a null in every response."""

    @model_serializer(mode="wrap")
    def _omit_unasked(self, handler):
        data = handler(self)
        if data.get("meta_info", 0) is None:
            del data["meta_info"]
        return data


class _OmitsNone(BaseModel):
    @model_serializer(mode="wrap")
    def _omit_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class FinishInfo(_OmitsNone):
    """SGLang's finish_reason object: what ended the text."""

    type: Literal["stop", "length"]
    matched: int | str | None = Field(None, description="the stop token id, or the stop string, that ended it")
    length: int | None = Field(None, description="the token budget that ended it")


class MetaInfo(_OmitsNone):
    """SGLang's `meta_info` of one choice (`return_meta_info`). The spec_* fields come from a speculative server only
    (a drafter or prompt lookup; plain decoding has none, as SGLang without a speculative algorithm);
    spec_accept_length is left out when no verify pass ran (the prefill's token alone), spec_accept_rate when no
    draft was proposed."""

    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishInfo
    e2e_latency: float = Field(description="seconds from admission to the last token")
    spec_verify_ct: int | None = Field(None, description="the target's passes over this request after its prefill "
                                       "(each verifies the drafts proposed for it, possibly none)")
    spec_num_proposed_drafts: int | None = Field(None, description="draft tokens verified, over all passes")
    spec_num_correct_drafts: int | None = Field(None, description="draft tokens the target accepted, over all passes")
    spec_accept_length: float | None = Field(None, description="completion_tokens / spec_verify_ct (SGLang's "
                                             "definition: the prefill's token counts in the numerator)")
    spec_accept_rate: float | None = Field(None, description="spec_num_correct_drafts / spec_num_proposed_drafts")
    spec_correct_drafts_histogram: list[int] | None = Field(None, description="passes by drafts accepted: entry i "
                                                            "counts the passes that accepted i drafts")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


FinishReason = Literal["stop", "length"]


class CompletionChoice(_OmitsMetaInfo):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None
    meta_info: MetaInfo | None = None


class CompletionResponse(_OmitsMetaInfo):
    """A whole completion, and (with one text delta per choice) each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # choices[0].meta_info again: z-lab's reference benchmark client (dflash's `benchmark openai`) reads it here
    meta_info: MetaInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_OmitsMetaInfo):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason
    meta_info: MetaInfo | None = None


class ChatCompletionResponse(_OmitsMetaInfo):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    meta_info: MetaInfo | None = None  # as CompletionResponse's


class ChatChunkChoice(_OmitsMetaInfo):
    index: int = 0
    delta: dict[str, str]  # {"role": ...} first, then {"content": ...}, {} with the finish reason
    logprobs: None = None
    finish_reason: FinishReason | None = None
    meta_info: MetaInfo | None = None  # on the chunk with the finish reason


class ChatCompletionChunk(_OmitsMetaInfo):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    meta_info: MetaInfo | None = None


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


class HealthStatus(BaseModel):
    status: Literal["ok", "draining", "engine not running"]


# ---- the two endpoints' shapes ------------------------------------------------------------------------


class ResponseShape:
    """One endpoint's response body and stream chunks, so the server has a single generation path."""

    id_prefix = ""

    def __init__(self, request_id: str, model: str) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())

    def full(self, text: str, finish_reason: str, usage: Usage, meta: MetaInfo | None = None) -> BaseModel:
        raise NotImplementedError

    def opening(self) -> BaseModel | None:
        """The chunk a stream starts with, if the endpoint has one."""
        return None

    def delta(self, text: str) -> BaseModel:
        raise NotImplementedError

    def finish(self, finish_reason: str, meta: MetaInfo | None = None) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    """/v1/completions: a stream chunk is a completion with a text delta."""

    id_prefix = "cmpl-"

    def _response(self, text: str, finish_reason: str | None, usage: Usage | None, choices: bool = True,
                  meta: MetaInfo | None = None) -> BaseModel:
        chosen = [CompletionChoice(text=text, finish_reason=finish_reason, meta_info=meta)] if choices else []
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=chosen, usage=usage,
                                  meta_info=meta)

    def full(self, text: str, finish_reason: str, usage: Usage, meta: MetaInfo | None = None) -> BaseModel:
        return self._response(text, finish_reason, usage, meta=meta)

    def delta(self, text: str) -> BaseModel:
        return self._response(text, None, None)

    def finish(self, finish_reason: str, meta: MetaInfo | None = None) -> BaseModel:
        return self._response("", finish_reason, None, meta=meta)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._response("", None, usage, choices=False)


class ChatShape(ResponseShape):
    """/v1/chat/completions: chunks carry a delta, the role first, then the content."""

    id_prefix = "chatcmpl-"

    def _chunk(self, delta: dict[str, str], finish_reason: str | None = None, usage: Usage | None = None,
               choices: bool = True, meta: MetaInfo | None = None) -> BaseModel:
        chosen = [ChatChunkChoice(delta=delta, finish_reason=finish_reason, meta_info=meta)] if choices else []
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=chosen, usage=usage,
                                   meta_info=meta)

    def full(self, text: str, finish_reason: str, usage: Usage, meta: MetaInfo | None = None) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason, meta_info=meta)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage,
                                      meta_info=meta)

    def opening(self) -> BaseModel | None:
        return self._chunk({"role": "assistant", "content": ""})

    def delta(self, text: str) -> BaseModel:
        return self._chunk({"content": text})

    def finish(self, finish_reason: str, meta: MetaInfo | None = None) -> BaseModel:
        return self._chunk({}, finish_reason, meta=meta)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._chunk({}, usage=usage, choices=False)
