"""POST /tokenize and POST /detokenize (vLLM's): a model's tokenizer, over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import attrs
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from laya_core.http.body import json_body
from laya_core.http.chat_requests import parse_chat
from laya_core.http.completion_requests import Body
from laya_core.http.errors import invalid
from laya_core.http.replicas import ready_client
from laya_core.serving.chat_template import TemplateError
from laya_core.serving.deployment import Deployment


@attrs.frozen
class TokenizeRequest:
    model: str
    prompt: str
    messages: tuple[dict[str, str], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool


def parse_tokenize(body: Any) -> TokenizeRequest:
    """vLLM's /tokenize body: ``model`` with ``prompt`` or ``messages``."""
    b = Body(body)
    model = b.get("model", str)
    if not model:
        raise invalid("model", "'model' is required", "missing")
    if "messages" in b.body:
        chat = parse_chat({"model": model, "messages": b.body["messages"]})
        return TokenizeRequest(model, "", chat.messages, b.get("add_special_tokens", bool, False),
                               b.get("add_generation_prompt", bool, True))
    prompt = b.get("prompt", str)
    if prompt is None:
        raise invalid("prompt", "give 'prompt' (a string) or 'messages'", "missing")
    return TokenizeRequest(model, prompt, None, b.get("add_special_tokens", bool, True), False)


def token_routes(deployment: Deployment) -> list[Route]:
    server = deployment.manifest.server

    async def tokenize(request: Request) -> Response:
        req = parse_tokenize(await json_body(request, server))
        async with ready_client(deployment, req.model) as (client, _):
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
        async with ready_client(deployment, model) as (client, _):
            return _detokenized(client.tokenizer(), tokens)

    return [Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"])]


def _detokenized(tokenizer: Any, tokens: Any) -> Response:
    vocab = tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens) \
            or tokenizer.first_unknown(tokens) is not None:
        raise invalid("tokens", f"'tokens' must be an array of token ids in 0..{vocab - 1}")
    return JSONResponse({"prompt": tokenizer.decode(tokens)})
