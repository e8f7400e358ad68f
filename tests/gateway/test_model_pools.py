"""Model pools behind one gateway, in process: two fake Engines serving models "a" and "b"
(`--scheduler a=HOST:PORT --scheduler b=HOST:PORT --fallback-model a=b`).

/v1/models lists both; `model` picks the pool and the reply says which model answered; an unknown
model is a 404; a request for "a" moves to "b" when a's pool sheds (RESOURCE_EXHAUSTED) or is down
(UNAVAILABLE, or every breaker open: then a is not even tried), counted by reason; without a
fallback a's refusal reaches the client.
"""

from __future__ import annotations

import contextlib
import json

import grpc
import httpx
import pytest

from gateway import metrics
from gateway.config import GatewayConfig
from gateway.grpc_api import GenerationServicer
from gateway.openai.api_server import create_app
from gateway.state import GatewayState
from gateway.upstream.model_pools import ModelPool, ModelPools, pools_from_config
from gateway.upstream.replica_set import ReplicaSet
from gateway.upstream.routing import RoutingConfig
from pagoda.v1 import gateway_pb2
from tests.e2e.conftest import free_port
from tests.gateway.conftest import sse_events, wait_until
from tests.gateway.fake_engine import FakeEngine
from tests.gateway.test_replica_set import serving

FAST_BREAKERS = RoutingConfig(stats_interval_s=0.05, breaker_failures=1, breaker_cooldown_s=60)


def _fallbacks(requested: str, served: str, reason: str) -> float:
    return metrics.FALLBACK_REQUESTS.labels(requested, served, reason)._value.get()


@contextlib.asynccontextmanager
async def two_pools(tokenizer_dir, scripts, fallback=(("a", "b"),), a_fails=None):
    """A gateway over pools a and b (fake engines; a's Generate fails with `a_fails` when set)."""
    engines = {name: FakeEngine(model_name=tokenizer_dir, scripts=scripts) for name in "ab"}
    engines["a"].fail_code = a_fails
    async with contextlib.AsyncExitStack() as stack:
        servers = {name: await stack.enter_async_context(serving(engine)) for name, engine in engines.items()}
        config = GatewayConfig(scheduler=",".join(f"{n}={target}" for n, (target, _) in servers.items()),
                               fallback_models=fallback, routing=FAST_BREAKERS)
        pools = pools_from_config(config)
        stack.push_async_callback(pools.close)
        state = GatewayState(config, pools=pools)
        await state.connect()
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://gw")
        stack.push_async_callback(http.aclose)
        yield state, http, engines, servers


def _completion(model: str, **fields) -> dict:
    return {"model": model, "prompt": "Hello", "max_tokens": 4, **fields}


def test_scheduler_entries_name_their_pools():
    config = GatewayConfig(scheduler="h:1, a=h:2,b=h:3,a=h:4", served_model_name="main")
    assert config.scheduler_entries == ((None, "h:1"), ("a", "h:2"), ("b", "h:3"), ("a", "h:4"))
    assert config.schedulers == ("h:1", "h:2", "h:3", "h:4")
    with pytest.raises(ValueError, match="MODEL="):
        GatewayConfig(scheduler="=h:1")
    with pytest.raises(ValueError, match="one --fallback-model"):
        GatewayConfig(fallback_models=(("a", "b"), ("a", "c")))
    with pytest.raises(ValueError, match="two different"):
        GatewayConfig(fallback_models=(("a", "a"),))


async def test_pools_group_the_entries_default_first_with_replica_labels_by_position():
    config = GatewayConfig(scheduler="a=h:2,h:1,a=h:4", served_model_name="main", tokenizer="/tok")
    pools = pools_from_config(config)
    try:
        assert [p.name for p in pools.pools] == ["main", "a"]
        assert [p.tokenizer_path for p in pools.pools] == ["/tok", None]  # named pools read their own
        assert all(isinstance(p.client, ReplicaSet) for p in pools.pools)  # every scheduler has a breaker
        assert [[r.label for r in p.client.replicas] for p in pools.pools] == [["1"], ["0", "2"]]
    finally:
        await pools.close()


def test_resolve_and_route_without_connections():
    a, b = ModelPool("org/a", client=None), ModelPool("b", client=None)
    pools = ModelPools([a, b], {"a": "b"})
    assert pools.resolve(None) is a and pools.resolve("a") is a and pools.resolve("org/a") is a
    with pytest.raises(Exception, match="does not exist"):
        pools.resolve("c")
    assert pools.route("a").pools == (a,)  # b has never connected: nothing to fall back to


async def test_models_lists_every_pool_and_the_model_picks_it(tokenizer_dir, scripts):
    async with two_pools(tokenizer_dir, scripts) as (_, http, engines, _servers):
        listed = (await http.get("/v1/models")).json()["data"]
        assert [m["id"] for m in listed] == ["a", "b"]
        for name in "ab":
            reply = await http.post("/v1/completions", json=_completion(name))
            assert reply.status_code == 200 and reply.json()["model"] == name
        assert [len(engines[n].requests) for n in "ab"] == [1, 1]
        missing = await http.post("/v1/completions", json=_completion("c"))
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "NotFoundError" and missing.json()["error"]["param"] == "model"
        assert (await http.post("/tokenize", json={"model": "c", "prompt": "x"})).status_code == 404


@pytest.mark.parametrize(("code", "reason"), [(grpc.StatusCode.RESOURCE_EXHAUSTED, "shedding"),
                                               (grpc.StatusCode.UNAVAILABLE, "unavailable")])
async def test_a_refusal_before_the_first_token_moves_the_request_to_the_fallback(tokenizer_dir, scripts,
                                                                                  code, reason):
    async with two_pools(tokenizer_dir, scripts, a_fails=code) as (_, http, engines, _servers):
        before = _fallbacks("a", "b", reason)
        reply = await http.post("/v1/chat/completions", json={
            "model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.json()["model"] == "b"
        streamed = await http.post("/v1/completions", json=_completion("a", stream=True))
        chunks = [json.loads(e) for e in sse_events(streamed.text)[:-1]]
        assert chunks and {c["model"] for c in chunks} == {"b"}
        assert _fallbacks("a", "b", reason) == before + 2
        # Shedding is load: a is asked each time. UNAVAILABLE opened a's breaker: the second skips it.
        assert len(engines["a"].requests) == (2 if reason == "shedding" else 1)
        assert len(engines["b"].requests) == 2


async def test_without_a_fallback_the_pools_refusal_reaches_the_client(tokenizer_dir, scripts):
    async with two_pools(tokenizer_dir, scripts, fallback=(), a_fails=grpc.StatusCode.RESOURCE_EXHAUSTED
                         ) as (_, http, engines, _servers):
        reply = await http.post("/v1/completions", json=_completion("a"))
        assert reply.status_code == 429 and "Retry-After" in reply.headers
        assert engines["b"].requests == []


async def test_a_pool_whose_breakers_are_all_open_is_not_tried(tokenizer_dir, scripts):
    async with two_pools(tokenizer_dir, scripts) as (state, http, engines, servers):
        _, health = servers["a"]
        await health.set_serving(False)  # a's only scheduler says NOT_SERVING: its breaker opens
        pool_a = state.pools.resolve("a")
        await wait_until(lambda: not pool_a.in_rotation, 5)
        before = _fallbacks("a", "b", "unavailable")
        reply = await http.post("/v1/completions", json=_completion("a"))
        assert reply.status_code == 200 and reply.json()["model"] == "b"
        assert engines["a"].requests == []  # skipped up front
        assert _fallbacks("a", "b", "unavailable") == before + 1
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["a", "b"]


async def test_grpc_chunks_name_the_model_that_answered(tokenizer_dir, scripts):
    async with two_pools(tokenizer_dir, scripts, a_fails=grpc.StatusCode.RESOURCE_EXHAUSTED) as (state, *_):
        servicer = GenerationServicer(state)

        class Context:
            def invocation_metadata(self):
                return ()

            async def send_initial_metadata(self, _metadata):
                pass

            async def abort(self, code, message, trailing_metadata=()):
                raise AssertionError(f"{code}: {message}")

        request = gateway_pb2.GenerationRequest(model="a", prompt="Hello")
        request.sampling.max_tokens = 4
        chunks = [c async for c in servicer.Generate(request, Context())]
        assert chunks and {c.model for c in chunks} == {"b"}


async def test_metrics_carry_each_pools_engine_series(tokenizer_dir, scripts):
    async with two_pools(tokenizer_dir, scripts) as (_, http, _engines, _servers):
        text = (await http.get("/metrics")).text
        assert 'pagoda:engine_up{model_name="a"} 1.0' in text and 'pagoda:engine_up{model_name="b"} 1.0' in text
        await http.post("/v1/completions", json=_completion("b"))
        text = (await http.get("/metrics")).text
        assert 'vllm:e2e_request_latency_seconds_count{model_name="b"} ' in text


async def test_a_pool_down_since_startup_is_a_503_or_its_fallback_and_shows_engine_down(tokenizer_dir, scripts):
    engine = FakeEngine(model_name=tokenizer_dir, scripts=scripts)
    async with serving(engine) as (target, _), contextlib.AsyncExitStack() as stack:
        config = GatewayConfig(scheduler=f"a={target},b=127.0.0.1:{free_port()},c=127.0.0.1:{free_port()}",
                               fallback_models=(("b", "a"),), routing=FAST_BREAKERS)
        pools = pools_from_config(config)
        stack.push_async_callback(pools.close)
        state = GatewayState(config, pools=pools)
        await state.pools.resolve("a").connect()  # b and c never answer
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://gw")
        stack.push_async_callback(http.aclose)
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["a"]
        assert (await http.post("/v1/completions", json=_completion("c"))).status_code == 503
        reply = await http.post("/v1/completions", json=_completion("b"))
        assert reply.status_code == 200 and reply.json()["model"] == "a"
        text = (await http.get("/metrics")).text
        assert 'pagoda:engine_up{model_name="a"} 1.0' in text and 'pagoda:engine_up{model_name="c"} 0.0' in text
