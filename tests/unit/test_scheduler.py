"""Scheduler policy with exact plans, block ids and tokens (the fake worker checks the KV)."""

import pytest

from pagoda.contract.errors import InvalidRequestError, QueueFullError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import FinishReason, SamplingParams
from pagoda.contract.step import BlockCopy, Embedding, Fork, StepPlan, StepResult, TableUpdate
from pagoda.tools.simulate import drive
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


def setup(num_blocks=16, block_size=4, **kw):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=kw.pop("max_model_len", 64),
                          eos_token_ids=(0,), **kw)
    return Scheduler(cfg), FakeWorker(num_blocks, block_size, FakeSampler(vocab_size=50))


def req(rid, prompt, **sampling):
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(**{"max_tokens": 8, **sampling}))


def step(sched, worker):
    plan = sched.schedule()
    deltas = sched.update(worker.execute(plan))
    sched.check_invariants()
    return plan, deltas


def test_plans_carry_only_changes():
    sched, worker = setup()
    sched.add_request(req("r", range(1, 7)))
    plan, deltas = step(sched, worker)
    (new,) = plan.new_requests
    assert (plan.step_id, new.token_ids, new.block_ids, new.num_scheduled_tokens) == (1, [1, 2, 3, 4, 5, 6], [0, 1], 6)
    assert [d.new_token_ids for d in deltas] == [worker.sampled["r"]]
    plan, _ = step(sched, worker)  # position 6 fits block 1: nothing to say
    assert plan.step_id == 2 and plan.is_empty
    step(sched, worker)
    plan, _ = step(sched, worker)  # position 8 opens block 2
    assert plan.table_updates == [TableUpdate(RequestId("r"), 2, [2])] and not plan.new_requests


def test_prefix_hits_full_partial_none():
    sched, worker = setup()
    prompt = list(range(1, 9))
    sched.add_request(req("a", prompt, max_tokens=1))
    drive(sched, worker)
    cases = [("full", prompt, 4), ("longer", prompt + [9], 8), ("partial", prompt[:4] + [20, 21, 22], 4),
             ("none", [30] + prompt[1:], 0)]
    for rid, tokens, cached in cases:
        sched.add_request(req(rid, tokens, max_tokens=1))
        plan, deltas = step(sched, worker)
        (new,) = plan.new_requests
        # A full hit leaves the last prompt token to compute: hits stop at (len-1)//block_size blocks.
        assert new.num_computed_tokens == cached and deltas[0].num_cached_tokens == cached, rid
        assert new.block_ids[:cached // 4] == [0, 1][:cached // 4], rid
    assert sched.stats().prefix_hits == 16


def test_a_pooling_request_gets_no_prefix_hit_and_its_embedding_rides_on_its_final_delta():
    """Mean pooling needs every prompt position's hidden state: no hit, though its blocks register."""
    sched, worker = setup()
    prompt = list(range(1, 9))
    sched.add_request(req("a", prompt, max_tokens=1))
    drive(sched, worker)
    sched.add_request(req("e", prompt, max_tokens=1, pooling=True))
    plan = sched.schedule()
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 0 and new.num_scheduled_tokens == 8 and new.sampling.pooling
    result = worker.execute(plan)
    result.embeddings = [Embedding(RequestId("e"), [0.6, 0.8])]
    (delta,) = sched.update(result)
    assert delta.embedding == [0.6, 0.8] and delta.finish_reason is FinishReason.LENGTH
    sched.add_request(req("b", prompt, max_tokens=1))  # a generation request still hits
    plan, _ = step(sched, worker)
    assert plan.new_requests[0].num_computed_tokens == 4


def test_forced_hash_collision_is_not_a_hit(monkeypatch):
    from scheduler_svc.core import prefix_index
    monkeypatch.setattr(prefix_index, "hash_block", lambda parent, tokens, extra=(): b"\1" * 32)
    sched, worker = setup()
    sched.add_request(req("a", range(1, 9), max_tokens=1))
    drive(sched, worker)
    sched.add_request(req("b", range(11, 19), max_tokens=2))
    plan, _ = step(sched, worker)
    assert plan.new_requests[0].num_computed_tokens == 0  # the fake KV check would fail otherwise
    drive(sched, worker)


def test_fork_shares_blocks_then_copies_on_first_write():
    sched, worker = setup()
    sched.add_request(req("r", range(1, 7), n=2))
    plan, deltas = step(sched, worker)
    assert plan.forks == [Fork(RequestId("r"), [RequestId("r#1")])]
    assert sorted((d.seq_index, d.new_token_ids) for d in deltas) == [
        (0, worker.sampled["r"]), (1, worker.sampled["r#1"])]
    plan, _ = step(sched, worker)  # both write position 6 into the shared block 1
    assert plan.block_copies == [BlockCopy(1, 2)]
    assert plan.table_updates == [TableUpdate(RequestId("r"), 1, [2])]
    assert worker.resident["r"].block_table == [0, 2] and worker.resident["r#1"].block_table == [0, 1]
    streams = drive(sched, worker)
    assert worker.sampled["r"] != worker.sampled["r#1"]
    assert streams[("r", 0)][-1] is FinishReason.LENGTH and streams[("r", 1)][-1] is FinishReason.LENGTH


def test_preemption_frees_everything_and_resumes_with_outputs():
    sched, worker = setup(num_blocks=4, block_size=2)
    sched.add_request(req("a", [1, 2, 3], max_tokens=4))
    sched.add_request(req("b", [4, 5, 6], max_tokens=4))
    plan, _ = step(sched, worker)
    assert [n.block_ids for n in plan.new_requests] == [[0, 1], [2, 3]]
    step(sched, worker)  # position 3 still fits
    plan, _ = step(sched, worker)  # position 4: a needs a block, b (newest) is preempted
    assert plan.preempted_ids == ["b"] and plan.table_updates == [TableUpdate(RequestId("a"), 2, [3])]
    assert sched.stats().num_preemptions == 1 and sched.stats().num_waiting == 1
    b_outputs = list(worker.sampled["b"])
    resumed = None
    while resumed is None:
        plan, _ = step(sched, worker)
        resumed = next((n for n in plan.new_requests if n.request_id == "b"), None)
    assert resumed.token_ids == [4, 5, 6] + b_outputs and resumed.num_prompt_tokens == 3
    drive(sched, worker)


def test_chunked_prefill_over_several_steps():
    sched, worker = setup(max_num_batched_tokens=8)  # threshold auto: 4 tokens per step
    sched.add_request(req("r", range(1, 11)))
    plan, deltas = step(sched, worker)
    assert plan.new_requests[0].num_scheduled_tokens == 4 and plan.new_requests[0].block_ids == [0]
    assert deltas == []
    plan, deltas = step(sched, worker)
    assert plan.num_scheduled_tokens == {"r": 4} and plan.table_updates == [TableUpdate(RequestId("r"), 1, [1])]
    plan, deltas = step(sched, worker)
    assert plan.num_scheduled_tokens == {"r": 2} and [d.new_token_ids for d in deltas] == [worker.sampled["r"]]


def test_abort_mid_prefill_releases_everything():
    sched, worker = setup(max_num_batched_tokens=8)
    sched.add_request(req("r", range(1, 11)))
    step(sched, worker)
    (delta,) = sched.abort(RequestId("r"))
    assert (delta.request_id, delta.finish_reason, delta.new_token_ids) == ("r", FinishReason.ABORT, [])
    assert sched.abort(RequestId("r")) == [] and sched.abort(RequestId("unknown")) == []
    plan = sched.schedule()
    assert plan.finished_ids == ["r"] and plan.step_id == 2 and not plan.new_requests
    worker.execute(plan)
    sched.update(StepResult(2))
    stats = sched.stats()  # the first chunk's full block stays cached (its step had reported)
    assert (stats.num_free_blocks, stats.num_evictable_blocks, stats.num_used_blocks) == (15, 1, 0)
    assert not sched.has_unfinished_requests()
    sched.check_invariants()


def test_abort_mid_prefill_keeps_the_chunks_in_flight_cached_for_a_retry():
    """A client that gives up mid-prefill and retries the same prompt (Claude Code after 300 s of
    silence) resumes from every block computed, those of the steps in flight at the abort too."""
    sched, worker = setup(max_num_batched_tokens=8)  # 4 prompt tokens a step, 2 steps in flight
    prompt = list(range(1, 13))
    sched.add_request(req("r", prompt))
    first, second = sched.schedule(), sched.schedule()
    assert first.new_requests[0].block_ids == [0] and second.table_updates == [TableUpdate(RequestId("r"), 1, [1])]
    assert sched.schedule() is None  # both in flight, neither reported
    (delta,) = sched.abort(RequestId("r"))
    assert delta.finish_reason is FinishReason.ABORT
    for plan in (first, second):  # the worker wrote blocks 0 and 1 all the same
        assert sched.update(worker.execute(plan)) == []
    stats = sched.stats()  # both hashed, evictable (not back on the free list)
    assert (stats.num_free_blocks, stats.num_evictable_blocks, stats.num_used_blocks) == (14, 2, 0)
    sched.check_invariants()
    sched.add_request(req("retry", prompt))
    plan, deltas = step(sched, worker)
    (new,) = plan.new_requests
    assert plan.finished_ids == ["r"] and new.block_ids[:2] == [0, 1] and new.num_computed_tokens == 8
    assert new.num_scheduled_tokens == 4 and deltas[0].num_cached_tokens == 8
    assert deltas[0].new_token_ids == worker.sampled["retry"][:1]  # the fake worker checked the KV it read


def test_admission_rejections():
    sched, _ = setup(max_model_len=32, max_waiting_requests=2, max_waiting_tokens=12)
    with pytest.raises(InvalidRequestError) as err:
        sched.add_request(req("long", range(1, 21), max_tokens=20))
    assert str(err.value) == ("This model's maximum context length is 32 tokens. However, you requested 40 "
                              "tokens (20 in the messages, 20 in the completion). Please reduce the length "
                              "of the messages or completion.")
    with pytest.raises(InvalidRequestError, match="empty"):
        sched.add_request(req("empty", []))
    sched.add_request(req("a", range(1, 6), max_tokens=None))  # None: up to max_model_len
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(req("a", [1]))
    with pytest.raises(QueueFullError, match="5 of 12 prompt tokens"):
        sched.add_request(req("b", range(1, 9)))
    sched.add_request(req("c", [1]))
    with pytest.raises(QueueFullError, match="2 of 2 requests"):
        sched.add_request(req("d", [1]))


def test_pipelined_eos_discards_the_extra_token_and_defers_the_free():
    sched, _ = setup(max_inflight_steps=2)
    sched.add_request(req("r", [1, 2, 3]))
    first = sched.schedule()
    second = sched.schedule()  # decode of the placeholder token
    assert second.step_id == 2 and second.is_empty and sched.num_inflight_steps == 2
    assert sched.schedule() is None  # two plans in flight
    (delta,) = sched.update(StepResult(1, [RequestId("r")], [0]))  # EOS
    assert (delta.new_token_ids, delta.finish_reason) == ([0], FinishReason.STOP)
    assert first.new_requests[0].block_ids == [0] and sched.stats().num_free_blocks == 15  # deferred
    sched.check_invariants()
    assert sched.update(StepResult(2, [RequestId("r")], [7])) == []  # the extra token is discarded
    assert sched.stats().num_free_blocks == 16
    plan = sched.schedule()
    assert plan.step_id == 3 and plan.finished_ids == ["r"] and not plan.num_scheduled_tokens
    sched.update(StepResult(3))
    assert sched.schedule() is None and not sched.has_unfinished_requests()


def test_pipelining_never_schedules_past_max_tokens():
    sched, worker = setup(max_inflight_steps=2)
    sched.add_request(req("r", [1, 2, 3], max_tokens=1))
    result = worker.execute(sched.schedule())
    assert sched.schedule() is None  # its only token is in flight: nothing else to compute
    (delta,) = sched.update(result)
    assert (delta.new_token_ids, delta.finish_reason) == (worker.sampled["r"], FinishReason.LENGTH)
    plan = sched.schedule()
    assert plan.finished_ids == ["r"] and plan.num_scheduled_tokens == {} and not plan.new_requests
    sched.check_invariants()


def test_worker_loss_resumes_everything_from_step_one():
    sched, worker = setup(max_inflight_steps=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", [i + 1] * 5, max_tokens=6))
    step(sched, worker)
    sched.schedule()  # in flight when the worker dies
    sched.reset_after_worker_loss()
    sched.check_invariants()
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 3, 16)
    worker = FakeWorker(16, 4, FakeSampler(vocab_size=50))
    plan = sched.schedule()
    assert plan.step_id == 1 and [n.request_id for n in plan.new_requests] == ["r0", "r1", "r2"]
    assert all(len(n.token_ids) == 6 for n in plan.new_requests)  # prompt + the one known output
    sched.update(worker.execute(plan))
    drive(sched, worker)
    assert not sched.has_unfinished_requests()


def test_priority_policy_admits_lower_values_first():
    sched, worker = setup(policy="priority", max_num_seqs=1)
    sched.add_request(EngineRequest(RequestId("low"), (1, 2), SamplingParams(max_tokens=1), priority=5))
    sched.add_request(EngineRequest(RequestId("high"), (3, 4), SamplingParams(max_tokens=1), priority=0))
    plan, _ = step(sched, worker)
    assert [n.request_id for n in plan.new_requests] == ["high"]


def test_fail_all_ends_every_sequence_once_including_unforked_children():
    sched, worker = setup(max_num_batched_tokens=8)
    sched.add_request(req("r", range(1, 11), n=3))
    step(sched, worker)
    deltas = sched.fail_all("worker gone")
    assert sorted((d.request_id, d.seq_index, d.finish_reason) for d in deltas) == [
        ("r", i, FinishReason.ERROR) for i in range(3)]
    assert not sched.has_unfinished_requests() and sched.stats().num_free_blocks == 16
    sched.check_invariants()


def test_a_failover_continuation_samples_what_the_original_would_have():
    """A continuation (prompt + earlier output, num_prior_output_tokens) is told to the worker as
    the original prompt with that output as output, so min_tokens masking (and, on a real worker,
    seeded positions and penalties) go on where they stopped; its own limits count new tokens."""
    stops = tuple(range(1, 45))  # most tokens stop the request, once past min_tokens
    prompt = (3, 1, 4, 1, 5)
    sched, worker = setup()
    sched.add_request(req("a", prompt, min_tokens=6, max_tokens=8, stop_token_ids=stops))
    original = drive(sched, worker)[("a", 0)]
    assert len(original) > 6  # masked until 6 outputs: the continuation below crosses that
    tokens = original[:-1]
    sched, worker = setup()
    sched.add_request(EngineRequest(RequestId("a"), prompt + tuple(tokens[:3]),
                                    SamplingParams(min_tokens=3, max_tokens=5, stop_token_ids=stops),
                                    num_prior_output_tokens=3))
    plan, _ = step(sched, worker)
    (new,) = plan.new_requests
    assert (new.num_prompt_tokens, new.sampling.min_tokens) == (len(prompt), 6)
    rest = drive(sched, worker)[("a", 0)]
    assert [*worker.sampled["a"][:1], *rest] == [*tokens[3:], original[-1]]


@pytest.mark.parametrize("sampling", [{"n": 2}, {"beam_width": 2}, {"prompt_logprobs": 1}, {}])
def test_a_continuation_must_be_one_sequence_and_shorter_than_its_prompt(sampling):
    sched, _ = setup()
    prior = 5 if not sampling else 2  # {}: all of its prompt would be earlier output
    with pytest.raises(InvalidRequestError, match="num_prior_output_tokens"):
        sched.add_request(EngineRequest(RequestId("c"), (1, 2, 3, 4, 5), SamplingParams(max_tokens=4, **sampling),
                                        num_prior_output_tokens=prior))


def test_a_pooling_request_is_never_swapped_out():
    """Its worker state (mean pooling's running sum) is dropped at preemption: swapping only its KV
    back would resume the sum from nothing, so it recomputes."""
    from scheduler_svc.core.request import Request, Sequence
    from scheduler_svc.core.swap import SwapManager

    swap = SwapManager(num_cpu_blocks=8, block_size=4, mode="swap", threshold=0)
    for pooling, swapped in [(False, 1), (True, 0)]:
        request = Request(RequestId("r"), tuple(range(1, 9)), SamplingParams(max_tokens=1, pooling=pooling),
                          1, 0, 0.0, 0, None)
        seq = Sequence(RequestId("r"), 0, request, list(range(1, 9)), num_computed_tokens=4, block_table=[3, 4])
        plan = StepPlan(step_id=1)
        swap.swap_out(seq, plan)
        assert len(plan.swap_out) == swapped, pooling
        swap.reset()
