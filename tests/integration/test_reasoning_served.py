"""A reasoning model's output split from its answer, through a real server: copies of the
embedded model under DeepSeek-R1's published chat template (its generation prompt opens
``<think>``) and under a small Qwen3-style one of the test's (the model opens the block;
``enable_thinking = false`` closes it in the prompt). The small model knows neither, so its
text stays reasoning until a constraint or a thinking budget ends it; what is checked is
where Laya puts each part, whole and streamed, and that a response format holds the answer
only, after the reasoning."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerProcess, serving
from hostile_gguf import FAMILY_CONTROLS, embedded, with_metadata, with_tokens

TEMPLATES = Path(__file__).parent.parent / "chat_templates"
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Is 7 a prime number? Answer in JSON."}]
SCHEMA = {"type": "object", "properties": {"prime": {"type": "boolean"}},
          "required": ["prime"], "additionalProperties": False}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("reasoning")
    r1 = with_metadata(embedded(), tmp / "r1.gguf", "tokenizer.chat_template",
                       (TEMPLATES / "deepseek_r1.jinja").read_text(), "str")
    q3 = with_metadata(embedded(), tmp / "q3.gguf", "tokenizer.chat_template", QWEN3_LIKE,
                       "str")
    oss = with_metadata(embedded(), tmp / "oss.gguf", "tokenizer.chat_template",
                        (TEMPLATES / "harmony.jinja").read_text(), "str")
    # gpt-oss's markup as control tokens, as its own vocabulary has it.
    oss_controls = with_tokens(oss, tmp / "oss-controls.gguf", FAMILY_CONTROLS)
    text = '[server]\nhost = "127.0.0.1"\nport = {port}\n'
    for name, path in (("oss", oss), ("oss-controls", oss_controls), ("r1", r1), ("q3", q3)):
        text += (f'\n[[models]]\nname = "{name}"\nbackend = "llamacpp"\npath = "{path}"\n'
                 "max_seq_len = 1024\nmax_num_seqs = 2\n")
    text += "max_reasoning_tokens = 10\n"  # q3's default thinking budget
    with serving(text, tmp) as s:
        yield s


def chat(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": ASK, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]  # type: ignore[no-any-return]


def streamed(server: ServerProcess, **fields: Any) -> tuple[str, str]:
    reasoning, content = "", ""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": ASK, "temperature": 0, "stream": True, **fields}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    return reasoning, content


def tokens(server: ServerProcess, text: str) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"model": "r1", "prompt": text,
                                                   "add_special_tokens": False})
    return int(r.json()["count"])


def test_an_open_block_makes_the_output_reasoning_until_it_ends(server: ServerProcess) -> None:
    choice = chat(server, model="r1", max_tokens=12)
    message = choice["message"]
    assert message["reasoning_content"], message  # no </think> came: all of it reasoning
    assert message["content"] == ""
    assert streamed(server, model="r1", max_tokens=12) == (message["reasoning_content"], "")


def test_a_response_format_holds_the_answer_after_a_budgeted_reasoning(
        server: ServerProcess) -> None:
    fields = {"model": "r1", "max_tokens": 60, "max_reasoning_tokens": 10,
              "response_format": JSON_FORMAT}
    message = chat(server, **fields)["message"]
    reasoning, answer = message["reasoning_content"], message["content"]
    assert reasoning and tokens(server, reasoning) <= 11, reasoning  # the budget ended it
    assert isinstance(json.loads(answer)["prime"], bool), answer  # the JSON, and only it
    assert streamed(server, **fields) == (reasoning, answer)


def usage_of(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}{path}", timeout=120, json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_the_usage_counts_the_reasoning_tokens(server: ServerProcess) -> None:
    """completion_tokens_details.reasoning_tokens (chat) and output_tokens_details
    (responses): every token of an output that stays reasoning; of a budgeted reasoning
    and its JSON answer, the reasoning's tokens (its closing markup included), whole and
    streamed alike."""
    all_reasoning = usage_of(server, "/v1/chat/completions", {
        "model": "r1", "messages": ASK, "max_tokens": 12, "temperature": 0})["usage"]
    assert all_reasoning["completion_tokens_details"]["reasoning_tokens"] == \
        all_reasoning["completion_tokens"] == 12
    fields = {"model": "r1", "messages": ASK, "max_tokens": 60, "temperature": 0,
              "max_reasoning_tokens": 10, "response_format": JSON_FORMAT}
    body = usage_of(server, "/v1/chat/completions", fields)
    usage, message = body["usage"], body["choices"][0]["message"]
    counted = usage["completion_tokens_details"]["reasoning_tokens"]
    assert tokens(server, message["reasoning_content"]) <= counted <= \
        tokens(server, message["reasoning_content"]) + 4, (counted, message)
    assert counted < usage["completion_tokens"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=120, json={
            **fields, "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[-1]["usage"] == usage
    responses = usage_of(server, "/v1/responses", {
        "model": "r1", "input": ASK[0]["content"], "max_output_tokens": 12,
        "temperature": 0})["usage"]
    assert responses["output_tokens_details"]["reasoning_tokens"] == \
        responses["output_tokens"] == 12


def test_the_template_hears_chat_template_kwargs(server: ServerProcess) -> None:
    off = chat(server, model="q3", max_tokens=40, response_format=JSON_FORMAT,
               chat_template_kwargs={"enable_thinking": False})["message"]
    assert off.get("reasoning_content") is None  # the prompt closed the block
    assert isinstance(json.loads(off["content"])["prime"], bool)
    budget = chat(server, model="q3", max_tokens=40, max_reasoning_tokens=5,
                  response_format=JSON_FORMAT)["message"]
    assert isinstance(json.loads(budget["content"])["prime"], bool)  # no reasoning leaks in


@pytest.mark.parametrize(("fields", "param"), [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"max_reasoning_tokens": 0}, "max_reasoning_tokens"),
])
def test_bad_reasoning_fields_are_named(server: ServerProcess, fields: dict[str, Any],
                                        param: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "q3", "messages": ASK, "max_tokens": 2, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def sse(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}{path}", timeout=120, json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_responses_give_the_reasoning_an_item_of_its_own(server: ServerProcess) -> None:
    body = {"model": "q3", "input": ASK[0]["content"], "max_output_tokens": 60,
            "temperature": 0, "reasoning": {"effort": "low"},
            "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}}
    r = httpx.post(f"{server.url}/v1/responses", timeout=120, json=body)
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    assert [item["type"] for item in output][-1] == "message"
    message = output[-1]
    answer = message["content"][0]["text"]
    assert message["type"] == "message" and isinstance(json.loads(answer)["prime"], bool)
    events = sse(server, "/v1/responses", {**body, "stream": True})
    said = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    done = next(e for e in events if e["type"] == "response.completed")["response"]
    assert [item["type"] for item in done["output"]] == [item["type"] for item in output]
    assert done["output"][-1]["content"][0]["text"] == answer
    if output[0]["type"] == "reasoning":  # the model opened a block (within q3's budget)
        assert output[0]["content"][0]["text"] and said == output[0]["content"][0]["text"]


def test_messages_give_the_thinking_a_block_with_its_budget(server: ServerProcess) -> None:
    body = {"model": "r1", "messages": ASK, "max_tokens": 40, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 6}}
    r = httpx.post(f"{server.url}/v1/messages", timeout=120, json=body)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert blocks[0]["type"] == "thinking" and tokens(server, blocks[0]["thinking"]) <= 7
    events = sse(server, "/v1/messages", {**body, "stream": True})
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts[0] == "thinking"
    thought = "".join(e["delta"]["thinking"] for e in events
                      if e["type"] == "content_block_delta"
                      and e["delta"]["type"] == "thinking_delta")
    assert thought == blocks[0]["thinking"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    assert text == "".join(b.get("text", "") for b in blocks[1:])
    # Past thinking stays out of the prompt: a conversation that holds it is counted alike.
    count = f"{server.url}/v1/messages/count_tokens"
    plain = [*ASK, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "?"}]
    with_thinking = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "7 has no divisors", "signature": ""},
        {"type": "text", "text": "Yes."}]}, {"role": "user", "content": "?"}]
    assert httpx.post(count, json={"model": "r1", "messages": with_thinking}).json() == \
        httpx.post(count, json={"model": "r1", "messages": plain}).json()


def test_responses_stream_the_reasoning_item(server: ServerProcess) -> None:
    body = {"model": "r1", "input": ASK[0]["content"], "max_output_tokens": 12,
            "temperature": 0}
    r = httpx.post(f"{server.url}/v1/responses", timeout=120, json=body)
    assert r.status_code == 200, r.text
    reasoning = r.json()["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"]
    events = sse(server, "/v1/responses", {**body, "stream": True})
    said = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert said == reasoning["content"][0]["text"]
    done = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert len(done) == 1 and done[0]["text"] == said


@pytest.mark.parametrize("model", ["oss", "oss-controls"])
def test_harmony_reasoning_then_the_answer_in_the_final_channel(server: ServerProcess,
                                                               model: str) -> None:
    """gpt-oss's channels: with a thinking budget and a constraint, at most the budget of
    analysis (the grammar then writes the message's end and the final channel), and the
    constrained answer in the final channel, markup left out; streamed as whole. The
    channel markup is text in one copy and control tokens in the other."""
    fields = {"model": model, "max_tokens": 60, "max_reasoning_tokens": 5,
              "guided_regex": "(yes|no)"}
    message = chat(server, **fields)["message"]
    assert message["content"] in ("yes", "no"), message
    reasoning = message["reasoning_content"] or ""
    assert "<|" not in reasoning and tokens(server, reasoning) <= 5, message
    assert streamed(server, **fields) == (reasoning, message["content"])
    answer = chat(server, model=model, max_tokens=80, max_reasoning_tokens=5,
                  response_format=JSON_FORMAT)
    assert answer["finish_reason"] == "stop", answer
    assert set(json.loads(answer["message"]["content"])) == {"prime"}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": ASK, "max_tokens": 2, "max_reasoning_tokens": 5,
        "tools": [{"type": "function", "function": {
            "name": "f", "description": "F.",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_reasoning_tokens", r.text
