"""Acceptance 1 of issue 23: structured outputs with the real `openai` client on the real default
model (SmolLM2-135M-Instruct) through real worker, scheduler and gateway processes."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

STR = {"type": "string", "maxLength": 24}
INT = {"type": "integer", "minimum": 0, "maximum": 9999}


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


# 20 schemas: nested objects, enums, arrays, required and optional fields, numbers, booleans.
SCHEMAS = [
    obj({"name": STR, "age": INT}),
    obj({"city": STR, "country": STR, "population": INT}),
    obj({"answer": {"enum": ["yes", "no", "maybe"]}}),
    obj({"title": STR, "tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 3}}),
    obj({"person": obj({"first": STR, "last": STR}), "email": STR}),
    obj({"ok": {"type": "boolean"}, "reason": STR}),
    obj({"x": {"type": "number", "minimum": -100, "maximum": 100},
         "y": {"type": "number", "minimum": -100, "maximum": 100}}),
    obj({"color": {"enum": ["red", "green", "blue"]}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"items": {"type": "array", "maxItems": 3, "items": obj({"sku": STR, "qty": INT})}}),
    obj({"user": obj({"id": INT, "roles": {"type": "array", "maxItems": 2,
                                           "items": {"enum": ["admin", "editor", "viewer"]}}})}),
    obj({"capital": STR, "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]}}),
    obj({"summary": STR, "score": {"type": "integer", "minimum": 1, "maximum": 5}}),
    obj({"a": STR, "b": STR, "c": STR}, required=["a"]),
    obj({"matrix": {"type": "array", "maxItems": 2,
                    "items": {"type": "array", "maxItems": 2, "items": INT}}}),
    obj({"event": obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                       "place": STR})}),
    obj({"status": {"enum": ["open", "closed"]}, "count": INT, "flag": {"type": "boolean"}}),
    obj({"book": obj({"title": STR, "author": obj({"name": STR, "born": INT})})}),
    obj({"languages": {"type": "array", "minItems": 2, "maxItems": 4, "items": STR}}),
    obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60},
         "unit": {"enum": ["C", "F"]}}),
    obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "active": {"type": "boolean"},
         "notes": {"anyOf": [STR, {"type": "null"}]}}),
]
QUESTIONS = ["Describe a person.", "Describe a city.", "Is the sky blue?", "Write a blog post title.",
             "Give a contact.", "Is water wet?", "Give a point.", "Pick a color.", "Make an order.",
             "Describe a user.", "What is the capital of France?", "Rate a movie.", "Give three words.",
             "Give a small matrix.", "Describe an event.", "Describe a ticket.", "Describe a book.",
             "Which languages are popular?", "What is the weather?", "Describe an account."]


@pytest.fixture(scope="module")
def async_client(smollm2_api) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{smollm2_api}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(smollm2_api) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2_api}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_twenty_json_schemas_all_parse_and_validate(async_client, model):
    assert len(SCHEMAS) == 20 and len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == 20

    async def ask(schema: dict, question: str):
        return await async_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{question} Answer in JSON."}],
            temperature=0, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                    "strict": True}})

    async def all_at_once():
        return await asyncio.gather(*(ask(s, q) for s, q in zip(SCHEMAS, QUESTIONS, strict=True)))

    replies = asyncio.run(all_at_once())
    valid = 0
    for schema, reply in zip(SCHEMAS, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content  # ended by the grammar, not length
        jsonschema.validate(json.loads(choice.message.content), schema)
        valid += 1
    assert valid == 20


def test_json_object_and_streamed_json_schema(client, model):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe Paris."}],
                                           temperature=0, max_tokens=300, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Describe a person."}], temperature=0,
        max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_choice_always_returns_one_of_the_choices(client, model):
    choices = ["Paris", "London", "Berlin", "Madrid"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Which city is in Germany?"}],
            temperature=1.0, seed=3, n=4, max_tokens=16, extra_body=extra)
        assert all(c.message.content in choices for c in reply.choices)
    completion = client.completions.create(model=model, prompt="The best fruit is", max_tokens=8, n=3,
                                           temperature=1.0, extra_body={"guided_choice": ["apple", "pear"]})
    assert all(c.text in ("apple", "pear") for c in completion.choices)


def test_regex_is_matched(client, model):
    pattern = r"[A-Z][a-z]+, [0-9]{4}"
    for extra in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a city and a year."}],
            temperature=0.7, seed=1, n=2, max_tokens=20, extra_body=extra)
        for choice in reply.choices:
            assert re.fullmatch(pattern, choice.message.content), choice.message.content


def test_grammar_and_a_bad_schema(client, model):
    reply = client.completions.create(model=model, prompt="Answer yes or no: is fire hot?", max_tokens=4,
                                      temperature=0, extra_body={"structured_outputs": {
                                          "grammar": 'root ::= "yes" | "no"'}})
    assert reply.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="invalid json"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}})
