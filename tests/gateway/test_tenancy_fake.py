"""Tenancy through the gateway over the fake engine: the real `openai` client sees 429s with
Retry-After and OpenAI's x-ratelimit-* headers; limits are per tenant; the concurrency cap; the
public gRPC API's RESOURCE_EXHAUSTED; metrics, span attribute and the cache salt sent upstream.
The limiter's clock is driven by hand: nothing waits on time."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway import generation, metrics
from gateway.server import start_grpc_server
from gateway.tenancy.tenants import parse_tenant_lines
from pagoda.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import wait_until

KEYS = """
{"key": "sk-a", "tenant": "rpm-a", "requests_per_minute": 2}
{"key": "sk-b", "tenant": "free-b"}
{"key": "sk-t", "tenant": "tpm-t", "tokens_per_minute": 200}
{"key": "sk-c", "tenant": "conc-c", "max_concurrent_requests": 1}
{"key": "sk-s", "tenant": "salt-s", "cache_salt": "group-1", "kv_share": 0.25}
"""
TABLE = parse_tenant_lines(KEYS, "keys.jsonl")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def tenant_gateway(make_gateway, clock):
    return await make_gateway(api_keys=TABLE, clock=clock)


def client_for(gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, http_client=gateway.http,
                              max_retries=0)


def sample(name: str, **labels) -> float:
    return metrics.METRICS.registry.get_sample_value(name, labels) or 0.0


async def complete(client: openai.AsyncOpenAI, **fields):
    return await client.completions.with_raw_response.create(
        model="", prompt=fields.pop("prompt", "Hi"), max_tokens=fields.pop("max_tokens", 8), **fields)


async def test_request_limit_429_with_headers_per_tenant(tenant_gateway, clock):
    a, b = client_for(tenant_gateway, "sk-a"), client_for(tenant_gateway, "sk-b")
    refused_before = sample("pagoda:tenant_rate_limited_total", tenant="rpm-a", limit="requests")
    first, second = await complete(a), await complete(a)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert [first.headers["x-ratelimit-remaining-requests"],
            second.headers["x-ratelimit-remaining-requests"]] == ["1", "0"]
    assert second.headers["x-ratelimit-reset-requests"] == "1m0s"  # both back in a minute
    assert "x-ratelimit-limit-tokens" not in first.headers  # rpm-a has no token limit
    assert first.parse().choices[0].text

    with pytest.raises(openai.RateLimitError) as refused:
        await complete(a)
    response = refused.value.response
    assert response.status_code == 429 and response.headers["retry-after"] == "30"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.json()["error"]["type"] == "RateLimitError"
    assert "requests per minute" in response.json()["error"]["message"]
    assert sample("pagoda:tenant_rate_limited_total", tenant="rpm-a", limit="requests") == refused_before + 1

    other = await complete(b)  # another tenant is still served, and has no limit headers
    assert other.http_response.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers

    clock.now += 30  # one request's worth refilled
    assert (await complete(a)).headers["x-ratelimit-remaining-requests"] == "0"


async def test_token_limit_reserves_prompt_plus_max_tokens_and_settles_real_usage(tenant_gateway, upstream):
    t = client_for(tenant_gateway, "sk-t")
    first = await complete(t, max_tokens=40)
    num_prompt = len(upstream.engine.requests[-1].prompt_token_ids)
    assert first.headers["x-ratelimit-remaining-tokens"] == str(200 - num_prompt - 40)  # reserved
    usage = first.parse().usage
    used = usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens < 40  # so settling gives some back

    second = await complete(t, max_tokens=40)  # the first's unused part came back
    assert second.headers["x-ratelimit-limit-tokens"] == "200"
    assert second.headers["x-ratelimit-remaining-tokens"] == str(200 - used - num_prompt - 40)
    remaining = 200 - 2 * used

    with pytest.raises(openai.RateLimitError) as refused:
        await complete(t, max_tokens=remaining - num_prompt + 1)
    response = refused.value.response
    assert response.headers["retry-after"] == "1"  # 1 token at 200/60 per second
    assert response.headers["x-ratelimit-remaining-tokens"] == str(remaining)
    assert "tokens per minute" in response.json()["error"]["message"]

    # A request that could never fit in a minute is a 400 that says what to change, not a 429.
    with pytest.raises(openai.BadRequestError, match="lower max_tokens"):
        await complete(t, max_tokens=200)


async def test_concurrency_cap_and_a_gone_client_frees_its_slot(tenant_gateway, upstream):
    c = client_for(tenant_gateway, "sk-c")
    upstream.engine.gate = asyncio.Event()  # hold every response
    held = asyncio.create_task(complete(c))
    await wait_until(lambda: upstream.engine.active)
    with pytest.raises(openai.RateLimitError, match="concurrent") as refused:
        await complete(c)
    assert refused.value.response.headers["retry-after"] == "1"
    assert sample("pagoda:tenant_requests_in_flight", tenant="conc-c") == 1

    held.cancel()  # the client goes away: its lease closes, the slot is free again
    with pytest.raises(asyncio.CancelledError):
        await held
    assert sample("pagoda:tenant_requests_in_flight", tenant="conc-c") == 0
    upstream.engine.gate.set()
    assert (await complete(c)).http_response.status_code == 200
    assert sample("pagoda:tenant_requests_in_flight", tenant="conc-c") == 0


async def test_the_tenant_salts_the_prefix_cache(tenant_gateway, make_gateway, upstream):
    await complete(client_for(tenant_gateway, "sk-b"))
    await complete(client_for(tenant_gateway, "sk-b"), extra_body={"cache_salt": "mine"})
    await complete(client_for(tenant_gateway, "sk-s"))
    open_gateway = await make_gateway()  # no keys: the request's own salt, unchanged
    await complete(client_for(open_gateway, "x"), extra_body={"cache_salt": "mine"})
    await complete(client_for(open_gateway, "x"))
    assert [r.cache_salt for r in upstream.engine.requests] == ["free-b", "free-b:mine", "group-1", "mine", ""]
    # The scheduler learns the tenant (its KV cap and fair share): "" for the anonymous one.
    assert [(r.tenant, r.kv_share) for r in upstream.engine.requests] == \
        [("free-b", 0.0), ("free-b", 0.0), ("salt-s", 0.25), ("", 0.0), ("", 0.0)]


async def test_a_session_reaches_the_engine_and_ends_in_its_tenant_only(tenant_gateway, upstream):
    await complete(client_for(tenant_gateway, "sk-b"), extra_body={"session_id": "s1", "session_ttl": 30})
    await complete(client_for(tenant_gateway, "sk-b"), extra_body={"session_id": "s2"})
    await complete(client_for(tenant_gateway, "sk-b"))
    assert [(r.session_id, r.session_ttl_s) for r in upstream.engine.requests] == \
        [("s1", 30.0), ("s2", generation.DEFAULT_SESSION_TTL_S), ("", 0.0)]
    http = tenant_gateway.http
    other = await http.delete("http://gateway/v1/sessions/s1", headers={"authorization": "Bearer sk-s"})
    assert other.status_code == 404 and other.json()["error"]["code"] == 404  # another tenant's salt
    mine = await http.delete("http://gateway/v1/sessions/s1", headers={"authorization": "Bearer sk-b"})
    assert mine.json() == {"id": "s1", "object": "session", "deleted": True}
    assert upstream.engine.ended_sessions == [("s1", "group-1"), ("s1", "free-b")]
    with pytest.raises(openai.BadRequestError, match="session_ttl"):
        await complete(client_for(tenant_gateway, "sk-b"), extra_body={"session_id": "s3", "session_ttl": -1})


async def test_unknown_key_is_401_and_usage_is_counted_per_tenant(tenant_gateway):
    with pytest.raises(openai.AuthenticationError):
        await complete(client_for(tenant_gateway, "sk-unknown"))
    before = sample("pagoda:tenant_tokens_total", tenant="free-b")
    admitted = sample("pagoda:tenant_requests_total", tenant="free-b")
    usage = (await complete(client_for(tenant_gateway, "sk-b"))).parse().usage
    assert sample("pagoda:tenant_tokens_total", tenant="free-b") == before + usage.total_tokens
    assert sample("pagoda:tenant_requests_total", tenant="free-b") == admitted + 1
    # every configured tenant has its series from the start (bounded label values)
    assert metrics.METRICS.registry.get_sample_value("pagoda:tenant_requests_total",
                                                     {"tenant": "salt-s"}) is not None


async def test_public_grpc_gets_resource_exhausted_with_the_same_accounting(make_gateway, clock):
    gateway = await make_gateway(api_keys=TABLE, clock=clock)
    server, port, health = await start_grpc_server(gateway.state, "127.0.0.1", 0)
    await health.set_serving(True)
    request = gateway_pb2.GenerationRequest(prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=8))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(request, metadata=(("authorization", "Bearer sk-a"),), timeout=10)
            chunks = [chunk async for chunk in call]
            assert chunks[-1].usage.completion_tokens > 0
            assert dict(await call.initial_metadata())["x-ratelimit-remaining-requests"] == "1"
            await complete(client_for(gateway, "sk-a"))  # HTTP and gRPC share the tenant's bucket
            call = stub.Generate(request, metadata=(("authorization", "Bearer sk-a"),), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [chunk async for chunk in call]
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailing = dict(refused.value.trailing_metadata())
            assert trailing["retry-after"] == "30" and trailing["x-ratelimit-remaining-requests"] == "0"
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                [chunk async for chunk in stub.Generate(request, metadata=(("authorization", "Bearer no"),))]
            assert unknown.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)


def test_the_request_span_carries_the_tenant(monkeypatch, tokenizer):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(generation, "tracing_enabled", lambda: True)
    monkeypatch.setattr(generation, "get_tracer", provider.get_tracer)
    from pagoda.contract.params import SamplingParams

    request = generation.GenerationInput("r1", (1, 2), SamplingParams(max_tokens=2))
    generation.start_request_span("chat", "m", None, request, "team-a").end()
    [span] = exporter.get_finished_spans()
    assert span.attributes["pagoda.tenant"] == "team-a"


async def test_a_stream_carries_the_headers_and_is_settled_when_it_ends(tenant_gateway, upstream):
    t = client_for(tenant_gateway, "sk-t")
    raw = await t.completions.with_raw_response.create(model="", prompt="Hi", max_tokens=40, stream=True,
                                                       stream_options={"include_usage": True})
    num_prompt = len(upstream.engine.requests[-1].prompt_token_ids)
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(200 - num_prompt - 40)
    usage = [chunk.usage async for chunk in raw.parse() if chunk.usage][-1]
    after = await complete(t, max_tokens=1)  # the stream's unused reservation is back
    assert after.headers["x-ratelimit-remaining-tokens"] == str(
        200 - usage.total_tokens - num_prompt - 1)
