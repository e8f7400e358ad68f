"""Blocks that fell out of every layer's sliding window go back to the pool (scheduler_svc/core/
kv_cache_manager.py: free_out_of_window): exact block ids and pool counts, prefix caching over
freed blocks, and a randomized run (pipelining, forks, preemption, prefix hits) in which the fake
worker checks every position attention reads inside the window, slot by slot."""

from __future__ import annotations

import random

import pytest

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import TableUpdate
from pagoda.tools.simulate import drive
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from tests.unit.test_scheduler import step
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


def setup(num_blocks=16, block_size=4, window=8, **kw):
    kw.setdefault("max_inflight_steps", 1)
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=kw.pop("max_model_len", 4096),
                          eos_token_ids=(0,), sliding_window=window, **kw)
    return Scheduler(cfg), FakeWorker(num_blocks, block_size, FakeSampler(vocab_size=50), sliding_window=window)


def req(rid, prompt, **sampling):
    return EngineRequest(RequestId(rid), tuple(prompt),
                         SamplingParams(**{"max_tokens": 4, "ignore_eos": True, **sampling}))


def test_blocks_before_the_window_are_freed_and_reused():
    # Window 8, blocks of 4, a 12-token prompt and 12 outputs: the step that computes position p
    # frees the blocks wholly before p - 8.
    sched, worker = setup(enable_prefix_caching=False)
    sched.add_request(req("a", range(1, 13), max_tokens=12))
    plan, _ = step(sched, worker)
    assert plan.new_requests[0].block_ids == [0, 1, 2]
    updates = {}
    used = []
    for k in range(2, 13):  # step k computes position 10 + k
        plan, _ = step(sched, worker)
        if plan.table_updates:
            updates[k] = plan.table_updates
        used.append(sched.stats().num_used_blocks)
    # Position 12 (step 2): block 0 (positions 0-3 <= 12 - 8) is freed first, to the free list's
    # tail, so the new block is 3, the list's head; likewise block 1 at 16 and block 2 at 20.
    assert updates == {2: [TableUpdate(RequestId("a"), 3, [3])], 6: [TableUpdate(RequestId("a"), 4, [4])],
                       10: [TableUpdate(RequestId("a"), 5, [5])]}
    # Finished at the last step: its blocks are back. Before that it held 3 blocks, never 4+.
    assert used == [3] * 10 + [0]
    assert max(used) == 3  # 6 without the window


def test_a_new_request_reuses_a_freed_block_while_the_old_one_still_runs():
    sched, worker = setup(num_blocks=6, enable_prefix_caching=False)
    sched.add_request(req("a", range(1, 13), max_tokens=8))
    step(sched, worker)  # a: [0, 1, 2]
    step(sched, worker)  # a frees block 0, takes 3
    sched.add_request(req("b", [7, 7, 7, 7, 7]))
    plan, _ = step(sched, worker)
    # The free list is [4, 5, 0]: b's 5 tokens take 4 and 5 (a kept 1, 2, 3).
    assert plan.new_requests[0].block_ids == [4, 5]
    plan, _ = step(sched, worker)
    assert not plan.table_updates
    plan, _ = step(sched, worker)  # a at position 15 with a full block: frees nothing yet (1 still needed)
    drive(sched, worker, on_step=lambda _: sched.check_invariants())
    assert len(worker.sampled["a"]) == 8 and len(worker.sampled["b"]) == 4


def test_freed_registered_blocks_stay_cached_as_evictable():
    sched, worker = setup()
    prompt = list(range(1, 13))
    sched.add_request(req("a", prompt, max_tokens=6))
    step(sched, worker)  # registers blocks 0, 1, 2 when it reports
    step(sched, worker)  # position 12: block 0 is freed, but keeps its hash: evictable, not free
    stats = sched.stats()
    assert (stats.num_used_blocks, stats.num_evictable_blocks, stats.num_free_blocks) == (3, 1, 12)
    sched.add_request(req("b", prompt, max_tokens=2))
    plan, _ = step(sched, worker)
    # b hits the chain [0, 1] (0 revived from the LRU, 1 shared with a) and computes from 8 on.
    (new,) = plan.new_requests
    assert new.block_ids[:2] == [0, 1] and new.num_computed_tokens == 8
    assert sched.num_cached_tokens(RequestId("b")) == 8
    drive(sched, worker, on_step=lambda _: sched.check_invariants())


def test_prefix_caching_frees_only_registered_blocks():
    # Two steps in flight: the step after a prefill chunk is scheduled before the chunk reports,
    # so its blocks are not registered yet, and they wait (the chain must stay registrable).
    sched, worker = setup(num_blocks=32, max_inflight_steps=2, max_num_batched_tokens=8,
                          long_prefill_token_threshold=8)
    sched.add_request(req("a", range(1, 25), max_tokens=2))
    first = sched.schedule()  # positions 0-7
    second = sched.schedule()  # positions 8-15: 8 - 8 = 0, nothing before the window yet
    sched.update(worker.execute(first))
    third = sched.schedule()  # positions 16-23: blocks 0, 1 (positions < 8) are out, and registered
    assert sched.stats().num_evictable_blocks == 0  # freed after `second` reports (it may read them)
    sched.update(worker.execute(second))
    assert sched.stats().num_evictable_blocks == 2
    sched.update(worker.execute(third))
    sched.check_invariants()
    drive(sched, worker, on_step=lambda _: sched.check_invariants())


@pytest.mark.parametrize("window", [0, 256])
def test_long_prompt_holds_the_window_not_the_context(window):
    # 2,000 prompt tokens in chunks of 512, window 256, blocks of 16: used blocks after each step.
    sched, worker = setup(num_blocks=200, block_size=16, window=window, max_num_batched_tokens=512,
                          long_prefill_token_threshold=512)
    sched.add_request(req("a", [random.Random(0).randrange(1, 50) for _ in range(2000)], max_tokens=3))
    used = []
    for _ in range(5):
        step(sched, worker)
        used.append(sched.stats().num_used_blocks)
    if window:
        # chunk at 512: blocks 0-15 (< 512 - 256) freed, 16-31 kept, 32 new; at 1024: 48-63 + 32;
        # at 1536: 80-95 + the 29 up to position 1999; the first decode (2000): 109-124 + 1.
        assert used == [32, 48, 48, 45, 17]
    else:
        assert used == [32, 64, 96, 125, 126]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_traffic_keeps_the_window_intact(seed):
    """Prompts past the window, n>1 forks, shared prefixes, a pool small enough to preempt, two
    steps in flight: every attended position holds its own token (the fake worker checks) and the
    block accounting holds after every step."""
    rng = random.Random(seed)
    sched, worker = setup(num_blocks=24, block_size=4, window=12, max_inflight_steps=2,
                          max_num_batched_tokens=32, long_prefill_token_threshold=16)
    system = [rng.randrange(1, 50) for _ in range(20)]
    for i in range(14):
        prompt = (system if i % 3 == 0 else []) + [rng.randrange(1, 50) for _ in range(rng.randint(3, 40))]
        sched.add_request(req(f"r{i}", prompt, max_tokens=rng.randint(5, 30), n=2 if i % 4 == 1 else 1))
    streams = drive(sched, worker, pipeline_depth=2, on_step=lambda _: sched.check_invariants())
    assert len(streams) == 14 + sum(1 for i in range(14) if i % 4 == 1)
    stats = sched.stats()
    assert stats.num_preemptions > 0 and stats.num_used_blocks == 0
