"""motor._fast.kvpick.TokenPick: the same decision as the numpy path (match each index,
their tier-wise maximum, gather, scoring.pick), on random indexes, candidates and loads."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from motor._fast.columns import gather
from motor._fast.kvpick import TokenPick
from motor._fast.radix import PrefixIndex
from motor._fast.scoring import pick as score_pick

CREDIT = (1.0, 0.8, 0.5)
BS = 16


class Ep:
    def __init__(self, key: str, prefill: float = 0, decode: float = 0,
                 inflight: int = 0) -> None:
        self.key = key
        self.inflight_prefill_tokens = prefill
        self.inflight_decode_tokens = decode
        self.inflight = inflight


def chain(rng: random.Random, n: int, base: int) -> np.ndarray:
    return np.array([base * 1000 + i + 1 for i in range(n)], np.uint64)


def reference(cands, slot_of, hashes, exact, approx, prompt, start, alt, fav_key, credit,
              weights, loads=None):
    """The numpy path, as KvAffinity._pick_columns / _pick_tokens do it."""
    m = None
    if hashes is not None and len(hashes):
        m = np.zeros((256, 3), np.int32)
        if exact is not None and exact.n_nodes:
            exact.match_into(hashes, m)
        if approx is not None and approx.n_nodes:
            m2 = np.zeros((256, 3), np.int32)
            approx.match_into(hashes, m2)
            np.maximum(m, m2, out=m)
    slots, ov, ld, missing, fav = gather(cands, slot_of, m, loads is None, fav_key)
    assert not missing
    cols = (ld[0], ld[1], ld[2]) if loads is None else loads
    if fav < 0 and alt >= 0:
        start = alt
    pw, dw, qp, guard, gmin = weights
    pos, cost = score_pick(ov, prompt, BS, np.array(CREDIT), cols[0], cols[1], cols[2], None,
                           pw, dw, qp, guard, start, favored=fav,
                           favored_credit=credit if fav >= 0 else 0.0, guard_min_load=gmin)
    return (pos, cost, *ov[pos].tolist(), fav)


@pytest.mark.parametrize("seed", range(40))
def test_same_decision_as_the_numpy_path(seed: int) -> None:
    rng = random.Random(seed)
    exact, approx = PrefixIndex(256), PrefixIndex(256)
    n_eps = rng.randint(1, 8)
    # slots spread over the words: some above 64, where an index may never have stored
    slot_of = {f"e{i}": s for i, s in enumerate(rng.sample(range(256), n_eps))}
    chains = [chain(rng, rng.randint(1, 40), b) for b in range(3)]
    for s in slot_of.values():
        for idx in (exact, approx):
            if rng.random() < 0.6:
                c = rng.choice(chains)
                idx.store(s, rng.randrange(3), 0, c[: rng.randint(1, len(c))], 1.0)
    weights = (rng.choice([1.0, 0.5]), rng.choice([0.0, 0.3]), rng.choice([0.0, 64.0]),
               rng.choice([0.0, 2.0]), rng.choice([0.0, 100.0]))
    tp = TokenPick(BS, CREDIT, *weights)
    for _ in range(30):
        cands = [Ep(k, rng.choice([0, 50, 400.5]), rng.choice([0, 30]), rng.randint(0, 4))
                 for k in rng.sample(sorted(slot_of), rng.randint(1, n_eps))]
        hashes = rng.choice(chains + [None, np.zeros(0, np.uint64)])
        if hashes is not None and len(hashes):
            hashes = hashes[: rng.randint(1, len(hashes))]
        use_x, use_a = rng.random() < 0.8, rng.random() < 0.8
        prompt = rng.randint(0, 800)
        start, alt = rng.randint(0, 9), rng.choice([-1, 3, 2**31])
        fav_key = rng.choice([None, "nobody", cands[-1].key])
        credit = rng.choice([0.0, 200.0])
        loads = None
        if rng.random() < 0.3:
            loads = tuple(np.array([rng.choice([0.0, 99.0]) for _ in cands]) for _ in range(3))
        want = reference(cands, slot_of, hashes, exact if use_x else None,
                         approx if use_a else None, prompt, start, alt, fav_key, credit,
                         weights, loads)
        got = tp.pick(cands, slot_of, hashes, exact if use_x else None,
                      approx if use_a else None, prompt, start, alt, fav_key, credit, loads)
        assert got is not None
        assert got[0] == want[0] and got[2:] == want[2:]
        assert got[1] == want[1] or (math.isinf(got[1]) and math.isinf(want[1]))


def test_a_stale_row_of_another_index_is_not_read() -> None:
    # the same TokenPick matches two approximate indexes in turn: the second one has only
    # used the first mask word, the first one filled rows above it
    wide, narrow = PrefixIndex(256), PrefixIndex(256)
    h = np.array([7, 8, 9], np.uint64)
    wide.store(200, 0, 0, h, 1.0)
    narrow.store(3, 0, 0, h[:1], 1.0)
    tp = TokenPick(BS, CREDIT)
    cands = [Ep("far"), Ep("near")]
    slots = {"far": 200, "near": 3}
    assert tp.pick(cands, slots, h, None, wide, 48, 0)[:5] == (0, 0.0, 3, 0, 0)
    assert tp.pick(cands, slots, h, None, narrow, 48, 0)[:5] == (1, 32.0, 1, 0, 0)


def test_a_strided_key_is_matched_as_its_copy() -> None:
    idx = PrefixIndex(256)
    h = np.arange(1, 21, dtype=np.uint64)
    idx.store(5, 1, 0, h[::2], 1.0)
    tp = TokenPick(BS, CREDIT)
    got = tp.pick([Ep("a"), Ep("b")], {"a": 4, "b": 5}, h[::2], idx, None, 200, 0)
    assert got[0] == 1 and got[2:5] == (0, 10, 0)


def test_missing_slot_and_no_candidates() -> None:
    tp = TokenPick(BS, CREDIT)
    assert tp.pick([Ep("a"), Ep("new")], {"a": 0}, None, None, None, 10, 0) is None
    pos, cost, *rest = tp.pick([], {}, None, None, None, 10, 0)
    assert pos == -1 and math.isinf(cost) and rest == [0, 0, 0, -1]


def test_bad_inputs_are_named() -> None:
    tp = TokenPick(BS, CREDIT)
    eps, slots = [Ep("a")], {"a": 0}
    with pytest.raises(TypeError, match="dtype uint64"):
        tp.pick(eps, slots, np.zeros(2, np.int64), None, None, 1, 0)
    with pytest.raises(TypeError, match="numpy uint64 array"):
        tp.pick(eps, slots, [1, 2], None, None, 1, 0)
    with pytest.raises(ValueError, match=r"hashes is expected to be 1-D, got shape \(1, 2\)"):
        tp.pick(eps, slots, np.ones((1, 2), np.uint64), None, None, 1, 0)
    with pytest.raises(ValueError, match="prompt_tokens is expected to be >= 0, got -1"):
        tp.pick(eps, slots, None, None, None, -1, 0)
    with pytest.raises(ValueError, match="slot of candidate 0 is expected to be in 0..255, "
                                         "got 300"):
        tp.pick(eps, {"a": 300}, None, None, None, 1, 0)
    with pytest.raises(ValueError, match=r"loads\[1\] is expected to have shape \(1,\), "
                                         r"got \(2,\)"):
        tp.pick(eps, slots, None, None, None, 1, 0, loads=(np.zeros(1), np.zeros(2),
                                                           np.zeros(1)))
    with pytest.raises(TypeError, match="counter|number|float"):
        tp.pick([Ep("a", prefill="x")], slots, None, None, None, 1, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size is expected to be > 0, got 0"):
        TokenPick(0, CREDIT)
    with pytest.raises(ValueError, match="tier_credit is expected to hold 3 numbers, got 2"):
        TokenPick(BS, (1.0, 0.5))
