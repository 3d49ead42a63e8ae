"""motor._fast.scoring.pick_ttft's stall term: candidates compared on TTFT + stall_weight x
running x the request's prefill time; the TTFT returned is the TTFT alone."""
from __future__ import annotations

import numpy as np
import pytest

from motor._fast import scoring

CREDIT = np.array([1.0, 0.75, 0.5])
#: (step_s, prefill_s_per_token, decode_s_per_seq): dyadic so every sum is exact
RATE = (2.0 ** -7, 2.0 ** -15, 2.0 ** -13)


def rates(n: int, *slower: int) -> np.ndarray:
    r = np.tile(np.array(RATE, np.float64), (n, 1))
    for i in slower:
        r[i, 1] *= 1.0625      # a few per cent slower per prefill token (learning noise)
    return r


def test_a_new_conversation_goes_to_the_instance_with_fewer_sequences() -> None:
    ov = np.zeros((2, 3), np.int32)
    q = np.zeros(2)
    running = np.array([3.0, 1.0])
    rt = rates(2, 1)               # instance 1 a little slower per token
    # TTFT alone: instance 0 (its 3 running sequences add 3 x 122 us to one step, less
    # than instance 1's slower 2048-token prefill)
    assert scoring.pick_ttft(ov, 2048, 16, CREDIT, q, running, rt)[0] == 0
    best, t = scoring.pick_ttft(ov, 2048, 16, CREDIT, q, running, rt, stall_weight=1.0)
    assert best == 1
    step, pre, dec = RATE
    assert t == pytest.approx(step + dec + pre * 1.0625 * 2048)    # the TTFT alone
    out = np.empty(2)
    scoring.pick_ttft(ov, 2048, 16, CREDIT, q, running, rt, out=out, stall_weight=1.0)
    assert out[0] == step + 3 * dec + pre * 2048


def test_the_stall_term_leaves_a_cached_conversation_on_its_holder() -> None:
    ov = np.zeros((2, 3), np.int32)
    ov[0] = [124, 0, 0]            # 1984 of 2048 tokens cached on the busy one
    q = np.zeros(2)
    running = np.array([6.0, 0.0])
    assert scoring.pick_ttft(ov, 2048, 16, CREDIT, q, running, rates(2),
                             stall_weight=1.0)[0] == 0
    with pytest.raises(ValueError, match="stall_weight"):
        scoring.pick_ttft(ov, 2048, 16, CREDIT, q, running, rates(2), stall_weight=-1.0)


def _brute_ttft(ov, prompt, rt, q, running, stall, fav, credit, start, cands):
    """min over (TTFT + stall - credit if favored, queued time, rotation rank)."""
    k = len(cands)
    keys = []
    for pos in range(k):
        i = cands[pos]
        step, pre, dec = rt[i]
        unc = max(prompt - 16 * float(CREDIT @ ov[i]), 0.0)
        work = q[i] + unc
        steps = max(1.0, float(np.ceil(work / 8192.0)))
        t = steps * (step + dec * running[i]) + pre * work
        eff = t + stall * running[i] * pre * unc - (credit if i == fav else 0.0)
        keys.append(((eff, pre * q[i] + dec * running[i], (pos - start) % k), i, t))
    best = min(keys)
    return best[1], best[2]


def _brute_tokens(ov, prompt, pf, dc, qu, fav, credit, start, cands):
    k = len(cands)
    keys = []
    for pos in range(k):
        i = cands[pos]
        load = pf[i] + 0.5 * dc[i] + 64.0 * qu[i]
        cost = max(prompt - 16 * float(CREDIT @ ov[i]), 0.0) + load
        keys.append(((cost - (credit if i == fav else 0.0), load, (pos - start) % k), i, cost))
    best = min(keys)
    return best[1], best[2]


def test_the_credit_and_the_stall_term_match_a_brute_force_argmin() -> None:
    rng = np.random.default_rng(11)
    for trial in range(400):
        n = int(rng.integers(1, 9))
        ov = rng.integers(0, 3, size=(n, 3)).astype(np.int32) * 32
        q = rng.choice([0.0, 512.0, 2048.0], n)
        running = rng.integers(0, 3, n).astype(np.float64)
        rt = rates(n, *[i for i in range(n) if rng.random() < 0.3])
        cands = rng.permutation(n)[: int(rng.integers(1, n + 1))].astype(np.int64)
        fav = int(rng.integers(-1, n))
        credit = float(rng.choice([0.0, 0.01, 0.05, 1.0]))
        stall = float(rng.choice([0.0, 1.0]))
        start = int(rng.integers(0, 5))
        prompt = int(rng.choice([100, 1024, 3000]))
        got = scoring.pick_ttft(ov, prompt, 16, CREDIT, q, running, rt, cands, 8192.0, start,
                                favored=fav, favored_credit=credit, stall_weight=stall)
        want = _brute_ttft(ov, prompt, rt, q, running, stall, fav, credit, start,
                           cands.tolist())
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), trial
        pf, dc = q / 4, running * 16
        got = scoring.pick(ov, prompt, 16, CREDIT, pf, dc, running, cands, 1.0, 0.5, 64.0,
                           0.0, start, favored=fav, favored_credit=credit * 1000)
        want = _brute_tokens(ov, prompt, pf, dc, running, fav, credit * 1000, start,
                             cands.tolist())
        assert got[0] == want[0] and got[1] == pytest.approx(want[1]), trial
