"""Case B29 (../shared/cases/bug_cases.md): the prefix tree must not grow without bound,
and removed workers must be purged.

Scaled down to run in seconds (the case's 30 min of 100 req/s with RSS sampling is a soak
run): instances churn through 60 distinct endpoints (one removed and one added per
round) while unique 4 KB prompts are routed by ``kv_affinity`` in approximate mode with
a memory cap, and engine KV events fill the exact index for the live instances. Pass
criteria, as in the case: (1) the index stays within its cap and its size after the
first rounds stays within +20 % for the rest of the run; (2) no request goes to a
removed endpoint, and a removed endpoint holds no block; (3) cache affinity still
works at the end: 10 repeats of one 8 KB prompt go to a single live endpoint.
"""
from __future__ import annotations

import random

from motor.config.schema import KvRoutingConfig
from motor.coordinator.kv import KvRouter
from motor.coordinator.policy import RequestInfo
from motor.coordinator.policy.kv_affinity import KvAffinity
from motor.protocol.kv_events import BlockStored, EventBatch


class Ep:
    def __init__(self, key: str, events: bool) -> None:
        self.key = key
        self.kv_events = "tcp://127.0.0.1:1" if events else None
        self.inflight = self.inflight_prefill_tokens = self.inflight_decode_tokens = 0


def unique_prompt(rng: random.Random, n: int) -> dict:
    return {"model": "m", "prompt": "".join(rng.choice("abcdefghij ") for _ in range(n))}


def test_index_bounded_under_worker_churn_and_removed_workers_purged() -> None:
    rng = random.Random(29)
    print("seed 29")
    cap = 20_000
    router = KvRouter(KvRoutingConfig.model_validate({"approximate": {"mode": "on", "ttl_s": 3600,
                                                                      "max_blocks": cap}}))
    policy = KvAffinity(router)
    live: list[Ep] = [Ep(f"w{i}#0", events=i % 2 == 0) for i in range(4)]
    removed: set[str] = set()
    next_id = 4
    sizes: list[int] = []
    seq = {e.key: 0 for e in live}
    for rnd in range(56):  # 4 + 56 = 60 distinct endpoints
        for _ in range(40):  # unique 4 KB prompts
            body = unique_prompt(rng, 4096)
            info = RequestInfo("m", 1, 16)
            policy.prepare(info, "completions", body)
            ep = policy.pick(live, info)
            assert ep.key not in removed
            policy.routed(ep, info)
            if ep.kv_events:  # the engine reports what it cached
                ids = router.tokenizers.token_ids("completions", body)
                n = len(ids) // router.block_size
                s = router.slot(ep.key)
                router.ingest.apply(s, seq[ep.key], EventBatch(0.0, [BlockStored(
                    [(rnd, i, j) for j in range(n) for i in [id(body)]], None,
                    ids[:n * router.block_size], router.block_size)], 0))
                seq[ep.key] += 1
        # churn: remove the oldest worker, add a fresh one on a new "port"
        gone = live.pop(0)
        removed.add(gone.key)
        router.sync([e.key for e in live])
        assert gone.key not in router.slots()
        new = Ep(f"w{next_id}#0", events=next_id % 2 == 0)
        next_id += 1
        live.append(new)
        seq[new.key] = 0
        assert router.approx["m"].index.n_nodes <= cap
        sizes.append(router.index_bytes("exact") + router.index_bytes("approximate"))
    assert next_id == 60
    base = sizes[9]
    assert max(sizes[10:]) <= 1.2 * base, (base, max(sizes[10:]))
    # no block of a removed worker anywhere: only the 4 live slots hold blocks
    live_slots = {router.slot(e.key) for e in live}
    assert len(router.slots()) == 4
    for s in range(256):
        if s not in live_slots:
            assert router.exact.instance_blocks(s) == 0
            assert router.approx["m"].index.instance_blocks(s) == 0
    # affinity still works: 10 repeats of one 8 KB prompt go to one live worker
    body = unique_prompt(rng, 8192)
    chosen = set()
    for _ in range(10):
        info = RequestInfo("m", 1, 16)
        policy.prepare(info, "completions", body)
        ep = policy.pick(live, info)
        policy.routed(ep, info)
        chosen.add(ep.key)
    assert len(chosen) == 1 and chosen <= {e.key for e in live}
