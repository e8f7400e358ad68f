"""ReplicaSet membership (gateway/upstream/replica_set.py) against in-process fake Engines: a DNS
answer adds a replica that takes requests at once, drains one that left (its stream under way
finishes there, nothing new reaches it, then its channel closes), lets it rejoin, and an empty or
failed answer keeps the set. Last, the whole loop with a real dnslib server on loopback and fake
Engines sharing one port on 127.0.0.1 / .2 / .3, as replicas on one machine do."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from dnslib import RCODE

from gateway import metrics
from gateway.errors import UpstreamError
from gateway.upstream.dns_discovery import DnsDiscovery, Reconcile, parse_dns_target
from gateway.upstream.replica_set import ReplicaSet
from gateway.upstream.routing import RoutingConfig
from pagoda.runtime.grpc_health import HealthState
from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.gateway.dns_server import FleetResolver, dns_server
from tests.gateway.fake_engine import FakeEngine


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine, host: str = "127.0.0.1", port: int = 0):
    server = grpc.aio.server()
    engine_pb2_grpc.add_EngineServicer_to_server(engine, server)
    health = HealthState("pagoda.v1.Engine")
    health.add_to_server(server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await health.set_serving(True)
    try:
        yield f"{host}:{bound}"
    finally:
        await server.stop(0)


def _engine(**fields) -> FakeEngine:
    return FakeEngine(model_name="m", scripts=[[5, 6, 7, 8]], tokens_per_response=2, **fields)


def _request(request_id: str) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                      sampling=common_pb2.SamplingParams(max_tokens=4))


async def _tokens(replicas: ReplicaSet, request_id: str) -> list[int]:
    return [t async for r in replicas.generate(_request(request_id)) for d in r.sequences for t in d.token_ids]


async def _until(predicate, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, "condition not reached before the deadline"
        await asyncio.sleep(0.01)  # yield to the streams and the discovery; the deadline bounds it


def _states(replicas: ReplicaSet) -> dict[str, str]:
    return {r["target"]: r["state"] for r in replicas.describe()}


def _series(label: str) -> bool:
    return any(s.labels.get("replica") == label for m in metrics.REPLICA_UP.collect() for s in m.samples)


@contextlib.asynccontextmanager
async def membership(*engines: FakeEngine, initial: int = 2):
    """A ReplicaSet (round-robin) over the first `initial` engines, added as a DNS answer would."""
    async with contextlib.AsyncExitStack() as stack:
        targets = [await stack.enter_async_context(serving(e)) for e in engines]
        replicas = ReplicaSet([], RoutingConfig(policy="round-robin"), timeout_s=2.0,
                              discovery=DnsDiscovery(parse_dns_target("dns:///unused.test:1")))
        stack.push_async_callback(replicas.close)
        for n in range(1, initial + 1):  # one at a time: replica i is engine i
            assert replicas.apply_membership(frozenset(targets[:n])) == Reconcile(add=(targets[n - 1],))
        yield replicas, targets


async def test_a_replica_that_left_the_answer_finishes_its_stream_takes_nothing_new_then_closes():
    a, b, c = _engine(gate=asyncio.Event()), _engine(), _engine()
    async with membership(a, b, c) as (replicas, (ta, tb, tc)):
        held = asyncio.create_task(_tokens(replicas, "held"))  # round-robin: replica 0 (a) first
        await _until(lambda: "held" in a.active)
        change = replicas.apply_membership(frozenset({tb, tc}))
        assert change == Reconcile(add=(tc,), drain=(ta,))
        assert _states(replicas)[ta] == "draining" and replicas.describe()[0]["in_flight"] == 1
        for i in range(6):
            assert await _tokens(replicas, f"r{i}") == [5, 6, 7, 8]
        assert [r.request_id for r in a.requests] == ["held"]  # nothing new reached it
        assert len(b.requests) == 3 and len(c.requests) == 3  # the new one joined the rotation at once
        assert _series(ta)
        a.gate.set()
        assert await held == [5, 6, 7, 8]  # the stream under way finished on its replica
        assert _states(replicas)[ta] == "removed" and replicas.replicas[0].closed
        assert not _series(ta)  # its pagoda:replica_up series is gone with it


async def test_a_replica_that_left_and_comes_back_rejoins_with_a_new_channel():
    a, b = _engine(), _engine()
    async with membership(a, b) as (replicas, (ta, tb)):
        replicas.apply_membership(frozenset({tb}))
        assert _states(replicas) == {ta: "removed", tb: "down"}  # idle: closed at once; b not probed yet
        with pytest.raises(UpstreamError) as error:  # an operator naming it gets a clear refusal
            await replicas.restore_session("s", "", 60.0, replica=0)
        assert error.value.grpc_code == grpc.StatusCode.UNAVAILABLE
        assert replicas.apply_membership(frozenset({ta, tb})) == Reconcile(add=(ta,))
        assert [r.index for r in replicas.replicas] == [0, 1]  # the same index, not a new replica
        for i in range(4):
            await _tokens(replicas, f"r{i}")
        assert len(a.requests) == 2 and len(b.requests) == 2


async def test_an_empty_answer_keeps_the_set():
    async with membership(_engine(), _engine()) as (replicas, targets):
        assert replicas.apply_membership(frozenset()) == Reconcile()
        assert all(r.in_set for r in replicas.replicas) and replicas.available() == [0, 1]


async def test_no_replica_before_the_first_answer_is_unavailable_not_a_crash():
    async def never_answers(name):
        await asyncio.Event().wait()

    discovery = DnsDiscovery(parse_dns_target("dns:///x.test:1"), resolve=never_answers)
    replicas = ReplicaSet([], RoutingConfig(), discovery=discovery)
    try:
        assert await replicas.is_serving() is False
        with pytest.raises(TimeoutError):
            await replicas.wait_for_info(0.05)  # waits for the first answer, bounded
        with pytest.raises(UpstreamError) as error:
            await replicas.get_stats()
        assert error.value.grpc_code == grpc.StatusCode.UNAVAILABLE
    finally:
        await replicas.close()


async def test_the_set_follows_a_real_dns_servers_answer_on_loopback():
    engines = [_engine() for _ in range(3)]
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(serving(engines[0], "127.0.0.1"))
        port = int(first.rpartition(":")[2])
        for engine, host in zip(engines[1:], ("127.0.0.2", "127.0.0.3"), strict=True):
            await stack.enter_async_context(serving(engine, host, port))  # the same port, another address
        resolver = FleetResolver("pagoda-engine.test", ["127.0.0.1", "127.0.0.2"], ttl=0)
        dns_port = stack.enter_context(dns_server(resolver))
        discovery = DnsDiscovery(parse_dns_target(f"dns://127.0.0.1:{dns_port}/pagoda-engine.test:{port}"),
                                 refresh_s=0.1)
        replicas = ReplicaSet([], RoutingConfig(policy="round-robin", stats_interval_s=0.05), timeout_s=2.0,
                              discovery=discovery)
        stack.push_async_callback(replicas.close)
        info = await replicas.wait_for_info(10.0)
        assert info.model_name == "m"
        await _until(lambda: _states(replicas) == {f"127.0.0.1:{port}": "serving", f"127.0.0.2:{port}": "serving"})
        resolver.answer(["127.0.0.2", "127.0.0.3"])
        await _until(lambda: _states(replicas).get(f"127.0.0.3:{port}") == "serving"
                     and _states(replicas)[f"127.0.0.1:{port}"] == "removed")
        before = len(engines[0].requests)
        for i in range(4):
            assert await _tokens(replicas, f"q{i}") == [5, 6, 7, 8]
        assert len(engines[0].requests) == before and len(engines[2].requests) == 2
        resolver.rcode = RCODE.SERVFAIL  # the DNS fails: the last good set stays
        queries = resolver.queries
        await _until(lambda: resolver.queries >= queries + 2 and discovery.failures >= 2)
        assert _states(replicas)[f"127.0.0.3:{port}"] == "serving" and replicas.available() == [1, 2]
