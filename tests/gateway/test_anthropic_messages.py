"""POST /v1/messages (Anthropic's Messages API) over the fake engine: validation errors in
Anthropic's shape, the request mapped onto the chat path, stop_reason and usage, the event stream,
tool_use both ways, and the real `anthropic` client."""

from __future__ import annotations

import json

import anthropic
import grpc
import httpx2
import pytest

from gateway.openai.api_server import create_app
from tests.gateway.conftest import SCRIPT_TEXTS
from tests.gateway.test_tool_calls import CALL_TEXT

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def events_of(body: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of an Anthropic stream."""
    out = []
    for frame in body.split("\n\n"):
        if not frame.strip():
            continue
        name, data = frame.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), frame
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        out.append((payload["type"], payload))
    return out


async def post(gateway, **body):
    return await gateway.http.post("/v1/messages", json={"messages": ASK, "max_tokens": 64, **body})


async def test_a_message_reply_with_usage_equal_to_the_token_counts(gateway, upstream, tokenizer):
    reply = await post(gateway, system=[{"type": "text", "text": "Be brief."}], temperature=0.5, top_k=5,
                       top_p=0.9, metadata={"user_id": "u-1"}, cache_control={"type": "ephemeral"},
                       thinking={"type": "disabled"}, service_tier="auto")
    assert reply.status_code == 200, reply.text
    message = reply.json()
    assert message["id"].startswith("msg_") and message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [{"type": "text", "text": SCRIPT_TEXTS[0]}]
    assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
    sent = upstream.engine.requests[-1]
    assert message["usage"] == {"input_tokens": len(sent.prompt_token_ids),
                                "output_tokens": len(tokenizer.encode(SCRIPT_TEXTS[0], add_special_tokens=False))}
    assert (sent.sampling.max_tokens, sent.sampling.top_k) == (64, 5)
    assert sent.sampling.temperature == pytest.approx(0.5) and sent.sampling.top_p == pytest.approx(0.9)
    prompt = tokenizer.decode(list(sent.prompt_token_ids), skip_special_tokens=False)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt and "Weather in Paris?" in prompt


async def test_stop_reasons(gateway):
    assert (await post(gateway, max_tokens=3)).json()["stop_reason"] == "max_tokens"
    message = (await post(gateway, stop_sequences=["end"])).json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "end")
    assert message["content"][0]["text"] == SCRIPT_TEXTS[0][:SCRIPT_TEXTS[0].index("end")]


@pytest.mark.parametrize("body, status, message", [
    ({"messages": ASK}, 400, "max_tokens"),  # required, as Anthropic's
    ({"messages": ASK, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [], "max_tokens": 8}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 8}, 400, "messages.0.role"),
    # a system message (served anywhere: test_agent_clients.py) holds text only
    ({"messages": [{"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
      "max_tokens": 8}, 400, "served: text"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"}}]}],
      "max_tokens": 8}, 400, "does not take images"),  # a text-only model (docs/vision.md)
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}], "max_tokens": 8}, 400,
     "document"),
    ({"messages": ASK, "max_tokens": 8, "frequency_penalty": 1}, 400, "frequency_penalty"),
    ({"messages": ASK, "max_tokens": 8, "temperature": -1}, 400, "temperature"),
    ({"messages": ASK, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 4}}, 400, "--reasoning-parser"),
    ({"messages": ASK, "max_tokens": 8, "tools": [WEATHER]}, 400, "--enable-auto-tool-choice"),
    ({"messages": ASK, "max_tokens": 8, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     400, "not in tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
      "max_tokens": 8}, 400, "assistant"),
    ({"messages": ASK, "max_tokens": 8, "model": "no-such-model"}, 404, "no-such-model"),
])
async def test_bad_requests_in_anthropic_shape(gateway, upstream, body, status, message):
    reply = await gateway.http.post("/v1/messages", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert message in error["error"]["message"]
    assert not upstream.engine.requests
    bad_json = await gateway.http.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"


async def test_the_event_stream(gateway, upstream, tokenizer):
    reply = await post(gateway, stream=True, max_tokens=5)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = events_of(reply.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    input_tokens = len(upstream.engine.requests[-1].prompt_token_ids)
    assert start["usage"] == {"input_tokens": input_tokens, "output_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta")
    assert text == tokenizer.decode(tokenizer.encode(SCRIPT_TEXTS[0], add_special_tokens=False)[:5])
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": input_tokens, "output_tokens": 5}


async def test_a_mid_stream_failure_is_an_error_event(gateway, upstream):
    upstream.engine.fail_after_responses = 1
    events = events_of((await post(gateway, stream=True)).text)
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"


async def test_tool_use_reply_whole_and_streamed(make_gateway, upstream, tokenizer):
    upstream.engine.max_model_len = 4096
    upstream.engine.scripts = [tokenizer.encode(CALL_TEXT, add_special_tokens=False)]
    gateway = await make_gateway(enable_auto_tool_choice=True)
    message = (await post(gateway, tools=[WEATHER], max_tokens=100)).json()
    assert message["stop_reason"] == "tool_use"
    text, use = message["content"]
    assert text == {"type": "text", "text": "Sure."}
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_") and use["name"] == "get_weather"
    assert use["input"] == {"city": "Paris"}
    events = events_of((await post(gateway, tools=[WEATHER], max_tokens=100, stream=True)).text)
    starts = [e for n, e in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"] and starts[1]["index"] == 1
    assert starts[1]["content_block"]["name"] == "get_weather" and starts[1]["content_block"]["input"] == {}
    partial = "".join(e["delta"]["partial_json"] for n, e in events
                      if n == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert [e["index"] for n, e in events if n == "content_block_stop"] == [0, 1]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_tool_turns_and_choices_reach_the_chat_path(make_gateway, upstream, tokenizer):
    upstream.engine.max_model_len = 4096
    gateway = await make_gateway()
    history = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]
    reply = await post(gateway, messages=history, tools=[WEATHER], tool_choice={"type": "none"})
    assert reply.status_code == 200, reply.text
    prompt = tokenizer.decode(list(upstream.engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt and "Let me look." in prompt
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        assert (await post(gateway, tools=[WEATHER], tool_choice=choice)).status_code == 200
        sent = upstream.engine.requests[-1].sampling.structured_outputs
        assert sent.kind == "grammar" and "get_weather" in sent.spec


def anthropic_client(gateway, api_key: str) -> anthropic.AsyncAnthropic:
    """The real client over the app in process (anthropic 2.x speaks httpx2)."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=create_app(gateway.state)), base_url="http://gateway")
    return anthropic.AsyncAnthropic(base_url="http://gateway", api_key=api_key, http_client=http, max_retries=0)


async def test_the_anthropic_client_with_x_api_key(make_gateway):
    gateway = await make_gateway(api_key="sk-test")
    client = anthropic_client(gateway, "sk-test")
    message = await client.messages.create(model="", max_tokens=64, messages=ASK)
    assert message.content[0].text == SCRIPT_TEXTS[0] and message.stop_reason == "end_turn"
    async with client.messages.stream(model="", max_tokens=64, messages=ASK) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == SCRIPT_TEXTS[0] and final.usage.output_tokens == message.usage.output_tokens
    bearer = await gateway.http.post("/v1/messages", json={"messages": ASK, "max_tokens": 8},
                                     headers={"authorization": "Bearer sk-test"})
    assert bearer.status_code == 200
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await anthropic_client(gateway, "wrong").messages.create(model="", max_tokens=8, messages=ASK)
    assert refused.value.status_code == 401 and refused.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("code, status, error_type", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),  # the engine's queue is full
    (grpc.StatusCode.UNAVAILABLE, 503, "overloaded_error"),
])
async def test_upstream_refusals_keep_their_status(gateway, upstream, code, status, error_type):
    upstream.engine.fail_code = code
    reply = await post(gateway)
    assert reply.status_code == status and reply.headers["retry-after"]
    assert reply.json()["error"]["type"] == error_type
