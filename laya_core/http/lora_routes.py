"""POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter (vLLM's names and bodies):
LoRA adapters loaded and unloaded while serving, on a model whose manifest entry left room
for them in the plan (``max_loras`` above the adapters its ``lora`` table lists).

A load checks the folder against the model's shape and its rank against ``max_lora_rank``
before any replica reads it, loads it on every replica of the model or on none, and only
then routes requests naming it. An unload stops routing requests to it at once and answers
when every replica has unloaded it, after the requests using it have finished. One change
runs at a time. A model loaded on demand is loaded for a load (and held meanwhile), and
keeps the adapters loaded now through its later loads (``serving/adapters.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.http.body import json_body
from laya_core.http.errors import APIError, invalid
from laya_core.http.replicas import ready_client
from laya_core.models.lora import AdapterError
from laya_core.serving.adapters import AdapterRoomError
from laya_core.serving.deployment import Deployment

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/-")


def lora_routes(deployment: Deployment) -> list[Route]:
    changing = asyncio.Lock()

    def string(body: dict[str, Any], key: str) -> str:
        value = body.get(key)
        if not isinstance(value, str) or not value:
            raise invalid(key, f"'{key}' is required: a non-empty string",
                          "missing" if value is None else "invalid_type")
        return value

    def models_taking_adapters() -> list[str]:
        return [n for n, m in deployment.models.items()
                if m.lora_slots > 0]

    def base_model(body: dict[str, Any]) -> str:
        takers = models_taking_adapters()
        name = body.get("model")
        if name is None:
            if len(takers) != 1:
                raise invalid("model", "'model' is required: the model the adapter adapts "
                              f"(these take adapters: {', '.join(takers) or 'none'})",
                              "missing")
            return takers[0]
        if not isinstance(name, str) or name not in deployment.models:
            raise APIError(404, f"the model {name!r} does not exist; see GET /v1/models",
                           param="model", code="model_not_found")
        if name not in takers:
            raise invalid("model", f"the model {name!r} takes no adapters while serving: its "
                          "manifest entry needs max_loras above the adapters of its lora "
                          "table", "lora_not_enabled")
        return name

    def check_room(model: str, path: str) -> None:
        try:
            deployment.lora.check(deployment.models[model], path)
        except AdapterRoomError as e:
            raise invalid("lora_name", str(e), "too_many_adapters") from None
        except AdapterError as e:
            raise invalid("lora_path", str(e)) from None

    async def load(request: Request) -> Response:
        body = await json_body(request, deployment.manifest.server)
        if not isinstance(body, dict):
            raise invalid("lora_name", "the body must be a JSON object", "invalid_type")
        name, path = string(body, "lora_name"), string(body, "lora_path")
        if not set(name) <= _NAME_CHARS or len(name) > 128:
            raise invalid("lora_name", "use 1-128 letters, digits and . _ : / -")
        model = base_model(body)
        async with changing:
            if name in deployment.models or name in deployment.lora.parents:
                raise invalid("lora_name", f"{name!r} is the name of a model or an adapter "
                              "already", "name_taken")
            await asyncio.to_thread(check_room, model, path)
            # An on-demand model loads first, as for a request, and stays loaded meanwhile.
            async with ready_client(deployment, model):
                try:
                    await deployment.lora.load(deployment.clients_of(model), model, name, path)
                except ValueError as e:
                    raise invalid("lora_path", str(e)) from None
        return JSONResponse({"object": "lora_adapter", "lora_name": name, "model": model,
                             "status": "loaded"})

    async def unload(request: Request) -> Response:
        body = await json_body(request, deployment.manifest.server)
        if not isinstance(body, dict):
            raise invalid("lora_name", "the body must be a JSON object", "invalid_type")
        name = string(body, "lora_name")
        async with changing:
            if name not in deployment.lora.parents:
                raise APIError(404, f"no adapter {name!r} is loaded; see GET /v1/models",
                               param="lora_name", code="lora_not_found")
            model = deployment.lora.parents[name]
            resident = deployment.residency.status(model)
            if resident is None:  # loaded always
                await deployment.lora.unload(name, deployment.clients_of(model))
            elif resident["status"] in ("loaded", "loading"):
                async with ready_client(deployment, model):
                    await deployment.lora.unload(name, deployment.clients_of(model))
            else:  # not loaded: its next load leaves the adapter out
                await deployment.lora.unload(name, None)
        return JSONResponse({"object": "lora_adapter", "lora_name": name, "model": model,
                             "status": "unloaded"})

    return [Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"])]
