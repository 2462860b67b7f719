"""What /openapi.json says: every status each operation answers (errors with OpenAI's body), the media types it
really serves (server-sent events, Prometheus text), the bounds of this server (the largest max_tokens its context
leaves room for), and its bearer key where it has one. A client or a contract tester (schemathesis) can then trust
the schema: a request it calls valid is served, one it calls invalid gets a 4xx.

FastAPI documents a 422 for every operation with a body; this server answers validation errors 400 (OpenAI's
status), so the 422 is taken out again.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from adaflash.server.gate import ServerConfig
from adaflash.server.protocol import ChatCompletionChunk, CompletionResponse, ErrorResponse, HealthStatus

REF = "#/components/schemas/"
BEARER = "bearerAuth"

RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
WWW_AUTHENTICATE = {"WWW-Authenticate": {"description": "`Bearer`", "schema": {"type": "string"}}}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"model": ErrorResponse, "description": description}
    if headers:
        response["headers"] = headers
    return response


def _sse_events(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: a text/event-stream schema describes each event): its data is a chunk,
    the error that ended the stream early (deadline, shutdown), or the closing `[DONE]`."""
    payload = {"anyOf": [{"$ref": REF + chunk.__name__}, {"$ref": REF + "ErrorResponse"}]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def _common(config: ServerConfig, needs_key: bool) -> dict[int | str, dict[str, Any]]:
    responses: dict[int | str, dict[str, Any]] = {500: _error("internal server error (`server_error`)")}
    if needs_key and config.api_key:
        responses[401] = _error("no or a wrong `Authorization: Bearer KEY` (`invalid_api_key`)", WWW_AUTHENTICATE)
    return responses


def api_responses(config: ServerConfig, *, model_lookup: bool = False) -> dict[int | str, dict[str, Any]]:
    """A /v1 read: refused while the server drains for a shutdown (503), a model name it does not serve (404)."""
    responses = _common(config, needs_key=True)
    responses[503] = _error("the server is shutting down and admits no new requests (`server_shutting_down`)",
                            RETRY_AFTER)
    if model_lookup:
        responses[404] = _error("no such model (`model_not_found`)")
    return responses


def generation_responses(config: ServerConfig, response: type[BaseModel],
                         chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    responses = api_responses(config, model_lookup=True)
    responses[200] = {"model": response, "description": "the completion (application/json), or with `stream: true` "
                      "its chunks as server-sent events (text/event-stream) ending with `data: [DONE]`",
                      "content": {"text/event-stream": {"schema": _sse_events(chunk)}}}
    responses[400] = _error("an invalid request (`invalid_request_error`): not JSON, against the schema, a field this "
                            "server does not support, or a prompt that with max_tokens does not fit the context "
                            "(`context_length_exceeded`)")
    responses[503] = _error("at capacity, the queue full (`queue_full`, with Retry-After); the engine stopped "
                            "(`engine_stopped`); shutting down (`server_shutting_down`)", RETRY_AFTER)
    if config.request_timeout_s is not None:
        responses[504] = _error(f"the request ran past the server's deadline of {config.request_timeout_s:g} s "
                                "(`request_timeout`); a stream ends with that error as its last event instead")
    return responses


def health_responses() -> dict[int | str, dict[str, Any]]:
    return {200: {"model": HealthStatus, "description": "serving"},
            503: {"model": HealthStatus, "description": "draining for a shutdown, or the engine is not running"}}


def metrics_responses(config: ServerConfig) -> dict[int | str, dict[str, Any]]:
    responses = _common(config, needs_key=not config.metrics_open)
    responses[200] = {"description": "Prometheus text exposition",
                      "content": {"text/plain": {"schema": {"type": "string"}}}}
    return responses


def _bound_max_tokens(schemas: dict[str, Any], name: str, fields: tuple[str, ...], maximum: int) -> None:
    for field in fields:
        for branch in schemas[name]["properties"][field].get("anyOf", []):
            if branch.get("type") == "integer":
                branch["maximum"] = maximum


def document(app: FastAPI, config: ServerConfig, *, completion_max_tokens: int, chat_max_tokens: int) -> None:
    """Install the app's /openapi.json. `*_max_tokens`: the most tokens the context leaves after the shortest prompt
    of each endpoint (a longer prompt leaves less: the server says so with a 400 context_length_exceeded)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for path in spec["paths"].values():
            for operation in path.values():
                operation["responses"].pop("422", None)
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        for model in (ChatCompletionChunk, CompletionResponse):  # the event schemas' references
            if model.__name__ not in schemas:
                definition = model.model_json_schema(ref_template=REF + "{model}", mode="serialization")
                for name, sub in definition.pop("$defs", {}).items():
                    schemas.setdefault(name, sub)
                schemas[model.__name__] = definition
        _bound_max_tokens(schemas, "CompletionRequest", ("max_tokens",), completion_max_tokens)
        _bound_max_tokens(schemas, "ChatCompletionRequest", ("max_tokens", "max_completion_tokens"), chat_max_tokens)
        if config.api_key:
            schemas_security = spec["components"].setdefault("securitySchemes", {})
            schemas_security[BEARER] = {"type": "http", "scheme": "bearer"}
            for route, path in spec["paths"].items():
                if route.startswith("/v1/") or (route == "/metrics" and not config.metrics_open):
                    for operation in path.values():
                        operation["security"] = [{BEARER: []}]
        app.openapi_schema = spec
        return spec

    app.openapi = openapi
