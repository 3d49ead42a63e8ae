"""Benchmarks of one rate-limit admission (``motor.coordinator.ratelimit`` / ``ratetable``).

What the edge pays per request of a limited key (rpm and tpm set, so both levels are
computed), the limit never reached:

* ``inprocess``: one worker, plain token buckets (:class:`RateLimiter`);
* ``shared-<n>``: ``coordinator.workers = n``, the shared table (:class:`SharedRateLimiter`),
  every row's ring of 512 buckets full (the worst case: a key busy in every worker for the
  last 64 s); ``reserved`` a configured name, ``hashed`` a name under the default limit.

One call = ``admit`` + ``headers`` (as :meth:`motor.coordinator.edge.Edge.run` calls them)
+ ``settle``. Units: seconds per call; ``extra_info["calls_per_s"]``.

Run::

    .venv/bin/python -m pytest bench/bench_ratelimit.py --benchmark-only -o addopts=""
"""
from __future__ import annotations

import math
import os
import time

import pytest

from motor.coordinator.ratelimit import Limit, RateLimiter
from motor.coordinator.ratetable import RateTable, SharedRateLimiter

pytestmark = pytest.mark.proxy

LIMITS = {"team": Limit(rpm=1e9, tpm=1e12)}
DEFAULT = Limit(rpm=1e9, tpm=1e12)


def _call(rl: RateLimiter, name: str) -> None:
    assert rl.admit(name, 300) is None
    rl.headers(name)
    rl.settle(name, 300, 120)


def test_inprocess(benchmark, rate):
    rl = RateLimiter(LIMITS, DEFAULT)
    benchmark(_call, rl, "team")
    rate("calls_per_s", 1)


@pytest.mark.parametrize("name", ["team", "anonymous"], ids=["reserved", "hashed"])
@pytest.mark.parametrize("workers", [2, 8], ids=lambda n: f"shared-{n}")
def test_shared(benchmark, rate, workers, name):
    table = RateTable.create(f"motor-bench-rate-{os.getpid()}-{workers}-{name}", workers, 1)
    try:
        rls = [SharedRateLimiter(LIMITS, DEFAULT, 1.0, table, w) for w in range(workers)]
        for rl in rls:                 # every row busy over the whole ring
            assert rl.admit(name, 1) is None
            k = rl._key(name)
            assert k is not None
            now = math.floor(time.monotonic() / table.bucket_s)
            for b in range(now - table.n_buckets, now + 1):
                rl._record(k.slot, b, 1.0, 10.0)
        benchmark(_call, rls[0], name)
        rate("calls_per_s", 1)
    finally:
        table.close()
        table.unlink()
