"""``metricvalue.BucketCounts`` against ``metrics.LoopHistogramChild`` (its reference): the
same bucket counts and sum for the same observations, bucket edges, infinities and NaN
included; and the coordinator's loop histograms are made of it when it is built."""
from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from motor._fast.metricvalue import BucketCounts
from motor.coordinator import metrics
from motor.coordinator.metrics import LoopHistogramChild

BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(BOUNDS),
                   st.integers(-3, 3))


@given(st.lists(VALUES, max_size=60), st.sampled_from([BOUNDS, (), (1.0,)]))
def test_same_counts_and_sum_as_the_reference(values: list[float], bounds: tuple) -> None:
    ref, got = LoopHistogramChild(bounds), BucketCounts(bounds)
    for v in values:
        ref.observe(v)
        got.observe(v)
    assert got.counts == ref.counts
    assert got.bounds == ref.bounds
    assert (math.isnan(got.sum) and math.isnan(ref.sum)) or got.sum == ref.sum


def test_the_loop_histograms_are_made_of_it() -> None:
    h = metrics.LoopHistogram("motor_test_seconds", "test", ["route"], BOUNDS,
                              registry=metrics.CollectorRegistry())
    c = h.labels("chat")
    assert isinstance(c, BucketCounts)
    c.observe(0.003)
    c.observe(7.0)
    fam = h.collect()[0]
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert buckets["0.0025"] == 0 and buckets["0.005"] == 1 and buckets["+Inf"] == 2


def test_a_counters_fast_inc_counts_like_its_inc() -> None:
    reg = metrics.CollectorRegistry()
    c = metrics.Counter("motor_test_total", "test", ["status"], registry=reg)
    inc = metrics.counter_inc(c.labels("200"))
    inc(1.0)
    inc(1.0)
    c.labels("200").inc()
    assert reg.get_sample_value("motor_test_total", {"status": "200"}) == 3.0
