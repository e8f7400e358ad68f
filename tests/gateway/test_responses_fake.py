"""POST /v1/responses over the fake engine: input forms, instructions, max_output_tokens, usage,
the streamed event sequence, text.format, function calls both ways, and the errors."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.gateway.conftest import SCRIPT_TEXTS
from tests.gateway.test_errors_fake import assert_openai_error
from tests.gateway.test_tool_calls import CALL_TEXT, TIME, WEATHER, tools_gateway  # noqa: F401 - a fixture

PATH = "/v1/responses"
EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
TIME_TOOL = {"type": "function", **TIME["function"]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"], "additionalProperties": False}


def sent_prompt(upstream, tokenizer) -> str:
    return tokenizer.decode(list(upstream.engine.requests[-1].prompt_token_ids), skip_special_tokens=False)


def parse(reply) -> Response:
    assert reply.status_code == 200, reply.text
    return Response.model_validate(reply.json())


def events_of(body: str) -> list:
    """The events of a Responses stream: `event: <type>` then `data: <json>` each, no [DONE]."""
    blocks = [block for block in body.split("\n\n") if block]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        event = EVENT.validate_python(json.loads(data[len("data: "):]))
        assert event.type == name[len("event: "):]
        events.append(event)
    return events


async def test_a_string_input_is_one_user_message(gateway, upstream, tokenizer, scripts):
    model = upstream.engine.model_name
    response = parse(await gateway.http.post(PATH, json={"model": model, "input": "Hi there"}))
    assert response.model == model and response.object == "response" and response.id.startswith("resp_") and response.status == "completed"
    assert response.incomplete_details is None and response.error is None
    assert response.output_text == SCRIPT_TEXTS[0]
    [message] = response.output
    assert (message.type, message.role, message.status, message.content[0].type) == (
        "message", "assistant", "completed", "output_text")
    assert sent_prompt(upstream, tokenizer).endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    usage = response.usage
    assert usage.input_tokens == len(upstream.engine.requests[-1].prompt_token_ids)
    assert usage.output_tokens == len(scripts[0]) and usage.total_tokens == usage.input_tokens + usage.output_tokens


async def test_items_and_instructions_become_the_chat(gateway, upstream, tokenizer):
    parse(await gateway.http.post(PATH, json={"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Answer in English."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                        {"type": "input_text", "text": " there"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
         "id": "msg_1", "status": "completed"},
        {"role": "user", "content": "Bye"}]}))
    prompt = sent_prompt(upstream, tokenizer)
    assert ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>system\nAnswer in English.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n") in prompt
    assert prompt.index("Be brief.") < prompt.index("Answer in English.")


async def test_sampling_fields_reach_the_engine(gateway, upstream):
    parse(await gateway.http.post(PATH, json={"input": "Hi", "temperature": 0.5, "top_p": 0.9,
                                              "max_output_tokens": 50, "store": False,
                                              "metadata": {"k": "v"}, "user": "u"}))
    sampling = upstream.engine.requests[-1].sampling
    assert (sampling.temperature, sampling.max_tokens) == (0.5, 50) and sampling.top_p == pytest.approx(0.9)


async def test_max_output_tokens_makes_it_incomplete(gateway, upstream, tokenizer, scripts):
    response = parse(await gateway.http.post(PATH, json={"input": "Hi", "max_output_tokens": 3}))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.max_output_tokens == 3
    assert response.output_text == tokenizer.decode(scripts[0][:3]) and response.output[0].status == "incomplete"


async def test_stream_events_in_order_and_deltas_make_the_text(gateway):
    whole = parse(await gateway.http.post(PATH, json={"input": "Hi"}))
    reply = await gateway.http.post(PATH, json={"input": "Hi", "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = events_of(reply.text)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas, "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == SCRIPT_TEXTS[0]
    assert events[-4].text == text and events[-3].part.text == text
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in events[3:-2])
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text and final.output[0].id == item_id
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id


async def test_a_cut_stream_ends_incomplete(gateway):
    events = events_of((await gateway.http.post(PATH, json={"input": "Hi", "stream": True,
                                                            "max_output_tokens": 3})).text)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"


@pytest.mark.parametrize("text_format, kind", [
    ({"type": "json_schema", "name": "pair", "schema": SCHEMA, "strict": True}, "json"),
    ({"type": "json_object"}, "json_object"),
])
async def test_text_format_asks_for_json(gateway, upstream, tokenizer, text_format, kind):
    upstream.engine.scripts = [tokenizer.encode('{"a": 1, "b": "x"}', add_special_tokens=False)]
    response = parse(await gateway.http.post(PATH, json={"input": "Give a pair", "text": {"format": text_format}}))
    sent = upstream.engine.requests[-1].sampling.structured_outputs
    assert sent.kind == kind and (kind != "json" or json.loads(sent.spec) == SCHEMA)
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == text_format["type"]


async def test_a_call_in_the_reply_becomes_a_function_call_item(tools_gateway, upstream, tokenizer):  # noqa: F811
    upstream.engine.scripts = [tokenizer.encode(CALL_TEXT, add_special_tokens=False)]
    gateway = await tools_gateway(enable_auto_tool_choice=True)
    body = {"input": "Weather in Paris?", "tools": [WEATHER_TOOL], "max_output_tokens": 100}
    response = parse(await gateway.http.post(PATH, json=body))
    message, call = response.output
    assert message.content[0].text == "Sure." and call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert response.tools[0].name == "get_weather" and response.tool_choice == "auto"
    events = events_of((await gateway.http.post(PATH, json={**body, "stream": True})).text)
    kinds = [e.type for e in events]
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    added, done, final = events[-5], events[-2], events[-1].response
    assert added.item.name == "get_weather" and added.output_index == 1 and added.item.arguments == ""
    assert json.loads(events[-3].arguments) == {"city": "Paris"} == json.loads(done.item.arguments)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure. "
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].call_id == added.item.call_id == done.item.call_id


async def test_the_round_trip_input_renders_the_call_and_its_output(tools_gateway, upstream, tokenizer):  # noqa: F811
    gateway = await tools_gateway()
    parse(await gateway.http.post(PATH, json={"tools": [WEATHER_TOOL], "tool_choice": "none", "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]}))
    prompt = sent_prompt(upstream, tokenizer)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


@pytest.mark.parametrize("choice, names", [("required", ["get_weather", "get_time"]),
                                           ({"type": "function", "name": "get_time"}, ["get_time"])])
async def test_required_and_named_tool_choice_force_a_call(tools_gateway, upstream, choice, names):  # noqa: F811
    gateway = await tools_gateway()
    response = parse(await gateway.http.post(PATH, json={"input": "Weather?", "tools": [WEATHER_TOOL, TIME_TOOL],
                                                         "tool_choice": choice}))
    sent = upstream.engine.requests[-1].sampling.structured_outputs
    assert sent.kind == "grammar" and all(name in sent.spec for name in names)
    assert ("get_weather" in sent.spec) == (len(names) == 2)
    assert response.tool_choice == choice or response.tool_choice.name == "get_time"


@pytest.mark.parametrize("body, part", [
    ({}, "input"),
    ({"input": []}, "input: List should have at least 1 item"),
    ({"input": 3}, "input is a string or a list of items"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]: image URLs from 'x' are refused"),  # docs/vision.md
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input.0.message.content: only text and image parts (input_text, output_text, input_image) are served, "
     "not input_file"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.message.role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "an input item is a message"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.function_call_output.call_id"),
    ({"input": "Hi", "store": True}, "store"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "Hi", "reasoning": {"effort": 3}}, "reasoning.effort"),  # what efforts do: test_agent_clients.py
    ({"input": "Hi", "reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include values not served"),
    ({"input": "Hi", "frequency_penalty": 1}, "frequency_penalty"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "invalid json"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "required"}, "name"),
    ({"input": "Hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "not in tools"),
    ({"input": "Hi", "tools": [WEATHER_TOOL]}, "--enable-auto-tool-choice"),
    # built-in tools are accepted and not offered (test_agent_clients.py): they cannot be required
    ({"input": "Hi", "tools": [{"type": "web_search"}], "tool_choice": "required"}, "needs a function tool"),
])
async def test_bad_requests_are_400(gateway, upstream, body, part):
    assert_openai_error(await gateway.http.post(PATH, json=body), 400, part)
    assert not upstream.engine.requests


async def test_unknown_model_is_404_and_a_full_queue_429(gateway, upstream):
    assert_openai_error(await gateway.http.post(PATH, json={"model": "gpt-9", "input": "Hi"}), 404, "gpt-9")
    upstream.engine.fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    for stream in (False, True):
        reply = await gateway.http.post(PATH, json={"input": "Hi", "stream": stream})
        assert_openai_error(reply, 429, "RESOURCE_EXHAUSTED")
