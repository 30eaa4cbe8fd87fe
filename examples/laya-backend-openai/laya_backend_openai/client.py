"""One replica: an upstream OpenAI-compatible server, behind Laya's replica seam.

``submit`` opens the upstream's streamed response before it returns, so what the upstream
refuses (429 and 503 with their ``Retry-After``, a 400 naming a field) is refused to the
client with a proper status; then a task reads the upstream's SSE chunks into the request's
stream. Cancelling the request (the client went away) cancels that task, which closes the
upstream response. A connection that breaks ends the request with a ``replica_lost`` error
(an error event mid-stream) and marks the replica down, so the router sends the next
requests to the others until the health check (``GET {base}/models``) passes again.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx

from laya_backend_openai.text import CHAT_TEMPLATE, ByteTokenizer, upstream_request
from laya_core.backend import ModelConfig, ModelInfo
from laya_core.engine.limits import check_length
from laya_core.engine.stream import ADMITTED, GenerationStream
from laya_core.models.tokenizer import Tokenizer
from laya_core.replica.client import (
    EngineState,
    EngineUnavailableError,
    QueueFullError,
    ReplicaInfo,
    UnsupportedParameterError,
)
from laya_core.replica.engine_backend import EngineBackendClient
from laya_core.structured.formats import JSON_KINDS, schema_of
from laya_core.structured.spec import ConstraintSpec
from laya_core.types import FinishReason, SamplingParams, Timing, TokenEvent, Usage

# httpx logs every request at INFO: a health check every few seconds would fill the log.
logging.getLogger("httpx").setLevel(logging.WARNING)

UPSTREAM = "upstream"  # the layer of the upstream's time: Server-Timing, /metrics
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH,
           "tool_calls": FinishReason.STOP, "function_call": FinishReason.STOP}


def _retry_after(response: httpx.Response) -> int | None:
    value = response.headers.get("retry-after", "")
    return int(value) if value.isdigit() else None


def _error_text(response: httpx.Response) -> tuple[str, str | None]:
    """The upstream's error message and the field it names, from its body."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        return str(error.get("message") or error), error.get("param")
    return response.text[:500] or response.reason_phrase, None


def _response_format(constraint: ConstraintSpec) -> dict[str, Any]:
    """OpenAI's ``response_format`` for a JSON constraint: its schema as the request gave it
    (less Laya's whitespace options), which the upstream enforces itself."""
    if constraint.kind == "json_object":
        return {"type": "json_object"}
    schema = schema_of(constraint)
    if isinstance(schema, dict):
        schema = {k: v for k, v in schema.items() if k != "x-guidance"}
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


class UpstreamClient(EngineBackendClient):
    """One upstream server as one replica; see the module docstring."""

    def __init__(self, config: ModelConfig, replica_id: int, base_url: str, *,
                 model: str | None, timeout_s: float, connect_timeout_s: float,
                 health_interval_s: float, api_key: str | None) -> None:
        super().__init__(config, replica_id)
        self.base_url = base_url
        self.upstream_model = model
        self.health_interval_s = health_interval_s
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._tokenizer = ByteTokenizer()
        self._ids = itertools.count()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._http: httpx.AsyncClient | None = None  # made on the event loop that uses it
        self._http_loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle (the replica's thread) -----------------------------------------------------

    def _models(self) -> list[str]:
        response = httpx.get(f"{self.base_url}/models", headers=self.headers,
                             timeout=self.timeout)
        response.raise_for_status()
        return [m["id"] for m in response.json().get("data", [])]

    def load(self) -> ReplicaInfo:
        served = self._models()
        if self.upstream_model is None:
            if not served:
                raise RuntimeError(f"{self.base_url} serves no model")
            self.upstream_model = served[0]
        elif self.upstream_model not in served:
            raise RuntimeError(f"{self.base_url} does not serve {self.upstream_model!r} "
                               f"(it serves {', '.join(served) or 'nothing'})")
        max_seq_len = self.config.max_seq_len or 4096
        info = ModelInfo(n_ctx_train=max_seq_len, vocab_size=256, eog_token_ids=frozenset(),
                         chat_template=CHAT_TEMPLATE, bos_token="", eos_token="",
                         add_bos=False, description=f"{self.upstream_model} at {self.base_url}")
        return self.replica_info(info, max_seq_len, "openai")

    def check(self) -> None:
        self._models()

    def runtime(self) -> dict[str, Any]:
        return {"upstream": self.base_url, "model": self.upstream_model,
                "restarts": self.restarts}

    def tokenizer(self) -> Tokenizer:
        self.info()  # raises until loaded
        return self._tokenizer

    # -- requests (the event loop) -------------------------------------------------------------

    def _body(self, prompt_ids: Sequence[int], params: SamplingParams,
              constraint: ConstraintSpec | None) -> tuple[str, dict[str, Any]]:
        path, body = upstream_request(prompt_ids)
        if constraint is not None:  # JSON (checked before): the upstream enforces it
            body["response_format"] = _response_format(constraint)
        body.update(model=self.upstream_model, stream=True, temperature=params.temperature,
                    top_p=params.top_p, stream_options={"include_usage": True})
        # A request without max_tokens gets the room the length rule leaves, counted in
        # bytes here: the upstream's own default (its room, in its tokens) is the meaning.
        if params.max_tokens < self.info().max_seq_len - len(prompt_ids):
            body["max_tokens"] = params.max_tokens
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if params.presence_penalty:
            body["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty:
            body["frequency_penalty"] = params.frequency_penalty
        # Beyond OpenAI's fields: what llama.cpp's, vLLM's and Laya's servers read.
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.min_p > 0:
            body["min_p"] = params.min_p
        if params.repetition_penalty != 1.0:
            body["repetition_penalty"] = params.repetition_penalty
        if params.ignore_eos:
            body["ignore_eos"] = True
        return path, body

    def _refuse_what_cannot_pass(self, params: SamplingParams,
                                 constraint: ConstraintSpec | None) -> None:
        if constraint is not None and constraint.kind not in JSON_KINDS:
            raise UnsupportedParameterError(
                constraint.param, f"the openai backend of {self.model!r} passes requests to "
                "an upstream server, which takes JSON output formats only "
                "(response_format json_object or json_schema); send the request without "
                f"this {constraint.kind} constraint")
        if params.logprobs is not None:
            raise UnsupportedParameterError(
                "logprobs", f"the openai backend of {self.model!r} does not pass "
                "log-probabilities through")
        if params.stop_token_ids:
            raise UnsupportedParameterError(
                "stop_token_ids", f"the openai backend of {self.model!r} has no token ids "
                "of the upstream's vocabulary; use stop strings")

    def _client(self) -> httpx.AsyncClient:
        """The connection pool of the running event loop (a pool is bound to its loop; code
        that embeds a deployment may call from several loops, one after another)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            self._http = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)
            self._http_loop = loop
        return self._http

    async def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     constraint: ConstraintSpec | None = None) -> GenerationStream:
        if self._state is not EngineState.READY:
            raise EngineUnavailableError(f"{self.model} replica {self.replica_id} "
                                         f"({self.base_url}) is down")
        if not prompt_token_ids:
            raise ValueError("the prompt must hold at least one token")
        self._refuse_what_cannot_pass(params, constraint)
        check_length(len(prompt_token_ids), params.max_tokens, self.info().max_seq_len)
        path, body = self._body(prompt_token_ids, params, constraint)
        waited = await self.wait_for_room()  # the manifest's max_num_seqs and max_queue
        try:
            started = time.perf_counter()
            response = await self._open(path, body)
        except BaseException:
            self.give_back_room()  # it never ran
            raise
        rid = next(self._ids)
        stream = self.new_stream(rid, len(prompt_token_ids))
        stream.queue.put_nowait(ADMITTED)
        self._tasks[rid] = asyncio.create_task(
            self._relay(rid, response, stream, started, waited))
        return stream

    async def _open(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """The upstream's streamed response, its status 200; raises what it refused."""
        client = self._client()
        try:
            response = await client.send(
                client.build_request("POST", f"{self.base_url}/{path}", json=body),
                stream=True)
        except httpx.TimeoutException as e:
            raise EngineUnavailableError(f"{self.base_url} did not answer in time: "
                                         f"{type(e).__name__}") from None
        except httpx.TransportError as e:
            self.mark_down(f"{self.base_url}: {type(e).__name__}: {e}")
            raise EngineUnavailableError(f"{self.model} replica {self.replica_id} "
                                         f"({self.base_url}) is down: {e}") from None
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            self._refuse(response)
        return response

    def _refuse(self, response: httpx.Response) -> None:
        message, param = _error_text(response)
        said = f"{self.base_url} answered {response.status_code}: {message}"
        if response.status_code == 429:
            self.count_rejected("queue_full")
            raise QueueFullError(said, _retry_after(response))
        if 400 <= response.status_code < 500:
            raise UnsupportedParameterError(param or "messages", said)
        # 5xx: the server failed this request, not the client; a 503 asks it to try again
        # (Laya's own 500 is kept for its own faults).
        raise EngineUnavailableError(said, _retry_after(response))

    def cancel(self, request_id: int) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()  # closes the upstream response (the task's finally)

    async def _relay(self, rid: int, response: httpx.Response, stream: GenerationStream,
                     started: float, waited: float) -> None:
        """Read the upstream's SSE chunks into the request's stream."""
        first: float | None = None
        pieces = 0
        usage: dict[str, Any] | None = None
        finish: FinishReason | None = None
        final: TokenEvent | None = None
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    raise RuntimeError(f"the upstream failed: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    text = delta.get("content") if "delta" in choice else choice.get("text")
                    if text:
                        first = first or time.perf_counter()
                        pieces += 1
                        stream.queue.put_nowait(TokenEvent(text, ()))
                    if choice.get("finish_reason"):
                        finish = _FINISH.get(choice["finish_reason"], FinishReason.STOP)
            if finish is None:
                raise httpx.RemoteProtocolError("the upstream's stream ended without a "
                                                "finish reason")
            end = time.perf_counter()
            first = first or end
            took = end - started
            timing = Timing(queue_s=waited, prefill_s=first - started, decode_s=end - first,
                            layers=((UPSTREAM, took),))
            counted = Usage(
                int((usage or {}).get("prompt_tokens", stream.num_prompt_tokens)),
                int((usage or {}).get("completion_tokens", pieces)),
                int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
                    or 0))
            final = TokenEvent("", (), finish, timing=timing, usage=counted)
        except asyncio.CancelledError:
            final = TokenEvent("", (), FinishReason.CANCELLED)
        except httpx.TimeoutException as e:
            final = TokenEvent("", (), FinishReason.ERROR,
                               error=f"{self.base_url} timed out: {type(e).__name__}")
        except httpx.TransportError as e:  # the server went away: so does this replica
            why = f"{self.base_url} broke off the response: {type(e).__name__}: {e}"
            self.mark_down(why)
            final = TokenEvent("", (), FinishReason.ERROR, error=why, replica_lost=True)
        except Exception as e:  # noqa: BLE001 - ends this request, not the replica
            final = TokenEvent("", (), FinishReason.ERROR,
                               error=f"{self.base_url}: {type(e).__name__}: {e}")
        finally:
            await response.aclose()  # a cancelled request closes its upstream request
            self._tasks.pop(rid, None)
            self.add_layer_seconds(UPSTREAM, time.perf_counter() - started)
            if final is None:
                final = TokenEvent("", (), FinishReason.ERROR, error="interrupted")
            if final.usage is None:  # ended early: what arrived, as the engine counts it
                final = attrs.evolve(final, usage=Usage(stream.num_prompt_tokens, pieces))
            reason = final.finish_reason or FinishReason.ERROR
            self.count_finished(reason, final.usage.completion_tokens if final.usage
                                else pieces)
            stream.queue.put_nowait(final)

    def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        self._http = None  # its loop is closing; its connections go with it
