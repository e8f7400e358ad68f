"""Tool calling at the gateway: parsers, prompt rendering, forced calls by grammar, and replies
(whole and streamed) over the fake engine scripted to answer with a call."""

from __future__ import annotations

import json

import pytest

from gateway.openai.tool_parsers import ToolParserManager
from tests.gateway.conftest import sse_events

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
async def tools_gateway(make_gateway, upstream):
    """A gateway over an engine with room for the Hermes tools block (long in the tiny tokenizer)."""
    upstream.engine.max_model_len = 4096

    async def make(**overrides):
        return await make_gateway(**overrides)

    return make


def parser(name: str):
    """A fresh parser of the format registered as `name` (one per choice: it keeps stream state)."""
    return ToolParserManager.get_tool_parser(name)()


def test_hermes_and_llama3_json_parsers():
    content, calls = parser("hermes").extract_tool_calls(
        CALL_TEXT + "\n<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>")
    assert content == "Sure." and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].id.startswith("call_")
    assert parser("hermes").extract_tool_calls("<tool_call>{not json}</tool_call>")[1] == []
    content, calls = parser("llama3_json").extract_tool_calls(
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g"}')
    assert content is None and [json.loads(c.function.arguments) for c in calls] == [{"a": 1}, {}]
    assert parser("llama3_json").extract_tool_calls("Paris is sunny.") == ("Paris is sunny.", [])
    assert parser("hermes").content_before_calls("Sure. <tool_") == len("Sure. ")
    assert parser("llama3_json").content_before_calls('{"na') == 0 and parser("llama3_json").content_before_calls("Hi") == 2


def test_streamed_deltas_hold_back_only_what_may_be_a_call():
    tools = parser("hermes")
    fed = [tools.extract_tool_calls_streaming(piece, None) for piece in ("Sure. <to", "ol_call>\n{\"name\": ", '"get_weather", "a')]
    assert "".join(f[0] for f in fed) == "Sure. " and fed[0][1] is None and fed[1][1] is None
    head = fed[2][1][0]  # the header as soon as the name is known
    assert (head.index, head.function.name, head.function.arguments, head.type) == (0, "get_weather", "", "function")
    rest = CALL_TEXT[len('Sure. <tool_call>\n{"name": "get_weather", "a'):]
    content, calls, finish = tools.extract_tool_calls_streaming(rest, "stop")
    assert finish == "tool_calls" and len(calls) == 1 and calls[0].index == 0 and calls[0].id is None
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].function.name is None
    plain = parser("hermes")
    assert (plain.extract_tool_calls_streaming("No call <", None)[0] == "No call "
            and plain.extract_tool_calls_streaming("3", "stop") == ("<3", None, "stop"))


async def test_required_and_named_choices_force_a_call_by_grammar(tools_gateway, upstream):
    gateway = await tools_gateway()
    for choice, names in (("required", ["get_weather", "get_time"]),
                          ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])):
        reply = await gateway.http.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice})
        assert reply.status_code == 200, reply.text
        sent = upstream.engine.requests[-1].sampling.structured_outputs
        assert sent.kind == "grammar" and sent.spec.startswith('start: "<tool_call>\\n"')
        assert all(name in sent.spec for name in names) and ("get_weather" in sent.spec) == (len(names) == 2)


async def test_tools_and_past_tool_turns_are_rendered_hermes_style(tools_gateway, upstream, tokenizer):
    gateway = await tools_gateway(enable_auto_tool_choice=True)
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
    reply = await gateway.http.post("/v1/chat/completions", json={"messages": ASK + [turn, result],
                                                                  "tools": [WEATHER]})
    assert reply.status_code == 200, reply.text
    prompt = tokenizer.decode(list(upstream.engine.requests[0].prompt_token_ids), skip_special_tokens=False)
    assert "<tools>" in prompt and '"get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert not upstream.engine.requests[0].sampling.HasField("structured_outputs")  # auto: free


@pytest.mark.parametrize("fields, message", [
    ({"tools": [WEATHER]}, "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    # an earlier call the prompt must render: once a 500 (schemathesis found it)
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": [1]}]}]}, "function: {name"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "function: {name"),
])
async def test_bad_tool_requests_are_400(tools_gateway, upstream, fields, message):
    gateway = await tools_gateway()
    reply = await gateway.http.post("/v1/chat/completions", json={"messages": ASK, **fields})
    assert reply.status_code == 400 and message in json.dumps(reply.json()["error"]), reply.text
    assert not upstream.engine.requests


async def test_a_call_in_the_reply_becomes_tool_calls(tools_gateway, upstream, tokenizer):
    upstream.engine.scripts = [tokenizer.encode(CALL_TEXT, add_special_tokens=False)]
    gateway = await tools_gateway(enable_auto_tool_choice=True)
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 100}
    choice = (await gateway.http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    reply = await gateway.http.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(reply.text)[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert content == "Sure. " and {c["index"] for c in calls} == {0} and calls[0]["id"].startswith("call_")
    assert "".join(c["function"].get("name") or "" for c in calls) == "get_weather"
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    plain = (await gateway.http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 100})).json()
    assert plain["choices"][0]["message"]["content"] == CALL_TEXT  # no tools: text stays text


def test_every_format_is_a_registered_parser_class():
    from gateway.__main__ import parse_args
    from gateway.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser, ToolParser

    assert ToolParserManager.names() == ("hermes", "llama3_json", "mistral", "pythonic")
    assert ToolParserManager.get_tool_parser("hermes") is HermesToolParser
    assert ToolParserManager.get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert all(issubclass(cls, ToolParser) and cls.name == name for name, cls in ToolParserManager.parsers.items())
    assert parse_args(["--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    with pytest.raises(KeyError, match="known: hermes, llama3_json, mistral, pythonic"):
        ToolParserManager.get_tool_parser("granite")
