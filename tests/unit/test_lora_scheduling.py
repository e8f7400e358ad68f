"""LoRA in the scheduler core: prefix-cache keys per adapter, the max_loras admission rule, and the
adapter riding to the worker on the new-request entry (pure: the fake worker)."""

import pytest

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import RequestId
from pagoda.contract.lora import LoRARequest
from pagoda.contract.params import SamplingParams
from pagoda.contract.prefix_hash import block_extra_keys, prefix_hash
from pagoda.tools.simulate import drive
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

A = LoRARequest("a", 1, "/adapters/a")
B = LoRARequest("b", 2, "/adapters/b")
C = LoRARequest("c", 3, "/adapters/c")
PROMPT = list(range(1, 11))  # block size 4: two full blocks cacheable


def setup(max_loras=2, **kw):
    cfg = SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, eos_token_ids=(0,),
                          max_loras=max_loras, **kw)
    return Scheduler(cfg), FakeWorker(32, 4, FakeSampler(vocab_size=50))


def req(rid, lora, prompt=PROMPT, max_tokens=2, salt=None):
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=max_tokens),
                         cache_salt=salt, lora=lora)


def cached_tokens_of(sched, worker, request):
    sched.add_request(request)
    plan = sched.schedule()
    (new,) = plan.new_requests
    sched.update(worker.execute(plan))
    drive(sched, worker)
    return new.num_computed_tokens, new.lora


def test_a_prefix_computed_under_one_adapter_is_never_a_hit_for_another():
    sched, worker = setup()
    assert cached_tokens_of(sched, worker, req("a1", A)) == (0, A)
    assert cached_tokens_of(sched, worker, req("b1", B)) == (0, B)  # same tokens, other adapter
    assert cached_tokens_of(sched, worker, req("base", None)) == (0, None)  # nor for the base model
    assert cached_tokens_of(sched, worker, req("a2", A)) == (8, A)  # the same adapter hits
    assert cached_tokens_of(sched, worker, req("b2", B)) == (8, B)
    sched.check_invariants()


def test_an_adapter_re_registered_from_another_path_does_not_reuse_blocks():
    sched, worker = setup()
    cached_tokens_of(sched, worker, req("a1", A))
    moved = LoRARequest("a", 1, "/adapters/a-v2")
    assert cached_tokens_of(sched, worker, req("a2", moved))[0] == 0


def test_salt_and_adapter_both_key_the_cache():
    assert block_extra_keys(0, None, None) == () and block_extra_keys(0, "t", None) == ("t",)
    assert block_extra_keys(1, "t", A.cache_key) == ()  # the chain carries the first block's keys
    keys = {block_extra_keys(0, salt, lora) for salt in (None, "t") for lora in (None, A.cache_key)}
    assert len(keys) == 4
    hashes = {prefix_hash(PROMPT, 4, salt, 2, lora) for salt in (None, "t") for lora in (None, A.cache_key)}
    assert len(hashes) == 4


def test_at_most_max_loras_adapters_run_at_once():
    sched, worker = setup(max_loras=2)
    for rid, lora in (("a", A), ("b", B), ("c", C), ("base", None)):
        sched.add_request(req(rid, lora, prompt=[5, 6, 7], max_tokens=3))
    plan = sched.schedule()
    # FCFS: c waits for a free adapter slot, and the base request behind it keeps the order
    assert [n.request_id for n in plan.new_requests] == ["a", "b"]
    sched.update(worker.execute(plan))
    admitted = ["a", "b"]
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        if plan.new_requests:  # c only once a or b finished; base right behind it
            assert {"a", "b"} - set(plan.finished_ids) != {"a", "b"}
        admitted += [n.request_id for n in plan.new_requests]
        sched.update(worker.execute(plan))
        sched.check_invariants()
    assert admitted == ["a", "b", "c", "base"]


def test_a_request_of_the_running_adapter_is_admitted_beyond_the_slots():
    sched, worker = setup(max_loras=1)
    sched.add_request(req("a1", A, prompt=[5, 6, 7], max_tokens=3))
    sched.add_request(req("a2", A, prompt=[8, 9], max_tokens=3))
    sched.add_request(req("base", None, prompt=[8, 9], max_tokens=3))
    plan = sched.schedule()
    assert [n.request_id for n in plan.new_requests] == ["a1", "a2", "base"]


def test_lora_without_enable_lora_is_a_400():
    sched, _ = setup(max_loras=0)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        sched.add_request(req("a", A))


def test_a_suspect_admitted_out_of_order_still_respects_the_adapter_slots():
    """Poison isolation admits a waiting suspect alone, preempting from the tail until it fits:
    with max_loras=1 that includes the running adapter's requests."""
    from pagoda.contract.step import StepPlan
    from scheduler_svc.core.step_draft import StepDraft

    sched, worker = setup(max_loras=1)
    sched.add_request(req("a", A, prompt=[5, 6, 7], max_tokens=8))
    sched.update(worker.execute(sched.schedule()))
    sched.add_request(req("b", B, prompt=[8, 9], max_tokens=8))
    (waiting_b,) = list(sched._queues.waiting)
    plan = StepPlan(step_id=sched._next_step_id)
    sched._admission.admit_suspect(StepDraft(plan, 64, sched.config.block_size), waiting_b)
    assert plan.preempted_ids == ["a"] and [n.request_id for n in plan.new_requests] == ["b"]


def test_stats_name_the_running_and_waiting_adapters_for_lora_requests_info():
    from gateway.metrics import EngineStatsCollector
    from scheduler_svc.convert import stats_to_pb

    sched, worker = setup(max_loras=1)
    for rid, lora in (("a", A), ("b", B), ("base", None)):
        sched.add_request(req(rid, lora, prompt=[5, 6, 7], max_tokens=3))
    sched.update(worker.execute(sched.schedule()))
    stats = sched.stats()
    assert (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_loras) == (("a",), ("b",), 1)
    pb = stats_to_pb(stats, num_total_blocks=32, num_steps=1, idle=False, invariant_ok=True,
                     request_success={}, worker_connected=True, step_seconds_sum=0.0)
    (family,) = [f for f in EngineStatsCollector(lambda: pb, "m").collect() if f.name == "vllm:lora_requests_info"]
    assert family.samples[0].labels == {"model_name": "m", "running_lora_adapters": "a",
                                        "waiting_lora_adapters": "b", "max_lora": "1"}
