"""The kv_affinity policy: prefix holder wins, load guard, tiers, rotation, approximate mode."""
from __future__ import annotations

from typing import Any

from motor.config.schema import KvRoutingConfig
from motor.coordinator.kv import KvRouter
from motor.coordinator.policy import RequestInfo, make_policy
from motor.coordinator.policy.kv_affinity import KvAffinity
from motor.protocol.kv_events import BlockStored, EventBatch

SYSTEM = "You are a careful assistant. " * 40  # ~1.1k tokens


class Ep:
    def __init__(self, key: str, kv_events: str | None = "tcp://x:1") -> None:
        self.key = key
        self.kv_events = kv_events
        self.inflight = 0
        self.inflight_prefill_tokens = 0
        self.inflight_decode_tokens = 0

    def __repr__(self) -> str:
        return self.key


def chat(user: str, system: str = SYSTEM) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": user}], "max_tokens": 8}


def request(policy: KvAffinity, body: dict[str, Any]) -> RequestInfo:
    info = RequestInfo(body.get("model"), 1, 8)
    policy.prepare(info, "chat", body)
    return info


def hold(router: KvRouter, ep: Ep, body: dict[str, Any], medium: str = "GPU",
         blocks: int | None = None) -> None:
    """The engine behind ``ep`` reports it cached ``body``'s prompt (full blocks)."""
    ids = router.tokenizers.token_ids("chat", body)
    n = len(ids) // router.block_size if blocks is None else blocks
    s = router.slot(ep.key)
    router.event_slots.add(s)
    router.ingest.apply(s, 0, EventBatch(0.0, [BlockStored(list(range(1, n + 1)), None,
                                                           ids[:n * router.block_size],
                                                           router.block_size, medium)], 0))


def test_registered_under_its_config_name() -> None:
    assert isinstance(make_policy("kv_affinity"), KvAffinity)


def test_the_holder_of_the_whole_conversation_wins() -> None:
    p = KvAffinity()
    a, b, c = Ep("a#0"), Ep("b#0"), Ep("c#0")
    hold(p.router, b, chat("first question"))
    for _ in range(4):  # whatever the rotation, b holds the prefix
        info = request(p, chat("first question, and a follow-up"))
        assert p.pick([a, b, c], info) is b
        assert info.cached_tokens > 1000 and info.prefill_tokens < info.prompt_tokens - 1000


def test_routing_key_is_the_whole_conversation_not_the_first_message() -> None:
    p = KvAffinity()
    a, b = Ep("a#0"), Ep("b#0")
    hold(p.router, a, chat("x", system="short system"), blocks=1)
    long_turn = {"model": "m", "messages": [{"role": "system", "content": "short system"},
                                            {"role": "user", "content": "x"},
                                            {"role": "assistant", "content": SYSTEM},
                                            {"role": "user", "content": "y"}]}
    hold(p.router, b, long_turn)
    nxt = dict(long_turn, messages=long_turn["messages"] + [{"role": "assistant", "content": "z"},
                                                           {"role": "user", "content": "w"}])
    assert p.pick([a, b], request(p, nxt)) is b


def test_load_guard_keeps_a_hot_holder_from_taking_everything() -> None:
    cfg = KvRoutingConfig(load_guard=2.0, load_guard_min_tokens=1000)
    p = KvAffinity(KvRouter(cfg))
    a, b, c = Ep("a#0"), Ep("b#0"), Ep("c#0")
    hold(p.router, a, chat("q"))
    a.inflight, a.inflight_prefill_tokens = 20, 50_000
    info = request(p, chat("q"))
    assert p.pick([a, b, c], info) in (b, c)


def test_device_tier_beats_host_tier_with_default_credits() -> None:
    p = KvAffinity()
    a, b = Ep("a#0"), Ep("b#0")
    hold(p.router, a, chat("q"), medium="CPU")
    hold(p.router, b, chat("q"), medium="GPU")
    assert p.pick([a, b], request(p, chat("q"))) is b
    assert p.pick([b, a], request(p, chat("q"))) is b


def test_no_cache_anywhere_spreads_and_exclude_is_honoured() -> None:
    p = KvAffinity()
    eps = [Ep("a#0"), Ep("b#0"), Ep("c#0")]
    got = {p.pick(eps, request(p, chat(f"q{i}", system=f"s{i}"))).key for i in range(3)}
    assert got == {"a#0", "b#0", "c#0"}
    hold(p.router, eps[0], chat("q"))
    assert p.pick(eps, request(p, chat("q")), exclude={eps[0]}) is not eps[0]
    assert p.pick(eps, request(p, chat("q")), exclude=set(eps)) in eps


def test_untokenizable_request_is_routed_on_load() -> None:
    p = KvAffinity()
    a, b = Ep("a#0"), Ep("b#0")
    a.inflight = 3
    info = request(p, {"model": "m", "messages": "not a list"})
    assert info.block_hashes is None
    assert p.pick([a, b], info) is b


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_approximate_mode_follows_what_was_routed_with_ttl_and_cap() -> None:
    clock = Clock()
    cfg = KvRoutingConfig.model_validate({"approximate": {"mode": "auto", "ttl_s": 60,
                                                          "max_blocks": 10_000}})
    p = KvAffinity(KvRouter(cfg, clock=clock))
    eps = [Ep(f"{k}#0", kv_events=None) for k in "abcd"]
    first = request(p, chat("turn 1"))
    ep = p.pick(eps, first)
    p.routed(ep, first)
    for turn in range(2, 6):  # later turns follow the first one
        info = request(p, chat(f"turn {turn}"))
        assert p.pick(eps, info) is ep
        p.routed(ep, info)
    clock.t += 61  # TTL over: forgotten
    info = request(p, chat("turn 9"))
    p.pick(eps, info)
    assert info.cached_tokens == 0
    assert p.router.index_blocks("approximate") == 0


def test_approximate_cap_and_per_group_settings() -> None:
    cfg = KvRoutingConfig.model_validate({"approximate": {"max_blocks": 100},
                                          "groups": {"off-model": {"approximate": {"mode": "off"}}}})
    p = KvAffinity(KvRouter(cfg))
    ep = Ep("a#0", kv_events=None)
    for i in range(20):
        info = request(p, chat("q", system=f"{i} " + SYSTEM))
        p.routed(ep, info)
    assert p.router.approx[""].index.n_nodes <= 100 if "" in p.router.approx else True
    assert p.router.approx["m"].index.n_nodes <= 100
    off = {"model": "off-model", "messages": [{"role": "user", "content": SYSTEM}]}
    info = request(p, off)
    p.routed(ep, info)
    assert "off-model" not in p.router.approx


def test_exact_instances_are_not_guessed_in_auto_mode() -> None:
    p = KvAffinity()
    ep = Ep("a#0")
    p.router.event_slots.add(p.router.slot(ep.key))
    info = request(p, chat("q"))
    p.routed(ep, info)
    assert p.router.index_blocks("approximate") == 0


def test_the_compiled_decision_is_the_numpy_paths(caplog: Any) -> None:
    """Under ``kv.cost: tokens`` pick runs TokenPick (one compiled call); with debug logging
    on it runs the numpy columns and logs the terms. Two policies fed the same run (exact
    holders, approximate inserts, loads, sessions, exclusions) decide alike."""
    import logging
    import random

    cfg = {"approximate": {"mode": "auto"}, "session": {"enabled": True}}
    fast, slow = (KvAffinity(KvRouter(KvRoutingConfig.model_validate(cfg))) for _ in range(2))
    eps = {p: [Ep(k, None if k in ("c#0", "d#0") else "tcp://x:1")
               for k in ("a#0", "b#0", "c#0", "d#0")] for p in (id(fast), id(slow))}
    for p in (fast, slow):
        hold(p.router, eps[id(p)][1], chat("shared question"))
    rng = random.Random(7)
    log = logging.getLogger("motor.coordinator.policy.kv_affinity")
    for i in range(120):
        body = chat(rng.choice(["shared question", f"q{i % 9}", "shared question, more"]),
                    system=rng.choice([SYSTEM, "Short system."]))
        if rng.random() < 0.5:      # a session seen before, or a new one (its stable start)
            body["user"] = f"s{i % 4}" if rng.random() < 0.5 else f"new{i}"
        loads = [(rng.randint(0, 3), rng.choice([0, 500, 5000])) for _ in range(4)]
        drop = rng.randrange(4) if rng.random() < 0.2 else None
        picked = []
        for p, debug in ((fast, False), (slow, True)):
            mine = eps[id(p)]
            for e, (n, toks) in zip(mine, loads):
                e.inflight, e.inflight_prefill_tokens = n, toks
            info = request(p, body)
            log.setLevel(logging.DEBUG if debug else logging.INFO)
            caplog.clear()
            with caplog.at_level(logging.DEBUG if debug else logging.INFO, log.name):
                ep = p.pick(mine, info, {mine[drop]} if drop is not None else None)
            assert ep is not None
            assert any("kv_affinity:" in r.getMessage() for r in caplog.records) == debug
            p.routed(ep, info)
            picked.append((ep.key, info.cost, info.cached_tokens, info.prefill_tokens))
        assert picked[0] == picked[1], i
    log.setLevel(logging.NOTSET)


def test_more_endpoints_than_slots_route_on_load_alone(caplog: Any) -> None:
    """257 endpoints: the one without a KV slot makes its requests go by load alone (warned
    once), on both decision paths and both costs; nothing raises, routed() skips it."""
    import logging

    for cost in ("tokens", "time"):
        p = KvAffinity(KvRouter(KvRoutingConfig.model_validate(
            {"cost": cost, "approximate": {"mode": "on"}})))
        eps = [Ep(f"e{i}#0", None) for i in range(257)]
        for e in eps:
            e.inflight, e.inflight_prefill_tokens = 1, 300
        eps[200].inflight, eps[200].inflight_prefill_tokens = 0, 0
        body = chat("a question")
        with_slots = eps[:256]
        info = request(p, body)
        assert p.pick(with_slots, info) is eps[200]       # 256 slots: the policy as usual
        p.routed(eps[200], info)
        eps[200].inflight, eps[200].inflight_prefill_tokens = 1, 300
        eps[7].inflight, eps[7].inflight_prefill_tokens = 0, 0
        info = request(p, body)
        assert p.pick(with_slots, info) is eps[200]       # its cached prefix wins
        caplog.clear()
        for debug in (False, True):
            log = logging.getLogger("motor.coordinator.policy.kv_affinity")
            log.setLevel(logging.DEBUG if debug else logging.INFO)
            try:
                info = request(p, body)
                ep = p.pick(eps, info)                    # e256 has no slot: load alone
            finally:
                log.setLevel(logging.NOTSET)
            assert ep is eps[7], (cost, debug, ep)
            assert info.cached_tokens == 0 and info.ttft_obs is None
            p.routed(eps[256], info)                      # no slot: not remembered, no error
        assert "e256#0" not in p.router.slot_map
        warned = [r for r in caplog.records if "routed on load alone" in r.getMessage()]
        assert len(warned) == 1, cost
