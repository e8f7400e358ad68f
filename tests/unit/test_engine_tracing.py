"""The scheduler's tracing hooks and the counters behind the engine metrics, in-process:
step spans link to the requests a plan computes for, plans carry the step's traceparent, the block
pool counts blocks in and out, and tracing off means the no-op hooks."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import StepPlan
from pagoda.runtime import telemetry
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.prefix_index import PrefixIndex
from scheduler_svc.core.request import EngineRequest
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.engine_tracing import EngineTracing, NoTracing, engine_tracing
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

NUM_BLOCKS, BLOCK_SIZE = 16, 4


def make_engine() -> tuple[Scheduler, FakeWorker]:
    config = SchedulerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=64,
                             eos_token_ids=(0,))
    return Scheduler(config), FakeWorker(NUM_BLOCKS, BLOCK_SIZE, FakeSampler(vocab_size=50))


def req(rid: str, num_prompt_tokens: int, **sampling) -> EngineRequest:
    return EngineRequest(RequestId(rid), tuple(range(1, num_prompt_tokens + 1)),
                         SamplingParams(**{"max_tokens": 8, "ignore_eos": True, **sampling}))


@pytest.fixture
def traced() -> tuple[EngineTracing, InMemorySpanExporter]:
    """EngineTracing over a private provider: the process's global one stays untouched."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return EngineTracing(provider.get_tracer("test")), exporter


def test_pool_counts_blocks_leaving_and_returning_to_the_available_set():
    index = PrefixIndex()
    pool = BlockPool(8, index)
    taken = pool.allocate(3)
    pool.touch(taken[:1])  # a second reference: nothing leaves the available set
    pool.free(taken[:2])  # block 0 keeps one reference, block 1 returns
    assert (pool.num_allocated_total, pool.num_freed_total, pool.num_used) == (3, 1, 2)
    index.register(taken[2], b"h", 0, (1, 2, 3, 4), ())
    pool.free(taken[2:])  # cached: evictable, still a return to the available set
    pool.touch(taken[2:])  # a prefix hit takes it out again
    assert (pool.num_allocated_total, pool.num_freed_total, pool.num_used) == (4, 2, 2)
    pool.reset()  # everything in use comes back
    assert (pool.num_allocated_total, pool.num_freed_total, pool.num_used) == (4, 4, 0)


def test_scheduler_stats_report_the_pool_counters():
    sched, worker = make_engine()
    sched.add_request(req("a", 6, max_tokens=3))
    while (plan := sched.schedule()) is not None:
        sched.update(worker.execute(plan))
    stats = sched.stats()
    assert stats.blocks_allocated == 2  # ceil((6 + 3 - 1) / 4): the last token is never written
    assert stats.blocks_freed == 2 and stats.num_used_blocks == 0


def test_running_request_ids_are_the_requests_a_plan_computes_for():
    sched, worker = make_engine()
    sched.add_request(req("a", 5))
    sched.add_request(req("b", 3, n=2))
    first = sched.schedule()
    assert sched.running_request_ids(first) == ["a", "b"]
    skipping_a = StepPlan(step_id=first.step_id, num_scheduled_tokens={RequestId("a"): 0})
    assert sched.running_request_ids(skipping_a) == ["b"]
    sched.update(worker.execute(first))
    second = sched.schedule()  # b was forked into b and b#1: still one request
    assert [f.child_ids for f in first.forks] == [["b#1"]]
    assert sched.running_request_ids(second) == ["a", "b"]


def test_step_spans_link_to_the_request_and_ride_in_the_plan(traced):
    tracing, exporter = traced
    sched, worker = make_engine()
    request = req("a", 5, max_tokens=2)
    sched.add_request(request)
    tracing.request_added(request, None)
    plans = []
    while (plan := sched.schedule()) is not None:
        tracing.plan_sent(plan, sched)
        plans.append(plan)
        deltas = sched.update(worker.execute(plan))
        tracing.step_reported(plan.step_id)
        if plan.step_id == 1:
            tracing.first_token(RequestId("a"))
        if any(d.finished for d in deltas):
            tracing.finished(RequestId("a"), "length")
    spans = exporter.get_finished_spans()
    [request_span] = [s for s in spans if s.name == "scheduler.request"]
    steps = sorted((s for s in spans if s.name == "scheduler.step"),
                   key=lambda s: s.attributes["pagoda.step.step_id"])
    assert [s.attributes["pagoda.step.step_id"] for s in steps] == [p.step_id for p in plans] == [1, 2, 3]
    assert plans[2].finished_ids == ["a"]  # step 3 only drops the request on the worker
    for step, plan in zip(steps, plans, strict=True):
        served = [request_span.context] if plan.step_id < 3 else []
        assert [link.context for link in step.links] == served
        _, trace_id, span_id, _ = plan.traceparent.split("-")
        assert (trace_id, span_id) == (f"{step.context.trace_id:032x}", f"{step.context.span_id:016x}")
        assert step.parent is None
    assert (steps[0].attributes["pagoda.step.prefill_tokens"],
            steps[1].attributes["pagoda.step.decode_tokens"]) == (5, 1)
    assert [(e.name, dict(e.attributes)) for e in request_span.events] == [
        ("queued", {}), ("scheduled", {"step_id": 1}), ("first_token", {}),
        ("finished", {"finish_reason": "length"})]
    assert request_span.attributes["gen_ai.usage.input_tokens"] == 5


def test_worker_loss_ends_the_in_flight_step_spans(traced):
    tracing, exporter = traced
    sched, _ = make_engine()
    request = req("a", 5)
    sched.add_request(request)
    tracing.request_added(request, None)
    tracing.plan_sent(sched.schedule(), sched)
    assert exporter.get_finished_spans() == ()
    tracing.worker_lost()
    [step] = exporter.get_finished_spans()
    assert (step.name, step.attributes["error.type"]) == ("scheduler.step", "worker_lost")
    tracing.step_reported(1)  # a late report of a step already ended: nothing happens
    assert len(exporter.get_finished_spans()) == 1


def test_tracing_off_gives_the_noop_hooks(monkeypatch):
    monkeypatch.setattr(telemetry, "_provider", None)
    hooks = engine_tracing()
    assert type(hooks) is NoTracing
    sched, _ = make_engine()
    sched.add_request(req("a", 5))
    plan = sched.schedule()
    hooks.plan_sent(plan, sched)
    assert plan.traceparent == ""


def test_step_spans_count_the_blocks_a_plan_swaps(traced):
    tracing, exporter = traced
    # a and b (3-token prompts) in 4 blocks of 2: b is swapped out at step 3, back in at step 5.
    config = SchedulerConfig(num_blocks=4, block_size=2, max_model_len=16, eos_token_ids=(0,), num_cpu_blocks=4,
                             preemption_mode="swap", enable_prefix_caching=False, max_inflight_steps=1)
    sched, worker = Scheduler(config), FakeWorker(4, 2, FakeSampler(vocab_size=50), num_cpu_blocks=4)
    for rid in ("a", "b"):
        sched.add_request(req(rid, 3, max_tokens=4))
    swaps = []
    while (plan := sched.schedule()) is not None:
        tracing.plan_sent(plan, sched)
        swaps.append((len(plan.swap_out), len(plan.swap_in)))
        sched.update(worker.execute(plan))
        tracing.step_reported(plan.step_id)
    assert swaps[2] == (2, 0) and swaps[4] == (0, 2)
    steps = sorted((s for s in exporter.get_finished_spans() if s.name == "scheduler.step"),
                   key=lambda s: s.attributes["pagoda.step.step_id"])
    assert [(s.attributes["pagoda.step.swapped_out_blocks"], s.attributes["pagoda.step.swapped_in_blocks"])
            for s in steps] == swaps
