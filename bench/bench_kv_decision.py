"""Benchmarks of one ``kv_affinity`` routing decision at the compiled-core budget's size.

Budget (issue 19): the routing decision p99 < 25 us at 32k tokens and 64 candidates.
Measured: ``KvAffinity.pick`` (the match of 2048 blocks in the approximate index, held by
16 of 64 endpoints, the load columns, the learned rates, the compiled argmin) for a request
of 32768 prompt tokens, with ``coordinator.kv.cost: time`` (``pick_ttft``) and ``tokens``
(``pick``), with and without a session whose last endpoint is the 61st candidate
(``coordinator.kv.session``: its table lookup and candidate scan), the compiled decision
``pick`` runs under ``cost: tokens`` alone (``motor._fast.kvpick.TokenPick``) and the compiled
scorers alone. Per call (pedantic, 1 iteration per round), so
``extra_info["p99_us"]`` is a per-call percentile.

Run::

    .venv/bin/python -m pytest bench/bench_kv_decision.py --benchmark-only \\
        -p no:cacheprovider -o addopts=""
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from motor._fast import scoring
from motor.config.schema import KvRoutingConfig, Role
from motor.coordinator.endpoints import EndpointState
from motor.coordinator.kv.router import KvRouter
from motor.coordinator.policy import RequestInfo
from motor.coordinator.policy.kv_affinity import KvAffinity

pytestmark = pytest.mark.routing

PROMPT_TOKENS = 32768
N = 64


def kv_case(pool: Any, cost: str, session: bool) -> tuple[KvAffinity, list[EndpointState],
                                                          RequestInfo]:
    """The benchmark's decision inputs: (policy, endpoints, request) with
    ``coordinator.kv.cost`` = ``cost`` and, when ``session``, a session whose last endpoint
    is the 61st; ``pool``: the endpoints' client pool (never used). Also counted by
    ``bench/decision_cost.py``."""
    rng = np.random.default_rng(5)
    eps = []
    for i in range(N):
        ep = EndpointState(f"dec-{i}", "m", Role.UNION, "127.0.0.1", 21000 + i, 0, pool)
        ep.ready = True
        ep.acquire(int(rng.integers(0, 20000)), int(rng.integers(0, 4000)),
                   int(rng.integers(0, 2000)))
        eps.append(ep)
    router = KvRouter(KvRoutingConfig(cost=cost))
    policy = KvAffinity(router)
    hashes = np.arange(1, PROMPT_TOKENS // 16 + 1, dtype=np.uint64)
    for j, ep in enumerate(eps[:16]):
        router.routed(ep, "m", hashes[: 2048 - 100 * j])
        policy.rates.observe(router.slot(ep.key), (1.0, 4.0, 3000.0), 0.2)
    info = RequestInfo("m", PROMPT_TOKENS, 128)
    info.block_hashes = hashes
    if session:
        assert policy.sessions is not None
        for k in range(1000):
            policy.sessions.routed(f"other-{k}", eps[k % N].key)
        policy.sessions.routed(b"conversation-7", eps[60].key)
        info.session = b"conversation-7"
    return policy, eps, info


@pytest.mark.parametrize("session", [False, True], ids=["no-session", "session"])
@pytest.mark.parametrize("cost", ["time", "tokens"])
def test_kv_affinity_decision(benchmark, percentiles, idle_pool, cost, session):
    benchmark.group = f"kv_affinity.pick[tokens={PROMPT_TOKENS},endpoints={N}]"
    policy, eps, info = kv_case(idle_pool, cost, session)
    ep = benchmark.pedantic(policy.pick, (eps, info, None), rounds=3000, iterations=1,
                            warmup_rounds=100)
    assert ep in eps
    percentiles()


def test_pick_ttft(benchmark, percentiles):
    benchmark.group = f"scoring[tokens={PROMPT_TOKENS},candidates={N}]"
    rng = np.random.default_rng(3)
    ov = rng.integers(0, 200, size=(N, 3), dtype=np.int32)
    credit = np.array([1.0, 0.8, 0.5])
    queued = rng.integers(0, 20000, N).astype(np.float64)
    running = rng.integers(0, 64, N).astype(np.float64)
    rates = np.tile([6e-3, 37e-6, 1e-4], (N, 1))
    best, _ = benchmark.pedantic(scoring.pick_ttft, (ov, PROMPT_TOKENS, 16, credit, queued,
                                                     running, rates, None, 8192.0, 7),
                                 rounds=3000, iterations=1, warmup_rounds=100)
    assert 0 <= best < N
    percentiles()


@pytest.mark.parametrize("session", [False, True], ids=["no-session", "session"])
def test_token_pick(benchmark, percentiles, idle_pool, session):
    """The compiled decision ``KvAffinity.pick`` runs under ``cost: tokens``
    (:class:`motor._fast.kvpick.TokenPick`: match, gather, score) alone."""
    benchmark.group = f"kvpick[tokens={PROMPT_TOKENS},endpoints={N}]"
    policy, eps, info = kv_case(idle_pool, "tokens", session)
    tp = policy._token_pick
    assert tp is not None
    r = policy.router
    policy.pick(eps, info)              # every endpoint gets its slot
    exact, approx = r.indexes("m")
    last = policy._session_last(info)
    got = benchmark.pedantic(tp.pick, (eps, r.slot_map, info.block_hashes, exact, approx,
                                       PROMPT_TOKENS, 0, -1, last, 1024.0, None),
                             rounds=3000, iterations=1, warmup_rounds=100)
    assert got is not None and 0 <= got[0] < N
    assert (got[5] == 60) == session     # the session's endpoint is found by its key
    percentiles()
