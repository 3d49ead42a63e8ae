"""kv_affinity's time cost spreads new conversations: with learned rates a few per cent
apart on identical instances, a first turn (nothing cached anywhere) still goes to the
instance with the fewest sequences (the stall term, ``ttft.stall_weight``); without the
term the slightly faster instance collects them all, and their later turns follow."""
from __future__ import annotations

from collections import Counter

import numpy as np

from motor.config.schema import KvRoutingConfig, KvTtftConfig
from motor.coordinator.kv import KvRouter
from motor.coordinator.policy.kv_affinity import KvAffinity

from .test_kv_affinity import Ep, chat, request


def place_first_turns(stall_weight: float, n: int = 8) -> Counter[str]:
    p = KvAffinity(KvRouter(KvRoutingConfig(cost="time", approximate={"mode": "off"},
                                            ttft=KvTtftConfig(stall_weight=stall_weight))))
    eps = [Ep(f"{k}#0") for k in "abcd"]
    base = p.rates.rates(np.array([0]))[0]
    for j, e in enumerate(eps):     # learned rates 0-3 % apart: a faster
        p.rates._rates[p.router.slot(e.key)] = base * np.array([1.0, 1.0 + 0.01 * j, 1.0])
    got: Counter[str] = Counter()
    for c in range(n):              # each first turn stays in flight (decoding)
        info = request(p, chat(f"first turn of conversation {c}", system=f"prompt {c} " * 200))
        ep = p.pick(eps, info)
        ep.inflight += 1
        got[ep.key] += 1
    return got


def test_first_turns_spread_over_identical_instances() -> None:
    assert place_first_turns(1.0) == Counter({"a#0": 2, "b#0": 2, "c#0": 2, "d#0": 2})


def test_without_the_stall_term_the_fastest_instance_collects_them() -> None:
    got = place_first_turns(0.0)
    assert got["a#0"] >= 6, got     # 3x its fair share of 2 and more
