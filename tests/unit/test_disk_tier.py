"""The prefix cache's disk tier in the scheduler (scheduler_svc/core/tiers/disk_tier.py): the host
tier's dropped entries are written to files in the plan, a later hit is loaded from disk, a full
tier deletes its least recently used file (never one the plan reads or writes), and a new worker's
listing rebuilds the index (a restart). Exact plans and block ids; the fake worker keeps files as
slot contents and checks every attended position, so a load of the wrong KV fails the step."""

from __future__ import annotations

from collections import OrderedDict

from pagoda.contract.prefix_hash import extra_keys_from_json, extra_keys_to_json, hash_block
from pagoda.contract.step import BlockCopy, DiskBlock, DiskLoad, DiskWrite
from scheduler_svc.core import Scheduler, SchedulerConfig
from tests.unit.test_host_tier import req, run_to_end
from worker_svc.fake.fake_worker import FakeSampler, FakeWorker

A0 = hash_block(None, [1, 2])  # a's two full blocks: [1, 2], [3, 4]
A1 = hash_block(A0, [3, 4])


def setup(num_disk_blocks=4, disk=None):
    cfg = SchedulerConfig(num_blocks=4, block_size=2, max_model_len=64, eos_token_ids=(0,),
                          num_offload_blocks=2, num_disk_blocks=num_disk_blocks, max_inflight_steps=1)
    disk = OrderedDict() if disk is None else disk
    worker = FakeWorker(4, 2, FakeSampler(vocab_size=50), num_cpu_blocks=2, disk=disk)
    sched = Scheduler(cfg)
    sched.restore_disk_tier(tuple(block for _, block in disk.values()))  # what Init lists
    return sched, worker, disk


def push_a_to_disk(num_disk_blocks=4):
    """a's blocks go device -> host (b evicts them) -> disk (c's evictions need the host slots)."""
    sched, worker, disk = setup(num_disk_blocks)
    run_to_end(sched, worker, req("a", [1, 2, 3, 4, 5]))
    ((plan, _),) = run_to_end(sched, worker, req("b", [6, 7, 8, 9, 10, 11, 12]))
    assert plan.swap_out == [BlockCopy(1, 0), BlockCopy(0, 1)] and not plan.disk_writes  # a1 -> slot 0, a0 -> 1
    ((plan, _),) = run_to_end(sched, worker, req("c", [30, 31, 32, 33, 34, 35, 36]))
    assert plan.new_requests[0].block_ids == [0, 1, 2, 3]
    # b's evicted 1 and 2 need both host slots: their entries (a1, then a0) are written first;
    # b's 3 finds both slots busy (written by this plan): it goes from the device straight to disk.
    assert plan.swap_out == [BlockCopy(1, 0), BlockCopy(2, 1)]
    return sched, worker, disk, plan


def test_host_drops_go_to_disk_and_a_later_hit_loads_them():
    sched, worker, disk, plan = push_a_to_disk()
    b0 = hash_block(None, [6, 7])
    assert plan.disk_writes == [DiskWrite(0, DiskBlock(A1, (3, 4))), DiskWrite(1, DiskBlock(A0, (1, 2))),
                                DiskWrite(3, DiskBlock(b0, (6, 7)), from_device=True)]
    assert not plan.disk_deletes and list(disk) == [A1, A0, b0] and disk[A0][0] == [1, 2] and disk[b0][0] == [6, 7]
    ((plan, deltas),) = run_to_end(sched, worker, req("a2", [1, 2, 3, 4, 5]))
    (new,) = plan.new_requests
    # No device or host hit: both blocks come from disk into a2's first two blocks (free 3, then
    # c's evicted 2, whose content the host tier saves first: a swap_out before the load; the
    # host slots it takes drop b's blocks, which go to disk in turn: the second write finds the
    # tier full and deletes its least recently used file not loaded by this plan, b's [6, 7]).
    assert (new.block_ids, new.num_computed_tokens) == ([3, 2, 1], 4)
    assert plan.disk_loads == [DiskLoad(A0, 3), DiskLoad(A1, 2)] and not plan.swap_in
    assert plan.swap_out == [BlockCopy(2, 0), BlockCopy(1, 1)]
    assert [(w.src, w.block.token_ids) for w in plan.disk_writes] == [(0, (10, 11)), (1, (8, 9))]
    assert plan.disk_deletes == [b0]
    assert deltas[0].num_cached_tokens == 4 and worker.kv[6:8] + worker.kv[4:6] == [1, 2, 3, 4]
    stats = sched.stats()
    assert (stats.num_disk_blocks, stats.blocks_disk_written, stats.blocks_disk_loaded) == (4, 5, 2)
    assert stats.disk_kv_usage == 1.0 and stats.blocks_disk_dropped == 1


def test_a_new_worker_lists_its_files_and_the_next_turn_hits_them():
    """A restart: the scheduler's index goes with the worker; the new one's listing brings it back."""
    _, _, disk, _ = push_a_to_disk()
    sched, worker, _ = setup(disk=disk)  # a new worker on the same files, a new scheduler index
    ((plan, deltas),) = run_to_end(sched, worker, req("a2", [1, 2, 3, 4, 5]))
    assert plan.new_requests[0].block_ids == [0, 1, 2]  # a fresh pool
    assert plan.disk_loads == [DiskLoad(A0, 0), DiskLoad(A1, 1)]
    assert deltas[0].num_cached_tokens == 4 and worker.kv[:4] == [1, 2, 3, 4]
    sched.reset_after_worker_loss()  # a loss empties the index until the next Init's listing
    assert sched.stats().disk_kv_usage == 0.0
    sched.restore_disk_tier(tuple(block for _, block in disk.values()))
    b0 = hash_block(None, [6, 7])  # in the worker's LRU order: the loads touched a's files
    assert sched._kv.disk.hashes() == [b0, A0, A1]


def test_full_disk_deletes_its_lru_file_but_never_one_the_plan_writes():
    sched, worker, disk, plan = push_a_to_disk(num_disk_blocks=1)
    # a1 was written; a0 (and b's [6, 7], from the device) found the one file busy (written by
    # this plan): dropped, not written.
    assert plan.disk_writes == [DiskWrite(0, DiskBlock(A1, (3, 4)))] and not plan.disk_deletes
    assert sched.stats().blocks_disk_dropped == 2
    ((plan, deltas),) = run_to_end(sched, worker, req("a2", [1, 2, 3, 4, 5]))
    assert deltas[0].num_cached_tokens == 0 and not plan.disk_loads  # the chain starts at a0: a miss
    # a2's evictions take both host slots, dropping b's [10, 11] then [8, 9]: the first deletes
    # a1 (LRU, not busy) for its file, the second finds the one file busy (written by this plan).
    assert plan.disk_deletes == [A1] and [w.block.token_ids for w in plan.disk_writes] == [(10, 11)]
    assert list(disk) == [plan.disk_writes[0].block.block_hash] and sched.stats().blocks_disk_dropped == 4


def test_a_hit_is_verified_against_the_files_tokens():
    sched, worker, disk, _ = push_a_to_disk()
    sched.restore_disk_tier((DiskBlock(A0, (1, 9)), DiskBlock(A1, (3, 4))))  # a0's tokens do not match
    ((plan, deltas),) = run_to_end(sched, worker, req("a2", [1, 2, 3, 4, 5]))
    assert deltas[0].num_cached_tokens == 0 and not plan.disk_loads


def test_extra_keys_survive_json():
    keys = ("tenant-a", ("lora", "sql:1"))
    assert extra_keys_from_json(extra_keys_to_json(keys)) == keys and extra_keys_from_json("") == ()


def test_disk_fields_cross_the_wire():
    from pagoda.contract.step import StepPlan, WorkerInfo
    from pagoda.contract.worker_codec import info_from_pb, info_to_pb, plan_from_pb, plan_to_pb

    block = DiskBlock(A0, (1, 2), ("tenant", ("lora", "x")))
    plan = StepPlan(3, disk_deletes=[A1], disk_writes=[DiskWrite(1, block), DiskWrite(4, block, from_device=True)],
                    disk_loads=[DiskLoad(A0, 2)])
    assert plan_from_pb(plan_to_pb(plan, epoch=9)) == (9, plan)
    info = WorkerInfo(8, 2, 64, (0,), 50, "m", num_offload_blocks=2, num_disk_blocks=5, disk_blocks=(block,))
    assert info_from_pb(info_to_pb(info, epoch=9)) == (9, info)
