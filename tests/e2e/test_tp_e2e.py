"""A worker started with --tensor-parallel-size 2 (rank 0 + one spawned follower, gloo on CPU)
behind a real scheduler: streamed greedy tokens equal the offline TP=1 LLM's on a mix with prefix
hits and preemption; SIGTERM stops both ranks cleanly; a dead follower makes the worker exit
non-zero (so its supervisor restarts it and the scheduler resyncs)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from pagoda.contract.params import SamplingParams
from pagoda.v1 import engine_pb2_grpc
from tests.e2e.conftest import start_scheduler, start_worker
from tests.e2e.test_engine_e2e import stream_one, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
# 16 blocks of 16 = 256 slots for 12 sequences of up to ~125 tokens: preemption is certain.
WORKER_FLAGS = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 16}
SCHEDULER_FLAGS = {"max_num_seqs": 16, "max_num_batched_tokens": 256}


def make_workload() -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, n): half share a 48-token system prompt (two full blocks hit)."""
    rng = random.Random(11)
    system = [rng.randrange(4, 2048) for _ in range(48)]
    workload = []
    for i in range(12):
        own = [rng.randrange(4, 2048) for _ in range(rng.randrange(3, 60))]
        workload.append((system + own if i % 2 else own, rng.randrange(6, 16), 2 if i % 4 == 0 else 1))
    return workload


def offline_tp1(model_dir: Path, workload) -> list:
    from pagoda.entrypoints.llm import LLM

    with LLM(model=str(model_dir), device="cpu", dtype="float32",
             num_gpu_blocks_override=WORKER_FLAGS["num_gpu_blocks_override"],
             max_num_seqs=SCHEDULER_FLAGS["max_num_seqs"],
             max_num_batched_tokens=SCHEDULER_FLAGS["max_num_batched_tokens"]) as llm:
        params = [SamplingParams(n=n, temperature=0.0, max_tokens=m) for _, m, n in workload]
        outputs = llm.generate([{"prompt_token_ids": p} for p, _, _ in workload], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason) for c in out.outputs] for out in outputs]


def follower_pids(pid: int) -> list[int]:
    """Children of `pid`, from /proc (the worker's spawned ranks)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


async def serve_workload(target: str, workload):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        first = await stream_one(stub, "tp-0", *workload[1])  # registers the system prompt
        rest = await asyncio.gather(*(stream_one(stub, f"tp-{i}", p, m, n)
                                      for i, (p, m, n) in enumerate(workload) if i != 1))
        stats = await wait_idle(stub)
    return [rest[0], first, *rest[1:]], stats


def test_tp2_worker_serves_tp1_tokens_and_stops_cleanly(tiny_model_dir, tmp_path) -> None:
    workload = make_workload()
    worker = start_worker(tiny_model_dir, tmp_path, tensor_parallel_size=2, **WORKER_FLAGS)
    try:
        scheduler = start_scheduler(worker.target, tmp_path, **SCHEDULER_FLAGS)
        try:
            served, stats = asyncio.run(serve_workload(scheduler.target, workload))
        finally:
            scheduler.stop()
        assert len(follower_pids(worker.proc.pid)) == 1
    finally:
        code = worker.stop()
    assert code == 0, worker.log_tail()
    assert '"event": "tp_rank_stopped"' in worker.log_tail(20000)  # the follower got "stop"
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.invariant_ok
    assert served == offline_tp1(tiny_model_dir, workload)


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_dead_follower_makes_the_worker_exit_nonzero(tiny_model_dir, tmp_path, sizes) -> None:
    """A TP follower, or the last pipeline stage (which samples and reports): either way rank 0 exits."""
    import os
    import signal

    worker = start_worker(tiny_model_dir, tmp_path, **sizes, **WORKER_FLAGS)
    try:
        [follower] = follower_pids(worker.proc.pid)
        os.kill(follower, signal.SIGKILL)
        assert worker.proc.wait(timeout=30) == 1
    finally:
        worker.stop()
    assert "tp_group_failed" in worker.log_tail(20000)
