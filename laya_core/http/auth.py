"""API keys, compared in constant time: a Bearer token, or Anthropic's ``x-api-key`` header
(which the anthropic SDK sends). A plain ASGI middleware."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from laya_core.http.anthropic_format import error_response
from laya_core.http.errors import APIError


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Iterable[str], open_paths: set[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = open_paths

    def _allowed(self, header: bytes, x_api_key: bytes | None) -> bool:
        scheme, _, token = header.partition(b" ")
        if x_api_key is not None and scheme.lower() != b"bearer":
            token = x_api_key
        elif scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # Check every key, so the time taken does not tell which one nearly matched.
        return sum(hmac.compare_digest(token, key) for key in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self._allowed(headers.get(b"authorization", b""), headers.get(b"x-api-key")):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        if scope["path"].startswith("/v1/messages"):  # Anthropic's API, Anthropic's shape
            error.message = "a valid API key is required: send 'x-api-key: <key>'"
            response = error_response(error)
        else:
            response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750 §3: a 401 names its scheme
        await response(scope, receive, send)
