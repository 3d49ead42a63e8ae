"""motor._fast.pairs.pick_joint against a plain-Python computation: the uncached tokens of
motor._fast.columns.uncached's formula, then the pure-Python reference of pick_pair."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor._fast.pairs import pick_joint

from . import pairs_reference as ref

CREDIT = np.array([1.0, 0.75, 0.5], np.float64)
XFER = 1e-6


def plain(P, overlap, prompt, bs, credit, queued, running, rates, xfer, decode_tokens,
          chunk, local, stall, start, handoff):
    k = len(queued)
    if overlap is None:
        unc, share = [float(prompt)] * k, [0.0] * k
    else:
        unc, share = [], []
        for row in overlap:
            saved = bs * (credit[0] * row[0] + credit[1] * row[1] + credit[2] * row[2])
            unc.append(max(prompt - saved, 0.0))
            held = bs * (float(row[0]) + row[1] + row[2])
            share.append(min(held, prompt) / max(prompt, 1.0))
    p_work = [queued[i] + unc[i] for i in range(P)]
    p, d, cost, best, lbest = ref.pick_pair(
        p_work, running[:P], rates[:P], queued[P:], unc[P:], running[P:], rates[P:], xfer,
        decode_tokens, chunk, local, stall, start, unc[:P], handoff)
    d_unc = unc[P + d] if d >= 0 else 0.0
    d_share = share[P + d] if d >= 0 else 0.0
    p_unc = unc[p] if p >= 0 else 0.0
    xs = xfer[p][d] if p >= 0 else 0.0
    return p, d, cost, best, lbest, d_unc, d_share, p_unc, xs


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5), st.integers(1, 5), st.data(), st.booleans(),
       st.sampled_from([0.0, 0.5, 1.0]), st.integers(0, 12), st.integers(0, 256),
       st.sampled_from([0.0, 2.0 ** -9]), st.booleans())
def test_compiled_matches_the_plain_computation(P, D, data, local, stall, start,
                                                decode_tokens, handoff, cached):
    k = P + D
    prompt = float(data.draw(st.integers(0, 9000)))
    blocks = st.integers(0, 600)
    overlap = (np.array(data.draw(st.lists(st.lists(blocks, min_size=3, max_size=3),
                                           min_size=k, max_size=k)), np.int32).reshape(k, 3)
               if cached else None)
    queued = np.array(data.draw(st.lists(st.integers(0, 8192), min_size=k, max_size=k)),
                      np.float64)
    running = np.array(data.draw(st.lists(st.integers(0, 64), min_size=k, max_size=k)),
                       np.float64)
    rates = np.array(data.draw(st.lists(st.sampled_from(
        [(6e-3, 37e-6, 1e-4), (2e-3, 50e-6, 3e-4), (1e-2, 20e-6, 5e-5)]),
        min_size=k, max_size=k)), np.float64).reshape(k, 3)
    xfer = np.array(data.draw(st.lists(st.lists(st.sampled_from([XFER, 2 * XFER, 8 * XFER]),
                                                min_size=D, max_size=D),
                                       min_size=P, max_size=P)), np.float64).reshape(P, D)
    got = pick_joint(P, overlap, prompt, 16.0, CREDIT, queued, running, rates, xfer,
                     float(decode_tokens), 2048.0, local, stall, start, handoff)
    want = plain(P, None if overlap is None else overlap.tolist(), prompt, 16.0,
                 CREDIT.tolist(), queued.tolist(), running.tolist(), rates.tolist(),
                 xfer.tolist(), float(decode_tokens), 2048.0, local, stall, start, handoff)
    assert got == want          # same formulas in the same order: the same doubles


def test_bad_inputs_are_refused():
    z = np.zeros(2)
    r = np.zeros((2, 3))
    x = np.zeros((1, 1))
    pick_joint(1, None, 10.0, 16.0, CREDIT, z, z, r, x)           # well formed
    with pytest.raises(ValueError):
        pick_joint(3, None, 10.0, 16.0, CREDIT, z, z, r, x)       # n_prefill > k
    with pytest.raises(ValueError):
        pick_joint(1, None, 10.0, 16.0, CREDIT, z, z, r, np.zeros((1, 2)))
    with pytest.raises(ValueError):
        pick_joint(1, np.zeros((3, 3), np.int32), 10.0, 16.0, CREDIT, z, z, r, x)
    with pytest.raises(TypeError):
        pick_joint(1, np.zeros((2, 3), np.int64), 10.0, 16.0, CREDIT, z, z, r, x)
    with pytest.raises(TypeError):
        pick_joint(1, None, 10.0, 16.0, CREDIT, z.astype(np.float32), z, r, x)
    with pytest.raises(ValueError):
        pick_joint(1, None, 10.0, 0.0, CREDIT, z, z, r, x)        # block_size
    with pytest.raises(ValueError):
        pick_joint(1, None, 10.0, 16.0, CREDIT, z, z, r, x, chunk_tokens=0.0)


def test_more_than_the_stack_buffers_hold():
    P, D = 70, 90
    rng = np.random.default_rng(1)
    k = P + D
    ov = rng.integers(0, 100, (k, 3)).astype(np.int32)
    q = rng.integers(0, 4000, k).astype(np.float64)
    run = rng.integers(0, 32, k).astype(np.float64)
    rates = np.tile([6e-3, 37e-6, 1e-4], (k, 1))
    xfer = rng.choice([XFER, 4 * XFER], (P, D))
    got = pick_joint(P, ov, 4096.0, 16.0, CREDIT, q, run, rates, xfer, 64.0, 2048.0, True,
                     1.0, 5, 0.0)
    want = plain(P, ov.tolist(), 4096.0, 16.0, CREDIT.tolist(), q.tolist(), run.tolist(),
                 rates.tolist(), xfer.tolist(), 64.0, 2048.0, True, 1.0, 5, 0.0)
    assert got == want
