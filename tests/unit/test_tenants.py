"""Tenants in the scheduler core: KV caps (exact block ids), scoped eviction, fair-share admission."""

import pytest

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.ids import BlockId, RequestId
from pagoda.contract.params import SamplingParams
from pagoda.tools.simulate import drive
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.prefix_index import PrefixIndex
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


def cached_pool(num_blocks: int) -> tuple[BlockPool, PrefixIndex]:
    index = PrefixIndex()
    return BlockPool(num_blocks, index), index


def cache(pool: BlockPool, index: PrefixIndex, blocks: list[BlockId]) -> None:
    """Register `blocks` in the index and let them go: they become the owner's evictable blocks."""
    for block in blocks:
        index.register(block, bytes([block]) * 32, 0, (block,), ())
    pool.free(blocks)


def test_a_tenant_at_its_cap_recycles_its_own_cached_blocks_not_free_ones():
    pool, index = cached_pool(8)
    pool.set_cap("a", 3)
    assert pool.allocate(3, "a") == [0, 1, 2]
    assert pool.allocate(1, "a") is None and not pool.can_allocate(1, "a")  # all 3 in use
    assert pool.allocate(2, "b") == [3, 4]
    cache(pool, index, [BlockId(0), BlockId(1)])  # freed tail first: LRU 1, 0
    cache(pool, index, [BlockId(3)])
    assert pool.evictable_order() == [1, 0, 3] and pool.held == {"a": 3, "b": 2}
    # At its cap, "a" takes its own oldest cached block (1), not free block 5 nor b's cached 3.
    assert pool.allocate(1, "a") == [1] and index.is_cached(BlockId(0)) and index.is_cached(BlockId(3))
    assert pool.allocate(2, "a") is None  # one own cached block left, two asked
    assert pool.allocate(1, "a") == [0]
    # Under no cap, "b" takes free blocks first, then the global LRU head.
    assert pool.allocate(3, "b") == [5, 6, 7]
    assert pool.allocate(1, "b") == [3] and pool.held == {"a": 3, "b": 5}
    pool.check()


def test_under_its_cap_a_tenant_evicts_in_the_pool_order_and_the_owner_loses_the_block():
    pool, index = cached_pool(4)
    pool.set_cap("a", 3)
    assert pool.allocate(4, "b") == [0, 1, 2, 3]
    cache(pool, index, [BlockId(0), BlockId(1), BlockId(2), BlockId(3)])  # LRU 3, 2, 1, 0
    assert pool.allocate(2, "a") == [3, 2]
    assert pool.held == {"a": 2, "b": 2} and pool.num_evictable_of("b") == 2
    # A prefix hit (touch) on another tenant's cached block keeps its owner.
    pool.touch([BlockId(1)])
    assert pool.owner(BlockId(1)) == "b" and pool.tenant_room("a") == 1 and pool.tenant_room("b") == 3
    pool.check()


def setup(num_blocks=16, block_size=4, **kw):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=kw.pop("max_model_len", 64),
                          eos_token_ids=(0,), **kw)
    return Scheduler(cfg), FakeWorker(num_blocks, block_size, FakeSampler(vocab_size=50))


def req(rid, prompt, tenant, max_tokens=4, **kw):
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         tenant=tenant, **kw)


def step(sched, worker):
    plan = sched.schedule()
    deltas = sched.update(worker.execute(plan))
    sched.check_invariants()
    return plan, deltas


def held(sched):
    return {t.tenant: t.blocks_held for t in sched.stats().tenants}


def test_a_capped_flood_does_not_stop_another_tenants_admission():
    sched, worker = setup(tenant_kv_share=0.5)  # 8 blocks each of 16
    for i in range(4):  # 9 tokens + 4: 4 blocks each at the end; two fit the flood's cap
        sched.add_request(req(f"f{i}", range(10 * i + 1, 10 * i + 10), "flood"))
    sched.add_request(req("light", range(100, 109), "light"))
    plan, _ = step(sched, worker)
    # FCFS: f0, f1 fit the flood's 8 (3 blocks each now); f2 would make 9: the flood is skipped for
    # this step, and the light tenant behind it is admitted anyway.
    assert [(n.request_id, n.block_ids) for n in plan.new_requests] == \
        [("f0", [0, 1, 2]), ("f1", [3, 4, 5]), ("light", [6, 7, 8])]
    assert held(sched) == {"flood": 6, "light": 3}
    while sched.has_unfinished_requests():
        step(sched, worker)
        assert held(sched)["flood"] <= 8
    stats = {t.tenant: t for t in sched.stats().tenants}
    assert stats["flood"].generation_tokens == 16 and stats["light"].generation_tokens == 4
    assert stats["flood"].prompt_tokens == 36 and stats["flood"].blocks_cap == 8


def test_a_running_sequence_short_of_its_tenants_cap_preempts_its_tenant_not_others():
    sched, worker = setup(num_blocks=16, tenant_kv_share=0.25, max_model_len=16)  # a cap of 4 blocks
    sched.add_request(req("a1", range(1, 8), "a", max_tokens=8))  # 7 tokens: 2 blocks, 15 at the end: 4
    sched.add_request(req("a2", range(11, 18), "a", max_tokens=8))
    sched.add_request(req("b1", range(21, 28), "b", max_tokens=8))
    step(sched, worker)
    assert held(sched) == {"a": 4, "b": 2}
    preempted = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched, worker)
        preempted += plan.preempted_ids
        assert held(sched).get("a", 0) <= 4
    assert preempted and set(preempted) == {"a2"}  # b1 was never touched


def test_a_preemption_for_a_tenants_own_cap_does_not_stop_another_tenants_admission():
    # Two slots: a1 and a2 run, b1 waits for one. When a reaches its cap (4 blocks) a2 is preempted;
    # the pool still has room, so b1 takes the freed slot in that same plan (a preemption for want
    # of pool blocks admits nothing), and a2 waits: its tenant is at its cap.
    sched, worker = setup(num_blocks=16, tenant_kv_share=0.25, max_model_len=16, max_num_seqs=2)
    sched.add_request(req("a1", range(1, 8), "a", max_tokens=8))
    sched.add_request(req("a2", range(11, 18), "a", max_tokens=8))
    sched.add_request(req("b1", range(21, 28), "b", max_tokens=8))
    plans = []
    while sched.has_unfinished_requests():
        plans.append(step(sched, worker)[0])
    preempting = [i for i, plan in enumerate(plans) if plan.preempted_ids]
    assert preempting and plans[preempting[0]].preempted_ids == ["a2"]
    first = plans[preempting[0]]
    assert [(n.request_id, n.block_ids) for n in first.new_requests] == [("b1", [4, 5])]
    assert all(n.request_id != "a2" for n in first.new_requests)


def test_fair_share_admits_the_tenant_with_the_smallest_virtual_token_counter():
    sched, worker = setup(num_blocks=64, max_num_seqs=1, tenant_fairness="vtc")
    sched.add_request(req("a1", range(1, 9), "a", max_tokens=2))
    sched.add_request(req("a2", range(1, 9), "a", max_tokens=2))
    sched.add_request(req("b1", range(31, 35), "b", max_tokens=2))
    sched.add_request(req("a3", range(1, 9), "a", max_tokens=2))
    order = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched, worker)
        order += [n.request_id for n in plan.new_requests]
    # FCFS would be a1 a2 b1 a3; a1 (8 prompt + 2x2 output = 12) puts a ahead, so b1 goes next
    # (4 + 4 = 8), then a2 and a3 (b has nothing waiting). They hit a1's first block: 4 prompt
    # tokens computed each, + 4: a = 12 + 8 + 8.
    assert order == ["a1", "b1", "a2", "a3"]
    assert {t.tenant: t.virtual_tokens for t in sched.stats().tenants} == {"a": 28.0, "b": 8.0}


def test_a_tenant_back_from_idle_starts_at_the_active_minimum_not_at_its_old_count():
    sched, worker = setup(num_blocks=64, tenant_fairness="vtc")
    sched.add_request(req("b0", range(1, 5), "b", max_tokens=1))
    drive(sched, worker)  # b: 4 + 2 = 6, now idle
    sched.add_request(req("a0", range(101, 141), "a", max_tokens=4))
    step(sched, worker)  # a: 40 (prefill) + 2 (its first token), still active
    sched.add_request(req("b1", range(1, 5), "b", max_tokens=1))
    assert {t.tenant: t.virtual_tokens for t in sched.stats().tenants}["b"] == 42.0  # lifted to a's


def test_the_fairness_off_and_no_caps_keep_fcfs_across_tenants():
    sched, worker = setup(num_blocks=64, max_num_seqs=1)
    for rid, tenant in [("a1", "a"), ("a2", "a"), ("b1", "b")]:
        sched.add_request(req(rid, range(1, 9), tenant, max_tokens=2))
    order = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched, worker)
        order += [n.request_id for n in plan.new_requests]
    assert order == ["a1", "a2", "b1"]


def test_a_request_larger_than_its_tenants_cap_is_refused_and_a_share_sets_the_cap():
    sched, _ = setup(num_blocks=16, tenant_kv_share=0.25)
    with pytest.raises(InvalidRequestError, match="tenant 'a' may hold only 4"):
        sched.add_request(req("big", range(1, 18), "a", max_tokens=4))  # 20 tokens: 5 blocks
    with pytest.raises(InvalidRequestError, match="kv_share must be in"):
        sched.add_request(req("bad", range(1, 5), "a", kv_share=1.5))
    sched.add_request(req("ok", range(1, 18), "a", max_tokens=4, kv_share=0.5))
    assert {t.tenant: t.blocks_cap for t in sched.stats().tenants} == {"a": 8}


def test_a_cap_set_after_blocks_were_cached_splits_the_lru_in_its_order():
    """Without a cap the pool keeps one LRU (no per-tenant copy of every cached block); the first
    cap splits it by owner in the same order, and the capped tenant then recycles its own oldest."""
    pool, index = cached_pool(6)
    assert pool.allocate(3, "a") == [0, 1, 2] and pool.allocate(2, "b") == [3, 4]
    cache(pool, index, [BlockId(0), BlockId(1)])  # LRU 1, 0
    cache(pool, index, [BlockId(3)])  # LRU 1, 0, 3
    cache(pool, index, [BlockId(2)])  # LRU 1, 0, 3, 2
    assert pool._evictable_of == {} and pool.num_evictable_of("a") == 3  # noqa: SLF001
    pool.check()
    pool.set_cap("a", 3)
    assert {t: list(lru) for t, lru in pool._evictable_of.items()} == {"a": [1, 0, 2], "b": [3]}  # noqa: SLF001
    pool.check()
    assert pool.allocate(1, "a") == [1]  # at its cap (3 held): its own oldest, not free block 5
    pool.set_cap("a", 6)  # no cap below the pool any more: back to one LRU
    assert pool._evictable_of == {} and pool.allocate(2, "a") == [5, 0]  # noqa: SLF001
    pool.check()
