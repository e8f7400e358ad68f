"""Reasoning output (--reasoning-parser): the parsers on whole replies and on every split of a
stream, then chat completions (message and streamed deltas), the Responses API's reasoning items
and events, and tool calls read after the thinking, over the fake engine scripted to think."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from gateway.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningParserManager,
)
from tests.gateway.conftest import sse_events
from tests.gateway.test_responses_fake import events_of
from tests.gateway.test_tool_calls import ASK, CALL_TEXT, WEATHER, tools_gateway  # noqa: F401 - a fixture

QWEN3_TEXT = "<think>\nThe user wants Paris.</think>\n\nSure, Paris."
R1_TEXT = "Paris is far.</think>It is sunny."

# (parser, reply, reasoning, content): what a whole reply splits into.
CASES = [
    ("qwen3", QWEN3_TEXT, "\nThe user wants Paris.", "\n\nSure, Paris."),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "No thinking here.", None, "No thinking here."),  # enable_thinking false: no tags
    ("qwen3", "<thin", None, "<thin"),  # a cut start tag that never completed is content
    ("qwen3", "Hi <think>x</think>", None, "Hi <think>x</think>"),  # the tag only opens a reply
    ("qwen3", "<think>cut by max_tokens", "cut by max_tokens", None),
    ("qwen3", "<think></think>", None, None),
    ("qwen3", "\n\n", None, "\n\n"),
    ("deepseek_r1", R1_TEXT, "Paris is far.", "It is sunny."),
    ("deepseek_r1", "<think>x</think>y", "x", "y"),  # a written start tag is dropped
    ("deepseek_r1", "</think>Just content.", None, "Just content."),
    ("deepseek_r1", "thinking, cut</th", "thinking, cut</th", None),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),  # only the first end tag closes it
    ("deepseek_r1", "<</think>>", "<", ">"),
]


def fresh(name: str) -> ReasoningParser:
    return ReasoningParserManager.get_reasoning_parser(name)()


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_whole_replies_split_into_reasoning_and_content(name, text, reasoning, content):
    assert fresh(name).extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_every_split_point_streams_the_same_split(name, text, reasoning, content):
    for cut in range(len(text) + 1):
        for last_empty in (False, True):  # the finish may come with the last text or after it
            parser = fresh(name)
            pieces = [parser.stream(text[:cut], False), parser.stream(text[cut:], not last_empty)]
            if last_empty:
                pieces.append(parser.stream("", True))
            assert ("".join(p.reasoning for p in pieces) or None, "".join(p.content for p in pieces) or None
                    ) == (reasoning, content), (cut, last_empty)
    for size in (1, 2, 3):  # every tag cut at every place at once
        parser = fresh(name)
        pieces = [parser.stream(text[i:i + size], i + size >= len(text)) for i in range(0, len(text), size)]
        assert ("".join(p.reasoning for p in pieces) or None, "".join(p.content for p in pieces) or None
                ) == (reasoning, content)


def test_a_stream_holds_back_only_what_may_be_a_tag():
    parser = fresh("qwen3")
    assert parser.stream("<thi", False) == ("", "") and parser.stream("nk>Hmm </thi", False) == ("Hmm ", "")
    assert parser.stream("nk>Yes", False) == ("", "Yes") and parser.stream(" <think>", False) == ("", " <think>")


def test_every_format_is_a_registered_parser_class():
    from gateway.__main__ import parse_args
    from gateway.config import GatewayConfig

    assert ReasoningParserManager.names() == ("deepseek_r1", "qwen3")
    assert ReasoningParserManager.get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert parse_args(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert parse_args([]).reasoning_parser is None
    with pytest.raises(ValueError, match="deepseek_r1 or qwen3"):
        GatewayConfig(reasoning_parser="granite")
    with pytest.raises(SystemExit):
        parse_args(["--reasoning-parser", "granite"])


def script(upstream, tokenizer, text: str) -> int:
    """The fake engine answers `text` (2 tokens a response: the tags arrive cut); its token count."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    upstream.engine.scripts = [ids]
    return len(ids)


def streamed(reply) -> list[ChatCompletionChunk]:
    assert reply.status_code == 200, reply.text
    return [ChatCompletionChunk.model_validate_json(e) for e in sse_events(reply.text)[:-1]]


@pytest.mark.parametrize(("name", "text", "thinking"), [
    ("qwen3", QWEN3_TEXT, "<think>\nThe user wants Paris.</think>"), ("deepseek_r1", R1_TEXT, "Paris is far.</think>"),
    ("qwen3", "No thinking here.", ""), ("deepseek_r1", "cut while thinking", "cut while thinking"),
    ("deepseek_r1", "</think>Just content.", "</think>")])
def test_reasoning_tokens_are_the_thinking_span_tags_included(tokenizer, name, text, thinking):
    ids = tokenizer.encode(text, add_special_tokens=False)
    count = ReasoningParserManager.get_reasoning_parser(name).count_reasoning_tokens(ids, tokenizer.decode)
    assert tokenizer.decode(ids[:count]) == thinking


@pytest.mark.parametrize(("name", "text"), [("qwen3", QWEN3_TEXT), ("deepseek_r1", R1_TEXT)])
async def test_chat_replies_carry_reasoning_content(make_gateway, upstream, tokenizer, name, text):
    num_tokens = script(upstream, tokenizer, text)
    _, reasoning, content = next(c[1:] for c in CASES if c[:2] == (name, text))
    gateway = await make_gateway(reasoning_parser=name)
    body = {"messages": ASK, "max_tokens": 100}
    reply = await gateway.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert ChatCompletion.model_validate(reply.json()).usage.completion_tokens == num_tokens  # thinking counts
    chunks = streamed(await gateway.http.post("/v1/chat/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas)  # thinking comes first
    assert chunks[-1].usage.completion_tokens == num_tokens


async def test_without_a_parser_the_thinking_stays_content(gateway, upstream, tokenizer):
    script(upstream, tokenizer, QWEN3_TEXT)
    message = (await gateway.http.post("/v1/chat/completions", json={"messages": ASK})).json()["choices"][0]["message"]
    assert message["content"] == QWEN3_TEXT and "reasoning_content" not in message


async def test_max_tokens_cuts_the_thinking(make_gateway, upstream, tokenizer):
    script(upstream, tokenizer, QWEN3_TEXT)
    gateway = await make_gateway(reasoning_parser="qwen3")
    reply = (await gateway.http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 9})).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    ids = tokenizer.encode(QWEN3_TEXT, add_special_tokens=False)[:9]
    assert choice["message"]["reasoning_content"] == tokenizer.decode(ids)[len("<think>"):]
    assert reply["usage"]["completion_tokens"] == 9


async def test_tool_calls_are_read_after_the_thinking(tools_gateway, upstream, tokenizer):  # noqa: F811
    # The thinking mentions a call: only the one after </think> is made.
    script(upstream, tokenizer, '<think>Maybe <tool_call>{"name": "nope"}</tool_call>?</think>' + CALL_TEXT)
    gateway = await tools_gateway(enable_auto_tool_choice=True, reasoning_parser="qwen3")
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 200}
    choice = (await gateway.http.post("/v1/chat/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    assert choice["message"]["reasoning_content"] == 'Maybe <tool_call>{"name": "nope"}</tool_call>?'
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    chunks = streamed(await gateway.http.post("/v1/chat/completions", json={**body, "stream": True}))
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert "".join(c.function.name or "" for c in calls) == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == \
        choice["message"]["reasoning_content"]


async def test_responses_have_a_reasoning_item_whole_and_streamed(make_gateway, upstream, tokenizer):
    script(upstream, tokenizer, QWEN3_TEXT)
    gateway = await make_gateway(reasoning_parser="qwen3")
    reply = await gateway.http.post("/v1/responses", json={"input": "Hi"})
    assert reply.status_code == 200, reply.text
    whole = Response.model_validate(reply.json())
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    thinking = whole.output[0]
    assert thinking.summary == [] and [(c.type, c.text) for c in thinking.content] == [
        ("reasoning_text", "\nThe user wants Paris.")]
    assert whole.output_text == "\n\nSure, Paris."
    thinking_ids = tokenizer.encode("<think>\nThe user wants Paris.</think>", add_special_tokens=False)
    assert whole.usage.output_tokens_details.reasoning_tokens == len(thinking_ids) < whole.usage.output_tokens
    events = events_of((await gateway.http.post("/v1/responses", json={"input": "Hi", "stream": True})).text)
    kinds = [e.type for e in events]
    thoughts, words = kinds.count("response.reasoning_text.delta"), kinds.count("response.output_text.delta")
    assert thoughts > 1 and words > 1 and kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", *["response.reasoning_text.delta"] * thoughts,
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * words,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thinking.content[0].text
    assert events[2 + thoughts + 2].text == thinking.content[0].text
    assert [e.output_index for e in events if e.type.endswith(".delta")] == [0] * thoughts + [1] * words
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == whole.output_text
    assert final.output[0].content[0].text == thinking.content[0].text and final.output[0].status == "completed"
    assert final.usage == whole.usage


async def test_a_response_cut_while_thinking_is_only_reasoning(make_gateway, upstream, tokenizer):
    script(upstream, tokenizer, QWEN3_TEXT)
    gateway = await make_gateway(reasoning_parser="qwen3")
    whole = Response.model_validate((await gateway.http.post("/v1/responses", json={
        "input": "Hi", "max_output_tokens": 9})).json())
    assert whole.status == "incomplete" and [i.type for i in whole.output] == ["reasoning"]
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 9  # all thinking
    events = events_of((await gateway.http.post("/v1/responses", json={
        "input": "Hi", "max_output_tokens": 9, "stream": True})).text)
    final = events[-1].response
    assert final.status == "incomplete" and [i.type for i in final.output] == ["reasoning"]
    assert final.output[0].content[0].text == whole.output[0].content[0].text


async def test_anthropic_messages_have_a_thinking_block_whole_and_streamed(make_gateway, upstream, tokenizer):
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    from tests.gateway.test_anthropic_messages import events_of as anthropic_events

    script(upstream, tokenizer, QWEN3_TEXT)
    gateway = await make_gateway(reasoning_parser="qwen3")
    body = {"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "earlier", "signature": "x"}, {"type": "text", "text": "Earlier."}]},
        {"role": "user", "content": "And now?"}], "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 32}}
    reply = await gateway.http.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    message = Message.model_validate(reply.json())
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "\nThe user wants Paris."), ("text", "\n\nSure, Paris.")]
    assert "earlier" not in tokenizer.decode(list(upstream.engine.requests[-1].prompt_token_ids))  # past thinking: dropped
    events = anthropic_events((await gateway.http.post("/v1/messages", json={**body, "stream": True})).text)
    adapter = TypeAdapter(RawMessageStreamEvent)
    for kind, payload in events:
        if kind != "ping":  # not one of the client's stream event types
            adapter.validate_python(payload)
    starts = [p["content_block"]["type"] for kind, p in events if kind == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert [p["index"] for kind, p in events if kind == "content_block_stop"] == [0, 1]
    thought = "".join(p["delta"].get("thinking", "") for kind, p in events if kind == "content_block_delta")
    said = "".join(p["delta"].get("text", "") for kind, p in events if kind == "content_block_delta")
    assert (thought, said) == (message.content[0].thinking, message.content[1].text)
    kinds = [kind for kind, _ in events]
    assert kinds.index("content_block_stop") < [i for i, p in enumerate(events)
                                                if p[0] == "content_block_start"][1]  # thinking closed first


async def test_anthropic_thinking_needs_a_reasoning_parser(gateway):
    reply = await gateway.http.post("/v1/messages", json={
        "messages": ASK, "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 32}})
    assert reply.status_code == 400 and reply.json()["type"] == "error" and "--reasoning-parser" in reply.text


async def test_a_responses_round_trip_sends_the_reasoning_item_back(make_gateway, upstream, tokenizer):
    script(upstream, tokenizer, QWEN3_TEXT)
    gateway = await make_gateway(reasoning_parser="qwen3")
    first = (await gateway.http.post("/v1/responses", json={"input": "Hi"})).json()
    follow_up = [{"role": "user", "content": "Hi"}, *first["output"], {"role": "user", "content": "Again?"}]
    reply = await gateway.http.post("/v1/responses", json={"input": follow_up})
    assert reply.status_code == 200, reply.text
    prompt = tokenizer.decode(list(upstream.engine.requests[-1].prompt_token_ids))
    assert "Sure, Paris." in prompt and "The user wants Paris." not in prompt  # past thinking: dropped
