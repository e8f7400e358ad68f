import pytest

from scheduler_svc.core import prefix_index
from scheduler_svc.core.prefix_index import PrefixIndex, hash_block


def chain(tokens, block_size, salt=None):
    hashes, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = prefix_index.hash_block(parent, tokens[i * block_size:(i + 1) * block_size],
                            prefix_index.block_extra_keys(i, salt))
        hashes.append(parent)
    return hashes


def register_all(index, tokens, blocks, block_size=2, salt=None):
    serial = 0
    for i, (h, block) in enumerate(zip(chain(tokens, block_size, salt), blocks, strict=False)):
        serial = index.register(block, h, serial, tuple(tokens[i * block_size:(i + 1) * block_size]),
                                prefix_index.block_extra_keys(i, salt))


def test_hash_chains_parent_and_salt():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0, 0]), [1, 2])
    assert hash_block(None, [1, 2], ("a",)) != hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == hash_block(None, (1, 2))
    assert len(hash_block(None, [1])) == 32


@pytest.mark.parametrize("query, hit_blocks", [
    ([1, 2, 3, 4, 5, 6], [10, 11, 12]),  # full hit
    ([1, 2, 3, 4, 9, 9], [10, 11]),  # partial hit
    ([9, 2, 3, 4, 5, 6], []),  # no hit
])
def test_match_full_partial_none(query, hit_blocks):
    index = PrefixIndex()
    register_all(index, [1, 2, 3, 4, 5, 6], [10, 11, 12])
    blocks, serial = index.match(chain(query, 2), query, 2, None, 3)
    assert blocks == hit_blocks
    assert (serial == 0) == (not hit_blocks)


def test_salt_isolates_tenants():
    index = PrefixIndex()
    register_all(index, [1, 2, 3, 4], [5, 6], salt="a")
    assert index.match(chain([1, 2, 3, 4], 2), [1, 2, 3, 4], 2, None, 2)[0] == []
    assert index.match(chain([1, 2, 3, 4], 2, "a"), [1, 2, 3, 4], 2, "a", 2)[0] == [5, 6]


def test_forced_collision_is_rejected_by_token_verification(monkeypatch):
    monkeypatch.setattr(prefix_index, "hash_block", lambda parent, tokens, extra=(): b"\0" * 32)
    index = PrefixIndex()
    register_all(index, [1, 2, 3, 4], [7, 8])
    # Every hash collides; only the stored tokens tell the blocks apart.
    assert index.match(chain([1, 2, 3, 4], 2), [1, 2, 3, 4], 2, None, 2)[0] == [7]
    assert index.match(chain([5, 6, 3, 4], 2), [5, 6, 3, 4], 2, None, 2)[0] == []
    # 8 was never registered (it collided with 7); block 1 of the first query and block 0 of the
    # second matched 7 by hash and were rejected.
    assert index.num_collisions == 3


def test_remove_and_purge():
    index = PrefixIndex()
    register_all(index, [1, 2, 3, 4], [7, 8])
    index.remove(8)
    assert index.match(chain([1, 2, 3, 4], 2), [1, 2, 3, 4], 2, None, 2)[0] == [7]
    index.purge()
    assert len(index) == 0 and not index.is_cached(7)


def test_entries_keep_token_ids_packed_and_the_host_tier_gets_them_back():
    index = PrefixIndex()
    register_all(index, [70000, 2, 3, 4], [7, 8])
    entry = index.remove(7)
    assert entry[2] == prefix_index.pack_tokens([70000, 2]) and len(entry[2]) == 8
    assert prefix_index.unpack_tokens(entry[2]) == (70000, 2)
    assert index.is_cached(8) and not index.is_cached(7) and not index.is_cached(-1) and len(index) == 1


def test_a_cached_block_costs_a_few_hundred_bytes():
    """The scheduler's RSS follows its prefix index until the pool is full (docs/reliability.md,
    "Scheduler memory"): its entries hold packed token ids, the pool one LRU entry per cached block.
    With token ids kept as a tuple of ints and a second per-tenant LRU it was ~1,000 bytes a block."""
    import random
    import tracemalloc

    from scheduler_svc.core.block_pool import BlockPool

    n, bs = 2000, 16
    index = PrefixIndex()
    pool = BlockPool(n, index)
    rng = random.Random(0)
    parent, serial = None, 0
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(n):
            tokens = [int(str(rng.randrange(300, 50000))) for _ in range(bs)]  # fresh int objects
            (block,) = pool.allocate(1)
            parent = hash_block(parent, tokens)
            serial = index.register(block, parent, serial, tokens, ())
            pool.free([block])
        parent = tokens = None
        per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert len(index) == pool.num_evictable == n
    assert per_block < 400, per_block
