"""/v1/completions with a list of prompts: one upstream request each, choices numbered
prompt_index * n + i as OpenAI does, usage summed, streamed and not."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from gateway.errors import UpstreamError
from gateway.generation import GenerationStep, SequenceChunk
from gateway.openai.batch_prompts import merge_steps
from tests.gateway.conftest import SCRIPT_TEXTS, sse_events


async def test_two_prompts_times_n2_number_choices_as_openai(gateway, upstream):
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": ["Hi", "Bye now"], "n": 2, "max_tokens": 64, "echo": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    first, second = sorted(upstream.engine.requests, key=lambda r: r.request_id)
    assert first.request_id.endswith("-0") and second.request_id.endswith("-1")
    assert list(second.prompt_token_ids) != list(first.prompt_token_ids)
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] == "Hi" + SCRIPT_TEXTS[0] and texts[1] == "Hi" + SCRIPT_TEXTS[1]
    assert texts[2].endswith(SCRIPT_TEXTS[0]) and texts[3].endswith(SCRIPT_TEXTS[1])
    assert texts[2].startswith("Bye now")  # each choice echoes its own prompt
    scripts = upstream.engine.scripts
    prompt_tokens = len(first.prompt_token_ids) + len(second.prompt_token_ids)
    completion_tokens = 2 * (len(scripts[0]) + len(scripts[1]))
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == completion_tokens
    assert body["usage"]["total_tokens"] == prompt_tokens + completion_tokens


async def test_streamed_batch_carries_every_index_and_one_summed_usage(gateway, upstream):
    reply = await gateway.http.post("/v1/completions", json={
        "prompt": [[5, 6], [7, 8, 9], [10]], "max_tokens": 64, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = [json.loads(e) for e in sse_events(reply.text)[:-1]]
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finished.add(choice["index"])
    assert texts == {0: SCRIPT_TEXTS[0], 1: SCRIPT_TEXTS[0], 2: SCRIPT_TEXTS[0]} and finished == {0, 1, 2}
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 3 * len(upstream.engine.scripts[0])
    assert usage["prompt_tokens"] == 6


async def test_leaving_the_merged_stream_closes_every_prompt_stream():
    closed = []

    async def endless(k: int):
        try:
            while True:
                yield GenerationStep([SequenceChunk(index=0, text=str(k))])
                await asyncio.sleep(0)
        finally:
            closed.append(k)

    merged = merge_steps([endless(0), endless(1)], n=1)
    seen = {(await anext(merged)).chunks[0].index for _ in range(6)}
    await merged.aclose()
    assert seen == {0, 1} and sorted(closed) == [0, 1]


async def test_the_first_error_of_any_prompt_is_raised():
    async def fails():
        raise UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        yield  # an async generator

    async def slow():
        await asyncio.sleep(10)
        yield GenerationStep([])

    with pytest.raises(UpstreamError):
        await anext(merge_steps([slow(), fails()], n=1))


async def test_a_bad_prompt_in_the_batch_rejects_the_call(gateway, upstream):
    reply = await gateway.http.post("/v1/completions", json={"prompt": ["Hi", ""]})
    assert reply.status_code == 400 and not upstream.engine.requests
    reply = await gateway.http.post("/v1/completions", json={"prompt": [[1, 2], [1, 10**6]]})
    assert reply.status_code == 400 and not upstream.engine.requests
