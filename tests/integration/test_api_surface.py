"""The wider OpenAI surface against the real server: choices, log-probabilities, echo,
penalties, tokenization, model lookup, metrics and cancellation."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import ServerProcess
from laya_backend_llamacpp.cpu import read_cpuinfo


@pytest.fixture(scope="module")
def client(smollm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="x", max_retries=0) as c:
        yield c


# serial: a seeded repeat is exact while the server's auto thread count stays put, which
# it does only with every core free.
@pytest.mark.serial
def test_n_choices_differ_and_usage_adds_up(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=12,
                                  temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3
    assert r.usage is not None and r.usage.prompt_tokens == 4
    assert r.usage.completion_tokens == 36
    again = client.completions.create(model="smollm2", prompt="Once upon a time",
                                      max_tokens=12, temperature=1.0, seed=5, n=3)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_streamed_choices_arrive_interleaved_and_complete(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say something."}],
        max_tokens=10, temperature=0.9, seed=1, n=2, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert item.top_logprobs[0].token == item.token  # greedy takes the likeliest
        assert math.isclose(item.top_logprobs[0].logprob, item.logprob)
    assert "".join(i.token for i in content) == r.choices[0].message.content


def test_completion_logprobs_echo_and_prompt_lists(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith("The capital of France is Paris")
    lp = choice.logprobs  # the prompt's 5 tokens (the first unscored), then the 3 generated
    assert lp is not None and len(lp.tokens or []) == 5 + 3
    assert lp.top_logprobs and lp.top_logprobs[0] is None
    # The 2 likeliest and the chosen token, when it is not one of them.
    assert all(len(t) in (2, 3) and tok in t
               for tok, t in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True))
    assert lp.text_offset and lp.text_offset[0] == 0
    assert lp.text_offset[5] == len("The capital of France is")
    many = client.completions.create(model="smollm2", prompt=["1, 2, 3,", "a, b, c,"],
                                     max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text != many.choices[1].text


def test_penalties_change_a_repetitive_output(client: openai.OpenAI) -> None:
    prompt = "1, 2, 3, 4, 5,"
    plain = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16,
                                      temperature=0).choices[0].text
    penalised = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16,
                                          temperature=0, frequency_penalty=2.0,
                                          presence_penalty=1.0).choices[0].text
    assert penalised != plain
    assert penalised.count(",") < plain.count(",")


def test_tokenize_detokenize_and_model_lookup(smollm_server: ServerProcess,
                                              client: openai.OpenAI) -> None:
    url = smollm_server.url
    t = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 1024
    back = httpx.post(f"{url}/detokenize", json={"model": "smollm2", "tokens": t["tokens"]})
    assert back.json() == {"prompt": "Hello world"}
    messages = [{"role": "user", "content": "Hi there"}]
    counted = httpx.post(f"{url}/tokenize", json={"model": "smollm2", "messages": messages})
    usage = client.chat.completions.create(model="smollm2", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=1).usage
    assert usage is not None and counted.json()["count"] == usage.prompt_tokens
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    bad = httpx.post(f"{url}/detokenize", json={"model": "smollm2", "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_fields_that_would_change_output_are_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x"}],
            functions=[{"name": "f", "parameters": {}}])  # OpenAI's deprecated tools
    assert e.value.body["param"] == "functions"  # type: ignore[index]


def test_metrics_expose_layers_and_cache(smollm_server: ServerProcess,
                                         client: openai.OpenAI) -> None:
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    text = httpx.get(f"{smollm_server.url}/metrics").text
    for name in ("laya:time_to_first_token_seconds_count", "laya:request_queue_time_seconds",
                 "laya:request_prefill_time_seconds", "laya:request_decode_time_seconds",
                 "laya:router_decision_seconds", "laya:kv_cache_usage_perc",
                 "laya:num_requests_waiting", "laya:prompt_tokens_total",
                 "laya:generation_tokens_total", "laya:memory_budget_bytes",
                 "laya:kv_cache_pool_bytes", "laya:request_rejections_total"):
        assert name in text, name


def test_dropped_streams_free_the_cache(smollm_server: ServerProcess) -> None:
    """12 streams on 8 slots: some run, some wait; all are dropped part-way."""
    async def drop_after(client: httpx.AsyncClient, i: int, lines: int) -> None:
        body = {"model": "smollm2", "prompt": f"Tell a long story number {i}.",
                "max_tokens": 400, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data:")
                if seen >= lines:
                    return  # leaving the block closes the connection

    async def go() -> None:
        async with httpx.AsyncClient(base_url=smollm_server.url, timeout=60) as client:
            runners = [asyncio.create_task(drop_after(client, i, 3)) for i in range(8)]
            await asyncio.sleep(0.5)
            waiters = [asyncio.create_task(drop_after(client, i, 10**6)) for i in range(8, 12)]
            await asyncio.gather(*runners)
            await asyncio.sleep(0.2)
            for task in waiters:  # these were queued or just admitted: drop them too
                task.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)

    asyncio.run(go())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        (replica,) = httpx.get(f"{smollm_server.url}/ready").json()["replicas"]
        if replica["running"] == replica["waiting"] == replica["kv_cache_used_tokens"] == 0:
            break
        time.sleep(0.1)
    assert replica["running"] == 0 and replica["waiting"] == 0
    assert replica["kv_cache_used_tokens"] == 0
    assert httpx.get(f"{smollm_server.url}/health").status_code == 200


def test_seeded_sampling_is_the_same_beside_other_requests(smollm_server: ServerProcess,
                                                          client: openai.OpenAI) -> None:
    body = {"model": "smollm2", "prompt": "My favourite animal is", "max_tokens": 16,
            "temperature": 1.0, "top_p": 0.95, "seed": 42}
    alone = client.completions.create(**body).choices[0].text  # type: ignore[call-overload]

    async def crowd() -> list[str]:
        async with httpx.AsyncClient(base_url=smollm_server.url, timeout=60) as c:
            others = [c.post("/v1/completions", json={**body, "seed": s, "prompt": f"Noise {s}"})
                      for s in range(7)]
            results = await asyncio.gather(c.post("/v1/completions", json=body), *others)
            return [r.json()["choices"][0]["text"] for r in results]

    assert asyncio.run(crowd())[0] == alone


def test_stop_token_ids_and_ignore_eos(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="smollm2", prompt="The capital of France is",
                                      max_tokens=8, temperature=0, logprobs=0)
    tokens = plain.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens and tokens[0] == " Paris"
    tid = httpx.post(f"{client.base_url}".replace("/v1/", "/tokenize"),
                     json={"model": "smollm2", "prompt": " Paris",
                           "add_special_tokens": False}).json()["tokens"]
    stopped = client.completions.create(model="smollm2", prompt="The capital of France is",
                                        max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": tid})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    chat = [{"role": "user", "content": "Say hi."}]
    full = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=40,  # type: ignore[arg-type]
                                          temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length"


def test_ready_and_the_start_up_log_say_how_the_backend_runs(
        smollm_server: ServerProcess) -> None:
    (replica,) = httpx.get(f"{smollm_server.url}/ready").json()["replicas"]
    runtime = replica["runtime"]
    line = next(x for x in smollm_server.log().splitlines() if "smollm2 replica 0 ready" in x)
    if smollm_server.backend == "torch":
        assert runtime["device"] == "cpu" and runtime["dtype"] in ("float32", "bfloat16")
        assert runtime["dtype_reason"].startswith("auto: the CPU")
        assert 1 <= runtime["n_threads"] <= runtime["n_threads_max"]
        assert runtime["n_threads_mode"] == "auto" and runtime["checkpoint"].startswith("GGUF")
        assert f"dtype {runtime['dtype']}" in line and "n_threads " in line
        return
    host = read_cpuinfo()
    assert runtime["cpu"] == host.model and runtime["cpu_flags"] == host.notable_flags
    assert isinstance(runtime["repack"], bool) and runtime["repack_reason"]
    assert set(runtime["weight_buffer_bytes"]) <= {"CPU", "CPU_Mapped"}  # never AMX here
    assert 1 <= runtime["n_threads"] <= runtime["n_threads_max"]
    assert runtime["n_threads_mode"] == "auto"
    assert host.model in line and "weight_buffer_bytes CPU" in line and "repack " in line
