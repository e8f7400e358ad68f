"""Session leases in the scheduler core (scheduler_svc/core/tiers/sessions.py): a finished turn's blocks
stay pinned for the session's next turn until the TTL passes or the session ends; under pressure
they are demoted (to the evictable LRU, and from there to the host tier) before anything running is
preempted. Exact block ids, a fake clock."""

from __future__ import annotations

import pytest

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import BlockCopy
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(num_blocks=6, num_offload_blocks=0):
    clock = Clock()
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=2, max_model_len=64, eos_token_ids=(0,),
                          max_inflight_steps=1, num_offload_blocks=num_offload_blocks)
    return (Scheduler(cfg, clock=clock), FakeWorker(num_blocks, 2, FakeSampler(vocab_size=50),
                                                    num_cpu_blocks=num_offload_blocks), clock)


def req(rid, prompt, max_tokens=1, session=None, ttl=10.0, salt=None):
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         cache_salt=salt, session_id=session, session_ttl=ttl if session else 0.0)


def run(sched, worker, request):
    sched.add_request(request)
    plans = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        deltas = sched.update(worker.execute(plan))
        sched.check_invariants()
        plans.append((plan, deltas))
    return plans


def first_turn(**kw):
    sched, worker, clock = setup(**kw)
    run(sched, worker, req("a", [1, 2, 3, 4, 5], max_tokens=2, session="s"))
    # 6 computed positions (the last sampled token is not): blocks 0, 1, 2 registered, leased.
    assert (sched.num_sessions, sched.num_session_blocks) == (1, 3)
    assert sched._kv.pool.evictable_order() == []  # nothing of the session's is evictable
    return sched, worker, clock


def test_the_next_turn_hits_the_leased_history():
    sched, worker, clock = first_turn()
    history = [1, 2, 3, 4, 5, *worker.sampled["a"]]
    plans = run(sched, worker, req("b", history + [7, 8], session="s"))
    new = plans[0][0].new_requests[0]
    assert new.block_ids[:3] == [0, 1, 2] and new.num_computed_tokens == 6
    assert plans[-1][1][0].num_cached_tokens == 6
    # b's lease replaced a's: its 4 registered blocks (0, 1, 2 and the new 3), one reference each.
    assert (sched.num_sessions, sched.num_session_blocks) == (1, 4)


def test_the_lease_expires_after_its_ttl():
    sched, worker, clock = first_turn()
    clock.now += 9.9
    plan = sched.schedule()  # only tells the worker that a finished
    assert plan.finished_ids == ["a"] and sched.num_session_blocks == 3
    sched.update(worker.execute(plan))
    clock.now += 0.1
    assert sched.schedule() is None
    sched.check_invariants()
    assert (sched.num_sessions, sched.num_session_blocks) == (0, 0)
    assert sched._kv.pool.evictable_order() == [2, 1, 0]  # ordinary cached blocks now, tail first


def test_ending_a_session_releases_it_and_only_its_tenant_can():
    sched, worker, clock = first_turn()
    assert not sched.end_session("other-tenant", "s")
    assert sched.end_session(None, "s")
    assert not sched.end_session(None, "s")
    sched.check_invariants()
    assert sched._kv.pool.evictable_order() == [2, 1, 0]


def test_pressure_demotes_the_lease_before_waiting_forever():
    sched, worker, clock = first_turn()
    # 4 blocks needed, 3 free: the lease lets go of its blocks (evictable, tail first: 2, 1, 0).
    plans = run(sched, worker, req("b", [20, 21, 22, 23, 24, 25, 26]))
    assert plans[0][0].new_requests[0].block_ids == [3, 4, 5, 2]
    assert (sched.num_sessions, sched.num_session_blocks) == (1, 0)  # demoted, not ended


def test_demoted_blocks_go_to_the_host_tier_and_the_next_turn_loads_them():
    sched, worker, clock = first_turn(num_offload_blocks=4)
    ((plan, _),) = run(sched, worker, req("b", [20, 21, 22, 23, 24, 25, 26]))
    assert plan.new_requests[0].block_ids == [3, 4, 5, 2] and plan.swap_out == [BlockCopy(2, 0)]
    ((plan, _),) = run(sched, worker, req("c", [30, 31, 32, 33, 34, 35, 36]))
    assert plan.swap_out == [BlockCopy(1, 1), BlockCopy(0, 2), BlockCopy(5, 3)]
    history = [1, 2, 3, 4, 5, *worker.sampled["a"]]
    plans = run(sched, worker, req("d", history + [7], session="s"))
    plan = plans[0][0]
    # The session's three blocks come back from host slots 2, 1, 0 (its blocks 0, 1, 2).
    assert plan.new_requests[0].block_ids == [5, 4, 3, 0] and plan.new_requests[0].num_computed_tokens == 6
    assert plan.swap_in == [BlockCopy(2, 5), BlockCopy(1, 4), BlockCopy(0, 3)]
    assert plans[-1][1][0].num_cached_tokens == 6


def test_a_session_needs_a_ttl():
    sched, worker, clock = setup()
    with pytest.raises(InvalidRequestError, match="TTL"):
        sched.add_request(req("a", [1, 2, 3], session="s", ttl=0.0))


def test_worker_loss_drops_the_blocks_but_keeps_the_lease():
    sched, worker, clock = first_turn()
    sched.reset_after_worker_loss()
    sched.check_invariants()
    assert (sched.num_sessions, sched.num_session_blocks) == (1, 0)
