"""The step timeline (pagoda/runtime/step_timeline.py) the batch-1 breakdown reads, and the GC freeze
after the worker's Init: real gRPC on loopback, a fake-model worker and the scheduler in-process."""

from __future__ import annotations

import gc

import pytest

from pagoda.runtime.step_timeline import ENV, StepTimeline, read_timelines
from pagoda.v1 import worker_pb2
from tests.service.test_engine_service import collect, expected, generate_request, wait_for_stats


@pytest.fixture
def timeline_dir(tmp_path, monkeypatch):
    """Set before the servers start (request it first): each service opens its file at start."""
    monkeypatch.setenv(ENV, str(tmp_path))
    return tmp_path


async def test_each_service_writes_one_ordered_line_per_step(timeline_dir, fake_worker, engine_factory):
    _, stub = await engine_factory()
    tokens, _ = await collect(stub, generate_request("t", [1, 2, 3], max_tokens=5))
    assert tokens == {0: expected([1, 2, 3], 5)}
    await wait_for_stats(stub, lambda stats: stats.idle)
    worker = {line["step"]: line for line in read_timelines(timeline_dir, "worker")}
    scheduler = {line["step"]: line for line in read_timelines(timeline_dir, "scheduler")}
    assert sorted(worker) == sorted(scheduler) == list(range(1, len(worker) + 1))
    assert len(worker) >= 5  # the prefill, then a step per further token
    assert worker[1]["decode"] is False and all(worker[s]["decode"] for s in range(2, 5))
    for step, w in worker.items():
        s = scheduler[step]
        assert s["scheduling"] <= s["planned"] <= s["sent"] <= s["received"] <= s["dispatched"]
        assert w["received"] <= w["started"] <= w["encoded"] <= w["written"]
        # One clock for every process: a plan is received after it was built, and a result is
        # read after the worker encoded it.
        assert s["planned"] <= w["received"] and w["encoded"] <= s["received"]


def test_the_timeline_is_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not StepTimeline("worker").enabled
    timeline = StepTimeline("worker", str(tmp_path))
    timeline.record(step=7, started=1.5)
    assert read_timelines(tmp_path, "worker") == [{"step": 7, "started": 1.5}]
    assert read_timelines(tmp_path, "scheduler") == []


async def test_init_freezes_the_workers_long_lived_objects(fake_worker):
    """Full collections must not walk the weights' and the cache's objects at every step."""
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    await fake_worker.stub.Init(worker_pb2.InitRequest())
    assert gc.get_freeze_count() > 0


async def test_a_step_without_a_forward_reports_no_stale_marks(timeline_dir, fake_worker, engine_factory):
    """The runner's marks belong to its last forward: a plan that ran none (it only drops a finished
    request) must not report them as its own."""
    from worker_svc.model_runner import StepMarks

    fake_worker.runner.marks = StepMarks(started=1.0, inputs_built=2.0, logits_done=3.0, sampled=4.0)
    _, stub = await engine_factory()
    await collect(stub, generate_request("s", [1, 2, 3], max_tokens=3))
    await wait_for_stats(stub, lambda stats: stats.idle)
    lines = read_timelines(timeline_dir, "worker")
    assert lines and not any("execute" in line for line in lines)
