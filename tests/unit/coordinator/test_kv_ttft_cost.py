"""kv_affinity's time cost: each term, rates learned from observed TTFT, ties, the log."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from motor.config.schema import KvRoutingConfig, KvTtftConfig
from motor.coordinator.kv import KvRouter
from motor.coordinator.policy.kv_affinity import KvAffinity
from motor.coordinator.policy.ttft import RateModel

from .test_kv_affinity import Ep, chat, hold, request

STEP, DEC, PRE = 6e-3, 100e-6, 37e-6      # the prior (s, s per sequence, s per token)


def policy(**ttft) -> KvAffinity:
    return KvAffinity(KvRouter(KvRoutingConfig(cost="time", ttft=KvTtftConfig(**ttft))))


# -- the rate model ------------------------------------------------------------------------

def test_an_instance_without_observations_is_priced_at_the_prior() -> None:
    m = RateModel(KvTtftConfig())
    assert m.theta(7) == pytest.approx((STEP, DEC, PRE))
    assert m.rates(np.array([0, 7])).tolist() == [pytest.approx([STEP, PRE, DEC])] * 2
    assert m.features(1000.0, 500.0, 3.0) == (1.0, 3.0, 1500.0)
    assert m.features(9000.0, 0.0, 3.0) == (2.0, 6.0, 9000.0)   # two 8192-token chunks


def test_rates_are_learned_from_observed_ttft() -> None:
    """An engine 3x slower per prefill token, 2x per step and per sequence than the prior:
    the fit finds it from TTFTs alone, whatever the mix of loads."""
    true = np.array([2 * STEP, 2 * DEC, 3 * PRE])
    # a weak prior: the fit itself; the default prior (1 observation's weight against ~92
    # effective ones at a 64-request half-life) pulls the fit a few % towards the prior
    for prior, tol in ((0.01, 0.01), (1.0, 0.06)):
        m = RateModel(KvTtftConfig(halflife_requests=64, prior_weight=prior))
        rng = np.random.default_rng(1)
        for _ in range(400):
            x = m.features(float(rng.integers(0, 6000)), float(rng.integers(16, 3000)),
                           float(rng.integers(0, 32)))
            m.observe(3, x, float(true @ np.array(x)))
        assert m.theta(3) == pytest.approx(tuple(true), rel=tol)
        assert m.theta(2) == pytest.approx((STEP, DEC, PRE))       # other slots untouched
        assert m.n_obs[3] == 400


def test_old_observations_fade_with_the_half_life() -> None:
    m = RateModel(KvTtftConfig(halflife_requests=16))
    rng = np.random.default_rng(2)

    def feed(true: np.ndarray, n: int) -> None:
        for _ in range(n):
            x = m.features(float(rng.integers(0, 4000)), float(rng.integers(16, 3000)),
                           float(rng.integers(0, 16)))
            m.observe(0, x, float(true @ np.array(x)))
    feed(np.array([STEP, DEC, PRE]), 200)
    feed(np.array([STEP, DEC, 4 * PRE]), 200)   # the engine got slower (e.g. a bigger model)
    assert m.theta(0)[2] == pytest.approx(4 * PRE, rel=0.05)


def test_a_fit_never_makes_an_instance_free_and_bad_samples_are_ignored() -> None:
    m = RateModel(KvTtftConfig())
    for _ in range(100):
        m.observe(0, (1.0, 0.0, 1000.0), 1e-9)                    # absurdly fast answers
    assert min(m.theta(0)) > 0
    assert all(t >= 0.01 * p * 0.999 for t, p in zip(m.theta(0), (STEP, DEC, PRE)))
    before = m.theta(1)
    m.observe(1, (1.0, 0.0, 1000.0), 0.0)
    m.observe(1, (1.0, 0.0, 1000.0), float("nan"))
    assert m.theta(1) == before and m.n_obs[1] == 0
    m.reset(0)
    assert m.theta(0) == pytest.approx((STEP, DEC, PRE))


# -- the policy ----------------------------------------------------------------------------

def test_the_holder_wins_on_time_and_the_cost_is_its_predicted_ttft() -> None:
    p = policy()
    a, b = Ep("a#0"), Ep("b#0")
    hold(p.router, b, chat("q"))
    info = request(p, chat("q, and more"))
    assert p.pick([a, b], info) is b
    assert info.cost == pytest.approx(STEP + PRE * info.prefill_tokens)
    slot, x = info.ttft_obs
    assert slot == p.router.slot("b#0") and x == (1.0, 0.0, float(info.prefill_tokens))


def test_queued_prefill_on_the_holder_sends_the_request_elsewhere() -> None:
    """No threshold: the holder loses once its queue takes longer than the prefix's
    recompute elsewhere (1.1k tokens x 37 us = 41 ms, i.e. ~1.1k queued tokens)."""
    p = policy()
    a, b = Ep("a#0"), Ep("b#0")
    hold(p.router, a, chat("q"))
    prompt = request(p, chat("q")).prompt_tokens
    a.inflight, a.inflight_prefill_tokens = 1, prompt - 200
    assert p.pick([a, b], request(p, chat("q"))) is a
    a.inflight_prefill_tokens = prompt + 200
    assert p.pick([a, b], request(p, chat("q"))) is b


def test_the_decode_batch_adds_its_step_time() -> None:
    p = policy()
    a, b = Ep("a#0"), Ep("b#0")
    a.inflight = 40                                    # 40 x 100 us = 4 ms per step
    b.inflight = 10
    info = request(p, chat("q", system="new"))
    assert p.pick([a, b], info) is b
    assert info.cost == pytest.approx(STEP + 10 * DEC + PRE * info.prompt_tokens)


def test_two_instances_one_hot_prefix_both_serve() -> None:
    """Case N07 in the cost: the holder keeps requests while its queue is short, the other
    instance gets them once the queue costs more than the prefix."""
    p = policy()
    a, b = Ep("a#0", kv_events=None), Ep("b#0", kv_events=None)
    body = chat("q")
    first = request(p, body)
    ep = p.pick([a, b], first)
    p.routed(ep, first)
    got = []
    for i in range(200):                                # requests pile up (none finishes)
        info = request(p, chat(f"q{i}"))
        e = p.pick([a, b], info)
        p.routed(e, info)
        e.inflight += 1
        e.inflight_prefill_tokens += info.prefill_tokens
        got.append(e.key)                               # affinity at low load:
    assert got[:20].count(ep.key) == 20
    assert 0.25 <= got.count("a#0") / len(got) <= 0.75, got.count("a#0")   # both serve


def test_a_learned_slow_instance_loses_its_requests() -> None:
    p = policy()
    a, b = Ep("a#0"), Ep("b#0")
    hold(p.router, a, chat("q"))
    hold(p.router, b, chat("q"))
    info = request(p, chat("q"))
    first = p.pick([a, b], info)
    watch = p.watch(first, info)
    assert watch is not None
    for _ in range(30):                                 # it answers in 2 s, not ~10 ms
        watch(2.0)
    assert p.pick([a, b], request(p, chat("q"))) is not first


def test_equal_candidates_rotate_and_learning_can_be_off() -> None:
    p = policy(learn=False)
    eps = [Ep("a#0"), Ep("b#0"), Ep("c#0")]
    got = []
    for i in range(3):
        info = request(p, chat(f"q{i}", system=f"s{i}"))
        got.append(p.pick(eps, info).key)
        assert info.ttft_obs is None and p.watch(eps[0], info) is None
    assert sorted(got) == ["a#0", "b#0", "c#0"]


def test_a_leaving_endpoint_forgets_its_rates() -> None:
    p = policy()
    s = p.router.slot("a#0")
    p.rates.observe(s, (1.0, 0.0, 100.0), 5.0)
    assert p.rates.theta(s) != pytest.approx((STEP, DEC, PRE))
    p.router.forget("a#0")
    assert p.rates.theta(s) == pytest.approx((STEP, DEC, PRE))


def test_tokens_cost_keeps_the_earlier_behaviour() -> None:
    p = KvAffinity(KvRouter(KvRoutingConfig(cost="tokens")))
    a, b = Ep("a#0"), Ep("b#0")
    hold(p.router, a, chat("q"))
    info = request(p, chat("q"))
    assert p.pick([a, b], info) is a
    assert info.ttft_obs is None
    assert info.cost == pytest.approx(info.prompt_tokens - info.cached_tokens)


def test_each_decision_is_logged_with_its_terms_and_units(caplog) -> None:
    p = policy()
    a, b = Ep("a#0"), Ep("b#0")
    hold(p.router, a, chat("q"))
    a.inflight, a.inflight_prefill_tokens = 2, 300
    with caplog.at_level(logging.DEBUG, "motor.coordinator.policy.kv_affinity"):
        p.pick([a, b], request(p, chat("q")))
    msg = caplog.records[-1].getMessage()
    assert "predicted ttft" in msg and "a#0: cached blocks" in msg and "b#0: cached" in msg
    for unit in ("tokens x 37.0 us", "queued 300 tokens = 11.1 ms", "1 step(s) x (6.00 ms + 2 "
                 "running x 100 us)", " ms"):
        assert unit in msg, msg


class _LeaseEp:
    def acquire(self, *a: int) -> None:
        pass

    def prefill_done(self, n: int) -> None:
        pass

    def release(self, *a: int) -> None:
        pass


def test_a_lease_reports_the_attempts_ttft_once_and_never_after_a_failure() -> None:
    from motor.coordinator.endpoints import Lease
    seen: list[float] = []
    lease = Lease(_LeaseEp(), 10, 0, 5)       # type: ignore[arg-type]
    lease.watch(seen.append)
    lease.prefill_done()                      # first token (fully cached prompt: 0 tokens)
    lease.answered()
    lease.release()
    assert len(seen) == 1 and seen[0] >= 0
    failed = Lease(_LeaseEp(), 10, 3, 5)      # type: ignore[arg-type]
    failed.watch(seen.append)
    failed.release()                          # a failed attempt: released unanswered
    failed.answered()
    assert len(seen) == 1
    whole = Lease(_LeaseEp(), 10, 3, 5)       # type: ignore[arg-type]
    whole.watch(None)
    assert whole.watcher is None
    p = policy()
    assert p.learns_ttft and not policy(learn=False).learns_ttft
