from scheduler_svc.core.block_pool import BlockPool
from scheduler_svc.core.prefix_index import PrefixIndex


def test_allocate_in_id_order_and_refuse_without_change():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert not pool.can_allocate(2)
    assert pool.allocate(2) is None
    assert (pool.num_free, pool.num_used) == (1, 3)
    pool.check()


def test_free_returns_blocks_tail_first():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    pool.free(blocks)
    assert pool.allocate(4) == [3, 2, 1, 0]


def test_shared_block_is_freed_only_by_its_last_reference():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free == 1
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.num_free == 2
    pool.check()


def test_cached_blocks_become_evictable_in_lru_order_and_are_evicted_tail_first():
    index = PrefixIndex()
    pool = BlockPool(4, index)
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks[:3]):
        index.register(block, bytes([i]) * 32, i, (i,), ())
    pool.free(blocks)  # 3 is uncached -> free list; 2, 1, 0 evictable in that order
    assert (pool.num_free, pool.num_evictable) == (1, 3)
    assert pool.evictable_order() == [2, 1, 0]
    pool.touch([1])  # a prefix hit revives block 1
    assert pool.evictable_order() == [2, 0] and pool.ref_count(1) == 1
    assert pool.allocate(2) == [3, 2]  # the free list first, then the LRU head
    assert not index.is_cached(2) and index.is_cached(0)
    pool.check()


def test_purge_moves_evictable_blocks_to_the_free_list():
    index = PrefixIndex()
    pool = BlockPool(2, index)
    (block,) = pool.allocate(1)
    index.register(block, b"h" * 32, 0, (1,), ())
    pool.free([block])
    pool.purge_cached()
    assert (pool.num_free, pool.num_evictable, len(index)) == (2, 0, 0)
    pool.check()
