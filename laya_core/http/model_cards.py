"""GET /v1/models and GET /v1/models/{model}: the models a deployment serves, each with its
status (loaded, loading, unloaded, failed) and planned memory; POST /models/load and POST
/models/unload for the models loaded on demand (laya_core/serving/residency.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.http.body import json_body
from laya_core.http.errors import APIError, invalid
from laya_core.http.replicas import LOAD_REFUSALS, load_refused
from laya_core.serving.deployment import Deployment, ModelUnavailableError


def model_routes(deployment: Deployment) -> list[Route]:
    created = int(time.time())  # the app's creation, for every card

    def model_card(name: str) -> dict[str, Any]:
        clients = deployment.clients_of(name)
        try:
            max_len: int | None = deployment.any_client(name).info().max_seq_len
        except ModelUnavailableError:
            max_len = None
        config = deployment.models[name]
        card = {"id": name, "object": "model", "created": created, "owned_by": "laya",
                "max_model_len": max_len, "replicas": len(clients), "load": config.load,
                "planned_bytes": deployment.plan.model_bytes(name) if deployment.plan
                else None}
        resident = deployment.residency.status(name)
        if resident is None:  # pinned: its replicas' states say
            states = {c.state().state.value for c in clients}
            status = "loaded" if "ready" in states else \
                "failed" if states <= {"failed", "stopped"} else "loading"
            return {**card, "status": status}
        return {**card, **resident}

    def adapter_card(name: str) -> dict[str, Any]:
        """A LoRA adapter, as vLLM lists one: its folder as ``root``, its model as ``parent``
        (whose status it shares)."""
        parent = deployment.lora.parents[name]
        card = model_card(parent)
        return {**card, "id": name, "root": deployment.lora.of(parent).get(name),
                "parent": parent, "replicas": card["replicas"], "planned_bytes": None}

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list",
                             "data": [*(model_card(n) for n in deployment.models),
                                      *(adapter_card(n) for n in deployment.lora.parents)]})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        if name in deployment.lora.parents:
            return JSONResponse(adapter_card(name))
        if name not in deployment.models:
            raise APIError(404, f"the model {name!r} does not exist; see GET /v1/models",
                           param="model", code="model_not_found")
        return JSONResponse(model_card(name))

    async def on_demand_model(request: Request) -> str:
        body = await json_body(request, deployment.manifest.server)
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise invalid("model", "'model' is required: a model name from GET /v1/models",
                          "missing")
        if name not in deployment.models:
            raise APIError(404, f"the model {name!r} does not exist; see GET /v1/models",
                           param="model", code="model_not_found")
        if not deployment.residency.on_demand(name):
            raise invalid("model", f"the model {name!r} is loaded always (its manifest "
                          "entry's load); only models with load = \"on_demand\" are loaded "
                          "and unloaded on request", "not_on_demand")
        return name

    async def load(request: Request) -> Response:
        """Load the model and answer once it is loaded (or could not be)."""
        name = await on_demand_model(request)
        try:
            await asyncio.wrap_future(deployment.residency.load(name))
        except LOAD_REFUSALS as e:
            raise load_refused(name, e) from None
        return JSONResponse(model_card(name))

    async def unload(request: Request) -> Response:
        """Unload the model once its running requests have finished; answers then."""
        name = await on_demand_model(request)
        await asyncio.to_thread(deployment.residency.unload, name, "asked")
        return JSONResponse(model_card(name))

    return [Route("/v1/models", list_models),
            Route("/v1/models/{model:path}", get_model),
            Route("/models/load", load, methods=["POST"]),
            Route("/models/unload", unload, methods=["POST"])]
