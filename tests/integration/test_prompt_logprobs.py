"""Prompt log-probabilities against the real server: echo with logprobs (OpenAI's legacy
API, what lm-evaluation-harness scores choices with) and vLLM's ``prompt_logprobs``, checked
against the model's own distribution computed apart, in this process, by the server's
backend's own library: llama-cpp-python, or the torch backend's model run in one pass.

The server runs with the options for exact repeatability (docs/architecture.md,
"Determinism"), so that a request's neighbours can be checked bit for bit.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from conftest import SMOLLM_BACKENDS, ServerProcess, repeatable_server, runtime

from laya_core.builtin.model_paths import embedded_file
from laya_core.kv.hashing import BLOCK_SIZE

# Long enough to be scored in three chunks (memory_plan.MAX_SCORED_TOKENS_PER_STEP = 128).
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
         "mended his nets every morning and told stories to the children every evening. ") * 9
# The server and the reference batch the prompt differently (chunks of 128 against one
# pass, other thread counts, other rows beside it). With flash attention off
# llama.cpp's CPU kernels give the same logits either way here (measured, AMD EPYC: 3e-15
# apart, the float64 arithmetic of the log-softmax); the margin is for CPUs whose kernels
# differ. torch's 16-bit and integer kernels promise a row the same bits in any batch
# (/ready's batch_invariant), so its reference is held to the same margin.
TOLERANCE = 1e-4
Reference = Callable[[list[int]], np.ndarray]  # tokens -> log_softmax [tokens, vocab]


@pytest.fixture(scope="module", params=SMOLLM_BACKENDS)
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    backend = request.param
    with repeatable_server(backend, tmp_path_factory.mktemp(f"prompt_logprobs_{backend}")) as s:
        yield s


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> Iterator[Reference]:
    """log_softmax of the model's logits at every position of a prompt, from the server's
    backend run apart, in this process."""
    if server.backend == "torch":
        settings = runtime(server)
        yield torch_reference(settings["dtype"], settings["quantize"])
        return
    from laya_backend_llamacpp.reference import reference_llama

    # The high-level API with logits for all rows, one thread (this is pytest's thread).
    llm = reference_llama(embedded_file("smollm2-135m-instruct"), n_ctx=512, n_batch=512,
                          n_threads=1, n_threads_batch=1, logits_all=True, flash_attn=False,
                          verbose=False)

    def log_softmax(tokens: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(tokens)
        x = np.array(llm.scores[: len(tokens)], dtype=np.float64)  # [tokens, vocab]
        peak = x.max(axis=1, keepdims=True)
        return x - peak - np.log(np.exp(x - peak).sum(axis=1, keepdims=True))

    yield log_softmax
    llm.close()


def torch_reference(dtype: str, quantize: str) -> Reference:
    """The torch backend's model in the server's dtype and quantization with its default
    f16 KV cache, each prompt in one pass of every row."""
    import torch
    from laya_backend_torch.checkpoint import open_checkpoint
    from laya_backend_torch.batch import build_batch
    from laya_backend_torch.model import LlamaModel

    checkpoint = open_checkpoint(embedded_file("smollm2-135m-instruct"))
    tensors = checkpoint.tensors(as_stored=quantize == "int4")  # as the backend reads them
    model = LlamaModel(checkpoint.config, tensors, getattr(torch, dtype),
                       torch.device("cpu"), quantize=quantize, max_positions=512,
                       attention_dtype=torch.float64)  # as the server's deterministic
    block_size = BLOCK_SIZE
    model.allocate_kv(512, torch.float16)

    def log_softmax(tokens: list[int]) -> np.ndarray:
        batch = build_batch([(tokens, 0, list(range(512 // block_size)))],
                            list(range(len(tokens))), block_size)
        with torch.inference_mode():
            return torch.log_softmax(model.forward(batch).double(), dim=-1).numpy()

    return log_softmax


def tokenize(server: ServerProcess, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": "smollm2", "prompt": text})
    return list(r.json()["tokens"])


def complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/completions", timeout=300,
                   json={"model": "smollm2", **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def ranked_top(entry: dict[str, Any], num_top: int) -> list[tuple[int, int, float]]:
    """The ``num_top`` likeliest of a position's entry, (rank, token, logprob), checked to be
    ranked by log-probability. Tokens of equal log-probability may take their ranks in any
    order among themselves: bfloat16 logits give such ties often, llama.cpp's hardly."""
    top = sorted((e["rank"], int(t), e["logprob"]) for t, e in entry.items())[:num_top]
    assert len(top) == num_top and top[0][0] == 1 and top[-1][0] <= num_top, entry
    logprobs = [e["logprob"] for e in entry.values()]
    for rank, _, logprob in top:
        assert 1 + sum(x > logprob for x in logprobs) <= rank \
            <= sum(x >= logprob for x in logprobs), entry
    return top


def prefix_hits(server: ServerProcess) -> int:
    (replica,) = httpx.get(f"{server.url}/ready").json()["replicas"]
    return int(replica["prefix_cache_hits"])


def test_prompt_logprobs_are_the_models_own(server: ServerProcess,
                                            reference: Reference) -> None:
    tokens = tokenize(server, STORY)
    assert len(tokens) > 2 * 128
    expected = reference(tokens)  # row p predicts token p + 1
    body = complete(server, prompt=STORY, max_tokens=1, temperature=0, prompt_logprobs=5)
    got = body["choices"][0]["prompt_logprobs"]
    assert len(got) == len(tokens) and got[0] is None
    worst = 0.0
    for p, (token, entry) in enumerate(zip(tokens[1:], got[1:], strict=True)):
        row = expected[p]
        mine = entry[str(token)]
        worst = max(worst, abs(mine["logprob"] - row[token]))
        # Tokens within the tolerance of this one may fall either side of it.
        assert 1 + (row > row[token] + TOLERANCE).sum() <= mine["rank"] \
            <= 1 + (row > row[token] - TOLERANCE).sum()
        top = ranked_top(entry, 5)
        for _, t, logprob in top:
            assert abs(logprob - row[t]) <= TOLERANCE
        assert top[0][2] >= row.max() - TOLERANCE  # the likeliest is the likeliest
    assert worst <= TOLERANCE, worst


def test_the_lm_eval_harness_request(server: ServerProcess, reference: Reference) -> None:
    """lm-evaluation-harness ``local-completions`` scores a choice with exactly this body
    (token ids, a batch of them) and sums token_logprobs[ctxlen:-1]."""
    context = tokenize(server, "Question: what colour is the sky on a clear day? Answer:")
    choices = [tokenize(server, " blue"), tokenize(server, " green")]
    prompts = [context + choice for choice in choices]
    body = complete(server, prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                    seed=1234, echo=True)
    sums = []
    for choice, prompt in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts,
                              strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ctxlen = len(context)
        total = sum(lp["token_logprobs"][ctxlen:-1])
        row = reference(prompt)
        assert abs(total - sum(row[p - 1][prompt[p]] for p in range(ctxlen, len(prompt)))) \
            <= TOLERANCE * len(prompt)
        for token_lp, top in zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1],
                                 strict=True):
            assert len(top) in (1, 2) and token_lp <= max(top.values()) + 1e-9
        sums.append(total)
    assert sums[0] > sums[1]  # the sky is blue, even to a 135M model


def test_echo_shape(server: ServerProcess) -> None:
    prompt = "The capital of France is"
    tokens = tokenize(server, prompt)
    choice = complete(server, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                      echo=True)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(tokens) + 3
    assert "".join(lp["tokens"]) == choice["text"] and choice["text"].startswith(prompt)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(tokens)] == len(prompt)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert [choice["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"],
                                                         strict=True)] == lp["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    assert all(len(t) in (2, 3) and t[tok] == tok_lp for tok, tok_lp, t in
               zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:],
                   strict=True))
    # vLLM's extra field comes along, with as many alternatives as logprobs asked for.
    prompt_lp = choice["prompt_logprobs"]
    assert len(prompt_lp) == len(tokens) and prompt_lp[0] is None
    for p, entry in enumerate(prompt_lp[1:], start=1):
        assert entry[str(tokens[p])]["logprob"] == lp["token_logprobs"][p]
        assert entry[str(tokens[p])]["decoded_token"] == lp["tokens"][p]
        ranked_top(entry, 2)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server: ServerProcess) -> None:
    """As OpenAI's legacy API and vLLM: the prompt scored, nothing generated."""
    prompt = "The capital of France is"
    tokens = tokenize(server, prompt)
    body = complete(server, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    choice = body["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [choice["text"][o:o + len(t)] for o, t in zip(
        choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"], strict=True)]
    assert len(choice["logprobs"]["token_logprobs"]) == len(tokens)
    assert body["usage"] == {"prompt_tokens": len(tokens), "completion_tokens": 0,
                             "total_tokens": len(tokens),
                             "prompt_tokens_details": {"cached_tokens": 0}}
    scored = complete(server, prompt=prompt, max_tokens=1, logprobs=0, echo=True)
    assert scored["choices"][0]["logprobs"]["token_logprobs"][:-1] \
        == choice["logprobs"]["token_logprobs"]


def test_chat_prompt_logprobs_beside_the_choices(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=4, temperature=0, n=2, extra_body={"prompt_logprobs": 2})
    prompt_lp = r.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert r.usage is not None and len(prompt_lp) == r.usage.prompt_tokens
    assert prompt_lp[0] is None
    for entry in prompt_lp[1:]:
        ranked_top(entry, 2)
        assert len(entry) in (2, 3)
        assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str)
                   for e in entry.values())
    assert [c.message.content for c in r.choices][0] == r.choices[1].message.content


def test_a_cached_prompt_is_prefilled_again_to_be_scored(server: ServerProcess) -> None:
    prompt = STORY[:400]
    first = complete(server, prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=1)
    plain = complete(server, prompt=prompt, max_tokens=2, temperature=0)
    hits = prefix_hits(server)
    again = complete(server, prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=1)
    assert prefix_hits(server) == hits  # the cache held it; the scored request did not use it
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    assert again["choices"][0]["text"] == plain["choices"][0]["text"]
    complete(server, prompt=prompt, max_tokens=2, temperature=0)
    assert prefix_hits(server) == hits + 1  # and others still do


def test_a_scored_request_changes_nothing_beside_it(server: ServerProcess) -> None:
    """Neighbours decode bit for bit as alone, and the scored request is scored as alone."""
    def neighbour(i: int) -> tuple[str, list[float]]:
        choice = complete(server, prompt=f"Story number {i}: once upon a time", max_tokens=40,
                          temperature=0, logprobs=1)["choices"][0]
        return choice["text"], choice["logprobs"]["token_logprobs"]

    def scored() -> list[Any]:
        body = complete(server, prompt=STORY, max_tokens=8, temperature=0, prompt_logprobs=3)
        return [body["choices"][0]["text"], body["choices"][0]["prompt_logprobs"]]

    alone = [neighbour(i) for i in range(3)]
    scored_alone = scored()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(neighbour, i) for i in range(3)]
        beside = scored()
        assert [f.result() for f in others] == alone
    assert beside[0] == scored_alone[0]
    for mine, solo in zip(beside[1][1:], scored_alone[1][1:], strict=True):
        assert mine.keys() == solo.keys()
        for t in mine:
            assert abs(mine[t]["logprob"] - solo[t]["logprob"]) <= TOLERANCE


# Refused before they reach the model: one backend's server is enough.
@pytest.mark.parametrize("server", ["llamacpp"], indirect=True)
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1.5}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "prompt_logprobs": 99}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 0, "echo": True}, "max_tokens"),
])
def test_bad_values_are_400s_naming_the_field(server: ServerProcess, path: str,
                                              body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.url}{path}", json={"model": "smollm2", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
