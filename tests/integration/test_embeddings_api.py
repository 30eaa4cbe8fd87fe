"""/v1/embeddings on a real server of the embedded model, through the official openai client,
on each backend (the session's ``smollm_server``)."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from conftest import ServerProcess

TEXTS = ["The capital of France is Paris.", "A cat sat on the mat."]
HIDDEN_SIZE = 576  # SmolLM2-135M


@pytest.fixture(scope="module")
def client(smollm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="unused",
                       max_retries=0) as client:
        yield client


def test_embeddings_of_texts_and_token_ids(smollm_server: ServerProcess,
                                          client: openai.OpenAI) -> None:
    r = client.embeddings.create(model="smollm2", input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == "smollm2"
    assert [d.index for d in r.data] == [0, 1] and all(d.object == "embedding" for d in r.data)
    vectors = np.array([d.embedding for d in r.data])
    assert vectors.shape == (2, HIDDEN_SIZE)
    assert np.linalg.norm(vectors, axis=1) == pytest.approx([1, 1], abs=1e-5)
    assert float(vectors[0] @ vectors[1]) < 0.95  # two texts, two directions
    ids = httpx.post(f"{smollm_server.url}/tokenize",
                     json={"model": "smollm2", "prompt": TEXTS[0]}).json()["tokens"]
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(ids)
    by_ids = client.embeddings.create(model="smollm2", input=[ids], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(r.data[0].embedding, abs=1e-6)
    assert by_ids.usage.prompt_tokens == len(ids)


def test_base64_is_what_the_client_decodes(client: openai.OpenAI) -> None:
    # The client asks for base64 by default and decodes it to floats itself.
    decoded = client.embeddings.create(model="smollm2", input=TEXTS[0])
    floats = client.embeddings.create(model="smollm2", input=TEXTS[0], encoding_format="float")
    assert decoded.data[0].embedding == floats.data[0].embedding
    raw = client.embeddings.with_raw_response.create(model="smollm2", input=TEXTS[0],
                                                     encoding_format="base64").http_response
    data = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert np.frombuffer(data, "<f4").tolist() == floats.data[0].embedding


def test_refusals_name_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="smollm2", input="hi", dimensions=64)
    assert e.value.body["param"] == "dimensions"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="smollm2", input=["hi", [100] * 1025])
    body = e.value.body
    assert body["param"] == "input[1]"  # type: ignore[index]
    assert "1025 tokens" in body["message"] and "1024" in body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="smollm2", input=[[1, 49152]])
    assert e.value.body["param"] == "input[0]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="smollm2", input="")
    assert e.value.body["param"] == "input"  # type: ignore[index]


def test_generation_beside_embeddings_is_undisturbed(client: openai.OpenAI) -> None:
    """Greedy completions while embed requests run on the same replica give the text they
    give alone: an embedding runs between steps, in a context (or scratch KV) of its own."""
    def complete() -> str:
        return client.completions.create(model="smollm2", prompt="The capital of France is",
                                         max_tokens=8, temperature=0).choices[0].text

    alone = complete()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        embeds = [pool.submit(client.embeddings.create, model="smollm2",
                              input=[f"text number {i}", TEXTS[1]]) for i in range(4)]
        texts = [pool.submit(complete) for _ in range(2)]
        assert [t.result() for t in texts] == [alone, alone]
        assert all(len(e.result().data) == 2 for e in embeds)
