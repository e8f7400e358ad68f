"""admission_order="cached-first" (scheduler_svc/core/tiers/prefill_order.py): a mostly cached turn is
admitted before a new prompt that arrived earlier; FCFS stays the default; overtaking is bounded."""

from __future__ import annotations

import pytest

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import BlockCopy
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from scheduler_svc.core.tiers.prefill_order import CachedFirst
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

HISTORY = list(range(1, 10))  # 9 tokens: 4 full blocks of 2 cached after the first turn


def setup(order: str, num_offload_blocks: int = 0, num_blocks: int = 16):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=2, max_model_len=64, eos_token_ids=(0,),
                          max_num_batched_tokens=8, long_prefill_token_threshold=8, max_inflight_steps=1,
                          admission_order=order, num_offload_blocks=num_offload_blocks)
    return Scheduler(cfg), FakeWorker(num_blocks, 2, FakeSampler(vocab_size=50), num_cpu_blocks=num_offload_blocks)


def req(rid: str, prompt: list[int]) -> EngineRequest:
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=1))


def step(sched: Scheduler, worker: FakeWorker):
    plan = sched.schedule()
    sched.update(worker.execute(plan))
    sched.check_invariants()
    return plan


def first_turn_then_two_arrivals(order: str, **kw):
    """Session s's first turn runs to the end; then a new 8-token prompt arrives, then s's next
    turn (its history + 2 tokens: 3 to compute after its 8-token hit)."""
    sched, worker = setup(order, **kw)
    sched.add_request(req("s1", HISTORY))
    while sched.has_unfinished_requests():
        step(sched, worker)
    sched.add_request(req("new", list(range(30, 38))))
    sched.add_request(req("s2", [*HISTORY, 40, 41]))
    return sched, worker


def test_fcfs_keeps_the_new_prompt_first():
    sched, worker = first_turn_then_two_arrivals("fcfs")
    plan = step(sched, worker)
    assert [(n.request_id, n.num_computed_tokens, n.num_scheduled_tokens) for n in plan.new_requests] == [
        ("new", 0, 8)]  # the whole budget: s2 waits a step


def test_cached_first_admits_the_cached_turn_first():
    sched, worker = first_turn_then_two_arrivals("cached-first")
    plan = step(sched, worker)
    assert [(n.request_id, n.num_computed_tokens, n.num_scheduled_tokens) for n in plan.new_requests] == [
        ("s2", 8, 3), ("new", 0, 5)]  # s2 answers in this step; new gets the rest of the budget
    plan = step(sched, worker)
    assert dict(plan.num_scheduled_tokens) == {"new": 3}
    assert not sched.has_unfinished_requests() or step(sched, worker)


def test_cached_first_counts_the_host_tier_hit():
    """s1's blocks mostly pushed out to the host tier by a 12-block prompt: s2's 8-token hit is one
    device block and three host blocks, loaded in the plan that admits it, ahead of `new`."""
    sched, worker = setup("cached-first", num_offload_blocks=8, num_blocks=12)
    for rid, prompt in (("s1", HISTORY), ("filler", list(range(100, 122)))):
        sched.add_request(req(rid, prompt))
        while sched.has_unfinished_requests():
            step(sched, worker)
    sched.add_request(req("new", list(range(30, 38))))
    sched.add_request(req("s2", [*HISTORY, 40, 41]))
    plan = step(sched, worker)
    assert [(n.request_id, n.num_computed_tokens) for n in plan.new_requests][0] == ("s2", 8)
    assert plan.swap_in == [BlockCopy(2, 1), BlockCopy(1, 2), BlockCopy(0, 3)]


class Seq:  # the picker only compares sequences by identity
    pass


@pytest.mark.parametrize("max_overtakes", [1, 3])
def test_the_head_is_overtaken_at_most_max_overtakes_times(max_overtakes):
    head, short = Seq(), Seq()
    uncached = {head: 100, short: 5}.__getitem__
    order = CachedFirst(window=8, max_overtakes=max_overtakes)
    picks = [order.pick([head, short], head, uncached) for _ in range(max_overtakes + 2)]
    assert picks == [short] * max_overtakes + [head, head]
    assert order.pick([short], short, uncached) is short  # a new head starts its own count
    other = Seq()
    assert CachedFirst().pick([head, short, other], head, {head: 1, short: 1, other: 1}.__getitem__) is head  # ties



def test_a_sequence_behind_the_head_keeps_its_overtakes_when_it_becomes_the_head():
    """Shorter turns keep arriving behind a long head and a middling turn: both are overtaken; when
    the head goes (its bound reached) the middling one is due at once, not after a bound of its own."""
    head, mid, short, short2 = Seq(), Seq(), Seq(), Seq()
    uncached = {head: 100, mid: 50, short: 5, short2: 5}.__getitem__
    order = CachedFirst(window=8, max_overtakes=2)
    assert [order.pick([head, mid, short], head, uncached) for _ in range(2)] == [short, short]
    assert order.pick([head, mid, short], head, uncached) is head  # its bound
    assert order.pick([mid, short, short2], mid, uncached) is mid  # overtaken twice already
    fresh = CachedFirst(window=8, max_overtakes=2)
    assert fresh.pick([mid, short, short2], mid, uncached) is short  # no history: the short one first


def test_the_flag_reaches_the_scheduler_config_and_the_launcher_passes_it_on():
    from pagoda.contract.step import WorkerInfo
    from pagoda.entrypoints.launcher.cli import parse_args as launcher_args
    from pagoda.entrypoints.launcher.topology import build_children
    from scheduler_svc.__main__ import build_config, parse_args
    from scheduler_svc.server import scheduler_config

    info = WorkerInfo(num_blocks=8, block_size=2, max_model_len=64, eos_token_ids=(0,), vocab_size=50, model_name="m")
    scheduler = build_children(launcher_args(["--fake", "--admission-order", "cached-first"]))[1]
    assert scheduler.name == "scheduler"
    config = build_config(parse_args(scheduler.argv[1:]))
    assert scheduler_config(info, config).admission_order == "cached-first"
    plain = build_children(launcher_args(["--fake"]))[1].argv
    assert "--admission-order" not in plain
    assert scheduler_config(info, build_config(parse_args(plain[1:]))).admission_order == "fcfs"
