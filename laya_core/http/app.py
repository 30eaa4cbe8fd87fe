"""The Starlette application, built by :func:`create_app` from a :class:`Deployment`.

Each group of routes lives in its module (``health``, ``model_cards``, ``completions``,
``embeddings``, ``tokens``, ``dashboard``); ``create_app`` assembles them, the error handlers
(``errors``) and the middleware, innermost first.
"""

from __future__ import annotations

from starlette.applications import Starlette

from laya_core.http.access_log import AccessLogMiddleware
from laya_core.http.auth import ApiKeyMiddleware
from laya_core.http.completions import completion_routes
from laya_core.http.cors import Cors, cors_options
from laya_core.http.dashboard import OPEN_PATHS, LatencyWindow, live_routes
from laya_core.http.embeddings import embedding_routes
from laya_core.http.errors import exception_handlers
from laya_core.http.health import health_routes
from laya_core.http.hosts import HostCheckMiddleware, host_rule
from laya_core.http.lora_routes import lora_routes
from laya_core.http.messages import message_routes
from laya_core.http.metrics import metrics_registry
from laya_core.http.model_cards import model_routes
from laya_core.http.observe import Observer
from laya_core.http.responses import response_routes
from laya_core.http.tokens import token_routes
from laya_core.serving.deployment import Deployment


def create_app(deployment: Deployment) -> Starlette:
    """The OpenAI-compatible app for a deployment whose engines are (being) started."""
    server = deployment.manifest.server
    registry = metrics_registry(deployment)
    window = LatencyWindow()
    routes = [
        *health_routes(deployment, registry),  # /health, /ready, /metrics
        *model_routes(deployment),  # /v1/models, /v1/models/{model}
        *lora_routes(deployment),  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        *completion_routes(deployment, observer := Observer(registry, window)),
        *response_routes(deployment, observer),  # /v1/responses, on the chat path
        *message_routes(deployment, observer),  # Anthropic's /v1/messages, on the chat path
        *embedding_routes(deployment),
        *token_routes(deployment),  # /tokenize, /detokenize
        *live_routes(deployment, window),  # the live page and GET /live
    ]
    app = Starlette(routes=routes, exception_handlers=exception_handlers())
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
