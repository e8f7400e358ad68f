"""Swap preemption through the services: scheduler server -> Steps stream (swap_out / swap_in on
the wire) -> fake worker with a host pool, which checks every attended KV slot. Exact token streams,
swaps counted in GetStats, the invariant (device and host pools) once idle."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.v1 import engine_pb2_grpc
from scheduler_svc.server import EngineServiceConfig, start_engine_server
from tests.service.test_engine_service import collect, expected, generate_request, wait_for_stats
from worker_svc.fake.runner import FakeStepRunner
from worker_svc.server import start_worker_server


async def start_pair(num_cpu_blocks: int, **engine_flags):
    # 12 blocks of 4 slots for 8 requests of up to 26 tokens: preemption all along.
    runner = FakeStepRunner(num_blocks=12, block_size=4, max_model_len=64, num_cpu_blocks=num_cpu_blocks)
    worker, _, worker_port = await start_worker_server(runner, "127.0.0.1", 0)
    config = EngineServiceConfig(workers=(f"127.0.0.1:{worker_port}",), port=0, **engine_flags)
    return worker, config


@pytest.mark.parametrize("pipelining", [True, False])
async def test_swapped_requests_stream_exactly_their_tokens(pipelining):
    worker, config = await start_pair(num_cpu_blocks=16, preemption_mode="swap", pipelining=pipelining)
    running = await start_engine_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            prompts = {f"r{i}": [i + 1] * (6 + 2 * i) for i in range(8)}
            results = await asyncio.gather(*(collect(stub, generate_request(rid, p, 12))
                                             for rid, p in prompts.items()))
            for prompt, (tokens, _) in zip(prompts.values(), results, strict=True):
                assert tokens == {0: expected(prompt, 12)}
            stats = await wait_for_stats(stub, lambda s: s.idle)
    finally:
        await running.stop(0)
        await worker.stop(0)
    assert stats.invariant_ok and stats.num_cpu_blocks == 16
    assert stats.num_swap_preemptions > 0 and stats.blocks_swapped_out > 0 and stats.blocks_swapped_in > 0
    assert stats.num_swapped == 0 and stats.cpu_kv_cache_usage == 0.0


async def test_swap_mode_without_swap_space_fails_at_start():
    worker, config = await start_pair(num_cpu_blocks=0, preemption_mode="swap")
    try:
        with pytest.raises(ValueError, match="needs a host block pool"):
            await start_engine_server(config)
    finally:
        await worker.stop(0)


def test_flags_reach_the_worker_and_the_scheduler():
    from pagoda.entrypoints.launcher.cli import parse_args as launcher_args
    from pagoda.entrypoints.launcher.topology import build_children
    from scheduler_svc.__main__ import build_config
    from scheduler_svc.__main__ import parse_args as scheduler_args
    from worker_svc.__main__ import build_runner
    from worker_svc.__main__ import parse_args as worker_args

    assert build_config(scheduler_args([])).preemption_mode is None
    assert build_config(scheduler_args(["--preemption-mode", "swap"])).preemption_mode == "swap"
    assert build_runner(worker_args(["--fake", "--swap-space", "0.5"])).initialize().num_cpu_blocks == 512
    assert build_runner(worker_args(["--fake"])).initialize().num_cpu_blocks == 0
    worker, scheduler = build_children(launcher_args(["--fake", "--swap-space", "2", "--preemption-mode",
                                                      "recompute"]))[:2]
    assert worker.argv[worker.argv.index("--swap-space") + 1] == "2.0"
    assert scheduler.argv[scheduler.argv.index("--preemption-mode") + 1] == "recompute"
    plain_worker, plain_scheduler = build_children(launcher_args(["--fake"]))[:2]
    assert "--swap-space" not in plain_worker.argv and "--preemption-mode" not in plain_scheduler.argv
