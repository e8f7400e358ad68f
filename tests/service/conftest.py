"""In-process gRPC fixtures on loopback: a fake-model worker server and a scheduler server on it.

Both run in the test's event loop (grpc.aio), on port 0 (the OS picks a free port).
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from pagoda.v1 import engine_pb2_grpc, worker_pb2_grpc
from scheduler_svc.server import EngineServiceConfig, start_engine_server
from worker_svc.fake.runner import FakeStepRunner
from worker_svc.server import start_worker_server

NUM_BLOCKS = 64
BLOCK_SIZE = 4


@dataclasses.dataclass
class WorkerHandle:
    server: grpc.aio.Server
    servicer: object
    runner: FakeStepRunner
    target: str
    stub: worker_pb2_grpc.WorkerStub


@pytest.fixture
async def fake_worker():
    runner = FakeStepRunner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=256)
    server, servicer, port = await start_worker_server(runner, "127.0.0.1", 0)
    target = f"127.0.0.1:{port}"
    async with grpc.aio.insecure_channel(target) as channel:
        yield WorkerHandle(server, servicer, runner, target, worker_pb2_grpc.WorkerStub(channel))
    await server.stop(0)


@pytest.fixture
async def engine_factory(fake_worker):
    """`await engine_factory(**EngineServiceConfig overrides)` -> (RunningEngine, EngineStub)."""
    started = []

    async def start(**overrides):
        config = EngineServiceConfig(workers=(fake_worker.target,), port=0, **overrides)
        running = await start_engine_server(config)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
        started.append((running, channel))
        return running, engine_pb2_grpc.EngineStub(channel)

    yield start
    for running, channel in started:
        await channel.close()
        await running.stop(0)
