"""motor._fast.scoring.pick_ttft: the time cost's terms, ties, compiled vs reference."""
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
#: (step_s, prefill_s_per_token, decode_s_per_seq): dyadic so every sum is exact
RATE = (2.0 ** -7, 2.0 ** -15, 2.0 ** -13)


def rates(n, rate=RATE):
    return np.tile(np.array(rate, np.float64), (n, 1))


@pytest.fixture(params=["compiled", "reference"])
def impl(request):
    if request.param == "compiled":
        return scoring
    return types.SimpleNamespace(pick_ttft=ref.pick_ttft)


def test_uncached_tokens_cost_prefill_time(impl):
    ov = np.zeros((3, 3), np.int32)
    ov[1] = [64, 0, 0]                         # 1024 of 2048 tokens cached
    q, r = np.zeros(3), np.zeros(3)
    step, pre, _ = RATE
    best, t = impl.pick_ttft(ov, 2048, 16, CREDIT, q, r, rates(3))
    assert best == 1 and t == step + pre * 1024


def test_queued_work_and_the_decode_batch_add_time(impl):
    ov = np.zeros((3, 3), np.int32)
    ov[0] = [64, 0, 0]                         # the holder saves 1024 tokens ...
    q = np.array([2048.0, 0.0, 0.0])           # ... but 2048 queued tokens wait there
    r = np.array([0.0, 32.0, 0.0])             # instance 1 decodes 32 sequences
    step, pre, dec = RATE
    best, t = impl.pick_ttft(ov, 2048, 16, CREDIT, q, r, rates(3))
    assert best == 2 and t == step + pre * 2048
    out = np.zeros(3)
    scoring.pick_ttft(ov, 2048, 16, CREDIT, q, r, rates(3), out=out)
    assert out.tolist() == [step + pre * (2048 + 1024), step + 32 * dec + pre * 2048,
                            step + pre * 2048]


def test_long_work_runs_in_chunked_steps_each_paying_the_batch(impl):
    ov = np.zeros((1, 3), np.int32)
    q, r = np.array([0.0]), np.array([4.0])
    step, pre, dec = RATE
    _, t = impl.pick_ttft(ov, 8193, 16, CREDIT, q, r, rates(1), chunk_tokens=4096.0)
    assert t == 3 * (step + 4 * dec) + pre * 8193
    _, t0 = impl.pick_ttft(ov, 0, 16, CREDIT, q, r, rates(1))
    assert t0 == step + 4 * dec                # no work is still one step


def test_per_instance_rates_decide(impl):
    ov = np.zeros((2, 3), np.int32)
    rt = rates(2)
    rt[0, 1] *= 4                              # instance 0 prefills 4x slower
    assert impl.pick_ttft(ov, 1000, 16, CREDIT, np.zeros(2), np.zeros(2), rt)[0] == 1


def test_ties_break_on_queued_time_then_rotation(impl):
    ov = np.zeros((4, 3), np.int32)
    ov[1] = [1, 0, 0]                          # saves 16 tokens, has 16 queued: same TTFT
    q = np.array([0.0, 16.0, 0.0, 0.0])
    r = np.zeros(4)
    rt = rates(4)
    got = [impl.pick_ttft(ov, 100, 16, CREDIT, q, r, rt, start=s)[0] for s in range(8)]
    assert got == [0, 2, 2, 3, 0, 2, 2, 3]
    assert impl.pick_ttft(ov, 100, 16, CREDIT, q, r, rt, start=-1)[0] == 3


def test_candidates_restrict_the_choice(impl):
    ov = np.zeros((5, 3), np.int32)
    ov[4] = [10, 0, 0]
    q, r = np.zeros(5), np.zeros(5)
    cands = np.array([3, 1, 2], np.int32)
    assert impl.pick_ttft(ov, 64, 16, CREDIT, q, r, rates(5), cands)[0] == 3
    assert impl.pick_ttft(ov, 64, 16, CREDIT, q, r, rates(5), cands.astype(np.int64),
                          start=1)[0] == 1
    assert impl.pick_ttft(ov, 64, 16, CREDIT, q, r, rates(5), np.zeros(0, np.int32)) == \
        (-1, math.inf)


def test_bad_inputs_raise_builtin_errors():
    ov = np.zeros((4, 3), np.int32)
    q, r, rt = np.zeros(4), np.zeros(4), rates(4)
    with pytest.raises(TypeError, match="queued_tokens"):
        scoring.pick_ttft(ov, 10, 16, CREDIT, q.astype(np.float32), r, rt)
    with pytest.raises(ValueError, match="running"):
        scoring.pick_ttft(ov, 10, 16, CREDIT, q, np.zeros(3), rt)
    with pytest.raises(ValueError, match="rates"):
        scoring.pick_ttft(ov, 10, 16, CREDIT, q, r, rates(3))
    with pytest.raises(TypeError, match="rates"):
        scoring.pick_ttft(ov, 10, 16, CREDIT, q, r, rt.astype(np.float32))
    with pytest.raises(ValueError, match="chunk_tokens"):
        scoring.pick_ttft(ov, 10, 16, CREDIT, q, r, rt, chunk_tokens=0.0)
    with pytest.raises(ValueError, match="out"):
        scoring.pick_ttft(ov, 10, 16, CREDIT, q, r, rt, out=np.zeros(3))
    with pytest.raises(TypeError, match="overlap"):
        scoring.pick_ttft(ov.astype(np.int64), 10, 16, CREDIT, q, r, rt)
    with pytest.raises(ValueError, match="prompt_tokens"):
        scoring.pick_ttft(ov, -1, 16, CREDIT, q, r, rt)


small = st.integers(0, 64)
dyadic = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0])
rate = st.sampled_from([2.0 ** -e for e in (6, 8, 10, 12, 14, 16)] + [0.0])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(1, 70))
def test_pick_ttft_agrees_with_the_reference(data, n):
    ov = np.array(data.draw(st.lists(st.lists(small, min_size=3, max_size=3), min_size=n,
                                     max_size=n)), dtype=np.int32)
    q = np.array(data.draw(st.lists(st.integers(0, 20000), min_size=n, max_size=n)), np.float64)
    r = np.array(data.draw(st.lists(st.integers(0, 64), min_size=n, max_size=n)), np.float64)
    rt = np.array(data.draw(st.lists(st.lists(rate, min_size=3, max_size=3), min_size=n,
                                     max_size=n)), np.float64)
    credit = np.array(data.draw(st.lists(dyadic, min_size=3, max_size=3)))
    cands = data.draw(st.none() | st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    cands = None if cands is None else np.array(cands, dtype=np.int32)
    chunk = data.draw(st.sampled_from([512.0, 2048.0, 8192.0]))
    start = data.draw(st.integers(-5, 100))
    prompt = data.draw(st.integers(0, 33000))
    bs = data.draw(st.sampled_from([1, 16, 64]))
    args = (ov, prompt, bs, credit, q, r, rt, cands)
    k = n if cands is None else len(cands)
    out = np.zeros(k)
    got = scoring.pick_ttft(*args, chunk_tokens=chunk, start=start, out=out)
    assert got == ref.pick_ttft(*args, chunk_tokens=chunk, start=start)
    _, expected = ref.ttft_costs(*args, chunk_tokens=chunk)
    assert out.tolist() == [t for t, _ in expected]
