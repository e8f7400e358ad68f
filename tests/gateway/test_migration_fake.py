"""Live migration in the gateway (gateway/upstream/replica_set.py, migration.py) over in-process fake
Engines: POST /admin/migrate's call asks the replica streaming a request to migrate it; that replica
ends the stream with MIGRATED and a KV handoff; the gateway sends the target the failover
continuation with `kv_import` = the handoff, and the caller's stream has exactly the undisturbed
tokens, with no seam. The fake engines sample like the seeded sampler (test_stream_failover.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway import metrics
from pagoda.v1 import common_pb2, engine_pb2
from tests.gateway.test_stream_failover import (
    SeededEngine,
    _count,
    _engine,
    _request,
    _responses,
    _tokens,
    replica_set,
)

HANDOFF = common_pb2.KvHandoff(migration_id="abc", num_tokens=5, num_blocks=1)


@dataclass(slots=True)
class MigratingEngine(SeededEngine):
    """Streams its first response, then waits for Migrate and ends the stream with MIGRATED."""

    asked: asyncio.Event = field(default_factory=asyncio.Event)

    async def Generate(self, request, context):
        async for response in SeededEngine.Generate(self, request, context):
            yield response
            await self.asked.wait()
            yield engine_pb2.GenerateResponse(
                request_id=request.request_id, finished=True, kv_export=HANDOFF,
                sequences=[engine_pb2.SequenceDelta(index=0, finish_reason=common_pb2.FINISH_REASON_MIGRATED)])
            return

    async def Migrate(self, request, context):
        self.asked.set()
        return engine_pb2.MigrateResponse(accepted=True)


async def test_a_migrated_stream_goes_on_on_the_target_with_its_kv_handoff():
    async with replica_set(_engine(), _engine()) as replicas:
        undisturbed = _tokens(await _responses(replicas, _request()))
    source, target = MigratingEngine(model_name="m", scripts=[[]], tokens_per_response=3), _engine()
    migrations, failovers = _count(metrics.ROUTER_MIGRATIONS, "0"), _count(metrics.ROUTER_STREAM_FAILOVERS, "0")
    async with replica_set(source, target) as replicas:
        stream = replicas.generate(_request())
        received = [await anext(stream)]  # the source's first 3 tokens
        move = asyncio.create_task(replicas.migrate("r"))
        received += [r async for r in stream]
        moved = await move
    assert _tokens(received) == undisturbed
    assert [d.finish_reason for r in received for d in r.sequences if d.finish_reason] == [
        common_pb2.FINISH_REASON_LENGTH]  # the caller never sees MIGRATED
    (carried,) = target.requests
    assert list(carried.prompt_token_ids) == [7, 8, 9, *undisturbed[:3]] and carried.num_prior_output_tokens == 3
    assert carried.kv_import == HANDOFF and carried.sampling.max_tokens == 7
    assert moved["migrated"] and (moved["source"], moved["target"]) == (0, 1)
    assert (moved["num_kv_tokens"], moved["num_kv_blocks"]) == (5, 1)
    assert moved["move_seconds"] >= moved["export_seconds"] >= 0
    assert _count(metrics.ROUTER_MIGRATIONS, "0") == migrations + 1
    assert _count(metrics.ROUTER_STREAM_FAILOVERS, "0") == failovers


async def test_an_unknown_request_is_not_migrated_and_a_drained_replica_leaves_the_rotation():
    async with replica_set(_engine(), _engine()) as replicas:
        assert await replicas.migrate("nobody") is None
        assert await replicas.drain(0) == []
        assert replicas.available() == [1]
        replicas.undrain(0)
        assert replicas.available() == [0, 1]


async def test_drain_moves_the_streams_of_a_replica_and_takes_it_out_of_the_rotation():
    async with replica_set(_engine(), _engine()) as replicas:
        undisturbed = _tokens(await _responses(replicas, _request()))
    source, target = MigratingEngine(model_name="m", scripts=[[]], tokens_per_response=3), _engine()
    async with replica_set(source, target) as replicas:
        stream = replicas.generate(_request())
        received = [await anext(stream)]
        drain = asyncio.create_task(replicas.drain(0))
        received += [r async for r in stream]
        moves = await drain
        assert replicas.available() == [1]  # new requests go to the other replica only
    assert _tokens(received) == undisturbed
    assert [(m["migrated"], m["source"], m["target"]) for m in moves] == [(True, 0, 1)]
    assert len(target.requests) == 1 and target.requests[0].kv_import == HANDOFF
