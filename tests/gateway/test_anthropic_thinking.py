"""Anthropic's `thinking` budget and structured outputs over the fake engine: the thinking cut at
budget_tokens (whole and streamed, the request cancelled upstream), thinking_tokens in the usage,
and output_config.format / the beta's output_format sent as the chat route's json_schema grammar,
read back by the real client's messages.parse."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import BaseModel, TypeAdapter

from tests.gateway.conftest import wait_until
from tests.gateway.test_anthropic_messages import anthropic_client
from tests.gateway.test_anthropic_messages import events_of as anthropic_events
from tests.gateway.test_reasoning import QWEN3_TEXT, script

ASK = [{"role": "user", "content": "Weather in Paris?"}]
THOUGHT = "<think>\nThe user wants Paris.</think>"  # QWEN3_TEXT's thinking span, tags included
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "degrees": {"type": "integer"}},
          "required": ["city", "degrees"], "additionalProperties": False}


class Weather(BaseModel):
    city: str
    degrees: int


def thinking(budget: int, max_tokens: int = 64) -> dict:
    return {"messages": ASK, "max_tokens": max_tokens, "thinking": {"type": "enabled", "budget_tokens": budget}}


async def test_the_budget_cuts_the_thinking(make_gateway, upstream, tokenizer):
    # The fake engine sends 2 tokens a step: a budget of 6 ends the reply after the third step.
    ids = tokenizer.encode(QWEN3_TEXT, add_special_tokens=False)
    assert len(tokenizer.encode(THOUGHT, add_special_tokens=False)) > 6
    script(upstream, tokenizer, QWEN3_TEXT)
    # The engine holds its last response until the caller leaves: otherwise, on a loaded machine,
    # it may have sent the whole script before the gateway cut, and nothing would be cancelled.
    upstream.engine.hold_final_response = True
    gateway = await make_gateway(reasoning_parser="qwen3")
    reply = await gateway.http.post("/v1/messages", json=thinking(6))
    assert reply.status_code == 200, reply.text
    message = Message.model_validate(reply.json())
    assert [block.type for block in message.content] == ["thinking"] and message.stop_reason == "max_tokens"
    assert message.content[0].thinking == tokenizer.decode(ids[:6])[len("<think>"):]
    assert message.usage.output_tokens == message.usage.output_tokens_details.thinking_tokens == 6
    await wait_until(lambda: upstream.engine.cancelled == [upstream.engine.requests[-1].request_id])  # cut upstream
    events = anthropic_events((await gateway.http.post("/v1/messages", json={**thinking(6), "stream": True})).text)
    adapter = TypeAdapter(RawMessageStreamEvent)
    for kind, payload in events:
        if kind != "ping":
            adapter.validate_python(payload)
    assert [p["content_block"]["type"] for kind, p in events if kind == "content_block_start"] == ["thinking"]
    assert "".join(p["delta"]["thinking"] for kind, p in events if kind == "content_block_delta") == \
        message.content[0].thinking
    delta = next(p for kind, p in events if kind == "message_delta")
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == delta["usage"]["output_tokens_details"]["thinking_tokens"] == 6
    await wait_until(lambda: len(upstream.engine.cancelled) == 2)


async def test_a_thinking_within_its_budget_is_untouched(make_gateway, upstream, tokenizer):
    total = script(upstream, tokenizer, QWEN3_TEXT)
    thought = len(tokenizer.encode(THOUGHT, add_special_tokens=False))
    gateway = await make_gateway(reasoning_parser="qwen3")
    client = anthropic_client(gateway, "unused")
    message = await client.messages.create(model="", **thinking(thought))
    assert [block.type for block in message.content] == ["thinking", "text"] and message.stop_reason == "end_turn"
    assert message.usage.output_tokens == total and message.usage.output_tokens_details.thinking_tokens == thought
    async with client.messages.stream(model="", **thinking(thought)) as stream:
        final = await stream.get_final_message()
    assert [b.model_dump(include={"type", "thinking", "text"}) for b in final.content] == \
        [b.model_dump(include={"type", "thinking", "text"}) for b in message.content]
    assert final.usage.output_tokens_details.thinking_tokens == thought
    assert not upstream.engine.cancelled


@pytest.mark.parametrize("fields", [
    {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    {"output_format": {"type": "json_schema", "schema": SCHEMA}},  # the structured-outputs beta's name
])
async def test_a_json_output_format_is_the_chat_routes_json_schema(gateway, upstream, tokenizer, fields):
    upstream.engine.scripts = [tokenizer.encode('{"city": "Paris", "degrees": 21}', add_special_tokens=False)]
    reply = await gateway.http.post("/v1/messages", json={"messages": ASK, "max_tokens": 64, **fields})
    assert reply.status_code == 200, reply.text
    sent = upstream.engine.requests[-1].sampling.structured_outputs
    assert sent.kind == "json" and json.loads(sent.spec) == SCHEMA
    assert json.loads(reply.json()["content"][0]["text"]) == {"city": "Paris", "degrees": 21}


async def test_the_clients_parse_reads_the_structured_output(gateway, upstream, tokenizer):
    upstream.engine.scripts = [tokenizer.encode('{"city": "Paris", "degrees": 21}', add_special_tokens=False)]
    parsed = await anthropic_client(gateway, "unused").messages.parse(
        model="", max_tokens=64, messages=ASK, output_format=Weather)
    assert parsed.parsed_output == Weather(city="Paris", degrees=21)
    sent = json.loads(upstream.engine.requests[-1].sampling.structured_outputs.spec)
    assert sent["properties"].keys() == {"city", "degrees"}  # the client's schema of Weather


@pytest.mark.parametrize("body, message", [
    (thinking(64, 64), "less than max_tokens"),
    ({"messages": ASK, "max_tokens": 64, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"messages": ASK, "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 8, "display": "omitted"}},
     "display"),
    ({**thinking(8), "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "grammar"),
    ({"messages": ASK, "max_tokens": 64, "output_config": {"effort": "extreme"}}, "effort"),  # low..max: ignored
    ({"messages": ASK, "max_tokens": 64, "output_format": {"type": "json_schema", "schema": SCHEMA},
      "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "not both"),
])
async def test_bad_thinking_and_formats_are_400s(make_gateway, upstream, body, message):
    gateway = await make_gateway(reasoning_parser="qwen3")
    reply = await gateway.http.post("/v1/messages", json=body)
    assert reply.status_code == 400 and reply.json()["type"] == "error" and message in reply.text, reply.text
    assert not upstream.engine.requests
