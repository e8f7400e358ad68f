"""The public gRPC API in-process over the fake engine: stubs, reflection, status codes, cancel."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.server import start_grpc_server
from pagoda.runtime.grpc_health import SERVING, check
from pagoda.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import SCRIPT_TEXTS, wait_until
from tests.gateway.fake_engine import fake_embedding


@pytest.fixture
async def public(make_gateway):
    """(gateway, channel to its public gRPC server); health flips to SERVING like server.serve()."""
    async def start(**overrides):
        gateway = await make_gateway(**overrides)
        server, port, health = await start_grpc_server(gateway.state, "127.0.0.1", 0)
        await health.set_serving(True)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        started.append((server, channel))
        return gateway, channel

    started = []
    yield start
    for server, channel in started:
        await channel.close()
        await server.stop(0)


async def collect(channel, request, metadata=None) -> list[gateway_pb2.GenerationChunk]:
    stub = gateway_pb2_grpc.GenerationStub(channel)
    return [chunk async for chunk in stub.Generate(request, metadata=metadata, timeout=10)]


async def test_generate_streams_text_tokens_and_usage(public, upstream):
    _, channel = await public()
    request = gateway_pb2.GenerationRequest(
        prompt="Hi", sampling=common_pb2.SamplingParams(n=2, max_tokens=64, logprobs=1))
    chunks = await collect(channel, request)
    for index, text in enumerate(SCRIPT_TEXTS):
        mine = [c for c in chunks if c.index == index]
        assert "".join(c.text for c in mine) == text
        assert [t for c in mine for t in c.token_ids] == upstream.engine.scripts[index]
        assert sum(len(c.logprobs) for c in mine) == len(upstream.engine.scripts[index])
        assert mine[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    usage = chunks[-1].usage
    assert usage.completion_tokens == sum(len(s) for s in upstream.engine.scripts)
    assert usage.prompt_tokens == len(upstream.engine.requests[0].prompt_token_ids)
    assert not any(c.HasField("usage") for c in chunks[:-1])


async def test_chat_input_and_stop_strings(public, upstream, tokenizer):
    _, channel = await public()
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="Hi")])
    chunks = await collect(channel, gateway_pb2.GenerationRequest(chat=chat, stop=["end"]))
    assert "".join(c.text for c in chunks) == "Hello world. The "
    expected = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert list(upstream.engine.requests[0].prompt_token_ids) == expected


@pytest.mark.parametrize("request_, code", [
    (gateway_pb2.GenerationRequest(prompt="Hi", sampling=common_pb2.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (gateway_pb2.GenerationRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (gateway_pb2.GenerationRequest(prompt="Hi", model="nope"), grpc.StatusCode.NOT_FOUND),
    (gateway_pb2.GenerationRequest(prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=10_000)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (gateway_pb2.GenerationRequest(prompt="Hi", sampling=common_pb2.SamplingParams(
        structured_outputs=common_pb2.StructuredOutputs(kind="regex", spec="(("))),
     grpc.StatusCode.INVALID_ARGUMENT),
    (gateway_pb2.GenerationRequest(prompt="Hi", sampling=common_pb2.SamplingParams(
        structured_outputs=common_pb2.StructuredOutputs(kind="yaml", spec="x"))),
     grpc.StatusCode.INVALID_ARGUMENT),
    (gateway_pb2.GenerationRequest(prompt="Hi", sampling=common_pb2.SamplingParams(logit_bias={10**6: 1.0})),
     grpc.StatusCode.INVALID_ARGUMENT),
])
async def test_bad_requests_are_rejected(public, request_, code):
    _, channel = await public()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(channel, request_)
    assert raised.value.code() == code


async def test_queue_full_and_no_scheduler(public, upstream):
    _, channel = await public()
    upstream.engine.fail_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(channel, gateway_pb2.GenerationRequest(prompt="Hi"))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await upstream.server.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(channel, gateway_pb2.GenerationRequest(prompt="Hi"))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_api_key_metadata(public):
    _, channel = await public(api_key="sekret")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(channel, gateway_pb2.GenerationRequest(prompt="Hi"))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
    chunks = await collect(channel, gateway_pb2.GenerationRequest(prompt="Hi"),
                           metadata=[("authorization", "Bearer sekret")])
    assert chunks[-1].HasField("usage")
    assert await check(channel) == SERVING  # health stays open


async def test_embed_over_grpc_is_the_http_routes_path(public, upstream, tokenizer):
    gateway, channel = await public(api_key="sekret")
    stub, key = gateway_pb2_grpc.GenerationStub(channel), [("authorization", "Bearer sekret")]
    texts = ["Hello world", "The quick brown fox"]
    reply = await stub.Embed(gateway_pb2.EmbedRequest(texts=texts), metadata=key, timeout=10)
    http = (await gateway.http.post("/v1/embeddings", json={"input": texts},
                                    headers={"authorization": "Bearer sekret"})).json()
    assert [list(e.values) for e in reply.embeddings] == [d["embedding"] for d in http["data"]]
    ids = [tokenizer.encode(text) for text in texts]
    assert [list(e.values) for e in reply.embeddings] == [fake_embedding(i) for i in ids]
    assert reply.usage.prompt_tokens == http["usage"]["prompt_tokens"] == sum(map(len, ids))
    sent = upstream.engine.requests[-1]
    assert sent.sampling.pooling and sent.sampling.max_tokens == 1
    bare = await stub.Embed(gateway_pb2.EmbedRequest(texts=texts[:1], add_special_tokens=False), metadata=key)
    assert list(bare.embeddings[0].values) == fake_embedding(tokenizer.encode(texts[0], add_special_tokens=False))
    for request, code in [(gateway_pb2.EmbedRequest(texts=texts), grpc.StatusCode.UNAUTHENTICATED),
                          (gateway_pb2.EmbedRequest(), grpc.StatusCode.INVALID_ARGUMENT),
                          (gateway_pb2.EmbedRequest(texts=["x", ""]), grpc.StatusCode.INVALID_ARGUMENT),
                          (gateway_pb2.EmbedRequest(texts=["x"] * 257), grpc.StatusCode.INVALID_ARGUMENT),
                          (gateway_pb2.EmbedRequest(texts=["x"], model="nope"), grpc.StatusCode.NOT_FOUND)]:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Embed(request, metadata=key if code != grpc.StatusCode.UNAUTHENTICATED else None,
                             timeout=10)
        assert raised.value.code() == code, raised.value.details()


async def test_reflection_lists_the_services(public):
    _, channel = await public()
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
    names = {s.name for s in responses[0].list_services_response.service}
    assert names == {"pagoda.v1.Generation", "grpc.health.v1.Health",
                     "grpc.reflection.v1alpha.ServerReflection"}


async def test_client_cancel_cancels_upstream(public, upstream):
    _, channel = await public()
    upstream.engine.gate = asyncio.Event()
    call = gateway_pb2_grpc.GenerationStub(channel).Generate(
        gateway_pb2.GenerationRequest(prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=64)))
    await wait_until(lambda: upstream.engine.active)  # the engine is streaming (held at the gate)
    call.cancel()
    await wait_until(lambda: not upstream.engine.active)
    assert upstream.engine.cancelled == [upstream.engine.requests[0].request_id]
