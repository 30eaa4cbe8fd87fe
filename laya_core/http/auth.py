"""Bearer API keys, compared in constant time. A plain ASGI middleware."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from laya_core.http.errors import APIError


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: Iterable[str], open_paths: set[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.open_paths = open_paths

    def _allowed(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # Check every key, so the time taken does not tell which one nearly matched.
        return sum(hmac.compare_digest(token, key) for key in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        if self._allowed(header):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
        response = error.response()
        response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750 §3: a 401 names its scheme
        await response(scope, receive, send)
