"""gateway/upstream/replica_set.py against two in-process fake Engines: failover before the first token,
none after it without a mid-stream failover budget, aborts to the holder, breakers fed by failures and probes, stats merged."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from gateway import metrics
from gateway.errors import UpstreamError
from gateway.upstream.replica_set import ReplicaSet, merge_stats
from gateway.upstream.routing import BreakerState, RoutingConfig, routing_key
from pagoda.runtime.grpc_health import HealthState
from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.gateway.fake_engine import FakeEngine


class MidStreamOutage(FakeEngine):
    """Streams one response, then fails UNAVAILABLE (a scheduler lost after the first token)."""

    async def Generate(self, request, context):
        async for response in FakeEngine.Generate(self, request, context):
            yield response
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler shutting down")


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine):
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    health = HealthState("pagoda.v1.Engine")
    health.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving(True)
    try:
        yield f"127.0.0.1:{port}", health
    finally:
        await server.stop(0)


def _engine(cls=FakeEngine, **fields) -> FakeEngine:
    return cls(model_name="m", scripts=[[5, 6, 7, 8]], tokens_per_response=2, **fields)


@contextlib.asynccontextmanager
async def replica_set(*engines: FakeEngine, **routing):
    async with contextlib.AsyncExitStack() as stack:
        targets = [(await stack.enter_async_context(serving(e)))[0] for e in engines]
        replicas = ReplicaSet(targets, RoutingConfig(**{"policy": "round-robin", **routing}), timeout_s=2.0)
        replicas.block_size = 16
        try:
            yield replicas
        finally:
            await replicas.close()


def _request(request_id: str, prompt=(1, 2, 3)) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=list(prompt),
                                      sampling=common_pb2.SamplingParams(max_tokens=4))


async def _tokens(replicas: ReplicaSet, request_id: str) -> list[int]:
    return [t for r in [r async for r in replicas.generate(_request(request_id))]
            for d in r.sequences for t in d.token_ids]


def _count(counter, *labels) -> float:
    return counter.labels(*labels)._value.get()


async def test_a_request_refused_unavailable_before_its_first_token_completes_on_another_replica():
    down, up = _engine(fail_code=grpc.StatusCode.UNAVAILABLE), _engine()
    resubmitted = _count(metrics.ROUTER_RESUBMITTED, "0")
    async with replica_set(down, up, breaker_failures=2) as replicas:
        assert await _tokens(replicas, "a") == [5, 6, 7, 8]  # round-robin sent it to 0 first
        assert [r.request_id for r in down.requests] == ["a"] and [r.request_id for r in up.requests] == ["a"]
        assert _count(metrics.ROUTER_RESUBMITTED, "0") == resubmitted + 1
        assert replicas.replicas[0].breaker.closed  # 1 failure of 2
        assert await _tokens(replicas, "b") == [5, 6, 7, 8]  # 1 again (round-robin), 0 is next
        assert await _tokens(replicas, "c") == [5, 6, 7, 8]
        assert replicas.replicas[0].breaker.state is BreakerState.OPEN  # second failure: out
        assert _count(metrics.REPLICA_UP, "0") == 0
        before = len(down.requests)
        for i in range(4):  # out of rotation: nothing more reaches it
            assert await _tokens(replicas, f"d{i}") == [5, 6, 7, 8]
        assert len(down.requests) == before


async def test_without_a_failover_budget_a_stream_under_way_ends_with_its_error():
    # Mid-stream failover itself: tests/gateway/test_stream_failover.py.
    failing, other = _engine(MidStreamOutage), _engine()
    failed = _count(metrics.ROUTER_STREAMS_FAILED, "0")
    async with replica_set(failing, other, max_stream_failovers=0) as replicas:
        received = []
        with pytest.raises(UpstreamError) as error:
            async for response in replicas.generate(_request("x")):
                received.append(response)
        assert error.value.grpc_code == grpc.StatusCode.UNAVAILABLE
        assert len(received) == 1 and not other.requests  # never sent twice
        assert _count(metrics.ROUTER_STREAMS_FAILED, "0") == failed + 1


async def test_when_every_replica_fails_the_last_error_reaches_the_caller():
    async with replica_set(_engine(fail_code=grpc.StatusCode.UNAVAILABLE),
                           _engine(fail_code=grpc.StatusCode.UNAVAILABLE)) as replicas:
        with pytest.raises(UpstreamError) as error:
            await _tokens(replicas, "z")
        assert error.value.grpc_code == grpc.StatusCode.UNAVAILABLE


async def test_other_errors_are_not_resubmitted():
    bad, good = _engine(fail_code=grpc.StatusCode.INVALID_ARGUMENT), _engine()
    async with replica_set(bad, good) as replicas:
        with pytest.raises(UpstreamError):
            await _tokens(replicas, "q")
        assert not good.requests


async def test_an_abort_goes_to_the_replica_holding_the_request():
    held = _engine(hold_final_response=True)
    other = _engine()
    async with replica_set(held, other) as replicas:
        stream = replicas.generate(_request("h"))
        await anext(stream)  # streaming from replica 0 now
        assert await replicas.abort("h") is True
        assert await replicas.abort("nobody") is False
        await stream.aclose()


async def test_probes_open_the_breaker_of_a_replica_not_serving_and_close_it_once_back():
    clock = [0.0]
    async with contextlib.AsyncExitStack() as stack:
        (t0, health0), (t1, _) = [await stack.enter_async_context(serving(_engine())) for _ in range(2)]
        replicas = ReplicaSet([t0, t1], RoutingConfig(breaker_failures=2, breaker_cooldown_s=5.0),
                              clock=lambda: clock[0])
        stack.push_async_callback(replicas.close)
        first = replicas.replicas[0]
        await health0.set_serving(False)  # its worker is gone, or it drains
        await replicas.refresh(first)
        await replicas.refresh(first)
        assert first.breaker.state is BreakerState.OPEN
        assert replicas.available() == [1]
        assert await replicas.is_serving()  # one replica serving is enough
        await health0.set_serving(True)
        await replicas.refresh(first)  # cooling down: not even probed
        assert first.breaker.state is BreakerState.OPEN
        clock[0] = 5.0
        await replicas.refresh(first)  # the half-open probe succeeds
        assert first.breaker.state is BreakerState.CLOSED and replicas.available() == [0, 1]


def test_stats_are_summed_across_replicas():
    merged = merge_stats([
        engine_pb2.EngineStats(num_waiting=2, num_used_blocks=10, num_total_blocks=100, idle=False,
                               request_success={"stop": 3}, spec_accepted_per_pos=[1, 2], invariant_ok=True),
        engine_pb2.EngineStats(num_waiting=1, num_used_blocks=30, num_total_blocks=100, idle=True,
                               request_success={"stop": 1, "length": 2}, spec_accepted_per_pos=[4],
                               invariant_ok=True)])
    assert merged.num_waiting == 3 and merged.kv_cache_usage == pytest.approx(0.2)
    assert dict(merged.request_success) == {"stop": 4, "length": 2}
    assert list(merged.spec_accepted_per_pos) == [5, 2]
    assert merged.idle is False and merged.invariant_ok is True


async def test_a_full_queue_on_one_replica_sends_the_request_to_another_without_opening_its_breaker():
    full, other = _engine(fail_code=grpc.StatusCode.RESOURCE_EXHAUSTED), _engine()
    async with replica_set(full, other, breaker_failures=1) as replicas:
        assert await _tokens(replicas, "r") == [5, 6, 7, 8]
        assert replicas.replicas[0].breaker.closed  # load, not a fault


async def test_prefix_routing_sends_a_shared_prefix_to_one_replica_and_salts_apart():
    engines = [_engine(), _engine()]
    async with replica_set(*engines, policy="prefix", overload_threshold=100) as replicas:
        system = list(range(100, 164))  # 4 full blocks
        for user in range(6):
            request = _request(f"u{user}", prompt=system + [200 + user] * 5)
            [r async for r in replicas.generate(request)]
        assert sorted(len(e.requests) for e in engines) == [0, 6]
        owners = set()
        for tenant in range(16):  # the same prompt under other salts spreads over both
            request = _request(f"t{tenant}", prompt=system)
            request.cache_salt = f"tenant-{tenant}"
            key = routing_key(request.prompt_token_ids, request.cache_salt, replicas.block_size, 4)
            owners.add(replicas.router.owner(key, [0, 1]))
        assert owners == {0, 1}
