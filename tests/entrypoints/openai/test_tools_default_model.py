"""Tool calling on the embedded default model (SmolLM2-135M-Instruct) through the real openai client.

Its chat template renders no tools, so the server's documented fallback prompt describes them; forced
calls (tool_choice "required", a named function) are made by guided decoding, so every sampled call
validates against its tool's schema (jsonschema), whole and streamed. The sampled requests ask for one
call each (parallel_tool_calls=False): allowed several, this small model repeats its calls until
max_tokens cuts the array (even greedy), so arrays of several calls are tested on fixed outputs
(test_tool_schema.py).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from llmplug import LLM, AsyncLLM
from llmplug.core.config import DEFAULT_MODEL

from .conftest import serve

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30, "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
SEARCH = {
    "name": "search_web",
    "description": "Search the web.",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 60}, "limit": {"type": "integer", "minimum": 1,
                                                                              "maximum": 10}},
        "required": ["query"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": SEARCH}]
SCHEMAS = {"get_weather": WEATHER["parameters"], "search_web": SEARCH["parameters"]}
QUESTION = [{"role": "user", "content": "What's the weather like in Paris and in Tokyo today?"}]
NUM_SAMPLES = 20


@pytest.fixture(scope="module")
def default_server():
    """The default model served (its engine loaded once for the module)."""
    llm = LLM(max_model_len=2048)
    engine = AsyncLLM.from_engine(llm.llm_engine, DEFAULT_MODEL)
    try:
        with serve(engine) as running:
            yield running
    finally:
        engine.shutdown()


async def sampled(server, stream: bool, **kwargs) -> list[tuple[list[tuple[str, str]], str]]:
    """NUM_SAMPLES concurrent sampled requests: each one's (name, arguments) calls and finish reason."""
    client = server.async_client()

    async def one(seed: int) -> tuple[list[tuple[str, str]], str]:
        reply = await client.chat.completions.create(model=server.model, messages=QUESTION, tools=TOOLS,
                                                     temperature=0.8, seed=seed, max_tokens=200, stream=stream,
                                                     parallel_tool_calls=False, **kwargs)
        if not stream:
            choice = reply.choices[0]
            return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls], choice.finish_reason
        calls: dict[int, list[str]] = {}
        finish = None
        async for chunk in reply:
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    calls.setdefault(delta.index, [delta.function.name, ""])[1] += delta.function.arguments or ""
        return [tuple(calls[i]) for i in sorted(calls)], finish

    try:
        return await asyncio.gather(*(one(seed) for seed in range(NUM_SAMPLES)))
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_every_sampled_forced_call_validates_against_its_tool_schema(default_server, tool_choice, stream):
    results = asyncio.run(sampled(default_server, stream, tool_choice=tool_choice))
    for calls, finish in results:
        assert finish == "tool_calls" and len(calls) == 1
        name, arguments = calls[0]
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        if tool_choice != "required":
            assert name == "get_weather"


class CityWeather(BaseModel):
    city: str
    temperature_celsius: int
    sunny: bool


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str
    unit: str


def test_parse_with_a_pydantic_model(default_server):
    client = default_server.client()
    parsed = client.chat.completions.parse(
        model=default_server.model, response_format=CityWeather, temperature=0, max_tokens=100,
        messages=[{"role": "user", "content": "Describe the weather in Paris as JSON."}],
    ).choices[0].message.parsed
    assert isinstance(parsed, CityWeather)
    calls = client.chat.completions.parse(
        model=default_server.model, messages=QUESTION, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", temperature=0, max_tokens=200,
    ).choices[0].message.tool_calls
    assert calls and all(isinstance(call.function.parsed_arguments, GetWeather) for call in calls)


def test_a_tool_result_goes_back_to_the_model(default_server):
    client = default_server.client()
    first = client.chat.completions.create(model=default_server.model, messages=QUESTION, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=100).choices[0].message
    history = [*QUESTION, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Sunny and 24 degrees Celsius."}]
    answer = client.chat.completions.create(model=default_server.model, messages=history, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=40).choices[0]
    assert answer.message.content and answer.message.tool_calls is None
