"""motor._fast.pairs.pick_pair: the pair cost's terms, local prefill, ties, compiled vs
reference."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor._fast.pairs import pick_pair
from . import pairs_reference as ref

#: (step_s, prefill_s_per_token, decode_s_per_seq): dyadic so every sum is exact
RATE = (2.0 ** -7, 2.0 ** -15, 2.0 ** -13)
XFER = 2.0 ** -20


def rates(n):
    return np.tile(np.array(RATE, np.float64), (n, 1))


def args(p_work, d_uncached, p_running=None, d_queued=None, d_running=None, xfer=None):
    P, D = len(p_work), len(d_uncached)
    return (np.array(p_work, np.float64),
            np.zeros(P) if p_running is None else np.array(p_running, np.float64), rates(P),
            np.zeros(D) if d_queued is None else np.array(d_queued, np.float64),
            np.array(d_uncached, np.float64),
            np.zeros(D) if d_running is None else np.array(d_running, np.float64), rates(D),
            np.full((P, D), XFER) if xfer is None else np.array(xfer, np.float64))


def test_prefill_with_the_cache_wins_and_the_cost_adds_every_term():
    step, pre, dec = RATE
    p, d, cost, pair_s, local_s = pick_pair(*args([4096.0, 1024.0], [4096.0, 4096.0]))
    assert (p, d) == (1, 0)
    assert cost == pair_s == (step + pre * 1024) + XFER * 4096 + step
    assert local_s == float("inf")


def test_the_transfer_cost_follows_the_topology():
    xfer = [[4 * XFER, XFER], [4 * XFER, 4 * XFER]]
    p, d, *_ = pick_pair(*args([1024.0, 1024.0], [1024.0, 1024.0], xfer=xfer))
    assert (p, d) == (0, 1)


def test_decode_load_counts_over_the_request_decode():
    step, pre, dec = RATE
    p, d, cost, *_ = pick_pair(*args([0.0], [0.0, 0.0], d_running=[8.0, 2.0]),
                               decode_tokens=16.0)
    assert (p, d) == (0, 1)
    assert cost == step + (step + 2 * dec) + 16 * (step + 3 * dec)


def test_the_delay_on_the_decode_batch_counts_with_the_stall_weight():
    step, pre, dec = RATE
    a = args([0.0], [0.0, 0.0], d_running=[8.0, 2.0])
    p, d, cost, *_ = pick_pair(*a, decode_tokens=16.0, stall_weight=1.0)
    assert (p, d) == (0, 1)
    # its own decode + the 2 running sequences' delay over its 16 steps
    assert cost == step + (step + 2 * dec) + 16 * (step + 3 * dec) + 16 * 2 * dec


def test_an_idle_decode_instance_prefills_a_short_prompt_itself():
    p, d, cost, pair_s, local_s = pick_pair(*args([64.0, 64.0], [64.0, 64.0]), local=True)
    assert p == -1 and cost == local_s < pair_s


def test_a_busy_decode_batch_sends_a_long_prompt_to_a_pair():
    # the stall a local prefill imposes on 32 running sequences outweighs the transfer
    p, d, cost, pair_s, local_s = pick_pair(
        *args([4096.0], [4096.0, 4096.0], d_running=[32.0, 32.0]), local=True,
        stall_weight=1.0)
    assert p == 0 and cost == pair_s < local_s


def test_a_prefill_on_a_busy_prefill_instance_counts_its_stall():
    # equal queued work, but 8 prefills running on P0: its batch would wait for this one
    step, pre, dec = RATE
    a = args([1024.0, 1024.0], [0.0], p_running=[8.0, 0.0])
    unc = np.array([1024.0, 1024.0])
    assert pick_pair(*a, stall_weight=1.0, p_uncached=unc)[:2] == (1, 0)
    p, d, cost, *_ = pick_pair(*a, stall_weight=1.0, p_uncached=unc, start=0)
    assert cost == (step + pre * 1024) + step
    with pytest.raises(ValueError):
        pick_pair(*a, p_uncached=np.zeros(3))


def test_the_learned_handoff_counts_on_every_pair_and_can_tip_to_local():
    a = args([64.0], [64.0], d_running=[5.0])
    p, d, cost, pair_s, local_s = pick_pair(*a, local=True, stall_weight=1.0)
    assert p == 0 and cost == pair_s < local_s      # the stall outweighs the pair's terms
    extra = local_s - pair_s + 2.0 ** -10
    p2, _, cost2, pair2, local2 = pick_pair(*a, local=True, stall_weight=1.0, handoff_s=extra)
    assert p2 == -1 and cost2 == local2 == local_s
    assert pair2 == pytest.approx(pair_s + extra, rel=1e-12)
    with pytest.raises(ValueError):
        pick_pair(*a, handoff_s=-1.0)


def test_ties_rotate_deterministically_with_start():
    a = args([100.0, 100.0], [100.0, 100.0])
    got = [pick_pair(*a, start=s)[:2] for s in range(4)]
    assert got == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert got == [pick_pair(*a, start=s)[:2] for s in range(4)]


def test_nothing_to_choose_and_bad_shapes():
    assert pick_pair(*args([], []))[:2] == (-1, -1)
    assert pick_pair(*args([], [10.0]), local=True)[:2] == (-1, 0)
    a = list(args([1.0], [1.0]))
    a[7] = np.zeros((2, 1))
    with pytest.raises(ValueError):
        pick_pair(*a)
    with pytest.raises(ValueError):
        pick_pair(*args([1.0], [1.0]), chunk_tokens=0.0)


floats = st.floats(0, 8192, allow_nan=False).map(lambda x: float(int(x)))
small = st.integers(0, 64).map(float)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 4), st.integers(1, 4), st.data(), st.booleans(),
       st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 10), st.integers(0, 256),
       st.sampled_from([0.0, 2.0 ** -9, 2.0 ** -6]))
def test_compiled_matches_the_reference(P, D, data, local, stall, start, decode_tokens,
                                        handoff):
    p_work = data.draw(st.lists(floats, min_size=P, max_size=P))
    p_running = data.draw(st.lists(small, min_size=P, max_size=P))
    d_queued = data.draw(st.lists(floats, min_size=D, max_size=D))
    d_unc = data.draw(st.lists(floats, min_size=D, max_size=D))
    d_running = data.draw(st.lists(small, min_size=D, max_size=D))
    xfer = data.draw(st.lists(st.lists(st.sampled_from([XFER, 2 * XFER, 8 * XFER]),
                                       min_size=D, max_size=D), min_size=P, max_size=P))
    p_unc = data.draw(st.none() | st.lists(floats, min_size=P, max_size=P))
    a = args(p_work, d_unc, p_running, d_queued, d_running, xfer if P else np.zeros((0, D)))
    got = pick_pair(*a, decode_tokens=float(decode_tokens), chunk_tokens=2048.0, local=local,
                    stall_weight=stall, start=start,
                    p_uncached=None if p_unc is None else np.array(p_unc, np.float64),
                    handoff_s=handoff)
    want = ref.pick_pair(*[x.tolist() for x in a], decode_tokens=float(decode_tokens),
                         chunk_tokens=2048.0, local=local, stall_weight=stall, start=start,
                         p_uncached=p_unc, handoff_s=handoff)
    assert got[:2] == want[:2]
    assert got[2:] == pytest.approx(want[2:], rel=1e-12)
