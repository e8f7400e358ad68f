"""The hermes parser also reads the calls small models write outside `<tool_call>` (hermes_scan.py):
other tags, code fences, a bare `{"name", "arguments"}` object, for the offered tools only. Each
form whole and streamed (a character at a time and in one piece), and the text that must stay
text. The first two forms are Qwen2.5-Coder-1.5B's own replies to Codex (docs/agents.md)."""

from __future__ import annotations

import json

import pytest

from gateway.openai.tool_parsers import HermesToolParser
from tests.gateway.conftest import sse_events

OFFERED = ["exec_command", "Bash"]
SED = {"cmd": "sed -i 's/hello/hi/g' hello.py", "workdir": "/tmp/w"}
OBJ = json.dumps({"name": "exec_command", "arguments": SED})

CALLS = [  # (reply, content around the calls, [(name, arguments)])
    (f"```python\n<tools>\n{OBJ}\n</tools>\n```", None, [("exec_command", SED)]),  # Qwen, try 1
    (f"I'll run it:\n```json\n{OBJ}\n```", "I'll run it:", [("exec_command", SED)]),  # Qwen, try 3
    ('Sure. {"name": "Bash", "parameters": {"command": "ls"}} Done.', "Sure.  Done.",
     [("Bash", {"command": "ls"})]),
    (f"<function_call>{OBJ}</function_call>", None, [("exec_command", SED)]),
    (f"<tools>{OBJ}", None, [("exec_command", SED)]),  # no closing tag before the end
    (f"```\n<tool_call>\n{OBJ}\n</tool_call>\n```\nok", "ok", [("exec_command", SED)]),
    (f'```json\n{OBJ}\n{{"name": "Bash", "arguments": {{}}}}\n```', None,
     [("exec_command", SED), ("Bash", {})]),  # two calls in one fence
    (f"```json\n{OBJ}\n", None, [("exec_command", SED)]),  # the fence never closed
    ('```json\n{"name": "Bash", "arguments": "{\\"command\\": \\"ls\\"}"}\n```', None,
     [("Bash", {"command": "ls"})]),  # arguments as JSON text, OpenAI's shape (Qwen, docs/agents.md)
    ('<tool_call>{"name": "anything", "arguments": {"a": 1}}</tool_call>', None, [("anything", {"a": 1})]),
]
TEXT = [  # replies that hold no call
    'A user looks like {"name": "Alice", "arguments": {"age": 3}}.',  # a name no tool has
    '{"name": "exec_command", "arguments": {}, "id": 7}',  # a key more than a call has
    '{"name": "exec_command", "arguments": "ls"}',  # arguments not an object (nor JSON text of one)
    '{"name": "exec_command", "arguments": "{\\"chars\\": 1}\\"}"}',  # JSON text, broken (Qwen's too)
    '{"arguments": {"cmd": "ls"}, "name": "exec_command"}',  # the name not first (llama.cpp: same)
    "```python\nprint({'name': 1})\nx = {\"cmd\": \"ls\"}\n```",
    "```python\n<tools>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tools>\n```",
    "Use `ls` or ``pwd``, and a <b>tag</b>; 1 < 2 and {braces}.",
    "<tool_call>not json</tool_call>",
    "```json\n{\"name\": \"exec_comm",  # cut off: never a call
]


def _parser(names=OFFERED) -> HermesToolParser:
    return HermesToolParser(None, names)


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def _stream(text: str, size: int, names=OFFERED) -> tuple[str, str, dict[int, list], str | None]:
    """Feed `text` in pieces of `size`: (content streamed before the end, content at the end,
    index -> [name, arguments] assembled from the call deltas, finish_reason)."""
    parser, early, calls = _parser(names), "", {}
    for i in range(0, len(text), size):
        content, deltas, _ = parser.extract_tool_calls_streaming(text[i:i + size], None)
        early += content
        for d in deltas or ():
            calls.setdefault(d.index, ["", ""])[0] += d.function.name or ""
    content, deltas, finish = parser.extract_tool_calls_streaming("", "stop")
    for d in deltas or ():
        call = calls.setdefault(d.index, ["", ""])
        call[0] += d.function.name or ""
        call[1] += d.function.arguments or ""
    return early, content, calls, finish


@pytest.mark.parametrize("text, content, expected", CALLS)
def test_each_form_is_a_call_whole_and_streamed(text, content, expected):
    got = _parser().extract_tool_calls(text)
    assert (got.content, _calls(got.tool_calls)) == (content, expected)
    for size in (1, len(text)):
        early, late, calls, finish = _stream(text, size)
        # content before the call streams as it comes; nothing of the call's fence or tag does
        assert (early + late).split() == (content or "").split()  # (streamed: as written, unstripped)
        assert not any(mark in early for mark in ("```", "<tool", "<function", '{"name"'))
        assert finish == "tool_calls"
        assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == expected


def test_a_call_outside_the_format_is_logged(monkeypatch):
    from gateway.openai.tool_parsers import hermes_tool_parser
    from tests.gateway.test_agent_clients import Recorder

    monkeypatch.setattr(hermes_tool_parser, "log", recorder := Recorder())
    _parser().extract_tool_calls(CALLS[0][0] + "\n" + CALLS[-1][0])
    _parser().extract_tool_calls(CALLS[-1][0])  # the format itself: nothing to say
    assert recorder.lines == [("info", "tool_call_outside_format", {"starts": ["```python\n<tools>\n{\"name"]})]


@pytest.mark.parametrize("text", TEXT)
def test_text_that_is_no_call_stays_text_whole_and_streamed(text):
    assert _parser().extract_tool_calls(text) == (text, [])
    for size in (1, 3, len(text)):
        early, late, calls, finish = _stream(text, size)
        assert (early + late, calls, finish) == (text, {}, "stop")


def test_the_lenient_forms_need_the_offered_tools():
    """A parser that does not know the request's tools reads `<tool_call>` only."""
    for text, _, _ in CALLS[:-1]:
        if "<tool_call>" not in text:
            assert HermesToolParser().extract_tool_calls(text) == (text, [])
            assert _stream(text, 1, names=None)[2] == {}
    assert _parser([]).extract_tool_calls(CALLS[1][0])[1] == []


def test_a_fence_is_held_only_until_its_first_line_shows_no_call():
    parser = _parser()
    fed = [parser.extract_tool_calls_streaming(piece, None)[0] for piece in ("Here:\n```py", "thon\n", "  pr")]
    assert fed == ["Here:\n", "", "```python\n  pr"]
    assert parser.extract_tool_calls_streaming("int(1)\n```", "stop") == ("int(1)\n```", None, "stop")
    parser = _parser()  # a bare object is held while it may still name an offered tool
    assert parser.extract_tool_calls_streaming('x {"name": "exe', None)[0] == "x "
    assert parser.extract_tool_calls_streaming('x', None)[0] == '{"name": "exex'


def test_a_strict_call_header_goes_out_early_a_lenient_one_once_complete():
    parser = _parser()
    _, deltas, _ = parser.extract_tool_calls_streaming('<tool_call>{"name": "Bash", "argu', None)
    assert deltas[0].function.name == "Bash"
    parser = _parser()
    assert parser.extract_tool_calls_streaming(f"```json\n{OBJ[:-5]}", None)[1] is None
    _, deltas, _ = parser.extract_tool_calls_streaming(OBJ[-5:], None)
    assert deltas[0].function.name == "exec_command" and deltas[0].index == 0


async def test_a_fenced_call_reaches_the_client_as_tool_calls(make_gateway, upstream, tokenizer):
    """Through the chat route: the request's tools are what the parser accepts."""
    upstream.engine.max_model_len = 4096
    reply = f"```python\n<tools>\n{OBJ}\n</tools>\n```"
    upstream.engine.scripts = [tokenizer.encode(reply, add_special_tokens=False)] * 2
    gateway = await make_gateway(enable_auto_tool_choice=True)
    tool = {"type": "function", "function": {"name": "exec_command", "parameters": {"type": "object"}}}
    body = {"messages": [{"role": "user", "content": "edit"}], "tools": [tool], "max_tokens": 200}
    choice = (await gateway.http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == SED
    streamed = await gateway.http.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
    assert not "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == SED
