"""Per-key rate limits (token buckets on a fake clock): requests and tokens per minute."""
from __future__ import annotations

from motor.coordinator.ratelimit import Limit, RateLimiter, duration


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def admitted_over(rl: RateLimiter, clock: Clock, name: str, seconds: float, step: float,
                  tokens: float = 0.0) -> int:
    n = 0
    end = clock.t + seconds
    while clock.t < end:
        if rl.admit(name, tokens) is None:
            n += 1
        clock.t += step
    return n


def test_rpm_holds_over_a_minute_within_the_burst():
    clock = Clock()
    rl = RateLimiter({"a": Limit(rpm=600)}, clock=clock)
    n = admitted_over(rl, clock, "a", 60.0, 0.001)
    assert 600 <= n <= 600 + 10  # the limit plus one 1 s burst (10 requests)


def test_refusal_says_when_and_carries_openai_headers():
    clock = Clock()
    rl = RateLimiter({"a": Limit(rpm=60)}, clock=clock)
    assert rl.admit("a", 0) is None
    refused = rl.admit("a", 0)
    assert refused is not None
    wait, kind, headers = refused
    assert 0.9 < wait <= 1.0 and kind == "requests"
    h = dict(headers)
    assert h[b"x-ratelimit-limit-requests"] == b"60"
    assert h[b"x-ratelimit-remaining-requests"] == b"0"
    assert h[b"x-ratelimit-reset-requests"].endswith(b"s")
    clock.t += 1.0
    assert rl.admit("a", 0) is None


def test_tpm_admits_a_big_prompt_once_then_waits_for_the_debt():
    clock = Clock()
    rl = RateLimiter({}, default=Limit(tpm=6000), clock=clock)  # 100 tokens / s
    assert rl.admit("anonymous", 1000) is None      # larger than the burst: admitted once
    refused = rl.admit("anonymous", 10)
    assert refused is not None and 8.9 < refused[0] <= 9.0  # 900 tokens of debt
    assert refused[1] == "tokens"
    clock.t += 9.0
    assert rl.admit("anonymous", 10) is None


def test_settle_replaces_the_estimate_by_the_usage():
    clock = Clock()
    rl = RateLimiter({"a": Limit(tpm=6000)}, clock=clock)
    assert rl.admit("a", 300) is None               # estimate: prompt + max_tokens; burst 100
    assert rl.admit("a", 1) is not None             # 200 tokens of debt
    rl.settle("a", 300, 50)                         # the engine used 50: level back to +50
    assert rl.admit("a", 1) is None
    rl.settle("a", 1, None)                        # unknown usage: the estimate stands


def test_keys_are_independent_and_unlisted_keys_get_the_default():
    clock = Clock()
    rl = RateLimiter({"vip": Limit()}, default=Limit(rpm=60), clock=clock)
    assert rl.enabled
    for _ in range(50):
        assert rl.admit("vip", 0) is None           # unlimited
    assert rl.admit("x", 0) is None and rl.admit("x", 0) is not None
    assert rl.admit("y", 0) is None                 # its own bucket
    assert rl.headers("vip") == ()
    assert not RateLimiter({}).enabled


def test_share_divides_the_limit_between_workers():
    clock = Clock()
    rl = RateLimiter({"a": Limit(rpm=1200)}, share=0.5, clock=clock)
    n = admitted_over(rl, clock, "a", 60.0, 0.001)
    assert 600 <= n <= 600 + 10


def test_duration_form():
    assert duration(0.25) == "250ms"
    assert duration(1.5) == "1.5s"
    assert duration(90) == "1m30s"
