"""kv_affinity's session affinity: the LRU session table, the session's name, the bounded
credit in both costs (same session back to its endpoint under equal load, an overloaded
session endpoint left, a longer cached prefix elsewhere still winning)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from motor._fast import scoring
from motor._fast.columns import gather
from motor.config.schema import KvRoutingConfig, KvSessionConfig
from motor.coordinator import metrics
from motor.coordinator.kv import KvRouter
from motor.coordinator.policy import RequestInfo
from motor.coordinator.policy.kv_affinity import KvAffinity
from motor.coordinator.policy.sessions import SessionTable, session_of

from .test_kv_affinity import Ep, chat, hold

CREDIT = np.array([1.0, 0.75, 0.25])


def policy(cost: str, **session: Any) -> KvAffinity:
    """No approximate index: what the KV index knows is only what a test holds."""
    return KvAffinity(KvRouter(KvRoutingConfig(cost=cost, session=KvSessionConfig(**session),
                                               approximate={"mode": "off"})))


def send(p: KvAffinity, eps: list[Ep], body: dict[str, Any], header: bytes | None = None) -> Ep:
    """One request through prepare / pick / routed, as a request path does."""
    info = request_with(p, body, header)
    ep = p.pick(eps, info)
    p.routed(ep, info)
    return ep


def request_with(p: KvAffinity, body: dict[str, Any], header: bytes | None) -> RequestInfo:
    info = RequestInfo(body.get("model"), 1, 8)
    info.session = header
    p.prepare(info, "chat", body)
    return info


def session_routes(outcome: str) -> float:
    v = metrics.REGISTRY.get_sample_value("motor_coordinator_kv_session_routes_total",
                                          {"outcome": outcome})
    return v or 0.0


# -- the table -------------------------------------------------------------------------

def test_the_table_forgets_the_least_recently_routed_session_beyond_its_bound() -> None:
    t = SessionTable(3)
    for i in range(3):
        t.routed(f"s{i}", f"ep{i}")
    assert t.last("s0") == "ep0"        # a read does not refresh
    t.routed("s1", "ep9")               # s1 routed again: now the most recent
    t.routed("s3", "ep3")               # one more: s0 (the oldest) goes
    assert len(t) == 3
    assert t.last("s0") is None
    assert [t.last(s) for s in ("s1", "s2", "s3")] == ["ep9", "ep2", "ep3"]
    for i in range(1000):
        t.routed(f"x{i}", "ep")
    assert len(t) == 3 and t.last("x999") == "ep" and t.last("x996") is None
    with pytest.raises(ValueError, match="max_sessions"):
        SessionTable(0)


def test_a_name_is_the_same_session_from_the_header_or_the_user_field() -> None:
    t = SessionTable(8)
    t.routed(b"alice", "ep1")
    assert t.last("alice") == "ep1"
    assert session_of(b"h", {"user": "u"}, True) == b"h"
    assert session_of(None, {"user": "u"}, True) == "u"
    assert session_of(b"", {"user": "u"}, True) == "u"
    assert session_of(None, {"user": "u"}, False) is None
    assert session_of(None, {"user": 7}, True) is None
    assert session_of(None, {"user": ""}, True) is None


# -- the compiled credit ---------------------------------------------------------------

def test_the_credit_moves_the_choice_only_within_its_bound_and_is_not_in_the_cost() -> None:
    ov = np.zeros((3, 3), np.int32)
    queued = np.array([0.0, 500.0, 0.0])
    running = np.zeros(3)
    rates = np.tile([6e-3, 37e-6, 100e-6], (3, 1))
    free = scoring.pick_ttft(ov, 1000, 16, CREDIT, queued, running, rates)
    assert free[0] == 0
    # 500 queued tokens cost 18.5 ms: a 20 ms credit wins over it, a 15 ms one does not
    best, t = scoring.pick_ttft(ov, 1000, 16, CREDIT, queued, running, rates,
                                favored=1, favored_credit=0.020)
    assert best == 1 and t == pytest.approx(0.006 + 37e-6 * 1500)
    out = np.empty(3)
    assert scoring.pick_ttft(ov, 1000, 16, CREDIT, queued, running, rates, out=out,
                             favored=1, favored_credit=0.015)[0] == 0
    assert out[1] == pytest.approx(0.006 + 37e-6 * 1500)
    # the token cost: 64 prompt-token equivalents per queued request
    q = np.array([0.0, 2.0, 0.0])
    z = np.zeros(3)
    assert scoring.pick(ov, 100, 16, CREDIT, z, z, q, None, 1.0, 0.0, 64.0, 0.0, 0,
                        favored=1, favored_credit=129.0) == (1, 228.0)
    assert scoring.pick(ov, 100, 16, CREDIT, z, z, q, None, 1.0, 0.0, 64.0, 0.0, 0,
                        favored=1, favored_credit=127.0)[0] == 0


# -- the policy ------------------------------------------------------------------------

@pytest.mark.parametrize("cost", ["tokens", "time"])
def test_a_session_goes_back_to_its_endpoint_under_equal_load(cost: str) -> None:
    p = policy(cost)
    eps = [Ep(f"{k}#0") for k in "abcd"]
    first = {s: send(p, eps, chat(f"hello {s}", system=f"tenant {s}"), header=s.encode())
             for s in (f"s{i}" for i in range(8))}
    assert len({e.key for e in first.values()}) >= 3      # new ones spread (by their hash)
    for turn in range(6):       # nothing cached anywhere, every endpoint idle: rotation aside
        for s, ep in first.items():
            assert send(p, eps, chat(f"turn {turn} of {s}", system=f"other {turn}"),
                        header=s.encode()) is ep
    # the body's user names a session as well
    u = send(p, eps, dict(chat("u", system="u0"), user="carol"))
    for turn in range(4):
        assert send(p, eps, dict(chat(f"u{turn}", system=f"u{turn}"), user="carol")) is u


@pytest.mark.parametrize("cost", ["tokens", "time"])
def test_an_overloaded_session_endpoint_is_left(cost: str) -> None:
    p = policy(cost)
    before = {o: session_routes(o) for o in ("kept", "moved", "new")}
    a, b = Ep("a#0"), Ep("b#0")
    home = send(p, [a, b], chat("q", system="s"), header=b"sess")
    other = b if home is a else a
    # a little more load than the other: still home (the credit is 1024 prompt tokens)
    home.inflight, home.inflight_prefill_tokens = 1, 300
    assert send(p, [a, b], chat("q2", system="s2"), header=b"sess") is home
    # a queue of 8 requests x 4k tokens: the credit does not outweigh it
    home.inflight, home.inflight_prefill_tokens = 8, 32768
    assert send(p, [a, b], chat("q3", system="s3"), header=b"sess") is other
    # and the session now lives where it went
    home.inflight, home.inflight_prefill_tokens = 0, 0
    assert send(p, [a, b], chat("q4", system="s4"), header=b"sess") is other
    send(p, [a, b], chat("q5", system="s5"))               # no session: not counted
    assert {o: session_routes(o) - before[o] for o in before} == \
        {"kept": 2, "moved": 1, "new": 1}


@pytest.mark.parametrize("cost", ["tokens", "time"])
def test_a_longer_cached_prefix_elsewhere_beats_the_session_credit(cost: str) -> None:
    p = policy(cost, credit_tokens=256)
    a, b = Ep("a#0"), Ep("b#0")
    hold(p.router, b, chat("question"))         # ~1.1k tokens cached on b only
    home = request_with(p, chat("x", system="y"), b"s")
    p.routed(a, home)                           # the session last went to a
    assert p.pick([a, b], request_with(p, chat("question"), b"s")) is b
    # with nothing cached anywhere, the session wins over the rotation
    assert all(p.pick([a, b], request_with(p, chat(f"n{i}", system=f"n{i}"), b"s")) is a
               for i in range(4))


def test_session_affinity_off_or_a_zero_credit_is_plain_rotation() -> None:
    for p in (policy("tokens", enabled=False), policy("time", credit_tokens=0)):
        assert p.sessions is None
        eps = [Ep("a#0"), Ep("b#0")]
        got = {send(p, eps, chat(f"q{i}", system=f"s{i}"), header=b"s").key for i in range(4)}
        assert got == {"a#0", "b#0"}


def test_a_session_endpoint_that_is_no_candidate_gets_nothing() -> None:
    p = policy("time")
    a, b, c = Ep("a#0"), Ep("b#0"), Ep("c#0")
    p.sessions.routed(b"s", "gone#0")
    p.sessions.routed(b"t", "a#0")

    def position(cands: list[Ep], session: bytes) -> int:
        # the favored position the policy reads (motor._fast.columns.gather)
        return gather(cands, {}, None, False, p.sessions.last(session))[4]

    assert position([a, b, c], b"s") == -1
    assert position([b, c], b"t") == -1
    assert position([b, a], b"t") == 1
    # excluded (a retry): another endpoint
    assert p.pick([a, b], request_with(p, chat("q"), b"t"), exclude={a}) is b


@pytest.mark.parametrize("cost", ["tokens", "time"])
def test_workers_send_a_new_session_to_the_same_endpoint_among_equals(cost: str) -> None:
    """Two workers (two policies, no shared memory) route the first request of each session
    alike when the candidates are equal, and the sessions still spread."""
    w1, w2 = policy(cost), policy(cost)
    eps = [Ep(f"{k}#0") for k in "abcd"]
    send(w2, eps, chat("x", system="y"))        # the workers' rotations differ
    homes = []
    for i in range(16):
        s = f"session-{i}".encode()
        a = send(w1, eps, chat(f"q{i}", system=f"s{i}"), header=s)
        assert send(w2, eps, chat(f"q{i}", system=f"s{i}"), header=s) is a
        homes.append(a.key)
    assert len(set(homes)) >= 3
