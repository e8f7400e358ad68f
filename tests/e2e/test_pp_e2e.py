"""Pipeline parallelism through the real services: a worker started with --pipeline-parallel-size 2
(x --tensor-parallel-size 1 and 2: 2 and 4 ranks, gloo on CPU) behind a real scheduler that keeps
two plans in flight. Streamed greedy tokens equal the offline single-rank LLM's on a mix with
prefix hits, parallel sampling (n=2) and preemption in a cramped pool; SIGTERM stops every rank.
(A dead last-stage rank: tests/e2e/test_tp_e2e.py.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import start_scheduler, start_worker
from tests.e2e.test_tp_e2e import (
    SCHEDULER_FLAGS,
    WORKER_FLAGS,
    follower_pids,
    make_workload,
    offline_tp1,
    serve_workload,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2xpp2"])
def test_pipeline_worker_serves_single_rank_tokens(tiny_model_dir, tmp_path, tp: int) -> None:
    workload = make_workload()
    worker = start_worker(tiny_model_dir, tmp_path, tensor_parallel_size=tp, pipeline_parallel_size=2,
                          **WORKER_FLAGS)
    try:
        scheduler = start_scheduler(worker.target, tmp_path, **SCHEDULER_FLAGS)
        try:
            served, stats = asyncio.run(serve_workload(scheduler.target, workload))
        finally:
            scheduler.stop()
        assert len(follower_pids(worker.proc.pid)) == 2 * tp - 1
    finally:
        code = worker.stop()
    log = worker.log_tail(50000)
    assert code == 0, worker.log_tail()
    assert log.count('"event": "tp_rank_stopped"') == 2 * tp - 1  # every rank got "stop"
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.invariant_ok
    assert served == offline_tp1(tiny_model_dir, workload)
