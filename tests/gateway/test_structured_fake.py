"""Structured outputs at the gateway: every spelling (response_format, structured_outputs, guided_*)
reaches the engine as one (kind, spec); bad or conflicting specs are a 400 before admission."""

from __future__ import annotations

import json

import pytest

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, kind, spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "strict": True}}},
     "json", json.dumps(SCHEMA, sort_keys=True)),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
    ({"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA, sort_keys=True)),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "grammar", 'root ::= "a" | "b"'),
    ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA, sort_keys=True)),
    ({"guided_regex": "a+"}, "regex", "a+"),
    ({"guided_choice": ["x", "y"]}, "choice", '["x", "y"]'),
    ({"guided_grammar": 'start: "x"'}, "grammar", 'start: "x"'),
])
@pytest.mark.parametrize("path, base", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "Hi"})])
async def test_every_spelling_reaches_the_engine(gateway, upstream, path, base, fields, kind, spec):
    reply = await gateway.http.post(path, json={**base, **fields})
    assert reply.status_code == 200, reply.text
    sent = upstream.engine.requests[0].sampling.structured_outputs
    assert (sent.kind, sent.spec) == (kind, spec)


async def test_text_format_is_unconstrained(gateway, upstream):
    reply = await gateway.http.post("/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}})
    assert reply.status_code == 200
    assert not upstream.engine.requests[0].sampling.HasField("structured_outputs")


@pytest.mark.parametrize("fields, message", [
    ({"structured_outputs": {"regex": "(("}}, "invalid regex"),
    ({"guided_json": {"type": "nonsense"}}, "invalid json"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "invalid grammar"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "not 2"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "whitespace": 1}}, "structured_outputs"),
])
async def test_bad_or_conflicting_specs_are_400(gateway, upstream, fields, message):
    reply = await gateway.http.post("/v1/chat/completions", json={**CHAT, **fields})
    assert reply.status_code == 400, reply.text
    assert message in json.dumps(reply.json()["error"])
    assert not upstream.engine.requests
