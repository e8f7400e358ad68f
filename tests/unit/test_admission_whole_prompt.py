"""Admission sizes a request by its whole prompt, beside what the running prompts' unfinished
prefills will still take (scheduler_svc/core/admission.py): a long prompt is not admitted for its
first chunk only to take the blocks another running prompt needs for its next one, which would
end in a preemption and its chunks computed again."""

from __future__ import annotations

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


def setup(num_blocks: int):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=64, eos_token_ids=(0,),
                          max_num_batched_tokens=16, long_prefill_token_threshold=8, max_inflight_steps=1)
    return Scheduler(cfg), FakeWorker(num_blocks, 4, FakeSampler(vocab_size=50))


def step(sched: Scheduler, worker: FakeWorker):
    plan = sched.schedule()
    sched.update(worker.execute(plan))
    sched.check_invariants()
    return plan


def long_prompt(start: int) -> tuple[int, ...]:
    return tuple(range(start, start + 24))  # 6 blocks of 4, prefilled in chunks of 8


def test_the_second_long_prompt_waits_for_room_for_all_of_it():
    """10 blocks: a's 24 tokens take 6 (7 with its first output), so b's 6 do not fit beside
    them. b waits, though its first chunk (2 blocks) would fit, and nobody is preempted."""
    sched, worker = setup(num_blocks=10)
    sched.add_request(EngineRequest(RequestId("a"), long_prompt(1), SamplingParams(max_tokens=2)))
    sched.add_request(EngineRequest(RequestId("b"), long_prompt(100), SamplingParams(max_tokens=2)))
    plan = step(sched, worker)
    assert [(n.request_id, n.block_ids, n.num_scheduled_tokens) for n in plan.new_requests] == [
        ("a", [0, 1], 8)]  # the budget had 8 more tokens for b's first chunk: b waits instead
    admitted_at = {}
    for i in range(1, 12):
        plan = step(sched, worker)
        for n in plan.new_requests:
            admitted_at[n.request_id] = (i, n.block_ids)
        assert not plan.preempted_ids
        if not sched.has_unfinished_requests():
            break
    assert sched.stats().num_preemptions == 0
    assert admitted_at["b"][0] >= 3  # after a's last chunk (steps 0, 1, 2)


def test_without_the_rule_the_same_pair_preempts_and_recomputes(monkeypatch):
    """The same two prompts with the whole-prompt check switched off (chunk-only admission, as
    before): b is admitted beside a for its first chunk, the pool runs short before both finish
    their prefills, and one of them is preempted and computed again."""
    from scheduler_svc.core.admission import Admission

    monkeypatch.setattr(Admission, "_fits_whole", lambda self, seq, hits, reserve: True)
    sched, worker = setup(num_blocks=10)
    sched.add_request(EngineRequest(RequestId("a"), long_prompt(1), SamplingParams(max_tokens=2)))
    sched.add_request(EngineRequest(RequestId("b"), long_prompt(100), SamplingParams(max_tokens=2)))
    plan = step(sched, worker)
    assert [n.request_id for n in plan.new_requests] == ["a", "b"]
    while sched.has_unfinished_requests():
        step(sched, worker)
    stats = sched.stats()
    assert stats.num_preemptions >= 1 and stats.prefill_tokens_computed > 48
