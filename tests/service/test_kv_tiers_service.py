"""The host tier and session leases through the services: scheduler server -> Steps stream (offloads
and loads as swap_out / swap_in on the wire) -> fake worker whose host pool holds the tier after the
swap space, checking every attended KV slot. Exact token streams, GetStats counters, EndSession,
the invariant once idle, and the flags from the launcher to the worker. The disk tier across a
worker restart: the new worker's Init lists the (fake) files, the scheduler rebuilds its index."""

from __future__ import annotations

import grpc

from pagoda.v1 import engine_pb2, engine_pb2_grpc
from scheduler_svc.server import EngineServiceConfig, start_engine_server
from tests.service.test_engine_service import collect, expected, generate_request, wait_for_stats
from worker_svc.fake.runner import FakeStepRunner
from worker_svc.server import start_worker_server


async def test_evicted_prefixes_come_back_from_the_host_tier_and_sessions_end():
    # 12 blocks of 4 slots; the tier's 32 host blocks follow 4 of swap space.
    runner = FakeStepRunner(num_blocks=12, block_size=4, max_model_len=64, num_cpu_blocks=4,
                            num_offload_blocks=32)
    worker, _, worker_port = await start_worker_server(runner, "127.0.0.1", 0)
    running = await start_engine_server(EngineServiceConfig(workers=(f"127.0.0.1:{worker_port}",), port=0))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            first = [3] * 20  # 5 blocks
            tokens, _ = await collect(stub, generate_request("a", first, 4))
            assert tokens == {0: expected(first, 4)}
            for i in range(3):  # each takes 6 blocks: a's cached blocks are evicted to the host
                flood = [10 + i] * 20
                tokens, _ = await collect(stub, generate_request(f"f{i}", flood, 4))
                assert tokens == {0: expected(flood, 4)}
            again = first + [7, 8]
            tokens, responses = await collect(stub, generate_request("b", again, 4))
            assert tokens == {0: expected(again, 4)} and responses[-1].num_cached_tokens == 20
            session = generate_request("s", [5] * 9, 2)
            session.session_id, session.session_ttl_s = "chat", 60.0
            await collect(stub, session)
            stats = await wait_for_stats(stub, lambda s: s.idle)
            assert (stats.num_sessions, stats.num_session_blocks) == (1, 2)
            assert (await stub.EndSession(engine_pb2.EndSessionRequest(session_id="chat"))).found
            assert not (await stub.EndSession(engine_pb2.EndSessionRequest(session_id="chat"))).found
            final = await wait_for_stats(stub, lambda s: s.idle)
    finally:
        await running.stop(0)
        await worker.stop(0)
    assert stats.invariant_ok and stats.num_offload_blocks == 32 and stats.num_cpu_blocks == 4
    assert stats.blocks_offloaded > 0 and stats.blocks_loaded == 5
    assert final.num_sessions == 0 and final.num_session_blocks == 0


async def test_a_restarted_worker_lists_its_disk_tier_and_the_next_turn_hits_it():
    # 12 blocks of 4 slots, 2 host slots over 32 disk files (the fake keeps them in memory).
    runner = FakeStepRunner(num_blocks=12, block_size=4, max_model_len=64, num_offload_blocks=2, num_disk_blocks=32)
    worker, _, worker_port = await start_worker_server(runner, "127.0.0.1", 0)
    running = await start_engine_server(EngineServiceConfig(workers=(f"127.0.0.1:{worker_port}",), port=0,
                                                            worker_timeout_s=20))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            first = [3] * 20  # 5 blocks: the floods push them device -> host -> disk
            await collect(stub, generate_request("a", first, 4))
            for i in range(3):
                await collect(stub, generate_request(f"f{i}", [10 + i] * 20, 4))
            before = await wait_for_stats(stub, lambda s: s.idle)
            await worker.stop(0)  # the worker goes, its device and host memory with it
            restarted = FakeStepRunner(num_blocks=12, block_size=4, max_model_len=64, num_offload_blocks=2,
                                       num_disk_blocks=32)
            restarted.disk = runner.disk  # the files outlive the process
            worker, _, _ = await start_worker_server(restarted, "127.0.0.1", worker_port)
            # Reconnected: the loss emptied the host tier, the new Init's listing refilled the disk index.
            await wait_for_stats(stub, lambda s: s.worker_connected and s.offload_kv_cache_usage == 0
                                 and s.disk_kv_cache_usage > 0)
            again = first + [7, 8]
            tokens, responses = await collect(stub, generate_request("b", again, 4))
            after = await wait_for_stats(stub, lambda s: s.idle)
    finally:
        await running.stop(0)
        await worker.stop(0)
    assert tokens == {0: expected(again, 4)} and responses[-1].num_cached_tokens == 20
    assert before.blocks_disk_written >= 5 and before.num_disk_blocks == 32 and before.offload_kv_cache_usage == 1
    assert after.blocks_disk_loaded == 5 and after.invariant_ok


def test_the_offloading_flags_reach_the_worker():
    from pagoda.entrypoints.launcher.cli import parse_args as launcher_args
    from pagoda.entrypoints.launcher.topology import build_children
    from worker_svc.__main__ import build_runner
    from worker_svc.__main__ import parse_args as worker_args

    info = build_runner(worker_args(["--fake", "--kv-offloading-size", "0.5"])).initialize()
    assert (info.num_offload_blocks, info.num_cpu_blocks) == (512, 0)
    worker = build_children(launcher_args(["--fake", "--kv-offloading-size", "2",
                                           "--num-gpu-blocks-override", "64"]))[0]
    assert worker.argv[worker.argv.index("--kv-offloading-size") + 1] == "2.0"
    assert worker.argv[worker.argv.index("--num-gpu-blocks-override") + 1] == "64"
    assert "--kv-offloading-size" not in build_children(launcher_args(["--fake"]))[0].argv
    info = build_runner(worker_args(["--fake", "--kv-offloading-size", "0.5", "--kv-offload-dir", "/unused",
                                     "--kv-offload-dir-size", "2"])).initialize()
    assert (info.num_offload_blocks, info.num_disk_blocks, info.disk_blocks) == (512, 2048, ())


async def test_session_save_and_restore_answer_grpc_statuses_without_a_snapshot_folder():
    """A worker without --kv-snapshot-dir (the fake): NOT_FOUND for a session with no lease,
    INVALID_ARGUMENT for saving one that has a lease and for any restore (the worker says so)."""
    runner = FakeStepRunner(num_blocks=12, block_size=4, max_model_len=64)
    worker, _, worker_port = await start_worker_server(runner, "127.0.0.1", 0)
    running = await start_engine_server(EngineServiceConfig(workers=(f"127.0.0.1:{worker_port}",), port=0))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            codes = []
            for call in (stub.SaveSession, None, stub.SaveSession, stub.RestoreSession):
                if call is None:  # a turn of session "chat": it now holds a lease
                    session = generate_request("s", [5] * 9, 2)
                    session.session_id, session.session_ttl_s = "chat", 60.0
                    await collect(stub, session)
                    continue
                try:
                    await call(engine_pb2.SessionRequest(session_id="chat", ttl_s=60.0))
                except grpc.aio.AioRpcError as error:
                    codes.append((error.code(), error.details()))
    finally:
        await running.stop(0)
        await worker.stop(0)
    assert [code for code, _ in codes] == [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                                           grpc.StatusCode.INVALID_ARGUMENT]
    assert all("--kv-snapshot-dir" in details for _, details in codes[1:])
