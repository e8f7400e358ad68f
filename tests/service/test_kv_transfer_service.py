"""KvTransfer over real gRPC in-process (two worker servers on loopback, no model): the target's
PullKv fetches the source's export through FetchKv, verified and staged; the export is gone from
the source once fetched. Every failure is a clear status, fast, never a hang: the export unknown
or fetched already (NOT_FOUND), the source gone (UNAVAILABLE), another model (FAILED_PRECONDITION),
a worker not running --kv-transfer grpc (FAILED_PRECONDITION)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from pagoda.contract.step import KvExport
from pagoda.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.e2e.conftest import free_port
from worker_svc.kv_transfer.store import KvTransferStore
from worker_svc.server import start_worker_server

BS = 4
SHAPE = (2, 2, 8, BS, 2, 4)


async def _worker(fingerprint: str = "fp"):
    port = free_port()
    store = KvTransferStore(fingerprint, BS, f"127.0.0.1:{port}", 1 << 30, 60.0)
    runner = SimpleNamespace(migration=SimpleNamespace(migration=store))
    server, _, _ = await start_worker_server(runner, "127.0.0.1", port)
    channel = grpc.aio.insecure_channel(store.address)
    return server, channel, store, kv_transfer_pb2_grpc.KvTransferStub(channel)


@pytest.fixture
async def workers():
    made = [await _worker(), await _worker(), await _worker("another-model")]
    yield made
    for server, channel, _, _ in made:
        await channel.close()
        await server.stop(0)


async def test_a_pull_moves_an_export_worker_to_worker(workers):
    (_, _, source, _), (_, _, target, target_stub), _ = workers
    cache = torch.randn(SHAPE)
    source.export(cache, [KvExport("r1", "m1", [3, 1], 6)], {"r1": [9, 8, 7, 6, 5, 4]})
    reply = await target_stub.PullKv(kv_transfer_pb2.PullKvRequest(
        migration_id="m1", source=source.address, num_blocks=2, timeout_s=10))
    assert reply.num_blocks == 2 and reply.num_bytes > cache[:, :, :2].numel() * 4
    assert target.inbox.holds("m1") and source.outbox.held_bytes == 0  # fetched: dropped at the source
    with pytest.raises(grpc.aio.AioRpcError) as again:  # one target imports a migration
        await target_stub.PullKv(kv_transfer_pb2.PullKvRequest(migration_id="m1", source=source.address,
                                                               num_blocks=2, timeout_s=10))
    assert again.value.code() == grpc.StatusCode.NOT_FOUND


async def test_failures_are_statuses_not_hangs(workers):
    (_, _, source, source_stub), (_, _, _, target_stub), (_, _, _, foreign_stub) = workers
    source.export(torch.randn(SHAPE), [KvExport("r1", "m2", [0], 3)], {"r1": [1, 2, 3]})
    gone = f"127.0.0.1:{free_port()}"  # nobody listens there
    started = time.monotonic()
    cases = [(target_stub, "unknown", source.address, grpc.StatusCode.NOT_FOUND),
             (target_stub, "m2", gone, grpc.StatusCode.UNAVAILABLE),
             (foreign_stub, "m2", source.address, grpc.StatusCode.FAILED_PRECONDITION)]
    for stub, migration_id, address, code in cases:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.PullKv(kv_transfer_pb2.PullKvRequest(migration_id=migration_id, source=address,
                                                            num_blocks=1, timeout_s=10))
        assert failed.value.code() == code, failed.value.details()
    assert time.monotonic() - started < 8  # none waited for its deadline
    assert source.outbox.open("m2", "fp")[0] == 1  # refused fetches leave the export for a retry


async def test_a_worker_without_grpc_transport_says_so():
    port = free_port()
    server, _, _ = await start_worker_server(SimpleNamespace(), "127.0.0.1", port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await kv_transfer_pb2_grpc.KvTransferStub(channel).PullKv(
                    kv_transfer_pb2.PullKvRequest(migration_id="m", source="127.0.0.1:1", num_blocks=1))
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await server.stop(0)
