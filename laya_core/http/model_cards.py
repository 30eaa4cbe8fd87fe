"""GET /v1/models and GET /v1/models/{model}: the models a deployment serves."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.http.errors import APIError
from laya_core.serving.deployment import Deployment, ModelUnavailableError


def model_routes(deployment: Deployment) -> list[Route]:
    created = int(time.time())  # the app's creation, for every card

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

    return [Route("/v1/models", list_models),
            Route("/v1/models/{model:path}", get_model)]
