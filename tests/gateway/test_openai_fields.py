"""Acceptance 5 of issue 23: every field of OpenAI's completion and chat request schemas (read from
the installed `openai` client) is either honoured or rejected with a 400 naming it."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from gateway.openai.request_fields import CONDITIONAL, HONOURED_CHAT, HONOURED_COMPLETION, INFORMATIONAL
from tests.gateway.conftest import sse_events

COMPLETION_FIELDS = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsStreaming))
CHAT_FIELDS = set(typing.get_type_hints(chat_create_params.CompletionCreateParamsStreaming))

# A value other than the default for every CONDITIONAL field (each must be a 400 naming it).
NON_DEFAULT = {
    "suffix": " and then", "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {"search_context_size": "low"}, "moderation": {"model": "m"}, "store": True,
}
# The value each INFORMATIONAL field is sent with (must be a 200).
INFORMATIVE = {
    "user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s", "service_tier": "auto",
    "prompt_cache_key": "k", "prompt_cache_options": {"ttl": "5m"}, "prompt_cache_retention": "24h",
}
BASES = {"completion": ("/v1/completions", {"prompt": "Hi"}),
         "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})}


def test_every_openai_field_is_in_the_table():
    for fields, honoured in ((COMPLETION_FIELDS, HONOURED_COMPLETION), (CHAT_FIELDS, HONOURED_CHAT)):
        classified = honoured | (INFORMATIONAL & fields) | (CONDITIONAL.keys() & fields)
        assert fields == classified, (fields - classified, classified - fields)
        assert not honoured & CONDITIONAL.keys()
    assert INFORMATIONAL <= CHAT_FIELDS and set(NON_DEFAULT) == set(CONDITIONAL)


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
async def test_conditional_fields_are_400_naming_the_field(gateway, endpoint):
    path, base = BASES[endpoint]
    fields = COMPLETION_FIELDS if endpoint == "completion" else CHAT_FIELDS
    for name in sorted(CONDITIONAL.keys() & fields):
        reply = await gateway.http.post(path, json={**base, name: NON_DEFAULT[name]})
        assert reply.status_code == 400, (name, reply.text)
        error = reply.json()["error"]
        assert error["param"] == name and name in error["message"], error


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
async def test_defaults_and_informational_fields_are_accepted(gateway, endpoint):
    path, base = BASES[endpoint]
    fields = COMPLETION_FIELDS if endpoint == "completion" else CHAT_FIELDS
    defaults = {"suffix": None, "best_of": 1, "modalities": ["text"], "tool_choice": "none",
                "store": False, "tools": [], "response_format": {"type": "text"}, "parallel_tool_calls": True}
    body = {**base, **{k: v for k, v in INFORMATIVE.items() if k in fields},
            **{k: v for k, v in defaults.items() if k in fields}}
    reply = await gateway.http.post(path, json=body)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
async def test_unknown_field_is_400_naming_it(gateway, endpoint):
    path, base = BASES[endpoint]
    reply = await gateway.http.post(path, json={**base, "use_fancy_search": True})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "use_fancy_search"
    reply = await gateway.http.post(path, json={**base, "stream": True,
                                                "stream_options": {"include_usage": True, "x": 1}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options.x"


async def test_non_text_content_and_function_call_turns_are_400(gateway):
    # an image for a text-only model; an http URL outside --allowed-media-domains (docs/vision.md)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"}}
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}]})
    assert reply.status_code == 400 and "does not take images" in reply.json()["error"]["message"]
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages[0].content[1]"
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})
    assert reply.status_code == 400 and "messages.0.content" in reply.json()["error"]["param"]
    turn = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}, turn]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages.1.function_call"
    echoed = {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None}
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}, echoed, {"role": "user", "content": "Go"}]})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
async def test_continuous_usage_stats_put_usage_so_far_on_every_chunk(gateway, endpoint):
    path, base = BASES[endpoint]
    reply = await gateway.http.post(path, json={
        **base, "max_tokens": 64, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(e) for e in sse_events(reply.text)[:-1]]
    with_content = [c for c in chunks if c["choices"] and c["usage"] is not None]
    completion_tokens = [c["usage"]["completion_tokens"] for c in with_content]
    assert len(with_content) >= 2 and completion_tokens == sorted(completion_tokens)
    assert completion_tokens[-1] == chunks[-1]["usage"]["completion_tokens"]
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in with_content)


async def test_logit_bias_allowed_ids_and_bad_words_reach_the_engine(gateway, upstream, tokenizer):
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "logit_bias": {"5": -100, "7": 2.5},
        "allowed_token_ids": [5, 7, 9], "bad_words": ["world"]})
    assert reply.status_code == 200, reply.text
    s = upstream.engine.requests[0].sampling
    assert dict(s.logit_bias) == {5: -100.0, 7: 2.5} and list(s.allowed_token_ids) == [5, 7, 9]
    expected = {tuple(tokenizer.encode(w, add_special_tokens=False)) for w in ("world", " world")}
    assert {tuple(w.token_ids) for w in s.bad_words} == expected


@pytest.mark.parametrize("fields", [{"logit_bias": {"5": 100.5}}, {"logit_bias": {"5000": 1}},
                                    {"logit_bias": {"x": 1}}, {"allowed_token_ids": []},
                                    {"allowed_token_ids": [1, 5000]}])
async def test_bad_token_constraints_are_400(gateway, upstream, fields):
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi", **fields})
    assert reply.status_code == 400 and next(iter(fields)) in reply.json()["error"]["message"]
    assert not upstream.engine.requests


async def test_best_of_is_the_beam_width_of_vllms_use_beam_search(gateway, upstream):
    """best_of > 1 is beam search only (sampling best_of candidates is not served): a 400 without
    use_beam_search; with it, n beams of width best_of reach the engine, ranked by raw logprobs."""
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi", "best_of": 3})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "best_of"
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi", "n": 3, "best_of": 2,
                                                             "use_beam_search": True})
    assert reply.status_code == 400 and "best_of (2) must be at least n (3)" in reply.text
    reply = await gateway.http.post("/v1/completions", json={"prompt": "Hi", "n": 2, "best_of": 3,
                                                             "use_beam_search": True, "logprobs": 2})
    assert reply.status_code == 400 and "logprobs" in reply.json()["error"]["message"]
    assert not upstream.engine.requests
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": "Hi", "n": 2, "best_of": 3, "use_beam_search": True, "length_penalty": 0.5,
        "temperature": 0.7})
    assert reply.status_code == 200, reply.text
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "n": 2, "use_beam_search": True})
    assert reply.status_code == 200, reply.text
    completion, chat = (r.sampling for r in upstream.engine.requests)
    assert (completion.n, completion.beam_width, completion.length_penalty) == (2, 3, 0.5)
    assert completion.temperature == 1.0  # 0.7 dropped: beams rank by the raw logprobs
    assert (chat.n, chat.beam_width, chat.length_penalty) == (2, 2, 1.0)
