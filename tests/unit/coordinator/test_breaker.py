"""The per-endpoint circuit breaker: transitions and what counts."""
from __future__ import annotations

import time

from motor.coordinator.breaker import CLOSED, HALF_OPEN, OPEN, Breaker


def test_opens_after_threshold_consecutive_failures_and_success_resets():
    b = Breaker(failure_threshold=3, open_s=10.0)
    b.failure()
    b.failure()
    b.success()
    b.failure()
    b.failure()
    assert b.state == CLOSED and b.allows(time.monotonic())
    b.failure()
    assert b.state == OPEN and not b.allows(time.monotonic())


def test_refused_connection_opens_at_once():
    b = Breaker(failure_threshold=5)
    b.failure(certain=True)
    assert b.state == OPEN


def test_half_open_lets_one_probe_then_closes_on_success():
    seen = []
    b = Breaker(failure_threshold=1, open_s=0.01, on_change=seen.append)
    b.failure()
    now = time.monotonic() + 0.02
    assert b.allows(now)
    b.on_pick(now)
    assert b.state == HALF_OPEN and b.probe_inflight
    assert not b.allows(now)             # one probe at a time
    b.success()
    assert b.state == CLOSED and b.allows(now)
    assert seen == [OPEN, HALF_OPEN, CLOSED]


def test_failed_probe_doubles_the_open_period_up_to_the_cap():
    b = Breaker(failure_threshold=1, open_s=1.0, open_max_s=3.0)
    b.failure()
    periods = []
    for _ in range(4):
        b.on_pick(b.open_until)
        assert b.state == HALF_OPEN
        t = time.monotonic()
        b.failure()
        periods.append(round(b.open_until - t))
    assert periods == [2, 3, 3, 3]
    b.on_pick(b.open_until)
    b.success()
    b.failure()
    assert round(b.open_until - time.monotonic()) == 1   # back to open_s after a success


def test_probe_without_verdict_lets_another_probe():
    b = Breaker(failure_threshold=1, open_s=0.0)
    b.failure()
    b.on_pick(time.monotonic())
    b.probe_done()
    assert b.allows(time.monotonic())


def test_reset_closes():
    b = Breaker(failure_threshold=1)
    b.failure()
    b.reset()
    assert b.state == CLOSED and b.failures == 0
