"""Benchmarks of one joint (prefill, decode) decision of the PD modes (``pd.joint``) at the
compiled-core budget's size.

Budget (issue 19): the routing decision p99 < 25 us at 32k tokens and 64 candidates.
Measured: :meth:`motor.coordinator.policy.pairs.PairChooser.choose` over 32 prefill x 32
decode endpoints (64 candidates, 1024 pairs; with local prefill, 32 more) for a request of
32768 prompt tokens: the two matches of 2048 blocks in the approximate index (held by 16
endpoints of each role), the load columns, the rates, the transfer matrix by topology, the
compiled argmin; and the compiled :func:`motor._fast.pairs.pick_pair` alone. Per call
(pedantic, 1 iteration per round), so ``extra_info["p99_us"]`` is a per-call percentile.

Run::

    .venv/bin/python -m pytest bench/bench_pd_decision.py --benchmark-only \\
        -p no:cacheprovider -o addopts=""
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from motor._fast.pairs import pick_pair
from motor.config.schema import CoordinatorConfig, Role
from motor.coordinator.endpoints import EndpointState
from motor.coordinator.policy import RequestInfo
from motor.coordinator.policy.pairs import PairChooser

pytestmark = pytest.mark.routing

PROMPT_TOKENS = 32768
N = 32          # per role: 64 candidates


def joint_case(pool: Any) -> tuple[PairChooser, RequestInfo, list[EndpointState],
                                  list[EndpointState]]:
    """The benchmark's decision inputs: (chooser, request, prefill endpoints, decode
    endpoints); ``pool``: the endpoints' client pool (never used). Also counted by
    ``bench/decision_cost.py``."""
    rng = np.random.default_rng(5)
    ps, ds = [], []
    for i in range(2 * N):
        role = Role.PREFILL if i < N else Role.DECODE
        ep = EndpointState(f"e-{i}", "m", role, f"10.0.{i // 8}.{i % 8}", 21000 + i, 0, pool)
        ep.ready = True
        ep.acquire(int(rng.integers(0, 20000)), int(rng.integers(0, 4000)),
                   int(rng.integers(0, 2000)))
        (ps if i < N else ds).append(ep)
    topology = {f"10.0.{i // 8}.{i % 8}": f"r{i // 16}/n{i // 8}" for i in range(2 * N)}
    j = PairChooser(CoordinatorConfig(pd={"joint": {"enabled": True, "topology": topology}}))
    hashes = np.arange(1, PROMPT_TOKENS // 16 + 1, dtype=np.uint64)
    for k in range(16):
        j.router.routed(ps[k], "m", hashes[: 2048 - 100 * k])
        j.router.routed(ds[k], "m", hashes[: 2048 - 120 * k])
    info = RequestInfo("m", PROMPT_TOKENS, 128)
    info.block_hashes = hashes
    return j, info, ps, ds


@pytest.mark.parametrize("local", [False, True], ids=["pairs", "pairs+local"])
def test_joint_decision(benchmark, percentiles, idle_pool, local):
    benchmark.group = f"pairs.choose[tokens={PROMPT_TOKENS},endpoints={2 * N}]"
    j, info, ps, ds = joint_case(idle_pool)
    ch = benchmark.pedantic(j.choose, (info, ps, ds, local), rounds=3000, iterations=1,
                            warmup_rounds=100)
    assert ch is not None and ch.d in ds
    percentiles()


def test_pick_pair(benchmark, percentiles):
    benchmark.group = f"pairs.pick_pair[candidates={2 * N}]"
    rng = np.random.default_rng(3)
    p_work = rng.integers(0, 40000, N).astype(np.float64)
    p_running = rng.integers(0, 16, N).astype(np.float64)
    d_queued = rng.integers(0, 4000, N).astype(np.float64)
    d_unc = rng.integers(0, 32768, N).astype(np.float64)
    d_running = rng.integers(0, 64, N).astype(np.float64)
    rates = np.tile([6e-3, 37e-6, 1e-4], (N, 1))
    xfer = rng.choice([0.7e-6, 2.6e-6, 5e-6], (N, N))
    p, d, *_ = benchmark.pedantic(pick_pair, (p_work, p_running, rates, d_queued, d_unc,
                                              d_running, rates, xfer, 128.0, 8192.0, True,
                                              1.0, 7),
                                  rounds=3000, iterations=1, warmup_rounds=100)
    assert 0 <= d < N
    percentiles()
