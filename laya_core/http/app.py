"""The Starlette application, built by :func:`create_app` from a :class:`Deployment`."""

from __future__ import annotations

import json
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.chat_template import TemplateError
from laya_core.deployment import Deployment
from laya_core.http import generation as gen
from laya_core.http.auth import ApiKeyMiddleware
from laya_core.http.errors import APIError, invalid
from laya_core.http.metrics import metrics_registry
from laya_core.http.status import deployment_status
from laya_core.http.requests import parse_chat, parse_completion


async def _json_body(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"the body is larger than {max_bytes} bytes", param="body",
                       code="body_too_large")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > max_bytes:
            raise APIError(413, f"the body is larger than {max_bytes} bytes", param="body",
                           code="body_too_large")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid("body", f"the body is not valid JSON: {e}", "invalid_json") from None


def create_app(deployment: Deployment) -> Starlette:
    """The OpenAI-compatible app for a deployment whose engines are (being) started."""
    server = deployment.manifest.server
    created = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        engines = deployment.engines_of(name)
        return {"id": name, "object": "model", "created": created, "owned_by": "laya",
                "max_model_len": engines[0].max_seq_len or None,
                "replicas": len(engines)}

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list",
                             "data": [model_card(n) for n in deployment.models]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        status = 200 if deployment.ready else 503
        return JSONResponse({"ready": status == 200, **deployment_status(deployment)},
                            status_code=status)

    registry = metrics_registry(deployment)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def chat_completions(request: Request) -> Response:
        req = parse_chat(await _json_body(request, server.max_body_bytes))
        run = await _start(req)
        rid, model = gen.new_id("chatcmpl"), req.common.model
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model}
        if req.common.stream:
            first = True

            def chunk(text: str, finish: str | None) -> dict[str, Any]:
                nonlocal first
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                first = False
                return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                             "finish_reason": finish}]}

            return EventSourceResponse(
                gen.sse_events(run, chunk, req.common.include_usage, base), ping=15)
        try:
            text, finish, timing = await gen.collect(run)
        finally:
            run.release()
        body = {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish.value}],
                "usage": gen.usage(run)}
        return JSONResponse(body, headers={"Server-Timing": gen.server_timing(run.route_s,
                                                                               timing)})

    async def completions(request: Request) -> Response:
        req = parse_completion(await _json_body(request, server.max_body_bytes))
        run = await _start(req)
        base = {"id": gen.new_id("cmpl"), "object": "text_completion",
                "created": int(time.time()), "model": req.common.model}
        if req.common.stream:
            def chunk(text: str, finish: str | None) -> dict[str, Any]:
                return {**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": finish}]}

            return EventSourceResponse(
                gen.sse_events(run, chunk, req.common.include_usage, base), ping=15)
        try:
            text, finish, timing = await gen.collect(run)
        finally:
            run.release()
        body = {**base, "choices": [{"index": 0, "text": text, "logprobs": None,
                                     "finish_reason": finish.value}],
                "usage": gen.usage(run)}
        return JSONResponse(body, headers={"Server-Timing": gen.server_timing(run.route_s,
                                                                               timing)})

    async def _start(req: Any) -> gen.Running:
        try:
            return await gen.start(deployment, req)
        except TemplateError as e:
            raise invalid("messages", str(e), "chat_template_error") from None

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return APIError(exc.status_code, exc.detail or "error", code="http_error").response()

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes,
                    exception_handlers={APIError: api_error, HTTPException: http_error})
    if server.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=server.api_keys, open_paths={"/health"})
    app.state.deployment = deployment
    return app
