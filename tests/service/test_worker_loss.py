"""Losing the worker mid-generation: recompute on a worker that comes back in time, UNAVAILABLE for
the requests when it does not."""

from __future__ import annotations

import asyncio

import grpc

from pagoda.v1 import engine_pb2, engine_pb2_grpc
from tests.service.conftest import BLOCK_SIZE, NUM_BLOCKS
from tests.service.test_engine_service import expected, first_response, generate_request, read_rest
from worker_svc.fake.runner import FakeStepRunner
from worker_svc.server import start_worker_server


async def test_requests_fail_unavailable_when_the_worker_does_not_come_back(fake_worker, engine_factory):
    _, stub = await engine_factory(worker_timeout_s=0.3)
    call = stub.Generate(generate_request("doomed", [1, 2, 3], max_tokens=200))
    await first_response(call)
    await fake_worker.server.stop(0)
    try:
        await read_rest(call)
        raise AssertionError("the stream should have failed")
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    second = stub.Generate(generate_request("late", [1], max_tokens=2))
    try:
        await read_rest(second)
        raise AssertionError("a request without a worker should be refused")
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    stats = await stub.GetStats(engine_pb2.GetStatsRequest())
    assert not stats.worker_connected and stats.idle and stats.num_used_blocks == 0


async def test_a_restarted_worker_recomputes_and_the_stream_completes(fake_worker, engine_factory):
    running, stub = await engine_factory(worker_timeout_s=20)
    prompt = [4, 5, 6, 7, 8]
    call = stub.Generate(generate_request("survivor", prompt, max_tokens=60))
    first = await first_response(call)
    port = int(fake_worker.target.rsplit(":", 1)[1])
    await fake_worker.server.stop(0)
    runner = FakeStepRunner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=256)
    server, servicer, _ = await start_worker_server(runner, "127.0.0.1", port)
    try:
        rest = await read_rest(call)
    finally:
        await server.stop(0)
    tokens = [t for r in [first, *rest] for s in r.sequences for t in s.token_ids]
    assert tokens == expected(prompt, 60)
    assert rest[-1].finished


async def test_scheduler_is_not_serving_until_its_worker_answers():
    """The scheduler listens at once but stays NOT_SERVING (and refuses work) until Init succeeded."""
    from pagoda.runtime.grpc_health import NOT_SERVING, SERVING, check
    from scheduler_svc.server import EngineServiceConfig, start_engine_server
    from tests.e2e.conftest import free_port

    port = free_port()
    worker_port = free_port()  # nothing listens there yet
    starting = asyncio.create_task(start_engine_server(
        EngineServiceConfig(workers=(f"127.0.0.1:{worker_port}",), port=port)))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        while (status := await check(channel)) is None:  # until the server listens
            await asyncio.sleep(0.01)
        assert status == NOT_SERVING and not starting.done()
        stub = engine_pb2_grpc.EngineStub(channel)
        try:
            await read_rest(stub.Generate(generate_request("early", [1], 2)))
            raise AssertionError("a request before the worker is up should be refused")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
        runner = FakeStepRunner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        server, servicer, _ = await start_worker_server(runner, "127.0.0.1", worker_port)
        running = await asyncio.wait_for(starting, 30)
        try:
            assert await check(channel) == SERVING
        finally:
            await running.stop(0)
            await server.stop(0)


async def test_a_worker_reconnecting_while_draining_does_not_flip_health_back(fake_worker, engine_factory):
    """SIGTERM started the drain: a worker restart during it must leave health NOT_SERVING."""
    from pagoda.runtime.grpc_health import NOT_SERVING, SERVING, check
    from scheduler_svc.server import drain

    running, _ = await engine_factory(worker_timeout_s=20)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        assert await check(channel) == SERVING
        await drain(running, timeout_s=5)  # idle: returns at once, health NOT_SERVING
        old_epoch = running.client.epoch
        port = int(fake_worker.target.rsplit(":", 1)[1])
        await fake_worker.server.stop(0)
        runner = FakeStepRunner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=256)
        server, servicer, _ = await start_worker_server(runner, "127.0.0.1", port)
        try:
            deadline = asyncio.get_running_loop().time() + 20
            while not (running.engine.connected and running.client.epoch != old_epoch):
                assert asyncio.get_running_loop().time() < deadline, "the worker did not reconnect"
                await asyncio.sleep(0.01)  # poll interval, bounded by the deadline
            # A health RPC takes several loop turns: the health update queued on reconnect ran.
            assert await check(channel) == NOT_SERVING
            assert running.health is not None and not running.health.serving
        finally:
            await server.stop(0)
