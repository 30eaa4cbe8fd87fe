"""Tools with a typed answer through a real server of the embedded model, on each backend:
``tools`` beside ``response_format`` (chat) or ``text.format`` (Responses) means a call or
an answer in the format, and both are enforced. With the openai client, the OpenAI Agents
SDK (``output_type`` and a function tool) and pydantic-ai (``NativeOutput`` and a tool).

The model is tiny: the tests check that every output is one of the two valid forms, not
that it chose well."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from conftest import ServerProcess

ASK = [{"role": "user", "content": "What is the largest city in France? Use a tool if "
        "you need one."}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                         "population": {"type": "integer"}},
        "required": ["name", "population"], "additionalProperties": False}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                      "strict": True}}
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string",
                                                                "maxLength": 40}},
                      "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": WEATHER_PARAMETERS, "strict": True}}
# At most 20 digits, 40 characters and bounded whitespace: either form ends well within it.
MAX_TOKENS = 150


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    population: int


class GetWeather(pydantic.BaseModel):
    """The current weather in a city."""

    city: str = pydantic.Field(max_length=40)


@pytest.fixture(scope="module")
def client(smollm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{smollm_server.url}/v1", api_key="unused",
                       max_retries=0, timeout=120) as client:
        yield client


def reply(client: openai.OpenAI, stream: bool, **kwargs: Any,
          ) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """The content, the calls (name, arguments) and the finish reason, streamed or not."""
    args = {"model": "smollm2", "messages": ASK, "tools": [WEATHER],
            "response_format": CITY_FORMAT, "max_tokens": MAX_TOKENS, **kwargs}
    if not stream:
        r = client.chat.completions.create(**args)
        m = r.choices[0].message
        return (m.content, [(c.function.name, c.function.arguments)
                            for c in m.tool_calls or []], r.choices[0].finish_reason)
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            assert c.function is not None
            if c.id is not None:
                calls[c.index] = [c.function.name or "", ""]
            calls[c.index][1] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [(name, args) for name, args in calls.values()], finish


def assert_a_call_or_the_answer(content: str | None, calls: list[tuple[str, str]],
                                finish: str | None) -> str:
    """Which form the reply took, having checked it is one of the two."""
    if calls:
        assert finish == "tool_calls" and not content, (content, calls, finish)
        for name, arguments in calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
        return "call"
    assert finish == "stop" and content is not None, (content, finish)
    jsonschema.validate(json.loads(content), CITY)
    return "answer"


def test_tool_choice_none_answers_in_the_schema(client: openai.OpenAI) -> None:
    for stream in (False, True):
        content, calls, finish = reply(client, stream, tool_choice="none", temperature=0)
        assert assert_a_call_or_the_answer(content, calls, finish) == "answer"


def test_a_forced_call_is_a_call_whatever_the_format(client: openai.OpenAI) -> None:
    content, calls, finish = reply(client, False, tool_choice="required",
                                   parallel_tool_calls=False, temperature=0)
    assert assert_a_call_or_the_answer(content, calls, finish) == "call" and len(calls) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = reply(client, True, tool_choice=named, temperature=0)
    assert [name for name, _ in calls] == ["get_weather"] and finish == "stop"
    jsonschema.validate(json.loads(calls[0][1]), WEATHER_PARAMETERS)


def test_auto_is_a_call_or_the_answer_at_every_seed(client: openai.OpenAI) -> None:
    # One call each: this small model, allowed more, calls again until max_tokens.
    for seed in range(6):
        content, calls, finish = reply(client, seed % 2 == 1, temperature=1.0, seed=seed,
                                       parallel_tool_calls=False)
        assert_a_call_or_the_answer(content, calls, finish)
    any_object = {"type": "json_object"}
    for seed in range(2):
        content, calls, finish = reply(client, False, temperature=1.0, seed=seed,
                                       response_format=any_object, parallel_tool_calls=False)
        if calls:
            assert_a_call_or_the_answer(content, calls, finish)
        else:
            assert finish == "stop" and isinstance(json.loads(content or ""), dict)


def test_parse_with_a_pydantic_model_and_a_tool(client: openai.OpenAI) -> None:
    for seed in range(4):
        r = client.chat.completions.parse(
            model="smollm2", messages=ASK, response_format=City,  # type: ignore[arg-type]
            tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
            parallel_tool_calls=False, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        message = r.choices[0].message
        if message.tool_calls:
            assert message.parsed is None and r.choices[0].finish_reason == "tool_calls"
            (call,) = message.tool_calls
            assert isinstance(call.function.parsed_arguments, GetWeather)
        else:
            assert isinstance(message.parsed, City), message


RESPONSES_WEATHER = {"type": "function", "name": "get_weather",
                     "description": "The current weather in a city",
                     "parameters": WEATHER_PARAMETERS, "strict": True}
RESPONSES_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY,
                               "strict": True}}


def test_responses_text_format_beside_function_tools(client: openai.OpenAI) -> None:
    def create(stream: bool = False, **kwargs: Any) -> str:
        args = {"model": "smollm2", "input": ASK, "tools": [RESPONSES_WEATHER],
                "text": RESPONSES_FORMAT, "max_output_tokens": MAX_TOKENS, **kwargs}
        if stream:  # the streamed text is the final response's
            text, r = "", None
            for event in client.responses.create(stream=True, **args):
                if event.type == "response.output_text.delta":
                    text += event.delta
                elif event.type == "response.completed":
                    r = event.response
            assert r is not None and r.output_text == text
        else:
            r = client.responses.create(**args)
        assert r.status == "completed", r
        calls = [o for o in r.output if o.type == "function_call"]
        for call in calls:
            assert call.name == "get_weather" and call.call_id
            jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
        if calls:
            assert not r.output_text
            return "call"
        jsonschema.validate(json.loads(r.output_text), CITY)
        return "answer"

    assert create(tool_choice="none", temperature=0) == "answer"
    assert create(True, tool_choice="none", temperature=0) == "answer"
    assert create(tool_choice="required", temperature=0, parallel_tool_calls=False) == "call"
    for i in range(4):  # sampled, so each is either form
        create(i % 2 == 1, temperature=1.0, parallel_tool_calls=False)


def test_the_agents_sdk_output_type_with_a_function_tool(smollm_server: ServerProcess) -> None:
    """The Agents SDK's default model (the Responses API) with ``output_type`` and a tool;
    the tool takes one call (this small model would call it every turn), then the agent's
    output must parse as ``City``."""
    import agents

    calls: list[str] = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "Sunny, 21 C"

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{smollm_server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            agent = agents.Agent(
                name="cities", instructions="Answer with the largest city of the country.",
                model=agents.OpenAIResponsesModel("smollm2", client), tools=[get_weather],
                output_type=City, model_settings=agents.ModelSettings(
                    max_tokens=MAX_TOKENS, temperature=0, parallel_tool_calls=False))
            return await agents.Runner.run(agent, "France", max_turns=3,
                                           run_config=agents.RunConfig(tracing_disabled=True))

    result = asyncio.run(run())
    assert isinstance(result.final_output, City)
    assert len(calls) <= 1


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_native_output_with_a_tool(smollm_server: ServerProcess, api: str) -> None:
    from pydantic_ai import Agent, NativeOutput, RunContext, Tool
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.tools import ToolDefinition

    calls: list[str] = []

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return "Sunny, 21 C"

    async def once(ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        return None if calls else tool  # one call, then the answer (see the Agents test)

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{smollm_server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=120) as client:
            provider = OpenAIProvider(openai_client=client)
            model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)(
                "smollm2", provider=provider)
            agent = Agent(model, output_type=NativeOutput(City),
                          tools=[Tool(get_weather, prepare=once)],
                          instructions="Answer with the largest city of the country.",
                          model_settings={"max_tokens": MAX_TOKENS, "temperature": 0,
                                          "parallel_tool_calls": False})
            return await agent.run("France")

    result = asyncio.run(run())
    assert isinstance(result.output, City)
    assert len(calls) <= 1
