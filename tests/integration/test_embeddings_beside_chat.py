"""Embeddings share a replica with generation, on the embedded model and each backend: a
large embed request leaves a concurrent chat a step after every quarter of
``max_step_tokens`` of embedding; many one-token inputs go through batched passes, with
the vectors they get alone, and longer ones with vectors that agree; and an HTTP client that goes away stops the replica's work, on
a thread and in a worker process. Counted in the engine's calls and embedded tokens, never
in seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import SMOLLM_BACKENDS, serving

from laya_core.backend import StepItem
from laya_core.config import manifest as mf
from laya_core.engine.embed_jobs import EmbedPlan
from laya_core.engine.embed_queue import embed_budget
from laya_core.engine.engine import Engine
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment
from laya_core.types import SamplingParams

pytestmark = pytest.mark.model

STEP = 32  # max_step_tokens: the budget a step shares with embedding
MAX_TOKENS = 4  # the chat's: one prefill step, then three decodes


def model(backend: str) -> dict[str, object]:
    return {"name": "smollm2", "backend": backend, "path": "embedded:smollm2-135m-instruct",
            "max_seq_len": 512, "max_num_seqs": 2, "max_step_tokens": STEP,
            "embeddings": True, "options": {"n_threads": 1}}


@pytest.fixture(scope="module", params=SMOLLM_BACKENDS)
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    registry = load_registry()
    d = Deployment(mf.resolve(mf.from_dict({"models": [model(request.param)]}), registry),
                   registry)
    d.start()
    assert d.wait_ready(120), [c.state().error for c in d.clients]
    yield d
    d.stop()


def texts(num: int, tokens: int) -> list[list[int]]:
    """``num`` inputs of ``tokens`` token ids each, all different."""
    return [[1000 + (7 * i + 13 * j) % 20000 for j in range(tokens)] for i in range(num)]


async def wait_for(condition: object, what: str) -> None:
    for _ in range(12000):  # the engine's progress decides, not a deadline; 20 min at most
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


@contextlib.contextmanager
def recording(engine: Engine) -> Iterator[list[tuple[str, int]]]:
    """The engine thread's calls of its backend, in order, as ("step" or "embed", tokens):
    the real backend's methods, wrapped on the instance while the block runs."""
    backend, calls = engine.backend, []
    step, embed_step = backend.step, backend.embed_step

    def recorded_step(items: Sequence[StepItem]) -> Any:
        calls.append(("step", sum(len(i.tokens) for i in items)))
        return step(items)

    def recorded_embed(plan: EmbedPlan) -> Any:
        calls.append(("embed", plan.num_tokens))
        return embed_step(plan)

    backend.step, backend.embed_step = recorded_step, recorded_embed  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del backend.step, backend.embed_step


def test_a_chat_beside_a_large_embedding_gets_a_step_per_budget(
        deployment: Deployment) -> None:
    client, engine = deployment.clients[0], deployment.engines[0]

    async def go() -> bool:
        inputs = texts(8, 200)  # 1,600 tokens: 50 budgets
        before = client.state().embedded_tokens
        embedding = asyncio.ensure_future(client.embed(inputs))
        await wait_for(lambda: client.state().embedded_tokens > before, "embedding began")
        prompt = client.tokenizer().encode("The capital of France is", add_special=True)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        events = [e async for e in await client.submit(prompt, params)]
        assert sum(len(e.token_ids) for e in events) == MAX_TOKENS
        chat_first = not embedding.done()
        result = await embedding
        assert len(result.vectors) == 8 and result.num_tokens == 1600
        return chat_first

    with recording(engine) as calls:
        chat_first = asyncio.run(go())
    assert chat_first  # the chat did not wait for the embedding to end
    steps = [i for i, (kind, _) in enumerate(calls) if kind == "step"]
    assert len(steps) == MAX_TOKENS  # its prefill, then a decode for each further token
    # Between two of the chat's steps, one pass of at most a quarter of the step's budget;
    # and one there always was: the two interleave step by step.
    between = [sum(n for _, n in calls[a + 1:b]) for a, b in zip(steps, steps[1:], strict=False)]
    assert all(0 < n <= embed_budget(STEP) == STEP // 4 for n in between), calls
    assert steps[-1] < len(calls) - 1 and calls[-1][0] == "embed"  # embedding went on after


def test_one_token_inputs_share_passes_and_embed_as_alone(deployment: Deployment) -> None:
    client, engine = deployment.clients[0], deployment.engines[0]
    assert isinstance(engine, Engine)
    inputs = [[t] for t in range(1000, 1512)]

    async def go() -> tuple[int, list[bytes], list[bytes]]:
        passes = engine.embed_passes
        batched = await client.embed(inputs)
        used = engine.embed_passes - passes
        alone = [(await client.embed([inputs[i]])).vectors[0] for i in (0, 77, 511)]
        return used, [batched.vectors[i] for i in (0, 77, 511)], alone

    used, batched, alone = asyncio.run(go())
    assert used == len(inputs) // embed_budget(STEP)  # a pass's worth each, not one each
    assert batched == alone  # the same bits: each attends to its own token alone


def test_inputs_of_many_lengths_batched_agree_with_alone(deployment: Deployment) -> None:
    """Inputs of 2 to 120 tokens in one request, cut into passes of a quarter budget
    beside each other, against each embedded alone. Their last digits move (here a cosine
    of 0.99984 at the least on llama.cpp, which sums an input's attention over other cells
    when it shares its buffer; 0.99993 on torch, whose float32 attention rounds by where an
    input was cut), far from another text's 0.45 to 0.71."""
    client = deployment.clients[0]
    rng = np.random.default_rng(7)
    inputs = [[int(t) for t in rng.integers(1000, 20000, n)] for n in rng.integers(2, 120, 16)]

    async def go() -> tuple[list[bytes], list[bytes]]:
        batched = await client.embed(inputs)
        alone = [(await client.embed([ids])).vectors[0] for ids in inputs]
        return list(batched.vectors), alone

    batched, alone = asyncio.run(go())
    cosines = [float(np.frombuffer(a, "<f4") @ np.frombuffer(b, "<f4"))
               for a, b in zip(batched, alone, strict=True)]
    assert min(cosines) >= 0.999, cosines


def http_embed_then_leave(server_url: str, inputs: list[list[int]],
                          client: httpx.Client) -> int:
    """POST an embed request, wait until the replica has begun it, then close the
    connection; returns the replica's embedded tokens from before it."""
    before = embedded(client)
    body = json.dumps({"model": "smollm2", "input": inputs}).encode()
    host, port = server_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    for _ in range(12000):
        if embedded(client) > before:
            break
        time.sleep(0.1)
    sock.close()
    return before


def embedded(client: httpx.Client) -> int:
    (replica,) = client.get("/ready").json()["replicas"]
    return int(replica["embedded_tokens"])


def chat(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={
        "model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_a_client_that_goes_away_stops_its_embedding(tmp_path: Path, engine: str) -> None:
    options = "\n".join(f"{k} = {json.dumps(v)}" for k, v in model("llamacpp").items()
                        if k != "options")
    manifest = (f'[server]\nhost = "127.0.0.1"\nport = {{port}}\n[cluster]\nengine = "{engine}"'
                f"\n[[models]]\n{options}\n[models.options]\nn_threads = 1\n")
    inputs = texts(16, 500)  # 8,000 tokens: 250 budgets
    with serving(manifest, tmp_path) as server, \
            httpx.Client(base_url=server.url, timeout=600) as client:
        before = http_embed_then_leave(server.url, inputs, client)
        # A chat goes through the engine after the cancel; once it is answered, nothing of
        # the embedding is left: a second chat later, the count has not moved.
        chat(client)
        stopped = embedded(client)
        chat(client)
        assert embedded(client) == stopped
        assert stopped - before < 8000 // 2, (before, stopped)
        (replica,) = client.get("/ready").json()["replicas"]
        assert replica["waiting"] == 0  # its place in the queue was given back
