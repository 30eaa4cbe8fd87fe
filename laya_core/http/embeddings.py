"""POST /v1/embeddings: OpenAI's embeddings endpoint.

The body is validated (``embedding_requests.py``), the inputs are tokenized and checked
against the model (vocabulary, ``max_seq_len``) on a worker thread, the router picks a
replica as for a completion (the request counts in its load until answered), and the
replica's engine embeds the inputs between its steps (laya_core/engine/embed_jobs.py).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.engine.embed_jobs import Embeddings, EmbeddingsUnsupportedError
from laya_core.http import access_log
from laya_core.http.body import json_body
from laya_core.http.disconnect import until_disconnect
from laya_core.http.embedding_requests import EmbeddingRequest, parse_embedding
from laya_core.http.errors import APIError, invalid, refusal
from laya_core.http.replicas import ready_client, route
from laya_core.replica.client import EngineClient
from laya_core.serving.deployment import Deployment


def _unsupported(deployment: Deployment, req: EmbeddingRequest,
                 client: EngineClient) -> APIError:
    """Why ``client`` embeds nothing: its manifest entry leaves embeddings off, or its
    backend cannot."""
    info = client.info()
    backend = info.backend_name
    if info.backend_embeds and not deployment.models[req.model].embeddings:
        return invalid("model", f"embeddings are off for the model {req.model!r}: its "
                       "[[models]] entry needs embeddings = true (which plans memory for one "
                       "input of max_seq_len)", "embeddings_off")
    return invalid("model", f"the model {req.model!r} runs on the {backend} backend, which "
                   "cannot compute embeddings; use a model whose backend can (one with "
                   "supports_embeddings)", "embeddings_unsupported")


def _token_ids(req: EmbeddingRequest, client: EngineClient) -> list[list[int]]:
    """Each input's token ids, checked against the model; blocking (tokenizing)."""
    tokenizer = client.tokenizer()
    limit = client.info().max_seq_len
    out: list[list[int]] = []
    for i, item in enumerate(req.inputs):
        param = req.param(i)
        if isinstance(item, tuple):
            bad = tokenizer.first_unknown(item)
            if bad is not None:
                raise invalid(param, f"token id {bad} in '{param}' is outside the vocabulary "
                              f"(0..{tokenizer.vocab_size - 1})")
            ids = list(item)
        else:
            # As /v1/completions tokenizes a prompt, so the same text is the same tokens.
            ids = tokenizer.encode(item, add_special=True)
            if not ids:
                raise invalid(param, f"'{param}' holds no tokens once tokenized", "empty_input")
        if len(ids) > limit:
            raise invalid(param, f"'{param}' has {len(ids)} tokens, more than this model's "
                          f"max_seq_len of {limit}; shorten it or split it",
                          "context_length_exceeded")
        out.append(ids)
    return out


def _vector(data: bytes, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: little-endian float32, base64
        return base64.b64encode(data).decode("ascii")
    return np.frombuffer(data, dtype="<f4").tolist()  # type: ignore[no-any-return]


async def _embed(deployment: Deployment, req: EmbeddingRequest, ids: list[list[int]],
                 request: Request) -> tuple[Embeddings, float]:
    replica, route_s = route(deployment, req.model, req.user, (), time.perf_counter())
    client = deployment.clients[replica]
    try:
        # Cancelled when the client leaves: the engine skips what is left of the inputs.
        return await until_disconnect(request, client.embed(ids)), route_s
    except EmbeddingsUnsupportedError:
        raise _unsupported(deployment, req, client) from None
    except Exception as e:
        error = refusal(e, "input")
        if error is None and isinstance(e, RuntimeError):  # the backend failed on this input
            error = APIError(500, str(e), code="engine_error")
        if error is None:
            raise
        raise error from None
    finally:
        deployment.router.release(replica)


class EmbeddingHandler:
    """The endpoint's handler, bound to a deployment."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment

    async def handle(self, request: Request) -> Response:
        deployment = self.deployment
        req = parse_embedding(await json_body(request, deployment.manifest.server))
        async with ready_client(deployment, req.model) as (client, _):
            if not client.supports_embeddings():
                raise _unsupported(deployment, req, client)
            ids = await asyncio.to_thread(_token_ids, req, client)
            result, route_s = await _embed(deployment, req, ids, request)
        usage = {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens}
        access_log.note(req.model, {**usage, "completion_tokens": 0}, route_s, None)
        data: list[dict[str, Any]] = [
            {"object": "embedding", "index": i, "embedding": _vector(v, req.encoding_format)}
            for i, v in enumerate(result.vectors)]
        return JSONResponse({"object": "list", "data": data, "model": req.model,
                             "usage": usage})


def embedding_routes(deployment: Deployment) -> list[Route]:
    return [Route("/v1/embeddings", EmbeddingHandler(deployment).handle, methods=["POST"])]
