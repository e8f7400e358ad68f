"""The Engine servicer end to end in-process: scheduler server -> Steps stream -> fake-model worker.

Token streams are checked exactly against FakeSampler.reference_stream (what every sequence must
produce whatever the batching); status codes against the error table.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pagoda.contract.params import SamplingParams
from pagoda.v1 import common_pb2, engine_pb2
from tests.service.conftest import NUM_BLOCKS
from worker_svc.fake.fake_worker import FakeSampler


def generate_request(rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n))


async def collect(stub, request) -> tuple[dict[int, list[int]], list[engine_pb2.GenerateResponse]]:
    tokens: dict[int, list[int]] = {}
    responses = []
    async for response in stub.Generate(request, timeout=30):
        responses.append(response)
        for seq in response.sequences:
            tokens.setdefault(seq.index, []).extend(seq.token_ids)
    return tokens, responses


def expected(prompt: list[int], max_tokens: int, seq_index: int = 0) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return FakeSampler().reference_stream(prompt, seq_index, params, max_tokens, set())


async def wait_for_stats(stub, predicate, deadline_s: float = 10.0) -> engine_pb2.EngineStats:
    end = time.monotonic() + deadline_s
    while True:
        stats = await stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)
        if predicate(stats):
            return stats
        assert time.monotonic() < end, f"condition not met within {deadline_s}s: {stats}"
        await asyncio.sleep(0.01)  # poll interval; the deadline bounds the wait


@pytest.mark.parametrize("pipelining", [True, False])
async def test_concurrent_streams_get_exactly_their_tokens(engine_factory, pipelining):
    _, stub = await engine_factory(pipelining=pipelining)
    prompts = {f"r{i}": [i + 1] * (1 + 3 * i) for i in range(8)}
    max_tokens = {rid: 3 + 2 * i for i, rid in enumerate(prompts)}
    results = await asyncio.gather(*(collect(stub, generate_request(rid, p, max_tokens[rid]))
                                     for rid, p in prompts.items()))
    for (rid, prompt), (tokens, responses) in zip(prompts.items(), results, strict=True):
        assert tokens == {0: expected(prompt, max_tokens[rid])}
        assert responses[-1].finished and not any(r.finished for r in responses[:-1])
        assert responses[-1].sequences[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert responses[0].num_prompt_tokens == len(prompt)
    stats = await wait_for_stats(stub, lambda s: s.idle)
    assert stats.invariant_ok and stats.request_success["length"] == 8
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks == NUM_BLOCKS


async def test_parallel_sampling_streams_n_sequences(engine_factory):
    _, stub = await engine_factory()
    tokens, responses = await collect(stub, generate_request("par", [1, 2, 3, 4, 5], 6, n=2))
    assert tokens == {0: expected([1, 2, 3, 4, 5], 6, 0), 1: expected([1, 2, 3, 4, 5], 6, 1)}
    assert responses[-1].finished


async def expect_status(call, code: grpc.StatusCode, fragment: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details()


async def test_bad_params_and_context_overflow_are_invalid_argument(engine_factory):
    _, stub = await engine_factory()
    bad = engine_pb2.GenerateRequest(request_id="x", prompt_token_ids=[1],
                                     sampling=common_pb2.SamplingParams(top_p=1.5))
    await expect_status(stub.Generate(bad), grpc.StatusCode.INVALID_ARGUMENT, "top_p")
    overflow = generate_request("y", [1] * 250, max_tokens=10)  # the fake worker's max_model_len: 256
    await expect_status(stub.Generate(overflow), grpc.StatusCode.INVALID_ARGUMENT,
                        "maximum context length is 256 tokens")
    await expect_status(stub.Generate(generate_request("z", [], 4)), grpc.StatusCode.INVALID_ARGUMENT,
                        "prompt is empty")


async def first_response(call) -> engine_pb2.GenerateResponse:
    return await call.read()


async def read_rest(call) -> list[engine_pb2.GenerateResponse]:
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def test_full_queue_is_resource_exhausted_and_duplicates_already_exist(engine_factory):
    _, stub = await engine_factory(max_num_seqs=1, max_waiting_requests=1)
    running = stub.Generate(generate_request("long", [1, 2], max_tokens=200))
    await first_response(running)  # "long" occupies the only running slot
    waiting = stub.Generate(generate_request("waits", [3], max_tokens=5))
    await wait_for_stats(stub, lambda s: s.num_waiting == 1)
    await expect_status(stub.Generate(generate_request("third", [4], 5)),
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full")
    await expect_status(stub.Generate(generate_request("long", [4], 5)),
                        grpc.StatusCode.ALREADY_EXISTS, "'long'")
    running.cancel()
    tokens = [t for r in [resp async for resp in waiting] for s in r.sequences for t in s.token_ids]
    assert tokens == expected([3], 5)


async def test_cancelling_a_stream_returns_its_blocks(engine_factory):
    running, stub = await engine_factory()
    call = stub.Generate(generate_request("cancel-me", list(range(1, 30)), max_tokens=200))
    await first_response(call)
    assert (await stub.GetStats(engine_pb2.GetStatsRequest())).num_used_blocks > 0
    call.cancel()
    stats = await wait_for_stats(stub, lambda s: s.idle)
    assert stats.invariant_ok and stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_evictable_blocks == NUM_BLOCKS
    assert stats.request_success["abort"] == 1
    assert running.engine.scheduler.num_inflight_steps == 0


async def test_abort_rpc_ends_the_stream_with_abort(engine_factory):
    _, stub = await engine_factory()
    call = stub.Generate(generate_request("victim", [5, 6], max_tokens=200))
    await first_response(call)
    assert (await stub.Abort(engine_pb2.AbortRequest(request_id="victim"))).found
    responses = await read_rest(call)
    assert responses[-1].finished
    assert responses[-1].sequences[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not (await stub.Abort(engine_pb2.AbortRequest(request_id="victim"))).found


async def test_get_info_reports_the_worker_cache_and_the_flags(engine_factory):
    _, stub = await engine_factory(max_num_seqs=7)
    info = await stub.GetInfo(engine_pb2.GetInfoRequest())
    assert (info.num_blocks, info.block_size, info.max_model_len, info.max_num_seqs) == (NUM_BLOCKS, 4, 256, 7)


async def test_the_engine_freezes_long_lived_objects_when_it_goes_idle(engine_factory):
    """Full GCs must not walk the startup heap every step: it is frozen, and re-frozen at idle."""
    import gc

    _, stub = await engine_factory()
    gc.unfreeze()  # whatever start-up froze: the idle transition below must freeze again
    assert gc.get_freeze_count() == 0
    tokens, _ = await collect(stub, generate_request("freeze", [1, 2, 3], max_tokens=4))
    assert tokens == {0: expected([1, 2, 3], 4)}
    await wait_for_stats(stub, lambda stats: stats.idle)
    assert gc.get_freeze_count() > 0


async def test_the_last_response_carries_the_request_timings(engine_factory):
    from tests.service.conftest import BLOCK_SIZE

    _, stub = await engine_factory()
    prompt = list(range(20, 20 + 2 * BLOCK_SIZE + 3))  # 2 full blocks, then a partial one
    for rid, cached in (("cold", 0), ("warm", 2 * BLOCK_SIZE)):  # the second hits the first's blocks
        started = time.monotonic()
        _, responses = await collect(stub, generate_request(rid, prompt, 5))
        elapsed = time.monotonic() - started
        assert responses[0].num_cached_tokens == cached
        assert not any(r.HasField("timings") for r in responses[:-1]) and responses[-1].HasField("timings")
        t = responses[-1].timings
        assert min(t.queue_seconds, t.prefill_seconds, t.decode_seconds) >= 0
        assert t.queue_seconds == pytest.approx(responses[0].queue_seconds, abs=1e-9)
        assert t.queue_seconds + t.prefill_seconds == pytest.approx(t.time_to_first_token_seconds, abs=1e-9)
        assert t.time_to_first_token_seconds + t.decode_seconds == pytest.approx(t.total_seconds, abs=1e-9)
        assert 0 < t.time_to_first_token_seconds <= t.total_seconds <= elapsed
        assert t.prefill_seconds > 0 and t.decode_seconds > 0  # 5 tokens: a prefill, then 4 decode steps
