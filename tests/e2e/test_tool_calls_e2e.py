"""Acceptance 4 of issue 23: a tool-call round trip through the real `openai` client on the real
default model: tools -> tool_calls with valid JSON arguments -> tool message -> final answer,
streamed and not. SmolLM2-135M rarely decides to call a tool by itself, so the call is forced
(tool_choice "required" / named: a grammar guarantees the arguments); "auto" is exercised too."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(smollm2_api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2_api}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _check_call(call, tools=(WEATHER, TIME)) -> dict:
    spec = next(t for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, spec["function"]["parameters"])
    return arguments


def _final_answer(client, model, call, stream: bool) -> str:
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="none", temperature=0, max_tokens=48, stream=stream)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    assert reply.choices[0].message.tool_calls is None
    return reply.choices[0].message.content


def test_round_trip_not_streamed(client, model):
    reply = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    _check_call(call)
    assert _final_answer(client, model, call, stream=False).strip()


def test_round_trip_streamed(client, model):
    stream = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                            tool_choice="required", temperature=0, max_tokens=100,
                                            stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += delta.id or ""
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    entry = calls[0]
    call = openai.types.chat.ChatCompletionMessageToolCall(
        id=entry["id"], type="function", function={"name": entry["name"], "arguments": entry["arguments"]})
    _check_call(call)
    assert _final_answer(client, model, call, stream=True).strip()


def test_auto_and_none(client, model):
    auto = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], temperature=0,
                                          max_tokens=100)
    message = auto.choices[0].message
    for call in message.tool_calls or []:  # the model chose; a call it makes is parsed and valid JSON
        json.loads(call.function.arguments)
    assert message.tool_calls or message.content
    none = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=24)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
