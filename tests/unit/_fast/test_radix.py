"""motor._fast.radix.PrefixIndex: behaviour (compiled and reference), random op
sequences compared against the reference model, memory returning to its start."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor._fast import radix
from motor._fast.hashing import block_hashes
from . import reference as ref

DEV, HOST, DISK = radix.TIER_DEVICE, radix.TIER_HOST, radix.TIER_DISK


@pytest.fixture(params=["compiled", "reference"])
def make(request):
    """Constructor of the implementation under test."""
    return radix.PrefixIndex if request.param == "compiled" else ref.PrefixIndex


def chain(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return block_hashes(rng.integers(0, 50_000, n * 4, dtype=np.uint32), 4)


def m(ix, hashes) -> np.ndarray:
    return np.asarray(ix.match(hashes), dtype=np.int64)


def test_tier_constants_are_pinned():
    assert (DEV, HOST, DISK, radix.N_TIERS) == (0, 1, 2, 3)
    assert (ref.TIER_DEVICE, ref.TIER_HOST, ref.TIER_DISK) == (0, 1, 2)


def test_match_counts_leading_blocks_per_instance_and_best_tier(make):
    ix = make(8)
    q = chain(1, 10)
    ix.store(0, DEV, 0, q[:6])
    ix.store(1, HOST, 0, q[:3])
    ix.store(1, DEV, 0, q[:2])          # block 0,1 on both tiers: device wins
    ix.store(2, DISK, 0, q)
    ix.store(3, DEV, 0, q[1:5])         # no block 0: no leading run at all
    out = m(ix, q)
    assert out.shape == (8, 3)
    assert out[0].tolist() == [6, 0, 0]
    assert out[1].tolist() == [2, 1, 0]
    assert out[2].tolist() == [0, 0, 10]
    assert out[3].tolist() == [0, 0, 0]
    assert out[4:].sum() == 0


def test_a_gap_ends_the_run_even_if_later_blocks_are_held(make):
    ix = make(4)
    q = chain(2, 8)
    ix.store(0, DEV, 0, q)
    ix.remove(0, DEV, q[3:4])
    assert m(ix, q)[0].tolist() == [3, 0, 0]
    ix.store(0, HOST, q[2], q[3:4])     # refilled from host: the run continues
    assert m(ix, q)[0].tolist() == [7, 1, 0]


def test_mixed_tiers_along_the_prefix_are_counted_per_block(make):
    ix = make(2)
    q = chain(3, 9)
    ix.store(1, DEV, 0, q[0:2])
    ix.store(1, HOST, q[1], q[2:5])
    ix.store(1, DEV, q[4], q[5:6])
    ix.store(1, DISK, q[5], q[6:9])
    assert m(ix, q)[1].tolist() == [3, 3, 3]


def test_match_into_returns_the_longest_run_and_reuses_out():
    ix = radix.PrefixIndex(4)
    q = chain(4, 6)
    ix.store(2, DEV, 0, q[:5])
    ix.store(3, DEV, 0, q[:2])
    out = np.full((4, 3), 99, dtype=np.int32)
    assert ix.match_into(q, out) == 5
    assert out.tolist() == [[0, 0, 0], [0, 0, 0], [5, 0, 0], [2, 0, 0]]
    assert ix.match(q, out=out) is out
    assert ix.match_into(chain(5, 3), out) == 0
    assert out.sum() == 0
    assert ix.match_into(np.zeros(0, np.uint64), out) == 0


def test_removing_the_last_holder_frees_the_node_even_with_held_children(make):
    ix = make(4)
    q = chain(6, 4)
    ix.store(0, DEV, 0, q)
    ix.store(1, HOST, 0, q[:2])
    assert ix.n_nodes == 4 and ix.n_blocks == 6
    assert ix.remove(0, DEV, q[:2]) == 2
    assert ix.n_nodes == 4                 # instance 1 still holds 0, 1
    assert ix.remove(1, HOST, q[1:2]) == 1
    # block 1 has no holder left: freed, though its child (block 2) is held by 0
    assert ix.n_nodes == 3
    assert ix.holders(int(q[1])) == []
    assert ix.holders(int(q[2])) == [(0, DEV)]
    assert m(ix, q)[1].tolist() == [0, 1, 0]
    assert m(ix, q)[0].sum() == 0          # 0 lost its block 0 and 1


def test_store_counts_new_holdings_and_remove_skips_unknown(make):
    ix = make(4)
    q = chain(7, 5)
    assert ix.store(0, DEV, 0, q) == 5
    assert ix.store(0, DEV, 0, q) == 0     # refresh only
    assert ix.store(0, HOST, 0, q[:2]) == 2
    assert ix.n_blocks == 7 and ix.instance_blocks(0) == 7
    assert ix.remove(0, DISK, q) == 0
    assert ix.remove(1, DEV, q) == 0
    assert ix.remove(0, DEV, chain(8, 3)) == 0
    assert ix.n_blocks == 7


def test_clear_frees_everything_of_an_instance(make):
    ix = make(3)
    a, b = chain(9, 50), chain(10, 20)
    ix.store(0, DEV, 0, a)
    ix.store(0, DISK, 0, a[:10])
    ix.store(1, HOST, 0, a[:5])
    ix.store(1, DEV, 0, b)
    assert ix.clear(0) == 60
    assert ix.n_nodes == 25 and ix.n_blocks == 25
    assert ix.clear(0) == 0
    assert ix.clear(1) == 25
    assert ix.n_nodes == 0 and ix.n_blocks == 0


def test_orphan_store_counts_a_parent_the_instance_does_not_hold(make):
    ix = make(2)
    q = chain(11, 4)
    ix.store(0, DEV, 0, q[:2])
    ix.store(0, DEV, q[1], q[2:])
    assert ix.n_orphan_stores == 0
    ix.store(1, DEV, q[1], q[2:])           # 1 does not hold q[1]
    ix.store(1, DEV, 12345, q[:1])          # unknown parent
    assert ix.n_orphan_stores == 2


def test_eviction_is_oldest_first_and_trims_prefixes_from_the_tail(make):
    ix = make(2)
    a, b = chain(12, 4), chain(13, 3)
    ix.store(0, DEV, 0, a, now=1.0)
    ix.store(1, DEV, 0, b, now=2.0)
    # LRU: a's deepest block first
    assert [int(x) for x in ix.lru_hashes()] == [int(x) for x in a[::-1]] + \
        [int(x) for x in b[::-1]]
    assert ix.evict_to_cap(6) == 1
    assert m(ix, a)[0].tolist() == [3, 0, 0]
    ix.store(0, DEV, 0, a[:1], now=0.5)     # older time is clamped to 2.0
    assert ix.last_store_time == 2.0
    assert ix.evict_older_than(2.0) == 2    # a[1], a[2] (stored at 1.0)
    assert ix.n_nodes == 4
    assert ix.evict_older_than(2.5) == 4
    assert ix.n_nodes == 0 and ix.n_blocks == 0
    with pytest.raises(ValueError, match="max_nodes"):
        ix.evict_to_cap(-1)


def test_bad_arguments_raise_builtin_errors(make):
    ix = make(4)
    q = chain(14, 2)
    with pytest.raises(ValueError, match="instance"):
        ix.store(4, DEV, 0, q)
    with pytest.raises(ValueError, match="instance"):
        ix.store(-1, DEV, 0, q)
    with pytest.raises(ValueError, match="tier"):
        ix.store(0, 3, 0, q)
    with pytest.raises(ValueError, match="tier"):
        ix.remove(0, -1, q)
    with pytest.raises(ValueError, match="non-zero"):
        ix.store(0, DEV, 0, np.array([5, 0], dtype=np.uint64))
    assert ix.n_nodes == 0                  # nothing stored on error
    with pytest.raises(ValueError, match="instance"):
        ix.clear(9)
    with pytest.raises(ValueError, match="max_instances"):
        make(0)
    with pytest.raises(ValueError, match="max_instances"):
        make(257)


def test_compiled_input_checks():
    ix = radix.PrefixIndex(4)
    with pytest.raises(TypeError, match="block_hashes"):
        ix.store(0, DEV, 0, np.arange(1, 4, dtype=np.int64))
    with pytest.raises(TypeError, match="block_hashes"):
        ix.match(np.arange(1, 4, dtype=np.uint32))
    with pytest.raises(TypeError, match="out"):
        ix.match(np.arange(1, 4, dtype=np.uint64), out=np.zeros((4, 3), np.int64))
    with pytest.raises(ValueError, match="shape"):
        ix.match(np.arange(1, 4, dtype=np.uint64), out=np.zeros((3, 3), np.int32))
    with pytest.raises(ValueError, match="C-contiguous"):
        ix.match(np.arange(1, 4, dtype=np.uint64), out=np.zeros((4, 6), np.int32)[:, ::2])
    with pytest.raises(OverflowError):
        ix.store(0, DEV, -1, np.arange(1, 4, dtype=np.uint64))
    # lists and strided buffers are accepted
    ix.store(0, DEV, 0, [1, 2, 3])
    assert ix.match(np.array([1, 2, 3, 4], dtype=np.uint64)[::1])[0].tolist() == [3, 0, 0]
    assert ix.match(np.array([1, 9, 2, 9, 3], dtype=np.uint64)[::2])[0].tolist() == [3, 0, 0]


def test_instances_beyond_the_first_word_work():
    ix = radix.PrefixIndex(200)
    q = chain(15, 6)
    for i in (0, 63, 64, 127, 128, 199):
        ix.store(i, (i % 3), 0, q[: 1 + i % 6])
    out = ix.match(q)
    for i in (0, 63, 64, 127, 128, 199):
        expected = [0, 0, 0]
        expected[i % 3] = 1 + i % 6
        assert out[i].tolist() == expected
    assert out.sum() == sum(1 + i % 6 for i in (0, 63, 64, 127, 128, 199))
    ix._check_invariants()


def test_a_match_reads_the_words_of_instances_stored_after_it():
    """The match reads only the mask words up to the highest instance stored so far; an
    instance in a later word, stored after a match, is seen by the next one."""
    ix = radix.PrefixIndex(256)
    q = chain(16, 4)
    assert ix.match(q).sum() == 0
    ix.store(1, DEV, 0, q[:2])
    assert ix.match(q)[1].tolist() == [2, 0, 0]
    ix.store(250, DEV, 0, q)
    out = ix.match(q)
    assert out[1].tolist() == [2, 0, 0] and out[250].tolist() == [4, 0, 0]
    ix.clear(250)
    assert ix.match(q)[250].tolist() == [0, 0, 0]


def settle(ix) -> int:
    """Calls that change nothing until no halving of the node pool is under way or due
    (each call is one bounded step of it); returns how many were needed."""
    for n in range(10_000):
        due = ix.node_capacity > 1024 and ix.n_nodes * 4 < ix.node_capacity
        if not ix._shrinking and not due:
            return n
        ix.remove(0, DEV, [1])
    raise AssertionError("the halvings did not end")


def test_memory_returns_to_its_start_after_store_remove_cycles():
    """Every halving is spread over calls (a bounded step each): a few calls after the
    last removal the memory is back to its start."""
    ix = radix.PrefixIndex(64)
    start = (ix.memory_bytes, ix.n_nodes, ix.n_blocks, ix.node_capacity)
    chains = [chain(100 + k, 700) for k in range(6)]   # 4200 nodes: forces growth
    for _ in range(3):
        for k, c in enumerate(chains):
            ix.store(k, k % 3, 0, c)
            ix.store(k + 10, DEV, 0, c[:100])
        assert ix.n_nodes == 4200 and ix.node_capacity >= 4200
        ix._check_invariants()
        for k, c in enumerate(chains):
            ix.remove(k, k % 3, c)
            ix.remove(k + 10, DEV, c[:100])
        assert settle(ix) < 10
        assert (ix.memory_bytes, ix.n_nodes, ix.n_blocks, ix.node_capacity) == start
        ix._check_invariants()
    # clear and eviction also give the memory back
    for k, c in enumerate(chains):
        ix.store(k, DEV, 0, c, now=float(k))
    ix.clear(0)
    ix.evict_older_than(3.0)
    ix.evict_to_cap(0)
    settle(ix)
    assert (ix.memory_bytes, ix.n_nodes, ix.n_blocks, ix.node_capacity) == start
    assert ix._debug_rebuilds > 1
    assert (ix._debug_checks > 0) if radix.DEBUG else (ix._debug_checks == 0)
    ix._check_invariants()


# ------------------------------------------------------------ hypothesis

UNIVERSE = [chain(200, 6), chain(201, 4)]
# a third chain sharing the first 3 blocks of chain 0 (hashes continue from it)
UNIVERSE.append(np.concatenate([UNIVERSE[0][:3], block_hashes(
    np.arange(8, dtype=np.uint32), 4, parent=int(UNIVERSE[0][2]))]))
INSTANCES = [0, 1, 2, 63, 64, 69]

chain_slice = st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 6))


def _slice(c, lo, hi):
    h = UNIVERSE[c]
    lo = min(lo, len(h))
    return h[lo:max(lo, min(hi, len(h)))]


op_st = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(INSTANCES), st.integers(0, 2), chain_slice,
              st.floats(0, 10, allow_nan=False)),
    st.tuples(st.just("remove"), st.sampled_from(INSTANCES), st.integers(0, 2), chain_slice),
    st.tuples(st.just("clear"), st.sampled_from(INSTANCES)),
    st.tuples(st.just("evict_older_than"), st.floats(0, 10, allow_nan=False)),
    st.tuples(st.just("evict_to_cap"), st.integers(0, 12)),
    st.tuples(st.just("match"), st.integers(0, 2), st.integers(0, 2)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op_st, max_size=40))
def test_random_operation_sequences_agree_with_the_reference(ops):
    c_ix = radix.PrefixIndex(70)
    r_ix = ref.PrefixIndex(70)
    for op in ops:
        kind = op[0]
        if kind == "store":
            _, inst, tier, (c, lo, hi), now = op
            h = _slice(c, lo, hi)
            parent = int(UNIVERSE[c][lo - 1]) if 0 < lo <= len(UNIVERSE[c]) else 0
            got = c_ix.store(inst, tier, parent, h, now)
            want = r_ix.store(inst, tier, parent, h, now)
        elif kind == "remove":
            _, inst, tier, (c, lo, hi) = op
            h = _slice(c, lo, hi)
            got, want = c_ix.remove(inst, tier, h), r_ix.remove(inst, tier, h)
        elif kind == "match":
            _, c, drop = op
            q = UNIVERSE[c][: len(UNIVERSE[c]) - drop]
            got, want = m(c_ix, q).tolist(), r_ix.match(q)
        else:
            got, want = getattr(c_ix, kind)(op[1]), getattr(r_ix, kind)(op[1])
        assert got == want, op
        assert (c_ix.n_nodes, c_ix.n_blocks, c_ix.n_orphan_stores) == \
            (r_ix.n_nodes, r_ix.n_blocks, r_ix.n_orphan_stores), op
        assert [int(x) for x in c_ix.lru_hashes()] == r_ix.lru_hashes(), op
    for c in range(3):
        for h in UNIVERSE[c]:
            assert c_ix.holders(int(h)) == r_ix.holders(int(h))
    for inst in INSTANCES:
        assert c_ix.instance_blocks(inst) == r_ix.instance_blocks(inst)
    c_ix._check_invariants()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       budget=st.sampled_from([65536, 70, 300, 1, 2, 64, 65, 129]))
def test_large_random_workload_agrees_with_the_reference(seed, budget):
    """Enough nodes to grow and shrink the tables several times. ``budget``: the work of
    one step of halving the node pool; a small one spreads a halving over many calls, so
    stores, removes, evictions and matches run between its steps (nodes moved down, ids
    above the new capacity dropped, stale hints)."""
    rng = np.random.default_rng(seed)
    c_ix, r_ix = radix.PrefixIndex(40), ref.PrefixIndex(40)
    c_ix._shrink_budget = budget
    start = c_ix.memory_bytes
    chains = [chain(int(s), int(n)) for s, n in zip(rng.integers(0, 10**9, 12),
                                                    rng.integers(50, 400, 12))]
    for step in range(60):
        c = chains[rng.integers(len(chains))]
        inst, tier = int(rng.integers(40)), int(rng.integers(3))
        lo = int(rng.integers(len(c)))
        hi = int(rng.integers(lo, len(c) + 1))
        r = rng.random()
        if r < 0.5:
            args = (inst, tier, int(c[lo - 1]) if lo else 0, c[lo:hi], float(step))
            assert c_ix.store(*args) == r_ix.store(*args)
        elif r < 0.8:
            assert c_ix.remove(inst, tier, c[lo:hi]) == r_ix.remove(inst, tier, c[lo:hi])
        elif r < 0.88:
            assert c_ix.clear(inst) == r_ix.clear(inst)
        elif r < 0.94:
            cap = int(rng.integers(2000))
            assert c_ix.evict_to_cap(cap) == r_ix.evict_to_cap(cap)
        else:
            assert c_ix.evict_older_than(step - 10) == r_ix.evict_older_than(step - 10)
        assert c_ix.n_nodes == r_ix.n_nodes
        q = chains[rng.integers(len(chains))]
        assert m(c_ix, q).tolist() == r_ix.match(q)
        if step % 6 == 0:
            assert [int(x) for x in c_ix.lru_hashes()] == r_ix.lru_hashes()
            c_ix._check_invariants()
    for c in chains:
        assert m(c_ix, c).tolist() == r_ix.match(c)
    c_ix._check_invariants()
    for inst in range(40):      # emptied, the index gives all its memory back
        c_ix.clear(inst)
    settle(c_ix)
    c_ix._check_invariants()
    assert (c_ix.memory_bytes, c_ix.node_capacity) == (start, 1024)


@pytest.mark.parametrize("slots", [64, 256], ids=["one-word", "first-of-four-words"])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_long_matches_agree_with_the_reference(slots, seed):
    """Matches of hundreds of blocks (past the look-ahead of the match loop) over held
    prefixes, branches (a child hint that misses), gaps and tier changes, instances 0..63
    of 64 or of 256 slots (the KV router's: the match reads the first mask word)."""
    rng = np.random.default_rng(seed)
    c_ix, r_ix = radix.PrefixIndex(slots), ref.PrefixIndex(slots)
    chains = [chain(int(s), int(n)) for s, n in zip(rng.integers(0, 10**9, 3),
                                                    rng.integers(20, 300, 3))]
    for _ in range(3):     # branches off a prefix of another chain
        base = chains[int(rng.integers(len(chains)))]
        cut = int(rng.integers(1, len(base)))
        tail = block_hashes(rng.integers(0, 50_000, int(rng.integers(4, 200)) * 4,
                                         dtype=np.uint32), 4, parent=int(base[cut - 1]))
        chains.append(np.concatenate([base[:cut], tail]))
    for step in range(30):
        c = chains[int(rng.integers(len(chains)))]
        inst, tier = int(rng.integers(64)), int(rng.integers(3))
        r = rng.random()
        if r < 0.7:                             # a held prefix
            hi = int(rng.integers(1, len(c) + 1))
            args = (inst, tier, 0, c[:hi], float(step))
            assert c_ix.store(*args) == r_ix.store(*args)
        elif r < 0.9:                           # a gap
            lo = int(rng.integers(len(c)))
            hi = int(rng.integers(lo, len(c) + 1))
            assert c_ix.remove(inst, tier, c[lo:hi]) == r_ix.remove(inst, tier, c[lo:hi])
        else:
            cap = int(rng.integers(100, 1000))
            assert c_ix.evict_to_cap(cap) == r_ix.evict_to_cap(cap)
        if step % 10 == 9:
            for q in chains:
                q = q[: int(rng.integers(1, len(q) + 1))]
                got = m(c_ix, q)
                assert got.tolist() == r_ix.match(q)
                assert c_ix.match_into(q, np.zeros((slots, 3), np.int32)) == got.sum(1).max()
    c_ix._check_invariants()


def test_branches_from_a_shared_prefix_match_independently(make):
    """The index keeps one child hint per node; the other branch must still match."""
    ix = make(4)
    trunk = chain(300, 3)
    left = block_hashes(np.arange(16, dtype=np.uint32), 4, parent=int(trunk[-1]))
    right = block_hashes(np.arange(100, 116, dtype=np.uint32), 4, parent=int(trunk[-1]))
    ix.store(0, DEV, 0, np.concatenate([trunk, left]))
    ix.store(1, HOST, int(trunk[-1]), right)
    ix.store(1, HOST, 0, trunk)
    ql, qr = np.concatenate([trunk, left]), np.concatenate([trunk, right])
    assert m(ix, ql)[:2].tolist() == [[7, 0, 0], [0, 3, 0]]
    assert m(ix, qr)[:2].tolist() == [[3, 0, 0], [0, 7, 0]]
    ix.remove(1, HOST, right[:1])
    assert m(ix, qr)[1].tolist() == [0, 3, 0]


@settings(max_examples=200, deadline=None)
@given(picks=st.lists(st.integers(0, 79), min_size=1, max_size=120),
       drops=st.lists(st.integers(0, 79), max_size=120), tier=st.integers(0, 2))
def test_a_hash_given_twice_in_one_call_agrees_with_the_reference(picks, drops, tier):
    """store and remove look blocks up ahead of changing them (32 at a time): a hash that
    comes back later in the same call, in the same batch of lookups or the next, is the
    node its first made (store) or is already gone (remove)."""
    universe = chain(5, 80)
    c_ix, r_ix = radix.PrefixIndex(8), ref.PrefixIndex(8)
    h = universe[picks]
    assert c_ix.store(3, tier, 0, h) == r_ix.store(3, tier, 0, h)
    assert [int(x) for x in c_ix.lru_hashes()] == r_ix.lru_hashes()
    c_ix._check_invariants()
    d = universe[drops]
    assert c_ix.remove(3, tier, d) == r_ix.remove(3, tier, d)
    assert (c_ix.n_nodes, c_ix.n_blocks) == (r_ix.n_nodes, r_ix.n_blocks)
    assert [int(x) for x in c_ix.lru_hashes()] == r_ix.lru_hashes()
    c_ix._check_invariants()


def test_growing_keeps_node_ids_and_copies_nothing():
    """A full node pool doubles in place (Linux: mremap): no compaction, so the growth's
    cost does not depend on how many nodes the index holds. The table grows one of its 256
    sub-tables at a time. Matches and the LRU order are those of an index that never grew."""
    assert radix.REMAP_IN_PLACE == sys.platform.startswith("linux")
    ix = radix.PrefixIndex(64)
    start_cap = ix.node_capacity
    chains = [chain(200 + k, 600) for k in range(40)]          # 24,000 nodes: 5 doublings
    for k, c in enumerate(chains):
        ix.store(k % 64, k % 3, 0, c, now=float(k))
    assert ix.node_capacity == start_cap * 32
    assert ix._debug_grows == 5 and ix._debug_rebuilds == 0
    ix._check_invariants()
    for k, c in enumerate(chains):
        out = ix.match(c)
        assert out[k % 64].tolist() == [600 if t == k % 3 else 0 for t in range(3)]
    assert [int(x) for x in ix.lru_hashes()] == [int(x) for c in chains for x in c[::-1]]
    # the pool shrinks by a compaction (ids change) once below a quarter full
    for k, c in enumerate(chains[4:]):
        ix.remove((k + 4) % 64, (k + 4) % 3, c)
    assert ix._debug_rebuilds >= 1 and ix.node_capacity < start_cap * 32
    ix._check_invariants()
    for k, c in enumerate(chains[:4]):
        assert ix.match(c)[k % 64].sum() == 600


def test_a_halving_of_the_pool_is_spread_over_calls_and_given_up_when_it_fills_again():
    """Below a quarter full the pool halves a bounded step at each call: the index answers
    as always in between, and a halving that runs out of ids below its new capacity (the
    index filled again) is given up, losing nothing."""
    ix = radix.PrefixIndex(64)
    ix._shrink_budget = 64 * 4 + 50          # about 4 nodes moved a call
    chains = [chain(300 + k, 500) for k in range(16)]   # 8,000 nodes: capacity 8,192
    for k, c in enumerate(chains):
        ix.store(k, DEV, 0, c, now=float(k))
    assert ix.node_capacity == 8192
    ix.evict_to_cap(1500)                     # below a quarter: the halving to 4,096 starts
    assert ix._shrinking and ix.node_capacity == 8192
    held = {k: c for k, c in enumerate(chains) if ix.match(c)[k].sum()}
    runs = {k: int(ix.match(c)[k].sum()) for k, c in held.items()}
    assert sum(runs.values()) == 1500
    steps = 0
    while ix._shrinking:
        ix.evict_to_cap(1500)                 # evicts nothing; one more step
        steps += 1
        ix._check_invariants()
        for k, c in held.items():             # the surviving prefixes still match whole
            assert ix.match(c)[k].sum() == runs[k] > 0
    assert steps > 5 and ix.node_capacity < 8192
    got = {k: int(ix.match(c)[k].sum()) for k, c in held.items()}
    assert sum(got.values()) == 1500 and ix.n_nodes == 1500
    # fill again in the middle of the next halving: it is given up, nothing is lost
    cap = ix.node_capacity
    ix.evict_to_cap(cap // 4 - 100)
    assert ix._shrinking
    more = [chain(400 + k, 500) for k in range(12)]
    for k, c in enumerate(more):
        ix.store(20 + k, HOST, 0, c, now=100.0 + k)
        ix._check_invariants()
    assert not ix._shrinking and ix.node_capacity >= cap
    for k, c in enumerate(more):
        assert ix.match(c)[20 + k].tolist() == [0, 500, 0]
    ix._check_invariants()


@pytest.mark.parametrize("budget", [1, 2, 64, 65, 66, 130])
def test_a_move_that_uses_up_a_steps_budget_ends_the_step(budget):
    """The last node moved down by a halving can leave its step with no budget, or less than
    none: the next phase starts at the next step (it read and wrote hints far past the
    array, and the process crashed; helper-10's repro)."""
    ix = radix.PrefixIndex(1)
    ix._shrink_budget = budget
    c = list(range(1, 1101))                # one store: c[-1] gets id 0 ... c[0] id 1099
    ix.store(0, DEV, 0, c)
    ix.remove(0, DEV, c[200:])              # 200 left: a halving to 1024 starts
    assert ix._shrinking
    for _ in range(5000):
        if not ix._shrinking:
            break
        ix.remove(0, DEV, [10**12])         # holds nothing: one step
        ix._check_invariants()
    assert not ix._shrinking and ix.node_capacity == 1024
    assert ix.match(c)[0].tolist() == [200, 0, 0]
    assert ix.match(c[200:])[0].tolist() == [0, 0, 0] and ix.n_nodes == 200


def test_a_node_at_the_new_capacity_moved_at_the_default_budget():
    """helper-10's repro at the default budget: one remove leaves the node whose id is the
    new capacity; the step that moves it ends the step's budget."""
    ix = radix.PrefixIndex(1)
    full, target = 49152, 32768
    c = list(range(1, full + 1))            # c[full - 1 - i] gets id i
    ix.store(0, DEV, 0, c)
    keep = c[full - 1 - target]
    ix.remove(0, DEV, [x for x in c if x != keep])
    ix._check_invariants()
    while ix._shrinking:
        ix.remove(0, DEV, [10**12])
    ix._check_invariants()
    assert ix.n_nodes == 1 and ix.holders(keep) == [(0, DEV)]


def test_a_halving_given_up_while_giving_memory_back_still_ends_at_the_floor():
    """A halving given up halfway through giving its tail back leaves a capacity between
    two powers of two; the next halvings still end at 1024 nodes and the memory at its
    start (a halving to half of such a capacity went below the floor)."""
    ix = radix.PrefixIndex(1)
    ix._shrink_budget = 300
    start = ix.memory_bytes
    c = list(range(1, 3001))
    ix.store(0, DEV, 0, c)
    assert ix.node_capacity == 4096
    ix.remove(0, DEV, c[500:])                  # 500 left: a halving to 2048
    for _ in range(10_000):
        if 2048 < ix.node_capacity < 4096:      # giving its tail back
            break
        ix.remove(0, DEV, [10**12])
    assert ix._shrinking and 2048 < ix.node_capacity < 4096
    more = list(range(10_001, 12_001))          # more nodes than free ids below 2048
    ix.store(0, HOST, 0, more)
    assert not ix._shrinking and ix.node_capacity & (ix.node_capacity - 1)
    ix._check_invariants()
    assert ix.match(more)[0].tolist() == [0, 2000, 0]
    ix.clear(0)
    settle(ix)
    ix._check_invariants()
    assert (ix.memory_bytes, ix.node_capacity) == (start, 1024)
