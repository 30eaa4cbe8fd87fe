"""OpenAI-style error objects: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

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
