"""GET /health, GET /ready and GET /metrics: what load balancers and monitoring poll."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.http.status import deployment_status
from laya_core.serving.deployment import Deployment


def health_routes(deployment: Deployment, registry: CollectorRegistry) -> list[Route]:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        status = 200 if deployment.ready else 503
        return JSONResponse({"ready": status == 200, **deployment_status(deployment)},
                            status_code=status)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return [Route("/health", health), Route("/ready", ready), Route("/metrics", metrics)]
