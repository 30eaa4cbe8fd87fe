"""POST /v1/embeddings against the app in-process, with the toy backend's exact embeddings."""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from toy_backend import ToyBackend

from laya_core.config import manifest as mf
from laya_core.engine.embed_jobs import Embeddings, unit_float32
from laya_core.hookspecs import hookimpl
from laya_core.http import create_app
from laya_core.models.pooling import pooling_of_folder
from laya_core.plugins import load_registry
from laya_core.serving.deployment import Deployment


class PlainToy(ToyBackend):
    """The toy without the embedding capability: what a generation-only backend is."""

    name = "plain-toy"
    supports_embeddings = False


class Plugin:
    @hookimpl
    def register_backends(self, register):  # type: ignore[no-untyped-def]
        register("toy", ToyBackend)
        register("plain-toy", PlainToy)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    weights = tmp_path_factory.mktemp("toy") / "toy.bin"
    weights.write_bytes(b"")
    registry = load_registry([Plugin()])
    model = {"path": str(weights), "max_seq_len": 64, "max_num_seqs": 2,
             "options": {"step_delay_s": 0.002}}
    manifest = mf.resolve(mf.from_dict({"models": [
        {"name": "toy", "backend": "toy", "embeddings": True, **model},
        {"name": "plain", "backend": "plain-toy", **model}]}), registry)
    d = Deployment(manifest, registry)
    d.start()
    assert d.wait_ready(10)
    yield d
    d.stop()


def post(deployment: Deployment, body: Any, path: str = "/v1/embeddings") -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(deployment))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def toy_vector(text: str) -> list[float]:
    ids = list(text.encode())
    v = [0.0] * 8
    for t in ids + ids[-1:]:
        v[t % 8] += 1
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


def test_the_response_is_openais_shape(deployment: Deployment) -> None:
    r = post(deployment, {"model": "toy", "input": ["abc", "hello"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == ["object", "data", "model", "usage"]
    assert body["object"] == "list" and body["model"] == "toy"
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8}
    assert [d["index"] for d in body["data"]] == [0, 1]
    for d, text in zip(body["data"], ["abc", "hello"], strict=True):
        assert d["object"] == "embedding"
        assert d["embedding"] == pytest.approx(toy_vector(text), abs=1e-7)


@pytest.mark.parametrize("value", ["abc", [97, 98, 99], [[97, 98, 99]], ["abc"]])
def test_the_four_input_shapes_embed_alike(deployment: Deployment, value: Any) -> None:
    r = post(deployment, {"model": "toy", "input": value})
    assert r.status_code == 200, r.text
    (d,) = r.json()["data"]
    assert d["embedding"] == pytest.approx(toy_vector("abc"), abs=1e-7)


def test_base64_is_little_endian_float32(deployment: Deployment) -> None:
    floats = post(deployment, {"model": "toy", "input": "abc"}).json()["data"][0]["embedding"]
    r = post(deployment, {"model": "toy", "input": "abc", "encoding_format": "base64"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == floats


def test_vectors_have_unit_length() -> None:
    v = np.frombuffer(unit_float32([3.0, 4.0]), "<f4")
    assert v.tolist() == pytest.approx([0.6, 0.8]) and np.linalg.norm(v) == pytest.approx(1)
    assert np.frombuffer(unit_float32([0.0, 0.0]), "<f4").tolist() == [0.0, 0.0]


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"model": "toy", "input": ""}, "input", "empty_input"),
    ({"model": "toy", "input": []}, "input", "empty_input"),
    ({"model": "toy", "input": ["a", ""]}, "input[1]", "empty_input"),
    ({"model": "toy", "input": ["a", []]}, "input[1]", "empty_input"),
    ({"model": "toy", "input": 5}, "input", "invalid_type"),
    ({"model": "toy", "input": None}, "input", "invalid_type"),
    ({"model": "toy"}, "input", "missing"),
    ({"model": "toy", "input": ["a", 5]}, "input[1]", "invalid_type"),
    ({"model": "toy", "input": [[1, "x"]]}, "input[0][1]", "invalid_type"),
    ({"model": "toy", "input": [1, True]}, "input[1]", "invalid_type"),
    ({"model": "toy", "input": [-1]}, "input[0]", "invalid_value"),
    ({"model": "toy", "input": [True]}, "input[0]", "invalid_type"),
    ({"model": "toy", "input": [300]}, "input", "invalid_value"),
    ({"model": "toy", "input": ["a", [7, 257]]}, "input[1]", "invalid_value"),
    ({"model": "toy", "input": "x" * 65}, "input", "context_length_exceeded"),
    ({"model": "toy", "input": ["a", "x" * 65]}, "input[1]", "context_length_exceeded"),
    ({"model": "toy", "input": ["a"] * 2049}, "input", "invalid_value"),
    ({"model": "toy", "input": "a", "dimensions": 4}, "dimensions", "unsupported_parameter"),
    ({"model": "toy", "input": "a", "encoding_format": "int8"}, "encoding_format",
     "invalid_value"),
    ({"model": "toy", "input": "a", "user": 3}, "user", "invalid_type"),
    ({"input": "a"}, "model", "missing"),
    ({"model": "plain", "input": "a"}, "model", "embeddings_unsupported"),
    ([1, 2], "body", "invalid_type"),
])
def test_bad_requests_get_a_400_naming_the_field(deployment: Deployment, body: Any,
                                                 param: str, code: str) -> None:
    r = post(deployment, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code,
                                                               "invalid_request_error")


def test_too_long_says_the_numbers(deployment: Deployment) -> None:
    message = post(deployment, {"model": "toy", "input": "x" * 70}).json()["error"]["message"]
    assert "70 tokens" in message and "max_seq_len of 64" in message


def test_dimensions_and_unknown_models_are_refused_plainly(deployment: Deployment) -> None:
    r = post(deployment, {"model": "toy", "input": "a", "dimensions": 8})
    assert "not supported" in r.json()["error"]["message"]
    r = post(deployment, {"model": "nope", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = post(deployment, {"model": "plain", "input": "a"})
    assert "plain-toy backend" in r.json()["error"]["message"]


def test_embeddings_run_between_steps_and_leave_generation_exact(
        deployment: Deployment) -> None:
    """Generation and embeddings at once on one replica: every output is what each gives
    alone, and the router's count of outstanding requests goes back to zero."""
    backend = deployment.engines[0].backend
    assert isinstance(backend, ToyBackend)
    prompt = "the quick brown fox "

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(deployment))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            gens = [client.post("/v1/completions", json={
                "model": "toy", "prompt": prompt, "max_tokens": 30}) for _ in range(2)]
            embeds = [client.post("/v1/embeddings", json={
                "model": "toy", "input": [f"text {i}", "abc"]}) for i in range(4)]
            return list(await asyncio.gather(*gens, *embeds))

    before = len(backend.embedded)
    responses = go_result = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses), [r.text for r in go_result]
    for r in responses[:2]:
        assert r.json()["choices"][0]["text"] == (prompt * 3)[len(prompt):len(prompt) + 30]
    for i, r in enumerate(responses[2:]):
        vectors = [d["embedding"] for d in r.json()["data"]]
        assert vectors == [pytest.approx(toy_vector(t), abs=1e-7) for t in (f"text {i}", "abc")]
    assert len(backend.embedded) == before + 8
    state = deployment.clients[0].state()
    assert state.num_waiting == 0 and state.num_running == 0


def test_a_cancelled_job_is_skipped(deployment: Deployment) -> None:
    """An embed request cancelled while it waits behind another is never fed to the
    backend: the engine embeds the request before it and the one after it, and not one
    token of it, and the cancelled one leaves the replica's queue."""
    engine = deployment.engines[0]
    backend = engine.backend
    assert isinstance(backend, ToyBackend)
    ahead = [[1, 2]] * 100  # the toy takes one input per pass: 100 passes of 2 ms or more
    cancelled, after = [[3, 4, 5]], [[6, 7]]

    async def go() -> tuple[Embeddings, Embeddings]:
        first = engine.embed(ahead)
        doomed = engine.embed(cancelled)
        last = engine.embed(after)
        doomed.cancel()  # its caller went away while the first request was embedded
        return await first, await last

    fed_before, tokens_before = len(backend.embedded), engine.embedded_tokens
    first, last = asyncio.run(go())
    assert len(first.vectors) == len(ahead) and len(last.vectors) == len(after)
    assert backend.embedded[fed_before:] == ahead + after
    assert engine.embedded_tokens - tokens_before == sum(map(len, ahead + after))
    # The cancelled job leaves the queue on the engine's thread, soon after: wait for it.
    deadline = time.monotonic() + 30
    while deployment.clients[0].state().num_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deployment.clients[0].state().num_waiting == 0


def test_sentence_transformers_pooling_is_read(tmp_path: Any) -> None:
    assert pooling_of_folder(tmp_path) is None
    (tmp_path / "modules.json").write_text(
        '[{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]')
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        '{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false}')
    assert pooling_of_folder(tmp_path) == "mean"
