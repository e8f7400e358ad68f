"""Real worker + scheduler processes on loopback: streamed tokens equal the offline LLM's, and a
cancelled stream gives all its blocks back."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from pagoda.contract.params import SamplingParams
from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.e2e.conftest import ENGINE_SCHEDULER_FLAGS, ENGINE_WORKER_FLAGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


def make_workload(num_requests: int = 16, seed: int = 0) -> list[tuple[list[int], int, int]]:
    """(prompt token ids, max_tokens, n): mixed lengths, a few n=2."""
    rng = random.Random(seed)
    return [([rng.randrange(4, 2048) for _ in range(rng.randrange(3, 90))], rng.randrange(4, 24),
             2 if i % 5 == 0 else 1) for i in range(num_requests)]


async def stream_one(stub, rid: str, prompt: list[int], max_tokens: int, n: int):
    request = engine_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
        n=n, temperature=0.0, max_tokens=max_tokens))
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    reasons: dict[int, str] = {}
    async for response in stub.Generate(request, timeout=60):
        for seq in response.sequences:
            tokens[seq.index].extend(seq.token_ids)
            if seq.finish_reason:
                reasons[seq.index] = FINISH_NAMES[seq.finish_reason]
    return [(tokens[i], reasons.get(i)) for i in range(n)]


def offline_outputs(model_dir, workload):
    from pagoda.entrypoints.llm import LLM

    llm = LLM(model=str(model_dir), device=ENGINE_WORKER_FLAGS["device"],
              dtype=ENGINE_WORKER_FLAGS["dtype"],
              num_gpu_blocks_override=ENGINE_WORKER_FLAGS["num_gpu_blocks_override"],
              max_num_seqs=ENGINE_SCHEDULER_FLAGS["max_num_seqs"],
              max_num_batched_tokens=ENGINE_SCHEDULER_FLAGS["max_num_batched_tokens"])
    params = [SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens) for _, max_tokens, n in workload]
    outputs = llm.generate([{"prompt_token_ids": p} for p, _, _ in workload], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in out.outputs] for out in outputs]


async def get_stats(stub) -> engine_pb2.EngineStats:
    return await stub.GetStats(engine_pb2.GetStatsRequest(), timeout=5)


async def wait_idle(stub, deadline_s: float = 20.0) -> engine_pb2.EngineStats:
    end = time.monotonic() + deadline_s
    while not (stats := await get_stats(stub)).idle:
        assert time.monotonic() < end, f"engine not idle after {deadline_s}s: {stats}"
        await asyncio.sleep(0.02)  # poll interval; the deadline bounds the wait
    return stats


async def test_streamed_tokens_equal_the_offline_llm(engine_processes):
    workload = make_workload()
    async with grpc.aio.insecure_channel(engine_processes.scheduler_target) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        served = await asyncio.gather(*(stream_one(stub, f"e2e-{i}", p, m, n)
                                        for i, (p, m, n) in enumerate(workload)))
        stats = await wait_idle(stub)
    assert served == offline_outputs(engine_processes.model_dir, workload)
    assert stats.invariant_ok and stats.worker_connected
    assert sum(stats.request_success.values()) >= len(workload)


async def test_cancelled_stream_returns_its_blocks(engine_processes):
    async with grpc.aio.insecure_channel(engine_processes.scheduler_target) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        before = await wait_idle(stub)
        request = engine_pb2.GenerateRequest(
            request_id="to-cancel", prompt_token_ids=list(range(10, 200)),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))
        call = stub.Generate(request, timeout=60)
        first = await call.read()
        assert first.sequences and first.sequences[0].token_ids
        assert (await get_stats(stub)).num_used_blocks > 0
        call.cancel()
        stats = await wait_idle(stub)
    assert stats.invariant_ok and stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_evictable_blocks == stats.num_total_blocks
    assert stats.request_success["abort"] == before.request_success["abort"] + 1
