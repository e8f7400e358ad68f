"""The prefix cache's host tier (scheduler_svc/core/tiers/host_tier.py): cached blocks evicted from the
device pool are offloaded to host slots in the plan, and a later prefix hit on them is loaded back
instead of recomputed. Exact plans and block ids; the fake worker models the host pool slot by slot
and checks every attended position, so a load that brought back the wrong KV fails the step."""

from __future__ import annotations

import random

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import BlockCopy
from pagoda.tools.simulate import drive
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from scheduler_svc.core.tiers.host_tier import HostTier
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


def setup(num_blocks=4, block_size=2, num_offload_blocks=4, num_cpu_blocks=0, **kw):
    kw.setdefault("max_inflight_steps", 1)
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=kw.pop("max_model_len", 64),
                          eos_token_ids=(0,), num_cpu_blocks=num_cpu_blocks,
                          num_offload_blocks=num_offload_blocks, **kw)
    return Scheduler(cfg), FakeWorker(num_blocks, block_size, FakeSampler(vocab_size=50),
                                      num_cpu_blocks=num_cpu_blocks + num_offload_blocks)


def req(rid, prompt, **sampling):
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(**{"max_tokens": 1, **sampling}))


def step(sched, worker):
    plan = sched.schedule()
    deltas = sched.update(worker.execute(plan))
    sched.check_invariants()
    return plan, deltas


def run_to_end(sched, worker, request):
    sched.add_request(request)
    plans = []
    while sched.has_unfinished_requests():
        plans.append(step(sched, worker))
    return plans


def evict_a_then_hit():
    """a ([1..5]) leaves blocks 0, 1 cached; b (7 tokens, 4 blocks) evicts them to host slots."""
    sched, worker = setup()
    ((plan, _),) = run_to_end(sched, worker, req("a", [1, 2, 3, 4, 5]))
    assert plan.new_requests[0].block_ids == [0, 1, 2] and not plan.swap_out
    assert sched._kv.pool.evictable_order() == [1, 0]  # freed tail first
    ((plan, _),) = run_to_end(sched, worker, req("b", [6, 7, 8, 9, 10, 11, 12]))
    # Free list [3, 2] first, then the LRU's 1 and 0: each goes to the next free host slot.
    assert plan.new_requests[0].block_ids == [3, 2, 1, 0]
    assert plan.swap_out == [BlockCopy(1, 0), BlockCopy(0, 1)] and not plan.swap_in
    assert worker.host_kv[:4] == [3, 4, 1, 2]  # slot 0 holds a's [3, 4], slot 1 its [1, 2]
    return sched, worker


def test_evicted_blocks_go_to_host_and_come_back_on_a_hit():
    sched, worker = evict_a_then_hit()
    stats = sched.stats()
    assert (stats.num_offload_blocks, stats.blocks_offloaded, stats.blocks_loaded) == (4, 2, 0)
    assert stats.offload_kv_usage == 0.5
    # b's registered blocks [3, 2, 1] are evictable (its 4th, block 0, held 1 token: free).
    assert sched._kv.pool.evictable_order() == [1, 2, 3]
    sched.add_request(req("c", [1, 2, 3, 4, 5, 99]))
    plan, deltas = step(sched, worker)
    (new,) = plan.new_requests
    # No device hit; host slots 1 and 0 hold c's first two blocks: loaded into its first two new
    # blocks (free block 0, then evicted 1), whose b-content goes to slots 2 and 3 first.
    assert (new.block_ids, new.num_computed_tokens, new.num_scheduled_tokens) == ([0, 1, 2], 4, 2)
    assert plan.swap_out == [BlockCopy(1, 2), BlockCopy(2, 3)]
    assert plan.swap_in == [BlockCopy(1, 0), BlockCopy(0, 1)]
    assert worker.kv[:4] == [1, 2, 3, 4] and worker.host_kv[4:8] == [10, 11, 8, 9]
    assert deltas[0].num_cached_tokens == 4 and deltas[0].finish_reason is not None
    stats = sched.stats()
    assert (stats.blocks_offloaded, stats.blocks_loaded, stats.prefix_hits) == (4, 2, 4)
    assert stats.prefill_tokens_computed == 5 + 7 + 2  # c computed only its last two tokens


def test_loaded_blocks_are_registered_again_and_keep_their_host_copy():
    sched, worker = evict_a_then_hit()
    run_to_end(sched, worker, req("c", [1, 2, 3, 4, 5, 99]))
    # c's loaded blocks 0 and 1 were registered when its step reported: a device hit now.
    ((plan, deltas),) = run_to_end(sched, worker, req("d", [1, 2, 3, 4, 7]))
    assert plan.new_requests[0].block_ids[:2] == [0, 1] and not plan.swap_in
    assert deltas[0].num_cached_tokens == 4
    # Evicting them again costs no copy: the tier still holds their content (inclusive).
    before = sched.stats().blocks_offloaded
    ((plan, _),) = run_to_end(sched, worker, req("e", [20, 21, 22, 23, 24, 25, 26]))
    assert all(copy.src not in (0, 1) for copy in plan.swap_out)
    assert sched.stats().blocks_offloaded - before == len(plan.swap_out)


def test_full_tier_drops_its_least_recent_entry():
    sched, worker = setup(num_offload_blocks=2)
    run_to_end(sched, worker, req("a", [1, 2, 3, 4, 5]))
    ((plan, _),) = run_to_end(sched, worker, req("b", [6, 7, 8, 9, 10, 11, 12]))
    assert plan.swap_out == [BlockCopy(1, 0), BlockCopy(0, 1)]
    ((plan, _),) = run_to_end(sched, worker, req("c", [30, 31, 32, 33, 34, 35, 36]))
    # Free 0, then b's evictable [1, 2, 3] serve c: 1 and 2 take the slots of a's entries (LRU
    # first), and 3 is dropped: both slots are written by this plan already.
    assert plan.new_requests[0].block_ids == [0, 1, 2, 3]
    assert plan.swap_out == [BlockCopy(1, 0), BlockCopy(2, 1)]
    stats = sched.stats()
    assert (stats.blocks_offloaded, stats.blocks_offload_dropped) == (4, 2)
    ((plan, deltas),) = run_to_end(sched, worker, req("a2", [1, 2, 3, 4, 5]))
    assert deltas[0].num_cached_tokens == 0 and not plan.swap_in  # a's blocks were dropped


def test_a_slot_loaded_in_a_plan_is_not_reused_by_its_offloads():
    """One host slot: the plan that loads from it evicts a block too, which must not go there
    (the worker runs offloads before loads: the load would read the evicted block's KV)."""
    sched, worker = setup(num_blocks=3, num_offload_blocks=1)
    run_to_end(sched, worker, req("a", [1, 2, 3]))  # block 0 cached, [1, 2]
    ((plan, _),) = run_to_end(sched, worker, req("b", [6, 7, 8, 9, 10]))  # evicts 0 -> slot 0
    assert plan.swap_out == [BlockCopy(0, 0)]
    ((plan, deltas),) = run_to_end(sched, worker, req("c", [1, 2, 3, 4, 5]))
    assert plan.swap_in == [BlockCopy(0, plan.new_requests[0].block_ids[0])]
    assert plan.swap_out == []  # the evicted b-blocks are dropped: the only slot is being read
    assert deltas[0].num_cached_tokens == 2


def test_worker_loss_empties_the_tier():
    sched, worker = evict_a_then_hit()
    sched.reset_after_worker_loss()
    worker = FakeWorker(4, 2, FakeSampler(vocab_size=50), num_cpu_blocks=4)
    sched.check_invariants()
    assert sched.stats().offload_kv_usage == 0.0
    ((plan, deltas),) = run_to_end(sched, worker, req("c", [1, 2, 3, 4, 5, 99]))
    assert not plan.swap_in and deltas[0].num_cached_tokens == 0


def test_tier_slots_follow_the_swap_space():
    """With swap space, the tier's host ids come after the swap pool's."""
    sched, worker = setup(num_cpu_blocks=3, num_offload_blocks=2)
    run_to_end(sched, worker, req("a", [1, 2, 3, 4, 5]))
    ((plan, _),) = run_to_end(sched, worker, req("b", [6, 7, 8, 9, 10, 11, 12]))
    assert plan.swap_out == [BlockCopy(1, 3), BlockCopy(0, 4)]


def test_host_tier_check_catches_lost_slots():
    tier = HostTier(2, 3)
    tier.check()
    tier._free.pop()
    try:
        tier.check()
    except AssertionError as e:
        assert "host tier accounting" in str(e)
    else:
        raise AssertionError("a lost slot was not caught")


def test_crowded_sessions_give_the_same_tokens_with_and_without_the_tier():
    """Growing conversations in a pool too small for them: identical greedy streams, fewer prefill
    tokens with the tier, and the invariant after every step."""
    sessions = [[random.Random(i).randint(1, 40) for _ in range(9)] for i in range(5)]
    results = {}
    for tier in (0, 64):
        rng = random.Random(7)  # the user's next messages: the same in both runs
        sched, worker = setup(num_blocks=12, block_size=2, num_offload_blocks=tier, max_num_seqs=2)
        histories = [list(s) for s in sessions]
        streams = []
        for turn in range(3):
            for i, history in enumerate(histories):
                rid = RequestId(f"s{i}t{turn}")
                sched.add_request(req(rid, history, max_tokens=3, ignore_eos=True))
                drive(sched, worker, on_step=lambda _, s=sched: s.check_invariants())
                out = worker.sampled[rid]
                streams.append(out)
                history += out + [rng.randint(1, 40) for _ in range(3)]
        results[tier] = (streams, sched.stats())
    (off, off_stats), (on, on_stats) = results[0], results[64]
    assert on == off
    assert on_stats.blocks_loaded > 0
    assert on_stats.prefill_tokens_computed < off_stats.prefill_tokens_computed
