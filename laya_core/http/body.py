"""Reading a JSON request body within a size limit (parsed by :mod:`safe_json`).

A body is read only when it is declared JSON. A web page may send any other site a POST
of ``text/plain``, a form or ``multipart/form-data`` without asking it (no CORS preflight),
so a server that read those as JSON would run whatever any page the user visits sends it.
``application/json`` is a type a page can send elsewhere only after a preflight, which
``[server] cors_origins`` answers (laya_core/http/cors.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from laya_core.config.manifest import ServerConfig
from laya_core.http import safe_json
from laya_core.http.errors import APIError

_PARSE_INLINE_BYTES = 256 * 2**10
JSON_TYPE = "application/json"


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the body is larger than {max_bytes} bytes", param="body",
                    code="body_too_large")


def check_json_type(request: Request) -> None:
    """415 unless the body is declared ``application/json`` (parameters such as
    ``charset=utf-8`` allowed). A body with no Content-Type is JSON from a client that
    sends no Origin: browsers send one with every POST, and a page may send a typeless body
    (a Blob, an ArrayBuffer) to another site without a preflight."""
    declared = request.headers.get("content-type")
    if declared is None and "origin" not in request.headers:
        return
    if declared is not None and declared.partition(";")[0].strip().lower() == JSON_TYPE:
        return
    got = "no Content-Type" if declared is None else f"Content-Type {declared!r}"
    raise APIError(415, f"the body must be JSON sent with 'Content-Type: {JSON_TYPE}', not "
                   f"{got} (with curl: -H 'Content-Type: {JSON_TYPE}')",
                   param="Content-Type", code="unsupported_media_type")


async def json_body(request: Request, server: ServerConfig) -> Any:
    """The body's JSON value. It must be declared JSON (415, :func:`check_json_type`),
    arrive whole within ``server.body_timeout_s`` (408 after that: a client that declares a
    length and then trickles or stops must not hold a connection), be at most
    ``server.max_body_bytes`` (413), and pass :mod:`safe_json`."""
    check_json_type(request)
    max_bytes = server.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    try:
        data = await asyncio.wait_for(_read(request, max_bytes), server.body_timeout_s)
    except TimeoutError:
        raise APIError(408, f"the body did not arrive within {server.body_timeout_s:g} s",
                       param="body", code="body_timeout") from None
    if len(data) > _PARSE_INLINE_BYTES:
        # The walk over a large body is Python code: on a worker thread the event loop gets
        # the GIL between its steps instead of waiting for the whole parse.
        return await asyncio.to_thread(safe_json.loads, data)
    return safe_json.loads(data)


async def _read(request: Request, max_bytes: int) -> bytearray:
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > max_bytes:
            raise _too_large(max_bytes)
    return data
