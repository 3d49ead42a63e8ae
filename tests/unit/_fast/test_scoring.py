"""motor._fast.scoring: cost formula, load guard, tie-break, compiled vs reference."""
from __future__ import annotations

import math
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor._fast import scoring
from . import reference as ref

CREDIT = np.array([1.0, 0.75, 0.5])


def loads(n, prefill=0.0, decode=0.0, queue=0.0):
    return (np.full(n, prefill, dtype=np.float64), np.full(n, decode, dtype=np.float64),
            np.full(n, queue, dtype=np.float64))


@pytest.fixture(params=["compiled", "reference"])
def impl(request):
    if request.param == "compiled":
        return scoring
    return types.SimpleNamespace(pick=ref.pick)


def test_cache_hit_wins_when_loads_are_equal(impl):
    ov = np.zeros((4, 3), np.int32)
    ov[2] = [10, 0, 0]
    p, d, q = loads(4)
    assert impl.pick(ov, 320, 16, CREDIT, p, d, q) == (2, 160.0)


def test_tier_credit_discounts_slower_tiers(impl):
    ov = np.zeros((3, 3), np.int32)
    ov[0] = [0, 8, 0]    # saves 8 * 16 * 0.75 = 96
    ov[1] = [0, 0, 10]   # saves 10 * 16 * 0.5 = 80
    ov[2] = [4, 0, 0]    # saves 64
    p, d, q = loads(3)
    assert impl.pick(ov, 500, 16, CREDIT, p, d, q) == (0, 404.0)


def test_load_terms_are_weighted(impl):
    ov = np.zeros((3, 3), np.int32)
    p = np.array([100.0, 0.0, 0.0])
    d = np.array([0.0, 300.0, 0.0])
    q = np.array([0.0, 0.0, 2.0])
    # costs: 100 + 1000, 0.5*300 + 1000, 100*2 + 1000 -> instance 0
    assert impl.pick(ov, 1000, 16, CREDIT, p, d, q, None, 1.0, 0.5, 100.0) == (0, 1100.0)
    # heavier prefill weight moves it to instance 1
    assert impl.pick(ov, 1000, 16, CREDIT, p, d, q, None, 2.0, 0.5, 100.0) == (1, 1150.0)


def test_saved_tokens_never_make_the_prefill_negative(impl):
    ov = np.zeros((2, 3), np.int32)
    ov[0] = [100, 0, 0]
    p, d, q = loads(2)
    assert impl.pick(ov, 50, 16, CREDIT, p, d, q) == (0, 0.0)


def test_load_guard_ignores_the_cache_of_an_overloaded_instance(impl):
    ov = np.zeros((3, 3), np.int32)
    ov[0] = [50, 0, 0]                  # saves 800
    p = np.array([800.0, 100.0, 100.0])  # the others' mean 100; guard 2x -> 200 < 800
    d = np.zeros(3)
    q = np.zeros(3)
    assert impl.pick(ov, 1000, 16, CREDIT, p, d, q) == (0, 1000.0)
    assert impl.pick(ov, 1000, 16, CREDIT, p, d, q, guard_factor=2.0) == (1, 1100.0)
    assert impl.pick(ov, 1000, 16, CREDIT, p, d, q, guard_factor=8.0) == (0, 1000.0)


def test_load_guard_acts_with_two_candidates(impl):
    """Case N07: with the candidate itself in the mean, two candidates could never trip the
    guard (load_A > 2 x (load_A + load_B) / 2); against the other's load it does."""
    ov = np.zeros((2, 3), np.int32)
    ov[0] = [100, 0, 0]                  # the holder saves 1600 of 2000
    p = np.array([5000.0, 0.0])          # and carries all the load
    d = np.zeros(2)
    q = np.zeros(2)
    assert impl.pick(ov, 2000, 16, CREDIT, p, d, q, guard_factor=2.0) == (1, 2000.0)
    p = np.array([900.0, 500.0])         # within 2x of the other: the cache still wins
    assert impl.pick(ov, 2000, 16, CREDIT, p, d, q, guard_factor=2.0) == (0, 1300.0)
    one = np.zeros((1, 3), np.int32)
    one[0] = [100, 0, 0]                 # a single candidate is never guarded
    assert impl.pick(one, 2000, 16, CREDIT, np.array([5000.0]), np.zeros(1), np.zeros(1),
                     guard_factor=2.0) == (0, 5400.0)


def test_load_guard_waits_for_a_load_above_its_floor(impl):
    """``guard_min_load``: while no candidate carries more than it, every cached prefix
    counts (the guard of ``coordinator.kv.load_guard_min_tokens``)."""
    ov = np.zeros((2, 3), np.int32)
    ov[0] = [100, 0, 0]                  # the holder saves 1600 of 2000
    p = np.array([300.0, 0.0])           # all of the (light) load on the holder
    d = np.zeros(2)
    q = np.zeros(2)
    assert impl.pick(ov, 2000, 16, CREDIT, p, d, q, guard_factor=2.0) == (1, 2000.0)
    assert impl.pick(ov, 2000, 16, CREDIT, p, d, q, guard_factor=2.0,
                     guard_min_load=300.0) == (0, 700.0)
    assert impl.pick(ov, 2000, 16, CREDIT, p, d, q, guard_factor=2.0,
                     guard_min_load=299.0) == (1, 2000.0)


def test_ties_break_on_load_then_rotation_from_start(impl):
    ov = np.zeros((4, 3), np.int32)
    ov[1] = [1, 0, 0]                    # saves 16, has load 16: same cost as others
    p = np.array([0.0, 16.0, 0.0, 0.0])
    d, q = np.zeros(4), np.zeros(4)
    # costs all 100; loads 0, 16, 0, 0 -> lowest load, first from start
    assert impl.pick(ov, 100, 16, CREDIT, p, d, q)[0] == 0
    assert impl.pick(ov, 100, 16, CREDIT, p, d, q, start=1)[0] == 2
    assert impl.pick(ov, 100, 16, CREDIT, p, d, q, start=3)[0] == 3
    assert impl.pick(ov, 100, 16, CREDIT, p, d, q, start=-1)[0] == 3
    assert [impl.pick(ov, 100, 16, CREDIT, p, d, q, start=s)[0] for s in range(8)] == \
        [0, 2, 2, 3, 0, 2, 2, 3]


def test_candidates_restrict_the_choice_and_order_the_ties(impl):
    ov = np.zeros((5, 3), np.int32)
    ov[4] = [10, 0, 0]
    p, d, q = loads(5)
    cands = np.array([3, 1, 2], dtype=np.int32)
    assert impl.pick(ov, 64, 16, CREDIT, p, d, q, cands) == (3, 64.0)
    assert impl.pick(ov, 64, 16, CREDIT, p, d, q, cands.astype(np.int64), start=1) == (1, 64.0)
    assert impl.pick(ov, 64, 16, CREDIT, p, d, q, np.zeros(0, np.int32)) == (-1, math.inf)


def test_costs_fills_out_in_candidate_order():
    ov = np.zeros((4, 3), np.int32)
    ov[2] = [2, 1, 0]
    p = np.array([0.0, 5.0, 0.0, 1.0])
    d, q = np.zeros(4), np.zeros(4)
    out = np.zeros(3)
    cands = np.array([3, 2, 1], dtype=np.int32)
    assert scoring.costs(ov, 100, 16, CREDIT, p, d, q, out, cands) == 1
    assert out.tolist() == [101.0, 100 - 32 - 12.0, 105.0]
    out4 = np.zeros(4)
    assert scoring.costs(ov, 100, 16, CREDIT, p, d, q, out4) == 2
    with pytest.raises(ValueError, match="out"):
        scoring.costs(ov, 100, 16, CREDIT, p, d, q, np.zeros(3))
    with pytest.raises(TypeError, match="out"):
        scoring.costs(ov, 100, 16, CREDIT, p, d, q, np.zeros(4, np.float32))


def test_bad_inputs_raise_builtin_errors():
    ov = np.zeros((4, 3), np.int32)
    p, d, q = loads(4)
    with pytest.raises(TypeError, match="overlap"):
        scoring.pick(ov.astype(np.int64), 10, 16, CREDIT, p, d, q)
    with pytest.raises(ValueError, match="overlap"):
        scoring.pick(np.zeros((4, 2), np.int32), 10, 16, CREDIT, p, d, q)
    with pytest.raises(TypeError, match="prefill_tokens"):
        scoring.pick(ov, 10, 16, CREDIT, p.astype(np.float32), d, q)
    with pytest.raises(ValueError, match="decode_tokens"):
        scoring.pick(ov, 10, 16, CREDIT, p, np.zeros(3), q)
    with pytest.raises(TypeError, match="queue"):
        scoring.pick(ov, 10, 16, CREDIT, p, d, [0.0] * 4)
    with pytest.raises(ValueError, match="tier_credit"):
        scoring.pick(ov, 10, 16, np.ones(2), p, d, q)
    with pytest.raises(ValueError, match=r"candidates\[1\]"):
        scoring.pick(ov, 10, 16, CREDIT, p, d, q, np.array([0, 4], np.int32))
    with pytest.raises(TypeError, match="candidates"):
        scoring.pick(ov, 10, 16, CREDIT, p, d, q, np.array([0, 1], np.uint8))
    with pytest.raises(ValueError, match="block_size"):
        scoring.pick(ov, 10, 0, CREDIT, p, d, q)
    with pytest.raises(ValueError, match="prompt_tokens"):
        scoring.pick(ov, -1, 16, CREDIT, p, d, q)


# Dyadic values keep every sum exact, so compiled and reference agree bit for bit.
small = st.integers(0, 64)
dyadic = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, 2.0])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 70))
def test_pick_and_costs_agree_with_the_reference(data, n):
    ov = np.array(data.draw(st.lists(st.lists(small, min_size=3, max_size=3), min_size=n,
                                     max_size=n)), dtype=np.int32)
    p = np.array(data.draw(st.lists(st.integers(0, 2000), min_size=n, max_size=n)), np.float64)
    d = np.array(data.draw(st.lists(st.integers(0, 2000), min_size=n, max_size=n)), np.float64)
    q = np.array(data.draw(st.lists(st.integers(0, 8), min_size=n, max_size=n)), np.float64)
    credit = np.array(data.draw(st.lists(dyadic, min_size=3, max_size=3)))
    cands = data.draw(st.none() | st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    cands = None if cands is None else np.array(cands, dtype=np.int32)
    kw = dict(w_prefill=data.draw(dyadic), w_decode=data.draw(dyadic),
              w_queue=data.draw(st.sampled_from([0.0, 16.0, 100.0])),
              guard_factor=data.draw(st.sampled_from([0.0, 1.0, 1.5, 2.0])))
    start = data.draw(st.integers(-5, 100))
    prompt = data.draw(st.integers(0, 5000))
    bs = data.draw(st.sampled_from([1, 16, 64]))
    args = (ov, prompt, bs, credit, p, d, q)
    assert scoring.pick(*args, cands, start=start, **kw) == \
        ref.pick(*args, cands, start=start, **kw)
    floor = data.draw(st.sampled_from([0.0, 500.0, 3000.0]))
    assert scoring.pick(*args, cands, start=start, guard_min_load=floor, **kw) == \
        ref.pick(*args, cands, start=start, guard_min_load=floor, **kw)
    k = n if cands is None else len(cands)
    out = np.zeros(k)
    pos = scoring.costs(*args, out, cands, start=start, **kw)
    _, expected = ref.score_costs(*args, cands, **kw)
    assert out.tolist() == [c for c, _ in expected]
    best = ref.pick(*args, cands, start=start, **kw)[0]
    assert pos == (-1 if k == 0 else (list(range(n)) if cands is None else
                                     cands.tolist()).index(best))
