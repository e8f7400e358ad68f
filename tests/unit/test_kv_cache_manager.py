from pagoda.contract.ids import RequestId
from pagoda.contract.params import SamplingParams
from pagoda.contract.step import BlockCopy, StepPlan, TableUpdate
from scheduler_svc.core.kv_cache_manager import KVCacheManager, position_to_block, slot_mapping
from scheduler_svc.core.request import Request, Sequence


def make_seq(tokens, seq_id="r", index=0):
    request = Request(RequestId("r"), tuple(tokens), SamplingParams(), 16, 0, 0.0, 0, None)
    return Sequence(RequestId(seq_id), index, request, list(tokens))


def test_position_to_block_and_slot_mapping():
    assert position_to_block(0, 4) == (0, 0)
    assert position_to_block(9, 4) == (2, 1)
    assert slot_mapping([7, 3, 5], 2, 9, 4) == [30, 31, 12, 13, 14, 15, 20]


def test_grow_appends_blocks_and_reports_the_table_update():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    seq = make_seq(range(1, 7))
    kv.admit(seq, [], 0, 6)
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 6
    plan = StepPlan(step_id=2)
    assert kv.blocks_needed(seq, 1) == 0
    seq.token_ids += [7, 8]
    seq.num_computed_tokens = 8
    assert kv.blocks_needed(seq, 1) == 1
    kv.grow(seq, 1, plan)
    assert plan.table_updates == [TableUpdate(RequestId("r"), 2, [2])] and seq.block_table == [0, 1, 2]


def test_first_write_into_a_shared_block_copies_it():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent, child = make_seq(range(1, 7)), make_seq(range(1, 7), "r#1", 1)
    kv.admit(parent, [], 0, 6)
    parent.num_computed_tokens = child.num_computed_tokens = 6
    child.block_table = list(parent.block_table)
    kv.share(child.block_table)
    assert kv.blocks_needed(parent, 1) == 1  # block 1 is shared: one copy
    plan = StepPlan(step_id=2)
    kv.grow(parent, 1, plan)
    assert plan.block_copies == [BlockCopy(1, 2)]
    assert plan.table_updates == [TableUpdate(RequestId("r"), 1, [2])]
    assert parent.block_table == [0, 2] and child.block_table == [0, 1]
    assert kv.blocks_needed(child, 1) == 0  # now the child alone holds block 1: write in place
    assert [kv.pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]


def test_deferred_release_waits_for_the_step():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    blocks = kv.pool.allocate(2)
    kv.release(blocks, after_step=5)
    assert kv.pool.num_free == 2 and kv.num_deferred == 2
    kv.step_reported(4)
    assert kv.pool.num_free == 2
    kv.step_reported(5)
    assert kv.pool.num_free == 4 and kv.num_deferred == 0
