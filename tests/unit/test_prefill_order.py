"""admission_order="cached-first" (scheduler_svc/core/tiers/prefill_order.py): a mostly cached turn is
admitted before a new prompt that arrived earlier; FCFS without a host tier, cached-first with one ("auto"); the head is passed at most
max_overtakes times, counted when a sequence that passes it is admitted."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import BlockCopy
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from scheduler_svc.core.request import SeqStatus
from scheduler_svc.core.tiers.prefill_order import CachedFirst
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

HISTORY = list(range(1, 10))  # 9 tokens: 4 full blocks of 2 cached after the first turn


def setup(order: str, num_offload_blocks: int = 0, num_blocks: int = 16, max_num_seqs: int = 256):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=2, max_model_len=64, eos_token_ids=(0,),
                          max_num_batched_tokens=8, long_prefill_token_threshold=8, max_inflight_steps=1,
                          admission_order=order, num_offload_blocks=num_offload_blocks, max_num_seqs=max_num_seqs)
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


def test_a_pass_counts_when_the_turn_is_admitted_not_each_step_it_waits_for_room():
    """The head ("new") is passed by 16 cached turns, each admitted in its own step
    (max_num_seqs 1), then goes: exactly max_overtakes passes. Counted per pick, as before, the
    pick that finds no free slot after each admission counted too, and the head went after 8."""
    sched, worker = setup("cached-first", num_blocks=64, max_num_seqs=1)
    histories = [list(range(100 + 4 * k, 104 + 4 * k)) for k in range(17)]  # 2 full blocks each
    for k, history in enumerate(histories):
        sched.add_request(req(f"t{k}", history))
    while sched.has_unfinished_requests():
        step(sched, worker)
    sched.add_request(req("new", list(range(30, 38))))  # 8 to compute
    for k, history in enumerate(histories):
        sched.add_request(req(f"s{k}", [*history, 40, 41]))  # 2 to compute after a 4-token hit
    admitted = []
    while sched.has_unfinished_requests():
        admitted += [(n.request_id, n.num_computed_tokens) for n in step(sched, worker).new_requests]
    assert admitted == [*((f"s{k}", 4) for k in range(16)), ("new", 0), ("s16", 4)]


class Seq:  # the picker compares sequences by identity, and forgets heads that stop waiting
    def __init__(self) -> None:
        self.status = SeqStatus.WAITING


def admit(order: CachedFirst, seq: Seq) -> None:
    seq.status = SeqStatus.RUNNING
    order.admitted(seq)


@pytest.mark.parametrize("max_overtakes", [1, 3])
def test_the_head_is_passed_at_most_max_overtakes_times(max_overtakes):
    head = Seq()
    shorts = [Seq() for _ in range(max_overtakes + 1)]
    uncached = {head: 100, **{s: 5 for s in shorts}}.__getitem__
    order = CachedFirst(window=8, max_overtakes=max_overtakes)
    assert all(order.pick([head, shorts[0]], head, uncached) is shorts[0] for _ in range(5))
    assert order.passes(head) == 0  # picked, not admitted (no room yet): no pass
    for short in shorts[:max_overtakes]:
        assert order.pick([head, short], head, uncached) is short
        admit(order, short)
    assert order.passes(head) == max_overtakes
    assert order.pick([head, shorts[-1]], head, uncached) is head  # its bound
    admit(order, head)
    assert order.passes(head) == 0  # forgotten once admitted
    assert order.pick([shorts[-1]], shorts[-1], uncached) is shorts[-1]


def test_the_earliest_cheaper_than_the_head_goes_not_the_cheapest():
    """Among the sequences that may pass the head, arrival order holds: a turn with a little more
    to compute is not passed by each cheaper one that arrives after it."""
    head, mid, short, same = Seq(), Seq(), Seq(), Seq()
    uncached = {head: 100, mid: 50, short: 5, same: 100}.__getitem__
    order = CachedFirst(window=8, max_overtakes=2)
    assert order.pick([head, same, mid, short], head, uncached) is mid
    assert order.pick([head, same], head, uncached) is head  # as costly as the head: no pass
    assert CachedFirst(window=2).pick([head, same, short], head, uncached) is head  # short: past the window


def test_only_the_head_counts_passes():
    """Two long prompts wait side by side: the second starts its count when it becomes the head,
    so they do not fall due together (charged together, a burst of first turns went FCFS again)."""
    first, second = Seq(), Seq()
    shorts = [Seq() for _ in range(5)]
    uncached = {first: 100, second: 100, **{s: 5 for s in shorts}}.__getitem__
    order = CachedFirst(window=8, max_overtakes=2)
    for short in shorts[:2]:
        assert order.pick([first, second, short], first, uncached) is short
        admit(order, short)
    assert order.pick([first, second, shorts[2]], first, uncached) is first
    admit(order, first)
    for short in shorts[2:4]:
        assert order.pick([second, short], second, uncached) is short
        admit(order, short)
    assert order.passes(second) == 2
    assert order.pick([second, shorts[4]], second, uncached) is second


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
    default = scheduler_config(info, build_config(parse_args(plain[1:])))
    assert default.admission_order == "auto" and not default.cached_first  # no host tier: FCFS
    tiered = scheduler_config(dataclasses.replace(info, num_offload_blocks=16), build_config(parse_args(plain[1:])))
    assert tiered.num_offload_blocks == 16 and tiered.cached_first  # a host tier: cached-first
    fcfs = build_children(launcher_args(["--fake", "--admission-order", "fcfs"]))[1].argv
    assert not scheduler_config(dataclasses.replace(info, num_offload_blocks=16),
                                build_config(parse_args(fcfs[1:]))).cached_first
