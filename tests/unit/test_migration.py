"""Live migration in the scheduler core (scheduler_svc/core/tiers/migration.py): two schedulers, each
with a fake worker, the fakes sharing one "migration folder". A request is exported mid-stream from
the source (exact export plan and block ids, the in-flight token discarded, its blocks freed) and its
continuation imports the KV on the target: 0 prefill tokens computed there, and the tokens equal an
undisturbed run's. The fake worker checks every attended position, so a wrong import fails a step."""

from __future__ import annotations

from collections import deque

import pytest

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from pagoda.contract.step import KvExport, KvImport
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from scheduler_svc.core.request import KvHandoff
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

BS = 4
PROMPT = tuple(range(1, 23))  # 22 tokens: 5 full blocks and a partial one
MAX_TOKENS = 12


def replica(folder: dict, inflight: int = 2, kv_migration: bool = True, num_blocks: int = 32):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=BS, max_model_len=128, eos_token_ids=(0,),
                          max_inflight_steps=inflight, kv_migration=kv_migration)
    return Scheduler(cfg), FakeWorker(num_blocks, BS, FakeSampler(vocab_size=50), migrations=folder)


class Driver:
    """Keeps up to max_inflight_steps plans out, as the engine loop's sender does."""

    def __init__(self, sched: Scheduler, worker: FakeWorker) -> None:
        self.sched, self.worker = sched, worker
        self.out: deque = deque()
        self.plans: list = []

    def step(self) -> list:
        while len(self.out) < self.sched.max_inflight_steps:
            plan = self.sched.schedule()
            if plan is None:
                break
            self.plans.append(plan)
            self.out.append(self.worker.execute(plan))  # the fake runs plans in order, as the worker
        if not self.out:
            return []
        deltas = self.sched.update(self.out.popleft())
        self.sched.check_invariants()
        return deltas


def request(rid: str, prompt=PROMPT, max_tokens=MAX_TOKENS, prior=0, handoff=None, **sampling):
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                       **sampling),
                         num_prior_output_tokens=prior, kv_import=handoff)


def run_to_end(driver: Driver, rid: str) -> tuple[list[int], FinishReason, KvHandoff | None]:
    tokens: list[int] = []
    for _ in range(200):
        for delta in driver.step():
            if delta.request_id == rid:
                tokens += delta.new_token_ids
                if delta.finish_reason is not None:
                    return tokens, delta.finish_reason, delta.migration
    raise AssertionError("never finished")


def undisturbed(**sampling) -> list[int]:
    sched, worker = replica({})
    sched.add_request(request("r", **sampling))
    tokens, reason, _ = run_to_end(Driver(sched, worker), "r")
    assert reason is FinishReason.LENGTH and len(tokens) == MAX_TOKENS
    return tokens


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}])
def test_migrated_mid_stream_resumes_without_prefill(sampling):
    expected = undisturbed(**sampling)
    folder: dict = {}
    source, source_worker = replica(folder)
    target, target_worker = replica(folder)
    src = Driver(source, source_worker)
    source.add_request(request("r", **sampling))
    streamed: list[int] = []
    while len(streamed) < 5:
        streamed += [t for d in src.step() for t in d.new_token_ids]
    assert streamed == expected[:5] and len(src.out) == 1  # a step is in flight (pipelining)
    assert source.export_request(RequestId("r"), "m1") == []  # running: detached by the next plan
    table = list(source._queues.live[RequestId("r")].block_table)
    more, reason, handoff = run_to_end(src, "r")
    streamed += more
    export_plan = src.plans[-1]
    # The plan exports the blocks of the 27 computed tokens (22 prompt + 5 sampled; the in-flight
    # step computed position 26), the worker drops the request in the same plan.
    assert export_plan.kv_exports == [KvExport(RequestId("r"), "m1", table[:7], 27)]
    assert export_plan.finished_ids == ["r"]
    # The in-flight token (the 6th) is discarded; the handoff covers the 5 streamed ones' context.
    assert reason is FinishReason.MIGRATED and len(streamed) == 5
    assert handoff == KvHandoff("m1", 27, 7)
    while src.out:
        src.step()
    assert source.stats().num_used_blocks == 0 and not source.has_unfinished_requests()

    # The gateway's continuation: prompt + streamed tokens, earlier output, the KV handoff.
    dst = Driver(target, target_worker)
    target.add_request(request("r", PROMPT + tuple(streamed), MAX_TOKENS - 5, prior=5, handoff=handoff,
                               **sampling))
    rest, reason, _ = run_to_end(dst, "r")
    first = dst.plans[0]
    assert first.new_requests[0].num_computed_tokens == 26 and first.new_requests[0].num_scheduled_tokens == 1
    assert first.kv_imports == [KvImport(RequestId("r"), "m1", 0, first.new_requests[0].block_ids[:7], 27)]
    assert target.stats().prefill_tokens_computed == 0
    assert reason is FinishReason.LENGTH and streamed + rest == expected
    assert folder == {}  # the target's worker took the files


def test_waiting_request_migrates_with_an_empty_handoff():
    sched, _ = replica({}, num_blocks=32)
    sched.add_request(request("q"))
    deltas = sched.export_request(RequestId("q"), "m2")
    assert [(d.finish_reason, d.migration) for d in deltas] == [(FinishReason.MIGRATED, KvHandoff("m2", 0, 0))]
    assert not sched.has_unfinished_requests()
    assert sched.export_request(RequestId("q"), "m3") is None


def test_without_worker_support_the_continuation_recomputes():
    folder: dict = {}
    source, source_worker = replica(folder, kv_migration=False)
    src = Driver(source, source_worker)
    source.add_request(request("r"))
    streamed: list[int] = []
    while len(streamed) < 3:
        streamed += [t for d in src.step() for t in d.new_token_ids]
    source.export_request(RequestId("r"), "m4")
    _, reason, handoff = run_to_end(src, "r")
    assert reason is FinishReason.MIGRATED and handoff == KvHandoff("m4", 0, 0)
    assert not any(p.kv_exports for p in src.plans) and folder == {}


def test_n_greater_than_one_is_refused():
    sched, _ = replica({})
    sched.add_request(request("n2", n=2))
    with pytest.raises(InvalidRequestError):
        sched.export_request(RequestId("n2"), "m5")


@pytest.mark.parametrize("when", ["asked", "exporting"])
def test_a_worker_loss_moves_the_request_with_an_empty_handoff(when):
    """The export may not have run: the request still moves (its stream ends MIGRATED), and its
    target recomputes it, as a failover continuation."""
    sched, worker = replica({}, inflight=1)
    driver = Driver(sched, worker)
    sched.add_request(request("r"))
    while not any(d.new_token_ids for d in driver.step()):
        pass
    sched.export_request(RequestId("r"), "m6")
    if when == "exporting":
        sched.schedule()  # the export's plan is out; its step never reports
    sched.reset_after_worker_loss()
    deltas = sched.take_migrated_after_loss()
    assert [(d.finish_reason, d.migration) for d in deltas] == [(FinishReason.MIGRATED, KvHandoff("m6", 0, 0))]
    assert not sched.has_unfinished_requests() and sched.take_migrated_after_loss() == []
    sched.check_invariants()
