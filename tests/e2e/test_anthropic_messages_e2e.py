"""Anthropic's Messages API (POST /v1/messages) over real worker, scheduler and gateway processes,
driven by the real `anthropic` client: the same greedy text as the chat route, streamed and not,
stop reasons, usage, a forced tool_use round trip, structured outputs (`messages.parse`), the
thinking budget on a second gateway with --reasoning-parser deepseek_r1, and errors."""

from __future__ import annotations

from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.gateway_conftest import start_gateway

pytestmark = pytest.mark.slow
# anthropic 2.x has no sampling parameters (temperature, top_p, top_k): they go in the body as extras.
GREEDY = {"extra_body": {"temperature": 0}}
ASK = [{"role": "user", "content": "Tell me about the river."}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"enum": ["Paris", "London"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}


class Verdict(BaseModel):
    """A schema the tiny model can finish within a few tokens (an enum and a bounded integer)."""

    answer: Literal["yes", "no"]
    score: Literal[0, 1, 2, 3]


@pytest.fixture(scope="module")
def thinking_client(engine_processes, tmp_path_factory):
    gateway, http_url = start_gateway(engine_processes.scheduler_target, tmp_path_factory.mktemp("gw-thinking"),
                                      "--reasoning-parser", "deepseek_r1")
    try:
        yield anthropic.Anthropic(base_url=http_url, api_key="unused", max_retries=0)
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def client(gateway_stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway_stack.http_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(gateway_stack) -> str:
    return gateway_stack.model_dir


def test_greedy_message_equals_the_chat_route(client, model, gateway_stack):
    message = client.messages.create(model=model, system="You answer briefly.", messages=ASK, max_tokens=12,
                                     **GREEDY)
    chat = openai.OpenAI(base_url=f"{gateway_stack.http_url}/v1", api_key="unused", max_retries=0)
    expected = chat.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "You answer briefly."}, *ASK], max_tokens=12,
        temperature=0)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == model
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (expected.usage.prompt_tokens, 12)


def test_streamed_message_equals_the_whole_one(client, model):
    whole = client.messages.create(model=model, messages=ASK, max_tokens=16, **GREEDY)
    with client.messages.stream(model=model, messages=ASK, max_tokens=16, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens and final.usage.output_tokens == 16


def test_stop_sequence(client, model):
    text = client.messages.create(model=model, messages=ASK, max_tokens=16, **GREEDY).content[0].text
    stop = text.strip().split()[1]  # a word the greedy reply reaches
    message = client.messages.create(model=model, messages=ASK, max_tokens=16, **GREEDY, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text and text.startswith(message.content[0].text)


def test_forced_tool_use_round_trip(client, model):
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    message = client.messages.create(model=model, messages=ask, tools=[WEATHER], max_tokens=100, **GREEDY,
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use", message
    use = next(block for block in message.content if block.type == "tool_use")
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input["city"] in ("Paris", "London") and use.input["unit"] in ("celsius", "fahrenheit")
    with client.messages.stream(model=model, messages=ask, tools=[WEATHER], max_tokens=100, **GREEDY,
                                tool_choice={"type": "any"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert next(b for b in streamed.content if b.type == "tool_use").input == use.input
    answer = client.messages.create(
        model=model, max_tokens=12, **GREEDY, tools=[WEATHER], tool_choice={"type": "none"},
        messages=[*ask, {"role": "assistant", "content": message.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "sunny, 21 C"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text


def test_errors_through_the_anthropic_client(client, model):
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, messages=ASK, max_tokens=4, extra_body={"temperature": -1})
    assert bad.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": bad.value.body["error"]["message"]}}
    assert "temperature" in bad.value.body["error"]["message"]


def test_structured_output_through_messages_parse(client, model):
    parsed = client.messages.parse(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                   max_tokens=64, output_format=Verdict, **GREEDY)
    assert parsed.stop_reason == "end_turn", parsed.content
    assert isinstance(parsed.parsed_output, Verdict)
    assert Verdict.model_validate_json(parsed.content[0].text) == parsed.parsed_output


def test_the_thinking_budget_ends_the_thinking(client, thinking_client, model):
    # The tiny model never writes </think>: for deepseek_r1 its whole reply is thinking, and the
    # budget of 5 tokens ends it after exactly 5 (one token a step), the plain reply's first 5.
    plain = client.messages.create(model=model, messages=ASK, max_tokens=5, **GREEDY).content[0].text
    ask = {"model": model, "messages": ASK, "max_tokens": 12, "thinking": {"type": "enabled", "budget_tokens": 5},
           **GREEDY}
    message = thinking_client.messages.create(**ask)
    assert [block.type for block in message.content] == ["thinking"] and message.stop_reason == "max_tokens"
    assert message.content[0].thinking == plain
    assert message.usage.output_tokens == message.usage.output_tokens_details.thinking_tokens == 5
    with thinking_client.messages.stream(**ask) as stream:
        deltas = [event.thinking for event in stream if event.type == "thinking"]
        final = stream.get_final_message()
    assert len(deltas) > 1 and "".join(deltas) == plain == final.content[0].thinking
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens_details.thinking_tokens == 5
    unbudgeted = thinking_client.messages.create(model=model, messages=ASK, max_tokens=12, **GREEDY)
    assert unbudgeted.usage.output_tokens == unbudgeted.usage.output_tokens_details.thinking_tokens == 12
