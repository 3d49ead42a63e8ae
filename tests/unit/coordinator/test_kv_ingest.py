"""Events -> index operations (re-hashing, engine-hash maps, tiers, sequence checks, memory)."""
from __future__ import annotations

import gc
import os
import random

import numpy as np
import pytest

from motor._fast.hashing import block_hashes
from motor.coordinator.kv import KvRouter, SeqCheck
from motor.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

BS = 16


def batch(*events) -> EventBatch:
    return EventBatch(0.0, list(events), 0)


def key_hashes(tokens: list[int]) -> np.ndarray:
    return block_hashes(np.asarray(tokens, np.uint32), BS)


@pytest.fixture
def router() -> KvRouter:
    return KvRouter()


def cached(router: KvRouter, key: str, tokens: list[int]) -> list[int]:
    return router.match(key_hashes(tokens), None)[router.slot(key)].tolist()


def test_stored_blocks_match_whatever_the_engine_hashes_are(router: KvRouter) -> None:
    toks = list(range(100, 164))  # 4 blocks
    a, b = router.slot("a#0"), router.slot("b#0")
    # two engines, different hash schemes, same tokens
    router.ingest.apply(a, 0, batch(BlockStored([11, 12], None, toks[:32], BS, "GPU")))
    router.ingest.apply(a, 1, batch(BlockStored([13, 14], 12, toks[32:], BS, "GPU")))
    router.ingest.apply(b, 0, batch(BlockStored([-1, -2, -3], None, toks[:48], BS, None)))
    assert cached(router, "a#0", toks) == [4, 0, 0]
    assert cached(router, "b#0", toks) == [3, 0, 0]
    # BlockRemoved by engine hash: the middle block goes, the prefix run stops there
    router.ingest.apply(a, 2, batch(BlockRemoved([13], "GPU")))
    assert cached(router, "a#0", toks) == [2, 0, 0]
    router.ingest.apply(b, 1, batch(AllBlocksCleared()))
    assert cached(router, "b#0", toks) == [0, 0, 0]
    assert router.ingest.slots[b].map_entries() == 0


def test_medium_maps_to_tier_and_removal_is_per_tier(router: KvRouter) -> None:
    toks = list(range(32))
    s = router.slot("a#0")
    router.ingest.apply(s, 0, batch(BlockStored([1], None, toks[:16], BS, "GPU"),
                                    BlockStored([2], 1, toks[16:], BS, "CPU")))
    assert cached(router, "a#0", toks) == [1, 1, 0]
    router.ingest.apply(s, 1, batch(BlockStored([1], None, toks[:16], BS, "STORAGE")))
    router.ingest.apply(s, 2, batch(BlockRemoved([1], "GPU")))
    assert cached(router, "a#0", toks) == [0, 1, 1]


def test_orphan_store_is_dropped_not_guessed(router: KvRouter) -> None:
    s = router.slot("a#0")
    router.ingest.apply(s, 0, batch(BlockStored([5], 99, list(range(16)), BS)))
    assert router.exact.n_blocks == 0
    assert router.ingest.slots[s].dropped == 1


def test_engine_block_size_multiple_is_split(router: KvRouter) -> None:
    toks = list(range(64))
    s = router.slot("a#0")
    router.ingest.apply(s, 0, batch(BlockStored([7, 8], None, toks, 32, "GPU")))
    assert cached(router, "a#0", toks) == [4, 0, 0]
    router.ingest.apply(s, 1, batch(BlockRemoved([8], "GPU")))
    assert cached(router, "a#0", toks) == [2, 0, 0]
    router.ingest.apply(s, 2, batch(BlockStored([9], None, list(range(24)), 24)))  # not a multiple
    assert router.ingest.slots[s].dropped == 1


def test_sequence_checks(router: KvRouter) -> None:
    s = router.slot("a#0")
    ing = router.ingest
    assert ing.check_seq(s, 7) is SeqCheck.OK  # first seen
    ing.apply(s, 7, batch())
    assert ing.check_seq(s, 8) is SeqCheck.OK
    assert ing.check_seq(s, 10) is SeqCheck.GAP
    assert ing.check_seq(s, 0) is SeqCheck.RESTART
    assert ing.check_seq(s, 5) is SeqCheck.DUPLICATE


def test_forget_purges_and_reuses_the_slot(router: KvRouter) -> None:
    s = router.slot("a#0")
    router.ingest.apply(s, 0, batch(BlockStored([1, 2], None, list(range(32)), BS)))
    assert router.exact.instance_blocks(s) == 2
    assert router.forget("a#0") == 2
    assert router.exact.n_blocks == 0 and router.exact.n_nodes == 0
    assert router.slot("new#0") == s  # freed slot reused: churn never grows the slot table


def test_burst_of_events_costs_at_most_the_stated_bytes_per_block(router: KvRouter) -> None:
    """200k BlockStored then BlockRemoved events: memory follows live blocks, nothing leaks."""
    rng = random.Random(4)
    print("seed 4")
    s = router.slot("a#0")
    n = 200_000
    toks = [rng.randrange(50_000) for _ in range(16 * 64)]
    base_nodes = router.exact.n_nodes
    seq = 0
    for i in range(0, n, 64):  # 64 chained blocks per event, fresh root each time
        toks[0] = i  # distinct chains
        router.ingest.apply(s, seq, batch(BlockStored(list(range(i, i + 64)), None, toks, BS)))
        seq += 1
    live = router.exact.n_nodes - base_nodes
    assert live >= n - 64
    per_block = router.index_bytes("exact") / live
    print(f"{per_block:.0f} bytes per block (radix + map estimate)")
    assert per_block <= 400  # docs/kv-routing.md: <= 400 bytes per block at 256 slots
    for i in range(0, n, 64):
        router.ingest.apply(s, seq, batch(BlockRemoved(list(range(i, i + 64)))))
        seq += 1
    assert router.exact.n_nodes == base_nodes and router.ingest.map_entries() == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_a_burst_of_1m_events_keeps_memory_within_the_per_block_cost(router: KvRouter) -> None:
    """1M events (500k BlockStored + 500k BlockRemoved, 100 per batch) from an engine
    whose cache holds ``cap`` blocks: every store past the cap evicts the oldest block,
    as an engine does. The index estimate stays <= 400 bytes per live block and the
    process RSS grows by at most 800 bytes per live block (the stated costs,
    docs/kv-routing.md: the RSS adds the map's int objects, dict and table headroom), and
    not with the event count."""
    s = router.slot("a#0")
    cap, per_batch, n_events = 100_000, 100, 1_000_000
    tok_base = [7] * BS
    seq = 0
    stored = removed = 0
    gc.collect()
    rss0 = _rss_bytes()
    rss_mid = 0
    while stored + removed < n_events:
        events: list[object] = []
        while len(events) < per_batch:
            if stored - removed >= cap:
                events.append(BlockRemoved([removed]))
                removed += 1
            else:
                toks = tok_base[:]
                toks[0], toks[1] = stored & 0xFFFF, stored >> 16   # distinct blocks
                events.append(BlockStored([stored], None, toks, BS))
                stored += 1
        router.ingest.apply(s, seq, batch(*events))
        seq += 1
        if rss_mid == 0 and stored + removed >= n_events // 2:
            rss_mid = _rss_bytes()
    live = stored - removed
    assert live == cap and router.exact.n_blocks == cap and router.ingest.map_entries() == cap
    gc.collect()
    rss1 = _rss_bytes()
    slack = 4 << 20   # allocator / interpreter noise
    print(f"rss +{(rss1 - rss0) / cap:.0f} (half-way +{(rss_mid - rss0) / cap:.0f}) bytes per "
          f"live block after 1M events (index estimate {router.index_bytes('exact') / cap:.0f})")
    assert rss1 - rss0 <= 800 * cap + slack
    # the second 500k events add at most table headroom (< 30 bytes per event: no leak)
    assert rss1 - rss_mid <= 30 * (n_events // 2)
    assert router.index_bytes("exact") <= 400 * cap
