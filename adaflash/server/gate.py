"""Who gets in: the API key, the draining state of a shutdown, and the count of requests in flight.

`Gate` is an ASGI middleware in front of the app. Every `/v1/*` request (and `/metrics`, unless it is
opened) must carry `Authorization: Bearer KEY` when the server has a key; the key is compared in constant
time (over fixed-length digests, so not even its length leaks) and never echoed or logged. While the
server drains for a shutdown, `/v1/*` requests get a 503 and only the ones already admitted run on.
`/health` is always open: a load balancer needs it without a key, and it reports the draining state.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Callable

from starlette.responses import JSONResponse

from adaflash.server.protocol import ErrorDetail, ErrorResponse

API_KEY_ENV = "ADAFLASH_API_KEY"


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP layer treats clients (the engine's own bounds live on the Engine)."""

    api_key: str | None = field(default=None, repr=False)  # never in a repr, hence never in a log line
    metrics_open: bool = False  # with a key: /metrics needs it too unless this is set (a scraper without the key)
    request_timeout_s: float | None = None  # per request, from admission: abort in the engine, answer 504

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"the request timeout must be > 0 seconds, got {self.request_timeout_s}")


class Admission:
    """Mutable serving state shared by the gate, the handlers and the shutdown sequence (one event loop)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0  # /v1 requests admitted and not yet fully answered (streams count until their end)
        self._abort_all: Callable[[], int] = lambda: 0

    def on_abort_all(self, abort_all: Callable[[], int]) -> None:
        """The app registers how to abort every running request (returns how many it aborted)."""
        self._abort_all = abort_all

    def abort_all(self) -> int:
        return self._abort_all()


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _is_guarded_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class Gate:
    """ASGI middleware: authentication, then admission (refused while draining), then the in-flight count."""

    def __init__(self, app, config: ServerConfig, admission: Admission) -> None:
        self.app, self.config, self.admission = app, config, admission
        self._key_digest = _digest(config.api_key.encode()) if config.api_key else None

    def _authorized(self, scope) -> bool:
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return False
        # compare_digest on equal-length digests: the time taken says nothing about the key, not even its length.
        return hmac.compare_digest(_digest(token), self._key_digest)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        api = _is_guarded_api(path)
        needs_key = api or (path == "/metrics" and not self.config.metrics_open)
        if needs_key and self._key_digest is not None and not self._authorized(scope):
            has_header = any(k == b"authorization" for k, _ in scope.get("headers", ()))
            message = ("Incorrect API key provided." if has_header else
                       "You didn't provide an API key: send it as `Authorization: Bearer KEY`.")
            detail = ErrorDetail(message=message, type="invalid_request_error", code="invalid_api_key")
            return await _reply(scope, receive, send, 401, detail, {"WWW-Authenticate": "Bearer"})
        if not api:
            return await self.app(scope, receive, send)
        if self.admission.draining:
            detail = ErrorDetail(message="the server is shutting down and admits no new requests; retry on another "
                                 "replica or after it restarts", type="server_error", code="server_shutting_down")
            return await _reply(scope, receive, send, 503, detail, {"Retry-After": "1", "Connection": "close"})
        self.admission.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.admission.in_flight -= 1


async def _reply(scope, receive, send, status: int, detail: ErrorDetail, headers: dict[str, str]) -> None:
    response = JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status, headers=headers)
    await response(scope, receive, send)
