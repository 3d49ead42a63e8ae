"""Benchmarks for motor._fast.scoring.

Budget (issue 3, one core): < 2 us per pick for 64 candidates, including the
Python call and argument checks.

Run::

    .venv/bin/python -m pytest bench/bench_scoring.py --benchmark-only \
        -p no:cacheprovider -o addopts=""
"""
import numpy as np
import pytest

from motor._fast import scoring

pytestmark = pytest.mark.fast_core


def _inputs(n):
    rng = np.random.default_rng(3)
    ov = rng.integers(0, 200, size=(n, 3), dtype=np.int32)
    credit = np.array([1.0, 0.8, 0.5])
    prefill = rng.integers(0, 20000, n).astype(np.float64)
    decode = rng.integers(0, 200000, n).astype(np.float64)
    queue = rng.integers(0, 10, n).astype(np.float64)
    cands = np.arange(n, dtype=np.int32)
    return ov, credit, prefill, decode, queue, cands


@pytest.mark.parametrize("n", [8, 64, 256], ids=lambda n: f"candidates={n}")
def test_pick(benchmark, n):
    benchmark.group = "scoring.pick"
    ov, credit, prefill, decode, queue, cands = _inputs(n)
    best, cost = benchmark(scoring.pick, ov, 32768, 16, credit, prefill, decode, queue, cands,
                           1.0, 0.1, 500.0, 2.0, 7)
    assert 0 <= best < n


@pytest.mark.parametrize("n", [64], ids=lambda n: f"candidates={n}")
def test_costs(benchmark, n):
    benchmark.group = "scoring.costs"
    ov, credit, prefill, decode, queue, cands = _inputs(n)
    out = np.zeros(n)
    benchmark(scoring.costs, ov, 32768, 16, credit, prefill, decode, queue, out, cands,
              1.0, 0.1, 500.0, 2.0, 7)
