"""--enable-request-timings: the scheduler's per-request timings (the fake engine sends fixed ones)
and the prefix-cache hits, as `timings` on chat / completion responses and their last stream chunk,
on the Responses API's finished Response (whole and in its response.completed event) and on the
public gRPC API's final chunk; absent without the flag."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from pagoda.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import sse_events
from tests.gateway.test_grpc_fake import collect, public  # noqa: F401 - a fixture

CACHED = 3


def expected(usage: dict) -> dict:
    """The fake engine's timings (fake_engine.FAKE_TIMINGS) as the HTTP `timings` of `usage`."""
    return {"queue_ms": 1.0, "prompt_n": usage["prompt_tokens"] - CACHED, "prompt_ms": 2.0,
            "predicted_n": usage["completion_tokens"], "predicted_ms": 4.0, "cache_n": CACHED,
            "ttft_ms": 3.0, "total_ms": 7.0}


def approx(timings: dict) -> dict:
    return {k: pytest.approx(v) for k, v in timings.items()}


@pytest.fixture
async def timed(make_gateway, upstream):
    upstream.engine.num_cached_tokens = CACHED
    return await make_gateway(enable_request_timings=True)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
])
async def test_whole_replies_carry_timings(timed, path, body):
    reply = (await timed.http.post(path, json=body)).json()
    assert reply["timings"] == approx(expected(reply["usage"]))
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == CACHED
    if path == "/v1/chat/completions":
        ChatCompletion.model_validate(reply)  # an extra field the openai client accepts


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Hi"}),
])
@pytest.mark.parametrize("include_usage", [True, False])
async def test_the_last_stream_chunk_carries_timings(timed, path, body, include_usage):
    whole = (await timed.http.post(path, json=body)).json()
    reply = await timed.http.post(path, json={**body, "stream": True,
                                              "stream_options": {"include_usage": include_usage}})
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c for c in chunks if "timings" in c] == [chunks[-1]]
    assert chunks[-1]["timings"] == whole["timings"]
    assert (chunks[-1]["choices"] == []) == include_usage


async def test_a_batch_of_prompts_reports_its_slowest(timed, upstream):
    reply = (await timed.http.post("/v1/completions", json={"prompt": ["Hi", "Hello there"]})).json()
    assert reply["timings"]["total_ms"] == pytest.approx(7.0) and reply["timings"]["cache_n"] == 2 * CACHED


async def test_a_stop_string_times_the_request_at_the_gateway(timed):
    # The stop string ends the request before the scheduler's last response: the gateway's clock.
    reply = (await timed.http.post("/v1/completions", json={"prompt": "Hi", "stop": ["world"]})).json()
    t = reply["timings"]
    assert reply["choices"][0]["finish_reason"] == "stop" and t["queue_ms"] == 0.0  # the fake sends none
    assert min(t.values()) >= 0 and t["ttft_ms"] <= t["total_ms"]
    assert t["queue_ms"] + t["prompt_ms"] == pytest.approx(t["ttft_ms"])
    assert t["ttft_ms"] + t["predicted_ms"] == pytest.approx(t["total_ms"])
    assert t["cache_n"] == CACHED


async def test_responses_carry_timings_whole_and_streamed(timed):
    reply = (await timed.http.post("/v1/responses", json={"input": "Hi"})).json()
    usage = {"prompt_tokens": reply["usage"]["input_tokens"], "completion_tokens": reply["usage"]["output_tokens"]}
    assert reply["timings"] == approx(expected(usage))
    assert Response.model_validate(reply).model_extra["timings"] == reply["timings"]  # the client keeps it
    body = (await timed.http.post("/v1/responses", json={"input": "Hi", "stream": True})).text
    events = [json.loads(block.split("\ndata: ")[1]) for block in body.split("\n\n") if block]
    assert [e["type"] for e in events if "timings" in e.get("response", {})] == ["response.completed"]
    assert events[-1]["response"]["timings"] == reply["timings"]


async def test_without_the_flag_there_are_no_timings(gateway):
    assert "timings" not in (await gateway.http.post("/v1/responses", json={"input": "Hi"})).json()
    chat = await gateway.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": {"include_usage": True}})
    assert '"timings"' not in chat.text
    assert "timings" not in (await gateway.http.post("/v1/completions", json={"prompt": "Hi"})).json()


@pytest.mark.parametrize("enabled", [True, False])
async def test_the_grpc_final_chunk_carries_timings(public, upstream, enabled):  # noqa: F811
    upstream.engine.num_cached_tokens = CACHED
    _, channel = await public(enable_request_timings=enabled)
    chunks = await collect(channel, gateway_pb2.GenerationRequest(prompt="Hi"))
    assert not any(c.HasField("timings") for c in chunks[:-1])
    assert chunks[-1].HasField("timings") == enabled and chunks[-1].usage.cached_tokens == CACHED
    if enabled:
        assert chunks[-1].timings == common_pb2.RequestTimings(
            queue_seconds=0.001, prefill_seconds=0.002, decode_seconds=0.004,
            time_to_first_token_seconds=0.003, total_seconds=0.007)
