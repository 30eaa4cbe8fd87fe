"""Reading a JSON request body within a size limit."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from laya_core.http.errors import APIError, invalid


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the body is larger than {max_bytes} bytes", param="body",
                    code="body_too_large")


async def json_body(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > max_bytes:
            raise _too_large(max_bytes)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid("body", f"the body is not valid JSON: {e}", "invalid_json") from None
