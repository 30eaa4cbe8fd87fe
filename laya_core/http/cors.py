"""CORS for browser clients: Starlette's middleware, with its refusals as OpenAI errors.

It must wrap the API-key middleware: a preflight carries no Authorization header, so it is
answered before the key is checked, and a 401 or 429 sent to an allowed origin still carries
``Access-Control-Allow-Origin``, without which the browser hides the error from the page.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from laya_core.http.errors import APIError

ALLOW_METHODS = ("GET", "POST", "OPTIONS")
# Preflights list the headers a page's client will send: Authorization, Content-Type,
# X-Session-ID, and the OpenAI SDKs' x-stainless-* family, whose members change between SDK
# versions. So every requested header is allowed (Starlette echoes the list back). This
# widens nothing: no cookies are accepted (allow_credentials stays off), and a key is
# still needed wherever one was.
ALLOW_HEADERS = ("*",)
# Response headers a page may read beyond the CORS-safelisted ones.
EXPOSE_HEADERS = ("Server-Timing", "Retry-After", "WWW-Authenticate", "X-Accel-Buffering")
PREFLIGHT_MAX_AGE_S = 600


class Cors(CORSMiddleware):
    """Starlette's CORSMiddleware; a refused preflight is an OpenAI error object."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        # Starlette's text: "Disallowed CORS origin, method, headers".
        reason = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        error = APIError(400, f"the CORS preflight was refused: this server does not allow "
                         f"the requested {reason} (see [server] cors_origins)",
                         code="cors_refused")
        keep = {k: v for k, v in response.headers.items()
                if k not in ("content-length", "content-type")}
        return error.response(keep)


def cors_options(origins: tuple[str, ...]) -> dict[str, Any]:
    """Keyword arguments of :class:`Cors` for the manifest's ``[server] cors_origins``."""
    return {"allow_origins": origins, "allow_methods": ALLOW_METHODS,
            "allow_headers": ALLOW_HEADERS, "expose_headers": EXPOSE_HEADERS,
            "max_age": PREFLIGHT_MAX_AGE_S}
