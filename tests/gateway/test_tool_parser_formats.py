"""The Mistral and pythonic tool-call formats, and `--tool-call-parser auto`'s choice from a chat
template (gateway/openai/tool_parsers/): whole replies, streamed replies, forced-call grammars, and
a gateway under `auto` picking the format from its model's template."""

from __future__ import annotations

import json

import pytest

from gateway.openai.tool_parsers import ToolParserManager, tool_parser_for_template
from gateway.openai.tool_parsers.mistral_tool_parser import mistral_call_id
from gateway.openai.tool_protocol import ToolDef
from pagoda.contract.structured import check_grammar

WEATHER = ToolDef.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                         "days": {"type": "integer"}},
                                          "required": ["city"]}}})


def parser(name: str):
    return ToolParserManager.get_tool_parser(name)()


def _args(call) -> dict:
    return json.loads(call.function.arguments)


@pytest.mark.parametrize("template, expected", [
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("<|im_start|>{% if tools %}<tools>{% endif %}<tool_call>\n{\"name\"", "hermes"),  # Qwen2.5 / Qwen3
    ("{{- '<|python_tag|>' + tool_call.name }}<|start_header_id|>ipython", "llama3_json"),  # Llama 3.1
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
     "llama3_json"),  # Llama 3.2's JSON template
    ("<|header_start|>{{ '<|python_start|>' }}", "pythonic"),  # Llama 4
    ("[func_name1(params_name1=params_value1, params_name2=params_value2...)]", "pythonic"),
    ("{% for message in messages %}<|im_start|>{{ message.role }}{% endfor %}", "hermes"),  # SmolLM2: no tools
    (None, "hermes"),
    ({"default": "<|im_start|>", "tool_use": "[TOOL_CALLS]"}, "mistral"),  # HF's named templates
])
def test_auto_reads_the_format_from_the_chat_template(template, expected):
    assert tool_parser_for_template(template) == expected


def test_mistral_replies_in_both_forms():
    content, calls = parser("mistral").extract_tool_calls(
        'Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f"}]')
    assert content == "Let me look." and [c.function.name for c in calls] == ["get_weather", "f"]
    assert _args(calls[0]) == {"city": "Paris"} and all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    _, calls = parser("mistral").extract_tool_calls('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]f[ARGS]{}')
    assert [(c.function.name, _args(c)) for c in calls] == [("get_weather", {"city": "Oslo"}), ("f", {})]
    # [TOOL_CALLS] is a special token the detokenizer skips: the bare array still reads as calls
    assert parser("mistral").extract_tool_calls('[{"name": "f", "arguments": {"a": 1}}]')[0] is None
    for text in ("Paris is sunny.", "[TOOL_CALLS] not json", "[1, 2]"):
        assert parser("mistral").extract_tool_calls(text) == (text, [])


def test_mistral_streams_content_then_a_call_header_with_a_9_character_id():
    tools = parser("mistral")
    fed = [tools.extract_tool_calls_streaming(p, None) for p in ("Sure [TOOL", '_CALLS] [{"name": "get_weather", ')]
    assert "".join(f.content for f in fed) == "Sure " and fed[0].tool_calls is None
    head = fed[1].tool_calls[0]
    assert head.function.name == "get_weather" and len(head.id) == 9 and head.id.isalnum()
    last = tools.extract_tool_calls_streaming('"arguments": {"city": "Rome"}}]', "stop")
    assert last.finish_reason == "tool_calls" and json.loads(last.tool_calls[0].function.arguments) == {"city": "Rome"}


def test_mistral_maps_other_clients_ids_for_its_template():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abcdefghijklmnop", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_abcdefghijklmnop", "content": "ok"}]
    out, _ = ToolParserManager.get_tool_parser("mistral").render_prompt(messages, None, "[TOOL_CALLS] tools")
    mapped = out[0]["tool_calls"][0]["id"]
    assert len(mapped) == 9 and mapped.isalnum() and out[1]["tool_call_id"] == mapped == mistral_call_id(
        "call_abcdefghijklmnop")
    assert mistral_call_id("abcDEF123") == "abcDEF123"  # already a Mistral id: kept


def test_pythonic_replies():
    content, calls = parser("pythonic").extract_tool_calls(
        '[get_weather(city="Paris", days=2), get_time(), set(flag=true, x=null, tags=["a"], o={"k": 1})]')
    assert content is None and [c.function.name for c in calls] == ["get_weather", "get_time", "set"]
    assert _args(calls[0]) == {"city": "Paris", "days": 2} and _args(calls[1]) == {}
    assert _args(calls[2]) == {"flag": True, "x": None, "tags": ["a"], "o": {"k": 1}}
    _, calls = parser("pythonic").extract_tool_calls("<|python_start|>[f(a=1)]<|python_end|>")
    assert [(c.function.name, _args(c)) for c in calls] == [("f", {"a": 1})]
    for text in ("Hello.", "[f(1)]", "[f(a=open('x'))]", "[]", "[1]", "[f(a=1"):
        assert parser("pythonic").extract_tool_calls(text) == (text, [])


def test_pythonic_streams_a_header_once_the_name_is_known():
    tools = parser("pythonic")
    fed = tools.extract_tool_calls_streaming('[get_weather(city="Pa', None)
    assert fed.content == "" and fed.tool_calls[0].function.name == "get_weather"
    last = tools.extract_tool_calls_streaming('ris")]', "stop")
    assert last.finish_reason == "tool_calls" and json.loads(last.tool_calls[0].function.arguments) == {"city": "Paris"}
    text = parser("pythonic")
    assert text.extract_tool_calls_streaming("Hi [", None).content == "Hi ["  # began as text: no call


@pytest.mark.parametrize("name", ["mistral", "pythonic"])
def test_forced_call_grammars_compile_and_parse_back(name):
    grammar = ToolParserManager.get_tool_parser(name).forced_call_grammar([WEATHER])
    assert grammar.kind == "grammar" and "get_weather" in grammar.spec
    check_grammar(grammar)  # a 400 if llguidance cannot compile it
    written = {"mistral": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
               "pythonic": '[get_weather(city="Paris")]'}[name]
    assert [c.function.name for c in parser(name).extract_tool_calls(written).tool_calls] == ["get_weather"]
