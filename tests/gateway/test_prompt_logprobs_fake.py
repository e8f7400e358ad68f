"""Prompt logprobs through the gateway over the fake engine: completions `echo` + `logprobs`
(JSON and SSE), vLLM's `prompt_logprobs` on completions and chat, the public gRPC API, and 400s.

The fake engine sends prompt token i (from 1) with logprob -1 - 0.01*i, rank i, and top k
token, token+1, ... (tests/gateway/fake_engine.py), on its first response."""

from __future__ import annotations

import json

import pytest

from pagoda.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import sse_events
from tests.gateway.test_grpc_fake import collect, public  # noqa: F401 - the fixture


def prompt_logprob(i: int) -> float:
    return -1.0 - 0.01 * i


async def test_echo_with_logprobs_covers_the_prompt_tokens_first(gateway, upstream, tokenizer):
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": "Hi there", "echo": True, "logprobs": 2, "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    request = upstream.engine.requests[0]
    assert request.sampling.prompt_logprobs == 2  # echo + logprobs asks the engine for them
    prompt_ids, output_ids = list(request.prompt_token_ids), upstream.engine.scripts[0][:3]
    logprobs, num_prompt = choice["logprobs"], len(prompt_ids)
    assert choice["text"].startswith("Hi there")
    assert logprobs["tokens"] == tokenizer.token_texts(prompt_ids + output_ids)
    # The first prompt token has nothing before it: null, as OpenAI and vLLM answer.
    assert logprobs["token_logprobs"] == [None] + [prompt_logprob(i) for i in range(1, num_prompt)] \
        + [-0.5, -0.6, -0.7]
    assert logprobs["top_logprobs"][0] is None
    second = prompt_ids[1]
    assert logprobs["top_logprobs"][1] == {tokenizer.token_text(second): prompt_logprob(1),
                                           tokenizer.token_text(second + 1): prompt_logprob(1) - 1}
    # Offsets: the echoed tokens from 0, then the completion's at their place after the prompt text.
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][num_prompt] == len("Hi there")
    # vLLM's prompt_logprobs rides along (it does whenever the engine computed them).
    assert len(choice["prompt_logprobs"]) == num_prompt and choice["prompt_logprobs"][0] is None


async def test_streamed_echo_sends_the_prompt_and_its_logprobs_in_the_first_chunk(gateway, upstream, tokenizer):
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": "Hi there", "echo": True, "logprobs": 1, "max_tokens": 4, "stream": True})
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    prompt_ids = list(upstream.engine.requests[0].prompt_token_ids)
    first = chunks[0]
    assert first["text"].startswith("Hi there")
    assert first["logprobs"]["tokens"][:len(prompt_ids)] == tokenizer.token_texts(prompt_ids)
    assert first["logprobs"]["token_logprobs"][:2] == [None, prompt_logprob(1)]
    assert all(len(c["logprobs"]["tokens"]) <= 2 for c in chunks[1:])  # the rest: completion only
    assert all("prompt_logprobs" not in c for c in chunks)  # vLLM streams no prompt_logprobs
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert tokens == tokenizer.token_texts(prompt_ids + upstream.engine.scripts[0][:4])


async def test_echo_of_several_prompts_and_n2(gateway, upstream, tokenizer):
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": ["Hi", "Hi there friend"], "n": 2, "echo": True, "logprobs": 0, "max_tokens": 2})
    choices = reply.json()["choices"]
    by_suffix = {r.request_id.rsplit("-", 1)[1]: list(r.prompt_token_ids) for r in upstream.engine.requests}
    assert len(choices) == 4
    for choice in choices:  # index = prompt index * n + sequence index
        prompt = by_suffix[str(choice["index"] // 2)]
        output = upstream.engine.scripts[choice["index"] % 2][:2]
        assert choice["logprobs"]["tokens"] == tokenizer.token_texts(prompt + output)
        assert choice["logprobs"]["token_logprobs"][:len(prompt)] == \
            [None] + [prompt_logprob(i) for i in range(1, len(prompt))]


async def test_prompt_logprobs_field_on_completions(gateway, upstream, tokenizer):
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": "Hi there", "prompt_logprobs": 1, "max_tokens": 2})
    choice = reply.json()["choices"][0]
    prompt_ids = list(upstream.engine.requests[0].prompt_token_ids)
    assert upstream.engine.requests[0].sampling.prompt_logprobs == 1
    assert choice["logprobs"] is None and not choice["text"].startswith("Hi there")  # no echo
    got = choice["prompt_logprobs"]
    assert len(got) == len(prompt_ids) and got[0] is None
    token = prompt_ids[1]
    # The prompt token (its rank from the engine), then the top k (ranks 1..k).
    assert got[1] == {str(token): {"logprob": prompt_logprob(1), "rank": 1,
                                   "decoded_token": tokenizer.token_text(token)}}
    assert list(got[2]) == [str(prompt_ids[2])] and got[2][str(prompt_ids[2])]["rank"] == 2
    plain = await gateway.http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()["choices"][0]  # absent unless asked for


async def test_prompt_logprobs_on_chat_are_top_level(gateway, upstream):
    reply = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 3})
    body = reply.json()
    prompt_ids = list(upstream.engine.requests[0].prompt_token_ids)
    assert len(body["prompt_logprobs"]) == len(prompt_ids) and body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"][1]) == 3  # the prompt token is its own best: 3 entries
    plain = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 0,
                              "stream": True}),
])
async def test_prompt_logprobs_cannot_stream(gateway, upstream, route, body):
    reply = await gateway.http.post(route, json=body)
    assert reply.status_code == 400 and "prompt_logprobs" in reply.json()["error"]["message"]
    assert not upstream.engine.requests


@pytest.mark.parametrize("body, field", [
    ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "Hi", "echo": True, "logprobs": 21}, "logprobs"),
])
async def test_out_of_range_is_a_400(gateway, upstream, body, field):
    reply = await gateway.http.post("/v1/completions", json=body)
    assert reply.status_code == 400 and f"{field} must be between 0 and 20" in reply.json()["error"]["message"]


async def test_public_grpc_sends_them_on_the_first_chunk(public, upstream):  # noqa: F811
    _, channel = await public()
    chunks = await collect(channel, gateway_pb2.GenerationRequest(
        prompt="Hi there", sampling=common_pb2.SamplingParams(max_tokens=4, prompt_logprobs=2)))
    prompt_ids = list(upstream.engine.requests[0].prompt_token_ids)
    first = chunks[0].prompt_logprobs
    assert [lp.logprob for lp in first] == [prompt_logprob(i) for i in range(1, len(prompt_ids))]
    assert first[0].rank == 1 and [t.token_id for t in first[0].top] == [prompt_ids[1], prompt_ids[1] + 1]
    assert not any(c.prompt_logprobs for c in chunks[1:])
