"""The Starlette application, built by :func:`create_app` from a :class:`Deployment`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.http import generation as gen
from laya_core.http.access_log import AccessLogMiddleware
from laya_core.http.auth import ApiKeyMiddleware
from laya_core.http.body import json_body
from laya_core.http.completions import CompletionHandlers
from laya_core.http.cors import Cors, cors_options
from laya_core.http.dashboard import OPEN_PATHS, LatencyWindow, live_routes
from laya_core.http.embeddings import EmbeddingHandler
from laya_core.http.errors import APIError, http_exception_response, invalid
from laya_core.http.hosts import HostCheckMiddleware, host_rule
from laya_core.http.metrics import metrics_registry
from laya_core.http.observe import Observer
from laya_core.http.requests import parse_tokenize
from laya_core.http.status import deployment_status
from laya_core.models.tokenizer import TokenizerClosedError
from laya_core.serving.chat_template import TemplateError
from laya_core.serving.deployment import Deployment, ModelUnavailableError

log = logging.getLogger(__name__)


def create_app(deployment: Deployment) -> Starlette:
    """The OpenAI-compatible app for a deployment whose engines are (being) started."""
    server = deployment.manifest.server
    created = int(time.time())
    registry = metrics_registry(deployment)
    window = LatencyWindow()
    handlers = CompletionHandlers(deployment, Observer(registry, window))

    def model_card(name: str) -> dict[str, Any]:
        clients = deployment.clients_of(name)
        try:
            max_len: int | None = deployment.any_client(name).info().max_seq_len
        except ModelUnavailableError:
            max_len = None
        return {"id": name, "object": "model", "created": created, "owned_by": "laya",
                "max_model_len": max_len, "replicas": len(clients)}

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list",
                             "data": [model_card(n) for n in deployment.models]})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        if name not in deployment.models:
            raise APIError(404, f"the model {name!r} does not exist; see GET /v1/models",
                           param="model", code="model_not_found")
        return JSONResponse(model_card(name))

    async def tokenize(request: Request) -> Response:
        req = parse_tokenize(await json_body(request, server))
        client = gen.client_for(deployment, req.model)
        if req.messages is not None:
            try:
                tokens = await asyncio.to_thread(
                    deployment.chat_prompt, client, req.messages, req.add_generation_prompt,
                    req.add_special_tokens)
            except TemplateError as e:
                raise invalid("messages", str(e), "chat_template_error") from None
        else:
            tokens = await asyncio.to_thread(client.tokenizer().encode, req.prompt,
                                             add_special=req.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens),
                             "max_model_len": client.info().max_seq_len})

    async def detokenize(request: Request) -> Response:
        body = await json_body(request, server)
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or not model:
            raise invalid("model", "'model' is required", "missing")
        tokens = body.get("tokens")
        tokenizer = gen.client_for(deployment, model).tokenizer()
        vocab = tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens) \
                or tokenizer.first_unknown(tokens) is not None:
            raise invalid("tokens", f"'tokens' must be an array of token ids in 0..{vocab - 1}")
        return JSONResponse({"prompt": tokenizer.decode(tokens)})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        status = 200 if deployment.ready else 503
        return JSONResponse({"ready": status == 200, **deployment_status(deployment)},
                            status_code=status)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, f"internal error ({type(exc).__name__}); the server log has the "
                        "details", code="internal_error").response()

    async def unloaded(request: Request, exc: Exception) -> Response:
        # A request that raced the server's shutdown: its model was unloaded under it.
        return APIError(503, f"{exc}; the server is shutting down", code="not_ready",
                        retry_after=gen.QUEUE_RETRY_AFTER_S).response()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return http_exception_response(request.method, request.url.path, exc)

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/models/{model:path}", get_model),
        Route("/v1/chat/completions", handlers.chat, methods=["POST"]),
        Route("/v1/completions", handlers.completions, methods=["POST"]),
        Route("/v1/embeddings", EmbeddingHandler(deployment).handle, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        *live_routes(deployment, window),  # the live page and GET /live
    ]
    app = Starlette(routes=routes,
                    exception_handlers={APIError: api_error, HTTPException: http_error,
                                        TokenizerClosedError: unloaded, Exception: unexpected})
    if server.api_keys:
        open_paths = {"/health"} if server.metrics_need_api_key else {"/health", "/metrics"}
        open_paths |= OPEN_PATHS  # the live page's files; its data (/live) needs a key
        app.add_middleware(ApiKeyMiddleware, keys=server.api_keys, open_paths=open_paths)
    if server.cors_origins:  # added after the key check, so it wraps it (laya_core/http/cors.py)
        app.add_middleware(Cors, **cors_options(server.cors_origins))
    if (rule := host_rule(server)) is not None:  # outside CORS: a rebinding page is no origin
        app.add_middleware(HostCheckMiddleware, rule=rule)
    if server.access_log:  # outermost, so what the layers inside refuse is logged too
        app.add_middleware(AccessLogMiddleware)
    app.state.deployment = deployment
    return app
