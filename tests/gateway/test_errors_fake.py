"""Every error case of the OpenAI routes: status code plus OpenAI's body shape."""

from __future__ import annotations

import json

import grpc
import pytest

from tests.gateway.conftest import sse_events

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


def assert_openai_error(reply, status: int, message_part: str = "") -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert message_part in error["message"]
    return error


@pytest.mark.parametrize("body, part", [
    ({"messages": HI, "temperature": -1}, "temperature must be non-negative"),
    ({"messages": HI, "n": "two"}, "n:"),
    ({"messages": []}, "messages"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs requires logprobs"),
    ({"messages": HI, "seed": 2**64}, "seed"),
    # Integers past their wire types once reached protobuf encoding and came back as 500s
    # (found by schemathesis): each is a 400 naming the field.
    ({"messages": HI, "top_k": 2**40}, "top_k"),
    ({"messages": HI, "min_tokens": 2**40}, "min_tokens"),
    ({"messages": HI, "stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"messages": HI, "priority": 2**40}, "priority"),
])
async def test_validation_errors_are_400_not_422(gateway, body, part):
    assert_openai_error(await gateway.http.post(CHAT, json=body), 400, part)


async def test_invalid_json_is_400(gateway):
    reply = await gateway.http.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(reply, 400)


async def test_context_overflow_is_400_with_vllms_message(gateway, tokenizer):
    prompt = "word " * 100
    num_prompt = len(tokenizer.encode(prompt))
    reply = await gateway.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 200})
    assert_openai_error(reply, 400, (
        f"This model's maximum context length is 256 tokens. However, you requested {num_prompt + 200} "
        f"tokens ({num_prompt} in the messages, 200 in the completion). Please reduce the length of the "
        "messages or completion."))


async def test_unknown_model_is_404(gateway):
    error = assert_openai_error(await gateway.http.post(CHAT, json={"model": "gpt-9", "messages": HI}), 404)
    assert error["message"] == "The model `gpt-9` does not exist." and error["type"] == "NotFoundError"


async def test_api_key_is_required_except_for_probes(make_gateway):
    gateway = await make_gateway(api_key="sekret")
    assert_openai_error(await gateway.http.post(CHAT, json={"messages": HI}), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_openai_error(await gateway.http.get("/v1/models", headers=wrong), 401)
    right = {"Authorization": "Bearer sekret"}
    assert (await gateway.http.post(CHAT, json={"messages": HI}, headers=right)).status_code == 200
    for open_path in ("/health", "/ready", "/metrics"):
        assert (await gateway.http.get(open_path)).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_queue_full_is_429_with_retry_after(gateway, upstream, stream):
    upstream.engine.fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reply = await gateway.http.post(CHAT, json={"messages": HI, "stream": stream})
    assert_openai_error(reply, 429, "RESOURCE_EXHAUSTED")
    assert reply.headers["retry-after"] == "1"


async def test_upstream_invalid_argument_is_400(gateway, upstream):
    upstream.engine.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    assert_openai_error(await gateway.http.post(CHAT, json={"messages": HI}), 400)


async def test_no_scheduler_is_503(gateway, upstream):
    await upstream.server.stop(0)
    assert_openai_error(await gateway.http.post(CHAT, json={"messages": HI}), 503, "unavailable")
    assert (await gateway.http.get("/ready")).status_code == 503


async def test_not_yet_connected_is_503(make_gateway):
    gateway = await make_gateway(connect=False)
    assert_openai_error(await gateway.http.post(CHAT, json={"messages": HI}), 503)


async def test_body_over_the_cap_is_413(make_gateway):
    gateway = await make_gateway(max_request_bytes=2048)
    big = {"messages": [{"role": "user", "content": "x" * 4096}]}
    assert_openai_error(await gateway.http.post(CHAT, json=big), 413)

    async def chunked():  # no Content-Length: the cap applies while reading
        yield json.dumps(big).encode()

    assert_openai_error(await gateway.http.post(CHAT, content=chunked(),
                                                headers={"content-type": "application/json"}), 413)


async def test_mid_stream_failure_sends_error_chunk_then_done(gateway, upstream):
    upstream.engine.fail_after_responses = 2
    reply = await gateway.http.post(CHAT, json={"messages": HI, "max_tokens": 64, "stream": True})
    assert reply.status_code == 200  # headers were already sent
    events = sse_events(reply.text)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "mid-stream" in error["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])


@pytest.mark.parametrize("method, path, content, status, part", [
    ("POST", CHAT, b"\xff\xfe{not json", 400, "error parsing the body"),
    ("POST", CHAT, b'{"messages": [', 400, ""),
    ("POST", "/v1/completions", b"[1, 2", 400, ""),
    ("GET", "/v1/no-such-route", None, 404, "Not Found"),
    ("GET", CHAT, None, 405, "Method Not Allowed"),
])
async def test_framework_refusals_have_the_openai_shape(gateway, method, path, content, status, part):
    reply = await gateway.http.request(method, path, content=content,
                                       headers={"content-type": "application/json"})
    assert_openai_error(reply, status, part)
