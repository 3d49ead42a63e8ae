"""Benchmarks of the routing policies' per-request work (``motor.coordinator.policy``).

What one request costs the coordinator before it is sent, for 8 and 64 union endpoints
(their load counters set, no I/O):

* ``pick``: ``round_robin`` / ``least_load`` / ``kv_affinity`` choosing one endpoint for a
  request whose routing key is known (kv_affinity: 2048 prompt tokens, the prefix held by
  a quarter of the endpoints in the exact index);
* ``prepare``: kv_affinity's routing key of a chat request (builtin tokenizer, chat template
  rendered, 2048 tokens hashed in 16-token blocks).

Units: seconds per call (pytest-benchmark's table); ``extra_info["calls_per_s"]``.

Run::

    .venv/bin/python -m pytest bench/bench_routing.py --benchmark-only -o addopts=""
"""
from __future__ import annotations

import numpy as np
import pytest

from motor.config.schema import Role
from motor.coordinator.endpoints import EndpointState
from motor.coordinator.kv.router import KvRouter
from motor.coordinator.policy import RequestInfo, make_policy
from motor.coordinator.policy.kv_affinity import KvAffinity
from motor.http.client import Pool

pytestmark = pytest.mark.routing

PROMPT_TOKENS = 2048


@pytest.fixture(scope="module")
def pool():
    p = Pool("127.0.0.1", 9)     # never connected: endpoints need one to exist
    yield p
    p.close()


def _endpoints(pool, n):
    eps = []
    rng = np.random.default_rng(5)
    for i in range(n):
        ep = EndpointState(f"bench-{n}-{i}", "m", Role.UNION, "127.0.0.1", 20000 + i, 0, pool)
        ep.ready = True
        ep.acquire(int(rng.integers(0, 20000)), int(rng.integers(0, 4000)),
                   int(rng.integers(0, 2000)))
        eps.append(ep)
    return eps


def _chat(words: int) -> dict:
    text = " ".join(f"w{i % 97}" for i in range(words))
    return {"model": "m", "messages": [{"role": "system", "content": text},
                                       {"role": "user", "content": "and now?"}]}


@pytest.mark.parametrize("n", [8, 64], ids=lambda n: f"endpoints={n}")
@pytest.mark.parametrize("name", ["round_robin", "least_load", "kv_affinity"])
def test_pick(benchmark, rate, pool, name, n):
    benchmark.group = f"routing.pick[endpoints={n}]"
    eps = _endpoints(pool, n)
    if name == "kv_affinity":
        router = KvRouter()
        policy = make_policy(name, router=router)
        hashes = np.arange(1, PROMPT_TOKENS // 16 + 1, dtype=np.uint64)
        for ep in eps[: max(1, n // 4)]:
            router.routed(ep, "m", hashes)      # approximate index: they hold the prefix
    else:
        policy = make_policy(name)
        hashes = None
    info = RequestInfo("m", PROMPT_TOKENS, 128)
    info.block_hashes = hashes
    ep = benchmark(policy.pick, eps, info, None)
    assert ep in eps
    rate("calls_per_s", 1)


def test_kv_affinity_prepare(benchmark, rate):
    benchmark.group = "routing.prepare"
    policy = make_policy("kv_affinity", router=KvRouter())
    assert isinstance(policy, KvAffinity)
    body = _chat(1400)
    info = RequestInfo("m", 1, 128)
    benchmark(policy.prepare, info, "chat", body)
    assert info.block_hashes is not None and info.prompt_tokens > 1000
    rate("calls_per_s", 1)
