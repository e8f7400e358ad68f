"""POST /v1/responses over real worker, scheduler and gateway processes (the tiny generated model),
driven by the real `openai` client: `client.responses.create`, whole and streamed, instructions,
text.format, and a function-call round trip (the call forced by tool_choice, as the chat tool
tests do: a grammar guarantees the call and its arguments)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow
ASK = "Tell me about the river."
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(gateway_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_stack.http_url}/v1", api_key="unused", max_retries=0)


def greedy_chat(client, model, messages, max_tokens: int = 12) -> str:
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def test_create_answers_as_the_chat_does(client, gateway_stack):
    model = gateway_stack.model_dir
    response = client.responses.create(model=model, input=ASK, max_output_tokens=12, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == model
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.output_text == greedy_chat(client, model, [{"role": "user", "content": ASK}])
    briefed = client.responses.create(model=model, instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]}], max_output_tokens=12, temperature=0)
    assert briefed.output_text == greedy_chat(client, model, [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": ASK}])


def test_streamed_events_make_the_same_text(client, gateway_stack):
    model = gateway_stack.model_dir
    whole = client.responses.create(model=model, input=ASK, max_output_tokens=16, temperature=0)
    events = list(client.responses.create(model=model, input=ASK, max_output_tokens=16, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 16


def test_text_format_json_schema_is_followed(client, gateway_stack):
    response = client.responses.create(
        model=gateway_stack.model_dir, input="Is the sky blue? Answer in JSON.", temperature=0,
        max_output_tokens=64, text={"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA,
                                               "strict": True}})
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_function_call_round_trip(client, gateway_stack):
    model = gateway_stack.model_dir
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    response = client.responses.create(model=model, input=ask, tools=[WEATHER], temperature=0,
                                       max_output_tokens=100, tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow_up = ask + [call.model_dump(exclude_none=True),
                       {"type": "function_call_output", "call_id": call.call_id,
                        "output": json.dumps({"temperature": 21, "sky": "sunny"})}]
    final = client.responses.create(model=model, input=follow_up, tools=[WEATHER], tool_choice="none",
                                    temperature=0, max_output_tokens=8)
    plain = client.responses.create(model=model, input=ask, tools=[WEATHER], tool_choice="none",
                                    max_output_tokens=1)
    assert [item.type for item in final.output] == ["message"]
    assert final.usage.input_tokens > plain.usage.input_tokens + 20  # the call and its output are in the prompt


def test_streamed_function_call(client, gateway_stack):
    events = list(client.responses.create(model=gateway_stack.model_dir, input="Weather in Paris?",
                                          tools=[WEATHER], tool_choice="required", temperature=0,
                                          max_output_tokens=100, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert added.item.name == "get_weather" and arguments == events[-3].arguments
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert call.call_id == added.item.call_id and call.arguments == arguments
