"""OpenAI-compatible HTTP server: a thin FastAPI layer over the EngineRunner.

Text handling lives here (the engine knows only token ids): prompts go through the CLI's encode (the pipeline's
`TextCodec`), output is detokenised incrementally, stop strings are applied to the decoded text, and every error a
client can cause is a 4xx with OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Sequence

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest

from adaflash.engine.engine_factory import method_of
from adaflash.engine.request import Request
from adaflash.engine.runner import EngineRunner, RequestStream, RunnerStoppedError
from adaflash.engine.scheduler import QueueFullError
from adaflash.models.targets.text_codec import TextCodec
from adaflash.server import openapi
from adaflash.server.gate import Admission, Gate, ServerConfig
from adaflash.server.meta_info import finish_info, meta_info
from adaflash.server.metrics import CountRequests, ServerMetrics
from adaflash.server.protocol import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatShape,
    CompletionRequest,
    CompletionResponse,
    CompletionShape,
    ErrorDetail,
    ErrorResponse,
    HealthStatus,
    MetaInfo,
    ModelCard,
    ModelList,
    ResponseShape,
    Usage,
)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 asks the client to wait; the queue drains at generation speed


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)


def _error(status: int, detail: ErrorDetail, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers)


def _validation_error(exc: RequestValidationError) -> ErrorDetail:
    """FastAPI's 422 list -> OpenAI's 400 body, naming the first offending field."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        reason = err.get("ctx", {}).get("error", err["msg"])
        return ErrorDetail(message=f"the request body is not valid JSON: {reason}", type="invalid_request_error")
    loc = [str(p) for p in err["loc"] if p != "body"]
    if not loc and err["type"] in ("model_attributes_type", "dict_type"):
        return ErrorDetail(message="the request body must be a JSON object (Content-Type: application/json)",
                           type="invalid_request_error")
    where = ".".join(loc)
    return ErrorDetail(message=f"{where}: {err['msg']}" if where else err["msg"],
                       type="invalid_request_error", param=loc[0] if loc else None)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return _error(exc.status, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_, exc: RequestValidationError):
        return _error(400, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):  # unknown routes, wrong methods
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error(exc.status_code, ErrorDetail(message=str(exc.detail), type=kind), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_, exc: Exception):
        return _error(500, ErrorDetail(message="internal server error", type="server_error"))


class TextStream:
    """Incremental detokenisation with stop strings.

    While the request runs, the text handed out holds back a trailing partial UTF-8 character and the
    last (longest stop string - 1) characters, which could still turn into a stop string; so what was sent
    never needs retracting, and stop strings never leak into the output.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]) -> None:
        self.decode, self.stops = decode, tuple(stops)
        self.hold = max(map(len, self.stops), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # the whole decoded output so far, cut at a stop string
        self.sent = ""  # the part handed out as deltas
        self.stopped = False  # a stop string matched
        self.matched: str | None = None  # which one

    def push(self, new_ids: list[int], finished: bool) -> str:
        """Add tokens; return the new text that is safe to send."""
        self.token_ids += new_ids
        self.text = self.decode(self.token_ids)
        found = [(i, stop) for stop in self.stops if (i := self.text.find(stop)) >= 0]
        if found:
            cut, self.matched = min(found)
            self.text, self.stopped, finished = self.text[:cut], True, True
        safe = self.text
        if not finished:
            safe = safe.rstrip("\ufffd")
            safe = safe[: max(0, len(safe) - self.hold)]
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""  # (a byte-level BPE decode only ever extends its prefix)
        delta, self.sent = safe[len(self.sent):], safe
        return delta


def _timed_out(timeout_s: float) -> APIError:
    return APIError(504, f"the request ran past this server's deadline of {timeout_s:g} s and was aborted; ask for "
                    "fewer tokens (max_tokens) or retry when the server is less busy", type="timeout_error",
                    code="request_timeout")


SHUTTING_DOWN = ("the server shut down before the request finished (its drain time ran out) and aborted it; "
                 "retry on another replica or after it restarts")


@dataclass(eq=False)  # hashed by identity: the service keeps its running jobs in a set
class _Job:
    """One admitted request: its engine stream, its text, and the response shape of its endpoint."""

    shape: ResponseShape
    request: Request
    stream: RequestStream
    text: TextStream
    metrics: ServerMetrics
    runner: EngineRunner
    on_release: Callable[["_Job"], None] = lambda job: None
    finish_reason: str | None = field(default=None, init=False)
    outputs: int = field(default=0, init=False)  # engine outputs read: the prefill's, then one per decode pass
    started: float = field(default_factory=time.monotonic, init=False)
    finished_at: float | None = field(default=None, init=False)
    aborted: APIError | None = field(default=None, init=False)  # why the server itself aborted the request
    timer: asyncio.TimerHandle | None = field(default=None, init=False)
    released: bool = field(default=False, init=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, len(self.text.token_ids))

    def meta_info(self) -> MetaInfo:
        """SGLang's meta_info of the finished request."""
        stop = self.text.matched if self.text.stopped else None
        finish = finish_info(self.finish_reason, stop, self.text.token_ids, self.request.max_new_tokens)
        return meta_info(self.request, self.outputs, self.prompt_tokens, len(self.text.token_ids), finish,
                         (self.finished_at or time.monotonic()) - self.started, self.runner.snapshot.max_verified)

    def abort(self, error: APIError) -> bool:
        """The server ends the request (deadline, shutdown): the engine frees its slot, the client gets `error`."""
        if self.stream.finished or self.aborted is not None:
            return False
        self.aborted = error
        self.runner.abort(self.stream.request_id)  # the engine answers with an "abort" output, which events() turns into `error`
        return True

    def release(self) -> None:
        """Idempotent end of the job: stop its deadline, abort the engine request if it still runs (the client
        went away), count its tokens."""
        if self.released:
            return
        self.released = True
        if self.timer is not None:
            self.timer.cancel()
        if self.stream.close() and not self.text.stopped:
            self.metrics.disconnects.inc()
        self.metrics.generation_tokens.inc(len(self.text.token_ids))
        self.on_release(self)

    async def events(self) -> AsyncIterator[str]:
        """Text deltas until the request finishes (then `finish_reason` is set). Leaving early, by a stop
        string or a client that went away, aborts the engine request so its slot frees at once."""
        try:
            async for out in self.stream:
                if out.finish_reason == "abort":  # the server's own abort (deadline, shutdown) or the runner stopping
                    raise self.aborted or APIError(503, "the request was aborted by the server", type="server_error",
                                                   code="aborted")
                self.outputs += 1
                delta = self.text.push(out.new_token_ids, out.finish_reason is not None)
                if delta:
                    yield delta
                if self.text.stopped or out.finish_reason is not None:
                    self.finish_reason = "stop" if self.text.stopped else out.finish_reason
                    self.finished_at = time.monotonic()
                    return
        finally:
            self.release()


async def _drain(job: _Job) -> None:
    async with contextlib.aclosing(job.events()) as events:
        async for _ in events:
            pass


async def _finish_unless_disconnected(job: _Job, http_request: HTTPRequest, poll_s: float = 0.25) -> bool:
    """Run a non-streaming request to its end while watching the connection: a client that hangs up has its
    engine request aborted (cancelling the drain closes the job's stream) instead of running to max_tokens."""
    drain = asyncio.ensure_future(_drain(job))
    try:
        while not drain.done():
            await asyncio.wait({drain}, timeout=poll_s)
            if not drain.done() and await http_request.is_disconnected():
                drain.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drain
                return False
        drain.result()  # re-raise what the generation raised
        return True
    finally:
        drain.cancel()


def _sse(model) -> str:
    return f"data: {model.model_dump_json()}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events whose body generator is closed as soon as the response ends, so a client that
    disconnects mid-stream aborts its engine request now, not whenever the generator is garbage-collected
    (and the job is released even if its body never started)."""

    def __init__(self, body: AsyncIterator[str], job: _Job) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.job.release()


class _Service:
    def __init__(self, runner: EngineRunner, codec: TextCodec, model_name: str, metrics: ServerMetrics,
                 config: ServerConfig) -> None:
        self.runner, self.codec, self.model_name, self.metrics = runner, codec, model_name, metrics
        self.config = config
        self.jobs: set[_Job] = set()  # admitted and not yet released (the event loop's thread only)

    def abort_all(self) -> int:
        """A shutdown whose drain time ran out: abort every running request; how many were aborted."""
        error = APIError(503, SHUTTING_DOWN, type="server_error", code="server_shutting_down")
        aborted = sum(job.abort(error) for job in list(self.jobs))
        self.metrics.shutdown_aborts.inc(aborted)
        return aborted

    def _expire(self, job: _Job) -> None:
        if job.abort(_timed_out(self.config.request_timeout_s)):
            self.metrics.request_timeouts.inc()

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                           param="model", code="model_not_found")

    def max_new_tokens(self, body, prompt_tokens: int, prompt_param: str) -> int:
        """The request's token budget. Every token bound it gives must fit the context after the prompt, the one
        that does not decide too (chat's max_tokens beside max_completion_tokens): the published schema bounds each."""
        context = self.runner.context_tokens
        room = context - prompt_tokens
        over = [(param, n) for param, n in body.token_limits().items() if n > room]
        if room < 1 or over:
            param, asked = over[0] if room >= 1 else (prompt_param, 1)
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens; the request has {prompt_tokens} prompt "
                f"tokens ({prompt_param}) and asks for {asked} more. Shorten the {prompt_param} or lower {param}.",
                param=param, code="context_length_exceeded",
            )
        asked = body.requested_max_tokens()
        return min(DEFAULT_MAX_TOKENS, room) if asked is None else asked

    async def respond(self, body, shape_cls: type[ResponseShape], encode: Callable[[], list[int]], prompt_param: str,
                      http_request: HTTPRequest):
        self.check_model(body.model)
        try:
            prompt_ids = encode()
        except (ValueError, TypeError, TemplateError) as exc:  # empty prompt, a template rejecting the roles
            raise APIError(400, f"invalid {prompt_param}: {exc}", param=prompt_param) from exc
        max_new = self.max_new_tokens(body, len(prompt_ids), prompt_param)
        shape = shape_cls(shape_cls.id_prefix + uuid.uuid4().hex, self.model_name)
        request = Request(shape.id, prompt_ids, max_new, body.sampling(), self.codec.stop_token_ids,
                          body.seed_or_random())
        try:
            stream = await self.runner.submit(request)
        except QueueFullError as exc:
            raise APIError(503, f"the server is at capacity ({exc}); retry shortly", type="server_overloaded",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from exc
        except RunnerStoppedError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_stopped") from exc
        except ValueError as exc:  # the engine's own bound (kept in step with max_new_tokens above)
            raise APIError(400, str(exc), param=prompt_param, code="context_length_exceeded") from exc
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        job = _Job(shape, request, stream, TextStream(self.codec.decode, body.stop_sequences()), self.metrics,
                   self.runner, self.jobs.discard)
        self.jobs.add(job)
        if self.config.request_timeout_s is not None:  # the deadline runs from admission, queueing included
            job.timer = asyncio.get_running_loop().call_later(self.config.request_timeout_s, self._expire, job)
        if body.stream:
            return EventStream(self._stream(job, body.include_usage, body.return_meta_info), job)
        try:
            if not await _finish_unless_disconnected(job, http_request):
                return Response(status_code=499)  # nobody is listening; the engine request is aborted
        finally:
            job.release()
        return shape.full(job.text.text, job.finish_reason, job.usage(),
                          job.meta_info() if body.return_meta_info else None)

    async def _stream(self, job: _Job, include_usage: bool, return_meta_info: bool) -> AsyncIterator[str]:
        shape = job.shape
        if (opening := shape.opening()) is not None:
            yield _sse(opening)
        try:
            async with contextlib.aclosing(job.events()) as events:
                async for delta in events:
                    yield _sse(shape.delta(delta))
            yield _sse(shape.finish(job.finish_reason, job.meta_info() if return_meta_info else None))
            if include_usage:
                yield _sse(shape.usage_chunk(job.usage()))
        except APIError as exc:  # the server aborted it (deadline, shutdown): say so in the stream
            yield _sse(ErrorResponse(error=exc.detail))
        except Exception:  # the status line is sent already: report in the stream, as OpenAI does
            log.exception("generation failed mid-stream")
            yield _sse(ErrorResponse(error=ErrorDetail(message="internal server error", type="server_error")))
        yield "data: [DONE]\n\n"


def _shortest_prompt(codec: TextCodec) -> int:
    """Tokens of the shortest prompt: one character (and whatever special tokens the tokenizer adds)."""
    return len(codec.encode(prompt="a"))


def _shortest_chat(codec: TextCodec) -> int:
    """Tokens of the shortest chat: one empty message of the role the template wraps least (a template may add a
    default system prompt before a user message, say)."""
    lengths = []
    for role in ("system", "user", "assistant"):
        with contextlib.suppress(ValueError, TypeError, TemplateError):
            lengths.append(len(codec.encode(messages=[{"role": role, "content": ""}])))
    return min(lengths, default=1)


def create_app(runner: EngineRunner, tokenizer, model_name: str, metrics: ServerMetrics | None = None,
               config: ServerConfig = ServerConfig(), method: str | None = None) -> FastAPI:
    """The app over a runner the caller starts and stops; it installs its metrics as the runner's observer.
    `method` labels the metrics (default: read from the engine's parts). `app.state.admission` is what a graceful
    shutdown (server/shutdown.py) drains."""
    engine = runner.snapshot
    # The same encode/decode/stop tokens as the CLI, so server output equals `adaflash generate` output.
    codec = TextCodec(tokenizer, engine.target.config.eos_token_ids)
    if metrics is None:
        metrics = ServerMetrics(engine.policy_name, method or method_of(engine.speculative, engine.policy_name),
                                engine.max_batch)
    runner.observer = metrics.observe_step
    service = _Service(runner, codec, model_name, metrics, config)
    admission = Admission()
    admission.on_abort_all(service.abort_all)
    created = int(time.time())

    app = FastAPI(title="adaflash", summary="OpenAI-compatible speculative decoding server")
    app.state.metrics, app.state.admission, app.state.config = metrics, admission, config
    app.add_middleware(Gate, config=config, admission=admission)  # inside CountRequests: 401s and 503s are counted
    app.add_middleware(CountRequests, metrics=metrics)
    _install_error_handlers(app)

    @app.post("/v1/completions", response_model=None,
              responses=openapi.generation_responses(config, CompletionResponse, CompletionResponse))
    async def completions(body: CompletionRequest, http_request: HTTPRequest):
        return await service.respond(body, CompletionShape, lambda: codec.encode(prompt=body.prompt), "prompt",
                                     http_request)

    @app.post("/v1/chat/completions", response_model=None,
              responses=openapi.generation_responses(config, ChatCompletionResponse, ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, http_request: HTTPRequest):
        messages = [m.for_template() for m in body.messages]
        return await service.respond(body, ChatShape, lambda: codec.encode(messages=messages), "messages",
                                     http_request)

    @app.get("/v1/models", responses=openapi.api_responses(config))
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created)])

    @app.get("/v1/models/{model_id:path}", responses=openapi.api_responses(config, model_lookup=True))
    async def get_model(model_id: str) -> ModelCard:
        service.check_model(model_id)
        return ModelCard(id=model_name, created=created)

    @app.get("/health", response_model=HealthStatus, responses=openapi.health_responses())
    async def health():
        if admission.draining:  # a load balancer should stop sending us traffic
            return JSONResponse({"status": "draining"}, status_code=503)
        if not runner.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses=openapi.metrics_responses(config))
    async def metrics_endpoint() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    context = runner.context_tokens
    openapi.document(app, config, completion_max_tokens=max(1, context - _shortest_prompt(codec)),
                     chat_max_tokens=max(1, context - _shortest_chat(codec)))
    return app
