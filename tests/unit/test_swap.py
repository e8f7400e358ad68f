"""Swap preemption in the scheduler core (scheduler_svc/core/swap.py): exact swap-out / swap-in
plans and block ids, the recompute fallback, the auto choice, pipelining, and the host-pool
invariant. The fake worker models the host pool slot by slot and checks every attended position,
so a swap that brought back the wrong KV fails the step."""

from __future__ import annotations

import random

import pytest

from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import BlockCopy, TableUpdate
from pagoda.tools.simulate import drive
from scheduler_svc.core import EngineRequest, Scheduler, SchedulerConfig
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker


def setup(num_blocks=4, block_size=2, num_cpu_blocks=4, **kw):
    kw.setdefault("max_inflight_steps", 1)
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, max_model_len=kw.pop("max_model_len", 64),
                          eos_token_ids=(0,), num_cpu_blocks=num_cpu_blocks, **kw)
    return Scheduler(cfg), FakeWorker(num_blocks, block_size, FakeSampler(vocab_size=50),
                                      num_cpu_blocks=num_cpu_blocks)


def req(rid, prompt, **sampling):
    return EngineRequest(RequestId(rid), tuple(prompt), SamplingParams(**{"max_tokens": 4, **sampling}))


def step(sched, worker):
    plan = sched.schedule()
    deltas = sched.update(worker.execute(plan))
    sched.check_invariants()
    return plan, deltas


def two_requests_in_four_blocks(**kw):
    """a and b (3-token prompts, 4 tokens each) in 4 blocks of 2: at step 3, a needs a block and b
    (the newest) is preempted, with its 4 computed tokens in blocks [2, 3]."""
    sched, worker = setup(**kw)
    sched.add_request(req("a", [1, 2, 3]))
    sched.add_request(req("b", [4, 5, 6]))
    plan, _ = step(sched, worker)
    assert [n.block_ids for n in plan.new_requests] == [[0, 1], [2, 3]]
    step(sched, worker)  # position 3 still fits
    return sched, worker


def test_swap_out_then_swap_in_with_exact_blocks():
    sched, worker = two_requests_in_four_blocks(preemption_mode="swap", enable_prefix_caching=False)
    plan, _ = step(sched, worker)
    # b's two blocks go to host blocks 0 and 1; its device blocks are free at once (nothing in
    # flight), tail first, so a's new block is b's old block 3.
    assert plan.preempted_ids == ["b"] and plan.swap_out == [BlockCopy(2, 0), BlockCopy(3, 1)]
    assert plan.table_updates == [TableUpdate(RequestId("a"), 2, [3])] and not plan.swap_in
    stats = sched.stats()
    assert (stats.num_preemptions, stats.num_swap_preemptions, stats.num_swapped) == (1, 1, 1)
    assert (stats.blocks_swapped_out, stats.cpu_kv_usage, stats.num_waiting) == (2, 0.5, 1)
    assert worker.host_kv[:4] == [4, 5, 6, worker.sampled["b"][0]]  # its KV, slot by slot
    plan, _ = step(sched, worker)  # b needs 3 blocks, 1 is free: it waits; a samples its last token
    assert not plan.new_requests and not plan.swap_in
    plan, _ = step(sched, worker)  # a's blocks [0, 1, 3] come back tail first: free = [2, 3, 1, 0]
    assert plan.finished_ids == ["a"]
    (resumed,) = plan.new_requests
    assert (resumed.request_id, resumed.block_ids, resumed.num_computed_tokens, resumed.num_scheduled_tokens) \
        == ("b", [2, 3, 1], 4, 1)
    assert resumed.token_ids == [4, 5, 6] + worker.sampled["b"][:2]
    assert plan.swap_in == [BlockCopy(0, 2), BlockCopy(1, 3)]
    stats = sched.stats()
    assert (stats.num_swapped, stats.blocks_swapped_in, stats.cpu_kv_usage) == (0, 2, 0.0)
    drive(sched, worker, on_step=lambda _: sched.check_invariants())
    assert len(worker.sampled["b"]) == 4


def test_swap_resume_uses_prefix_hits_and_swaps_in_the_rest():
    sched, worker = two_requests_in_four_blocks(preemption_mode="swap")
    plan, _ = step(sched, worker)
    # Both of b's blocks were registered, so they go to the evictable LRU (tail first: [3, 2]);
    # a's new block evicts 3. Block 2 ([4, 5]) stays cached.
    assert plan.swap_out == [BlockCopy(2, 0), BlockCopy(3, 1)]
    assert plan.table_updates == [TableUpdate(RequestId("a"), 2, [3])]
    step(sched, worker)
    plan, _ = step(sched, worker)
    (resumed,) = plan.new_requests
    # b hits block 2 for its first 2 tokens; only host block 1 (tokens 2..3) is copied back, into
    # the first block evicted from the LRU [2, 3, 1, 0] once the hit took 2 off it.
    assert (resumed.block_ids, resumed.num_computed_tokens, resumed.num_scheduled_tokens) == ([2, 3, 1], 4, 1)
    assert plan.swap_in == [BlockCopy(1, 3)]
    assert sched.stats().blocks_swapped_in == 1 and sched.stats().cpu_kv_usage == 0.0
    drive(sched, worker, on_step=lambda _: sched.check_invariants())


def test_recompute_mode_and_a_full_host_pool_recompute():
    for kw in ({"preemption_mode": "recompute"}, {"preemption_mode": "swap", "num_cpu_blocks": 1}):
        sched, worker = two_requests_in_four_blocks(enable_prefix_caching=False, **kw)
        plan, _ = step(sched, worker)
        assert plan.preempted_ids == ["b"] and not plan.swap_out, kw  # 1 host block < b's 2
        assert sched.stats().num_swap_preemptions == 0 and sched.stats().num_swapped == 0
        step(sched, worker)
        plan, _ = step(sched, worker)
        (resumed,) = plan.new_requests
        assert (resumed.num_computed_tokens, resumed.num_scheduled_tokens, plan.swap_in) == (0, 5, []), kw


def test_swap_computes_fewer_prefill_tokens_with_the_same_tokens():
    sampled, prefill = {}, {}  # sampled: every token the worker sampled, per sequence
    for mode in ("recompute", "swap"):
        sched, worker = two_requests_in_four_blocks(preemption_mode=mode, enable_prefix_caching=False)
        drive(sched, worker, on_step=lambda _, s=sched: s.check_invariants())
        assert sched.stats().num_preemptions == 1
        sampled[mode], prefill[mode] = worker.sampled, sched.stats().prefill_tokens_computed
    sched, worker = setup(num_blocks=16)  # room for both: no preemption
    sched.add_request(req("a", [1, 2, 3]))
    sched.add_request(req("b", [4, 5, 6]))
    drive(sched, worker)
    assert sched.stats().num_preemptions == 0
    assert sampled["swap"] == sampled["recompute"] == worker.sampled and len(worker.sampled["b"]) == 4
    # Both prefill the two prompts (6 tokens); recompute then prefills b's 5 tokens again, while
    # swap computes only its last one (a decode).
    assert (prefill["recompute"], prefill["swap"]) == (11, 6)


def test_auto_swaps_only_sequences_longer_than_a_prefill_chunk():
    # threshold 4: b's 4 computed tokens fit in one chunk (recompute); with threshold 3 they do not.
    for threshold, swapped in ((4, False), (3, True)):
        sched, worker = two_requests_in_four_blocks(long_prefill_token_threshold=threshold)
        plan, _ = step(sched, worker)
        assert plan.preempted_ids == ["b"] and bool(plan.swap_out) is swapped, threshold
        drive(sched, worker, on_step=lambda _, s=sched: s.check_invariants())
    sched, worker = two_requests_in_four_blocks(long_prefill_token_threshold=3, num_cpu_blocks=0)
    plan, _ = step(sched, worker)  # no host pool: auto recomputes
    assert plan.preempted_ids == ["b"] and not plan.swap_out


def test_pipelined_swap_out_saves_the_in_flight_step_kv():
    """Preempted while the step computing its position 3 is in flight: the swap-out (in the next
    plan, which the worker runs after that step) saves 4 tokens' KV, and b resumes only once the
    in-flight token arrived."""
    sched, worker = setup(preemption_mode="swap", enable_prefix_caching=False, max_inflight_steps=2)
    sched.add_request(req("a", [1, 2, 3]))
    sched.add_request(req("b", [4, 5, 6]))
    streams = {}

    def record(deltas):
        for delta in deltas:
            streams.setdefault((delta.request_id, delta.seq_index), []).extend(delta.new_token_ids)

    results = [worker.execute(sched.schedule())]
    results.append(worker.execute(sched.schedule()))  # step 2 in flight while step 1 is unreported
    record(sched.update(results.pop(0)))
    plan = sched.schedule()  # step 3, with step 2 in flight: a needs a block, b is preempted
    assert plan.preempted_ids == ["b"] and plan.swap_out == [BlockCopy(2, 0), BlockCopy(3, 1)]
    # b's blocks are released only when step 2 reports, so a waits (no block for it yet).
    assert plan.table_updates == [] and plan.num_scheduled_tokens == {"a": 0}
    results.append(worker.execute(plan))
    sched.check_invariants()
    assert worker.host_kv[:4] == [4, 5, 6, worker.sampled["b"][0]]  # position 3: written by step 2
    for result in results:
        record(sched.update(result))
        sched.check_invariants()
    rest = drive(sched, worker, pipeline_depth=2, on_step=lambda _: sched.check_invariants())
    for key, tokens in rest.items():
        streams.setdefault(key, []).extend(t for t in tokens if isinstance(t, int))
    alone, lone_worker = setup(num_blocks=16)
    alone.add_request(req("a", [1, 2, 3]))
    alone.add_request(req("b", [4, 5, 6]))
    want = {key: tokens[:-1] for key, tokens in drive(alone, lone_worker).items()}
    assert streams == want and sched.stats().blocks_swapped_in == 2


def test_ending_while_swapped_frees_the_host_blocks():
    sched, worker = two_requests_in_four_blocks(preemption_mode="swap", enable_prefix_caching=False)
    step(sched, worker)
    assert sched.stats().num_swapped == 1
    sched.abort(RequestId("b"))
    sched.check_invariants()
    assert sched.stats().num_swapped == 0 and sched.stats().cpu_kv_usage == 0.0
    drive(sched, worker)


def test_worker_loss_turns_swapped_sequences_into_recomputes():
    sched, worker = two_requests_in_four_blocks(preemption_mode="swap", enable_prefix_caching=False)
    step(sched, worker)
    sched.reset_after_worker_loss()
    sched.check_invariants()
    assert sched.stats().num_swapped == 0 and sched.stats().cpu_kv_usage == 0.0
    worker = FakeWorker(4, 2, FakeSampler(vocab_size=50), num_cpu_blocks=4)
    plan = sched.schedule()
    assert not plan.swap_in and all(n.num_computed_tokens == 0 for n in plan.new_requests)
    worker.execute(plan)


def test_invariant_catches_a_leaked_or_shared_host_block():
    sched, worker = two_requests_in_four_blocks(preemption_mode="swap", enable_prefix_caching=False)
    step(sched, worker)
    b = sched._queues.live[RequestId("b")]
    b.host_blocks = [0]  # host block 1 is now held by nobody
    with pytest.raises(AssertionError, match="swapped tokens in host blocks"):
        sched.check_invariants()
    b.host_blocks = [0, 0]
    with pytest.raises(AssertionError, match="host block 0: ref count 1 but held by 2"):
        sched.check_invariants()


def test_swap_mode_needs_a_host_pool():
    with pytest.raises(ValueError, match="needs a host block pool"):
        SchedulerConfig(num_blocks=4, block_size=2, max_model_len=8, preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be"):
        SchedulerConfig(num_blocks=4, block_size=2, max_model_len=8, num_cpu_blocks=2, preemption_mode="sw")


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_crowded_random_workload_swaps_and_matches_an_unconstrained_run(depth):
    """Many requests, some sharing a prefix, some n=2, in a pool that preempts a lot, with a host
    pool that is sometimes full: the same tokens as with room for all, the invariant after every
    step (device and host pools), and swaps in both directions."""
    rng = random.Random(depth)
    base = [rng.randrange(1, 50) for _ in range(9)]
    requests = []
    for i in range(14):
        prompt = (base[:rng.randrange(0, 9)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 8))])
        requests.append(EngineRequest(RequestId(f"r{i}"), tuple(prompt), SamplingParams(
            max_tokens=rng.randrange(4, 14), n=rng.choice([1, 1, 2]), ignore_eos=True)))
    results = {}
    for name, num_blocks, num_cpu_blocks, mode in (("roomy", 64, 0, None), ("recompute", 16, 0, None),
                                                  ("swap", 16, 8, "swap"), ("auto", 16, 8, None)):
        sched, worker = setup(num_blocks=num_blocks, block_size=2, num_cpu_blocks=num_cpu_blocks,
                              preemption_mode=mode, max_num_batched_tokens=8, max_inflight_steps=depth)
        for request in requests:
            sched.add_request(request)
        results[name] = drive(sched, worker, pipeline_depth=depth, on_step=lambda _, s=sched: s.check_invariants())
        stats = sched.stats()
        assert stats.num_used_blocks == 0 and stats.num_swapped == 0 and stats.cpu_kv_usage == 0.0
        if name == "swap":
            assert stats.num_swap_preemptions > 0 and stats.blocks_swapped_in > 0
            assert stats.num_swap_preemptions < stats.num_preemptions  # some found the host pool full
        if name != "roomy":
            assert stats.num_preemptions > 0, name
    assert results["swap"] == results["recompute"] == results["auto"] == results["roomy"]
