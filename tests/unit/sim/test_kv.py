from __future__ import annotations

from motor.sim.kv import ROOT_PARENT, BlockPool, block_hashes, hash_block


def test_chained_hashes_share_prefixes():
    a = block_hashes(list(range(40)), 8)
    b = block_hashes(list(range(32)) + [99] * 8, 8)
    assert len(a) == 5 and a[:4] == b[:4] and a[4] != b[4]
    assert a[0] == hash_block(ROOT_PARENT, list(range(8)))
    assert a[1] == hash_block(a[0], list(range(8, 16)))
    assert all(0 <= h < 2 ** 64 for h in a)
    assert block_hashes(list(range(7)), 8) == []


def test_allocate_release_and_usage():
    pool = BlockPool(4, 2)
    got = pool.allocate(3)
    assert got is not None and len(got) == 3 and pool.usage == 0.75
    assert pool.allocate(2) is None
    pool.release(got)
    assert pool.num_free == 4 and pool.usage == 0.0


def test_prefix_hits_and_lru_eviction():
    pool = BlockPool(4, 2, record_events=True)
    blocks = pool.allocate(2)
    hashes = block_hashes([1, 2, 3, 4], 2)
    pool.cache_blocks(blocks, hashes, None, [1, 2, 3, 4])
    assert pool.take_events() == [("stored", hashes, None, [1, 2, 3, 4])]
    pool.release(blocks)
    # still cached while free
    assert pool.lookup(hashes) == blocks
    pool.touch(pool.lookup(hashes[:1]))
    assert pool.num_free == 3
    # fresh allocations take hash-less blocks first, then evict the LRU cached one
    fresh = pool.allocate(2)
    assert fresh is not None and not set(fresh) & set(blocks)
    assert pool.take_events() == []
    evicting = pool.allocate(1)
    assert evicting == [blocks[1]]
    assert pool.take_events() == [("removed", [hashes[1]])]
    assert pool.lookup(hashes) == [blocks[0]]


def test_no_prefix_caching():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    b = pool.allocate(1)
    assert b is not None
    pool.cache_blocks(b, [123], None, [1, 2])
    assert pool.lookup([123]) == []


def test_reset_prefix_cache():
    pool = BlockPool(2, 2, record_events=True)
    b = pool.allocate(1)
    assert b is not None
    pool.cache_blocks(b, [5], None, [1, 2])
    assert not pool.reset_prefix_cache()  # in use
    pool.release(b)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.lookup([5]) == [] and pool.take_events() == [("cleared",)]
