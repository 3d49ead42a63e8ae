"""motor bench statistics: percentiles against numpy, per-request metrics, summary."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor.bench.config import BenchConfig
from motor.bench.results import BenchResult, RequestResult, compute_metrics, metric_stats


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=300))
def test_metric_stats_match_numpy(values):
    s = metric_stats("E2EL", "ms", values)
    a = np.array(values)
    assert s.n == len(values)
    assert s.min == a.min() and s.max == a.max()
    assert s.average == pytest.approx(a.mean(), rel=1e-12, abs=1e-9)
    for got, q in ((s.median, 50), (s.p75, 75), (s.p90, 90), (s.p99, 99)):
        assert got == pytest.approx(np.percentile(a, q), rel=1e-12, abs=1e-9)


def test_metric_stats_known_values():
    s = metric_stats("X", "ms", list(range(1, 101)))   # 1..100
    assert (s.average, s.min, s.max, s.n) == (50.5, 1, 100, 100)
    assert s.median == 50.5
    assert s.p75 == pytest.approx(75.25)
    assert s.p90 == pytest.approx(90.1)
    assert s.p99 == pytest.approx(99.01)
    one = metric_stats("X", "ms", [7.0])
    assert (one.min, one.median, one.p99, one.max, one.n) == (7.0, 7.0, 7.0, 7.0, 1)


def test_metric_stats_empty():
    s = metric_stats("TTFT", "ms", [])
    assert s.n == 0 and math.isnan(s.average) and math.isnan(s.p99)
    assert s.to_dict()["average"] is None and s.to_dict()["n"] == 0


def test_request_derived_metrics():
    r = RequestResult(0, 0, True, e2el=1.0, ttft=0.1, itl=[0.3, 0.3, 0.3], output_tokens=4)
    assert r.tpot == pytest.approx(0.3)
    assert r.output_throughput == pytest.approx(4.0)
    assert RequestResult(0, 0, True, e2el=1.0, ttft=0.1, output_tokens=1).tpot is None
    assert RequestResult(0, 0, True, e2el=1.0, ttft=None, output_tokens=5).tpot is None


def _reqs():
    return [
        RequestResult(0, 0, True, e2el=0.5, ttft=0.1, itl=[0.1, 0.2], input_tokens=100,
                      output_tokens=3, cached_tokens=50),
        RequestResult(1, 0, True, e2el=1.0, ttft=0.2, itl=[0.4], input_tokens=300,
                      output_tokens=2, cached_tokens=0),
        RequestResult(2, 0, True, e2el=2.0, ttft=None, input_tokens=1000, output_tokens=10),
        RequestResult(3, 0, False, e2el=9.0, reason="http_500", error="HTTP 500: boom"),
        RequestResult(4, 0, False, e2el=9.0, reason="timeout", error="late"),
        RequestResult(5, 0, False, e2el=9.0, reason="http_500", error="HTTP 500: boom2"),
    ]


def test_compute_metrics_uses_successful_requests_only():
    m = compute_metrics(_reqs())
    assert m["E2EL"].n == 3 and m["E2EL"].max == pytest.approx(2000.0)
    assert m["TTFT"].n == 2 and m["TTFT"].average == pytest.approx(150.0)
    assert m["ITL"].n == 3 and m["ITL"].max == pytest.approx(400.0)        # pooled gaps
    assert m["TPOT"].n == 2                                                 # needs ttft and >1 token
    assert m["TPOT"].min == pytest.approx((0.5 - 0.1) / 2 * 1000)
    assert m["InputTokens"].average == pytest.approx(1400 / 3)
    assert m["OutputTokens"].max == 10
    assert m["OutputTokenThroughput"].max == pytest.approx(6.0)


def test_bench_result_summary():
    res = BenchResult(BenchConfig(), "m", _reqs(), duration=2.0)
    assert (res.completed, res.failed) == (3, 3)
    assert res.failure_reasons == {"http_500": 2, "timeout": 1}
    assert res.failure_messages[0] == "http_500: HTTP 500: boom"
    assert res.request_throughput == pytest.approx(1.5)
    assert res.output_throughput == pytest.approx(15 / 2.0)
    # cached share over the requests that reported cached tokens: 50 / (100 + 300)
    assert res.cached_tokens == 50 and res.cached_share == pytest.approx(0.125)
    assert res.exit_status == 1 and not res.ok
    good = BenchResult(BenchConfig(), "m", _reqs()[:3], duration=1.0)
    assert good.exit_status == 0 and good.ok
    assert BenchResult(BenchConfig(), "m", [], duration=1.0).exit_status == 1  # nothing completed
    no_cache = BenchResult(BenchConfig(), "m", _reqs()[2:3], duration=1.0)
    assert no_cache.cached_share is None
