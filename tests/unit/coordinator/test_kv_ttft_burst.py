"""The rate model after a cold-start burst (issue 19): two identical instances, the first
wave of requests all lands on one of them at once. Its TTFTs hold queueing the features
explain badly (the wave shares the engine's steps), so a fit to them alone prices that
instance far slower, the router avoids it and it never gets the observations that would
correct it. Shrinking each fit toward the pooled fit (``ttft.pool_weight``) keeps the two
close; an instance that is really slower is still learned slower.

The engine here is the simulator's step loop (``motor/sim/engine.py``): each step takes
every waiting request's prefill up to ``chunk`` tokens and lasts ``step + per_token x
tokens``; a request's TTFT ends with the step that computes its last token (plus a fixed
HTTP overhead). Requests are routed as the routers do: to the instance with the lower
predicted TTFT (:meth:`RateModel.features` of its in-flight prefill tokens at dispatch),
observed at completion with those features."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from motor.config.schema import KvTtftConfig
from motor.coordinator.policy.ttft import RateModel

STEP, PRE, HTTP = 6e-3, 37e-6, 2e-3     # the true engine (the prior's rates) + overhead
TYPICAL = 1350.0                        # the workload's mean prompt, tokens


@dataclass
class Engine:
    slow: float = 1.0                   # x the true rates
    waiting: list[list[float]] = field(default_factory=list)  # [remaining, tokens, t0, id]
    batch: list[tuple[list[float], float]] | None = None
    inflight_tokens: float = 0.0


def serve(model: RateModel, slow: tuple[float, float], seed: int, burst: int = 6,
          concurrency: int = 1, n: int = 200) -> list[int]:
    """``burst`` requests at t=0 all on instance 0, then ``concurrency`` clients back to
    back, routed by the model, ``n`` requests in all; returns the requests per instance."""
    rng = np.random.default_rng(seed)
    engines = [Engine(slow[0]), Engine(slow[1])]
    events: list[tuple[float, int, str, object]] = []
    seq, sent, done = 0, 0, 0
    served = [0, 0]
    obs: dict[int, tuple[int, tuple[float, float, float]]] = {}

    def step(i: int, now: float) -> None:
        nonlocal seq
        e, budget, batch = engines[i], float(model.chunk_tokens), []
        for r in e.waiting:
            if budget <= 0:
                break
            k = min(budget, r[0])
            budget -= k
            batch.append((r, k))
        e.batch = batch or None
        if batch:
            seq += 1
            dt = (STEP + PRE * sum(k for _, k in batch)) * e.slow
            heapq.heappush(events, (now + dt, seq, "step", i))

    def route(now: float, forced: int | None = None) -> None:
        nonlocal sent, seq
        u = float(rng.integers(200, 2500))
        if forced is None:
            cost = [float(model.rates(np.array([i]))[0] @ _cols(model.features(
                e.inflight_tokens, u, 0.0))) for i, e in enumerate(engines)]
            i = int(np.argmin(cost))
        else:
            i = forced
        e = engines[i]
        obs[sent] = (i, model.features(e.inflight_tokens, u, 0.0))
        e.inflight_tokens += u
        e.waiting.append([u, u, now, float(sent)])
        sent += 1
        served[i] += 1
        if e.batch is None:
            step(i, now)

    for _ in range(burst):
        route(0.0, forced=0)
    while events:
        now, _, kind, p = heapq.heappop(events)
        if kind == "answer":
            assert isinstance(p, list)
            slot, x = obs.pop(int(p[3]))
            model.observe(slot, x, now - p[2])
            done += 1
            while sent < n and sent - done < concurrency:
                route(now)
            continue
        assert isinstance(p, int)
        e = engines[p]
        assert e.batch is not None
        for r, k in e.batch:
            r[0] -= k
        for r in [r for r, _ in e.batch if r[0] <= 0]:
            e.waiting.remove(r)
            e.inflight_tokens -= r[1]
            seq += 1
            heapq.heappush(events, (now + HTTP, seq, "answer", r))
        step(p, now)
    return served


def _cols(x: tuple[float, float, float]) -> np.ndarray:
    """Features in the scorer's column order (step, prefill token, decode sequence)."""
    return np.array([x[0], x[2], x[1]])


def typical_ttft(model: RateModel, slot: int) -> float:
    """Predicted TTFT of a typical prompt on an idle instance, seconds."""
    return float(model.rates(np.array([slot]))[0] @ _cols(model.features(0.0, TYPICAL, 0.0)))


def test_identical_instances_learn_apart_from_the_burst_without_the_pool() -> None:
    for seed in (1, 2, 3):
        m = RateModel(KvTtftConfig(pool_weight=0.0), 4)
        served = serve(m, (1.0, 1.0), seed)
        assert served[0] <= 8, served                  # the burst's instance, then avoided
        ratio = typical_ttft(m, 0) / typical_ttft(m, 1)
        assert ratio > 1.4, (seed, ratio)              # priced 1.4x+ slower: it is not


def test_the_pool_keeps_identical_instances_close() -> None:
    for seed in (1, 2, 3):
        m = RateModel(KvTtftConfig(), 4)
        serve(m, (1.0, 1.0), seed)
        ratio = typical_ttft(m, 0) / typical_ttft(m, 1)
        assert ratio < 1.3, (seed, ratio)              # 2.0-2.3x without the pool
        # and both near the truth (step + tokens + the HTTP overhead the fit absorbs)
        for slot in (0, 1):
            assert 0.7 < typical_ttft(m, slot) / (STEP + HTTP + PRE * TYPICAL) < 1.3


def test_a_really_slower_instance_is_still_learned_slower() -> None:
    """Instance 1 is 1.5x slower (per step and per token); it gets the burst's peers'
    traffic at concurrency 2 (both instances serve: it is priced slower and gets fewer) and
    at 1 (one instance serves: where it is the one, its fit stays near its own truth)."""
    for concurrency in (1, 2):
        for seed in (1, 2, 3):
            m = RateModel(KvTtftConfig(), 4)
            served = serve(m, (1.0, 1.5), seed, concurrency=concurrency)
            if concurrency == 2:
                assert served[1] < served[0], served
                ratio = typical_ttft(m, 1) / typical_ttft(m, 0)
                assert ratio > 1.2, (seed, ratio, served)
            truth = 1.5 * (STEP + PRE * TYPICAL) + HTTP
            if m.n_obs[1] >= 20:                        # its fit is its own, not the pool's
                assert 0.85 < typical_ttft(m, 1) / truth < 1.15, (seed, concurrency)


def test_a_leaving_instance_leaves_the_pool() -> None:
    m = RateModel(KvTtftConfig(), 4)
    for _ in range(50):
        m.observe(0, (1.0, 0.0, 1000.0), 0.5)          # a very slow instance
        m.observe(1, (1.0, 0.0, 1000.0), 0.05)
    slow_pull = m.theta(1)[2]
    m.reset(0)
    m.observe(1, (1.0, 0.0, 1000.0), 0.05)
    assert m.theta(1)[2] < slow_pull                    # no longer pulled toward slot 0
    assert m.n_obs[0] == 0 and m.theta(0)[2] == m.theta0[2]


def test_first_observations_stay_off_numpy_unique(monkeypatch) -> None:
    """A new slot's first observation (every instance's, at a coordinator's first wave of
    first tokens) does not call ``np.unique`` / ``np.union1d``: their first call in a process
    took ~30 ms, on the event loop that relays the other requests' first tokens. The slots
    still end up active in order, each observed slot fitted."""
    m = RateModel(KvTtftConfig(), 8)

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("np.unique / np.union1d on the observe path")

    monkeypatch.setattr(np, "unique", refuse)
    monkeypatch.setattr(np, "union1d", refuse)
    for slot in (5, 2, 7, 2, 0):
        m.observe(slot, (1.0, 2.0, 2000.0), 0.2)
    assert m._active.tolist() == [0, 2, 5, 7] and m._active.dtype == np.intp
    assert list(m.n_obs) == [1, 0, 2, 0, 0, 1, 0, 1]
