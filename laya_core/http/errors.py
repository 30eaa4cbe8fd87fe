"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``, and the
one mapping from what a replica or the app refuses with to those objects."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from laya_core.models.tokenizer import TokenizerClosedError
from laya_core.replica.client import (
    EngineUnavailableError,
    GrammarError,
    QueueFullError,
    QueueTimeoutError,
    RequestTooLongError,
    UnsupportedParameterError,
)

# The app's logger: an unhandled error is logged as the app's, as it always was.
log = logging.getLogger("laya_core.http.app")
# Seconds a client is told to wait (Retry-After) when the queue or the replicas are busy.
QUEUE_RETRY_AFTER_S = 2

# OpenAI types every client error (400, 404 unknown URL or model, 405, 408, 413, ...)
# "invalid_request_error" and every server fault "server_error"; these statuses get a type
# that says more. 503 stays apart from server_error: it means "wait and retry", not a fault.
_TYPE_OF_STATUS = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_type(status: int) -> str:
    """The OpenAI error ``type`` of an HTTP status."""
    if status in _TYPE_OF_STATUS:
        return _TYPE_OF_STATUS[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class APIError(Exception):
    """An error a client caused or must wait out; becomes a JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message,
                          "type": error_type(self.status),
                          "param": self.param, "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        all_headers = dict(headers or {})
        if self.retry_after:
            all_headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=all_headers)


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def http_exception_response(method: str, path: str, exc: HTTPException) -> JSONResponse:
    """Starlette's routing errors as OpenAI error objects, keeping their headers (``Allow``)."""
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        error = APIError(404, f"unknown request URL: {method} {path}; the paths are listed in "
                         "spec/openapi.yaml", code="unknown_url")
    elif exc.status_code == 405:
        # Starlette keeps a route's methods in a set; sorted, the header is the same each time.
        allowed = ", ".join(sorted(m.strip() for m in headers.get("Allow", "").split(",")))
        headers["Allow"] = allowed
        error = APIError(405, f"{method} is not allowed on {path}; use {allowed}",
                         code="method_not_allowed")
    else:
        error = APIError(exc.status_code, exc.detail or "error", code="http_error")
    return error.response(headers)


def refusal(e: BaseException, too_long_param: str) -> APIError | None:
    """The error object answering a replica's refusal ``e`` of ``submit`` or ``embed``, or
    None where ``e`` is no refusal. ``too_long_param``: the request field a too-long request
    names (``max_tokens``, ``max_completion_tokens`` or ``input``)."""
    if isinstance(e, GrammarError):
        return invalid(e.param, str(e), "invalid_constraint")
    if isinstance(e, RequestTooLongError):
        return invalid(too_long_param, str(e), "context_length_exceeded")
    if isinstance(e, UnsupportedParameterError):
        return invalid(e.param, str(e), "unsupported_parameter")
    # An engine-level backend may pass on how long its upstream asked callers to wait.
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), code="queue_full",
                        retry_after=e.retry_after_s or QUEUE_RETRY_AFTER_S)
    if isinstance(e, QueueTimeoutError):
        return APIError(503, f"no room for this request: {e}; retry later",
                        code="queue_timeout", retry_after=QUEUE_RETRY_AFTER_S)
    if isinstance(e, EngineUnavailableError):  # stopped or failed since routing: shutting down
        return APIError(503, f"{e}; retry later", code="not_ready",
                        retry_after=e.retry_after_s or QUEUE_RETRY_AFTER_S)
    return None


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return http_exception_response(request.method, request.url.path, exc)


async def _unloaded(request: Request, exc: Exception) -> Response:
    # A request that raced the server's shutdown: its model was unloaded under it.
    return APIError(503, f"{exc}; the server is shutting down", code="not_ready",
                    retry_after=QUEUE_RETRY_AFTER_S).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}); the server log has the "
                    "details", code="internal_error").response()


def exception_handlers() -> dict[Any, Any]:
    """The app's handlers: every error a client meets is an error object."""
    return {APIError: _api_error, HTTPException: _http_error,
            TokenizerClosedError: _unloaded, Exception: _unexpected}
