"""Poison isolation on the real model: the tiny model's worker (ModelRunner) behind the scheduler,
in-process. A request the fault hook poisons fails alone with INTERNAL; 16 concurrent greedy
requests produce exactly the tokens they produce in a run without it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.v1 import engine_pb2_grpc
from scheduler_svc.server import EngineServiceConfig, start_engine_server
from tests.service.test_engine_service import collect, generate_request, wait_for_stats
from tests.service.test_poison_isolation import prompts, run_with_poison
from worker_svc import fault_injection
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import ModelRunner
from worker_svc.server import start_worker_server


@pytest.fixture
async def engine_on_tiny_model(tiny_model_dir: str):
    config = WorkerConfig(model=tiny_model_dir, dtype="float32", device="cpu", block_size=4,
                          num_gpu_blocks_override=256)
    runner = ModelRunner(config, max_num_batched_tokens=512)
    worker, _, worker_port = await start_worker_server(runner, "127.0.0.1", 0)
    engine = await start_engine_server(EngineServiceConfig(workers=(f"127.0.0.1:{worker_port}",), port=0,
                                                           worker_timeout_s=60))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{engine.port}")
    yield engine_pb2_grpc.EngineStub(channel)
    await channel.close()
    await engine.stop(0)
    await worker.stop(0)


async def test_poisoned_request_fails_alone_and_others_match_a_clean_run(engine_on_tiny_model, monkeypatch):
    stub = engine_on_tiny_model
    calls = {rid: collect(stub, generate_request(f"clean-{rid}", prompt, 20))  # no poison: the reference
             for rid, prompt in prompts().items()}
    outputs = await asyncio.gather(*calls.values())
    clean = {rid: tokens[0] for rid, (tokens, _) in zip(calls, outputs, strict=True)}
    monkeypatch.setattr(fault_injection, "fail_request_ids", frozenset({"poison"}))
    assert await run_with_poison(stub) == clean
    stats = await wait_for_stats(stub, lambda s: s.idle)
    assert (stats.num_step_failures, stats.num_requests_isolated) == (2, 1)
    assert stats.invariant_ok and stats.num_used_blocks == 0
