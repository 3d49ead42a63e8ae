"""motor.coordinator.policy.pairs: topology closeness, the pair and local decisions over
endpoints, and pd.joint's config validation."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from motor.config.schema import CoordinatorConfig, Role
from motor.coordinator.endpoints import EndpointState
from motor.coordinator.policy.base import RequestInfo
from motor.coordinator.policy.pairs import (OTHER, SAME_NODE, SAME_RACK, Choice, PairChooser,
                                            closeness)


def ep(iid: str, role: Role, host: str = "10.0.0.1", port: int = 8000) -> EndpointState:
    e = EndpointState(iid, "m", role, host, port, 0, pool=None)  # type: ignore[arg-type]
    e.ready = True
    return e


def test_closeness_from_labels_and_hosts():
    a, b = ep("p0", Role.PREFILL, "10.0.0.1"), ep("d0", Role.DECODE, "10.0.0.1", 8001)
    c = ep("d1", Role.DECODE, "10.0.0.2")
    assert closeness(a, b, {}) == SAME_NODE            # one host, no labels
    assert closeness(a, c, {}) == OTHER
    labels = {"p0": "r1/n1", "10.0.0.1:8001": "r1/n2", "10.0.0.2": "r2/n1"}
    assert closeness(a, b, labels) == SAME_RACK
    assert closeness(a, c, labels) == OTHER
    assert closeness(a, ep("p9", Role.PREFILL, "10.0.0.1"), labels) == OTHER  # one unlabelled


def chooser(**joint):
    return PairChooser(CoordinatorConfig(pd={"joint": {"enabled": True, **joint}}))


def test_the_pair_follows_the_topology_and_ties_are_deterministic():
    ps = [ep("p0", Role.PREFILL, "h1"), ep("p1", Role.PREFILL, "h2")]
    ds = [ep("d0", Role.DECODE, "h3"), ep("d1", Role.DECODE, "h2", 8001)]
    j = chooser(local_prefill=False, topology={"h1": "r1/n1", "h2": "r2/n2", "h3": "r3/n3"})
    info = RequestInfo("m", 4096, 16)
    got = j.choose(info, ps, ds, local=True)
    assert got is not None and (got.p, got.d) == (ps[1], ds[1]) and got.reason == "local_off"
    j2 = chooser(local_prefill=False)
    picks = [j2.choose(RequestInfo("m", 100, 4), ps[:1], ds, False) for _ in range(4)]
    assert [c.d.instance_id for c in picks if c is not None] == ["d0", "d1", "d0", "d1"]


def test_a_short_prompt_goes_local_and_a_busy_decode_batch_sends_it_to_a_pair():
    ps = [ep("p0", Role.PREFILL)]
    ds = [ep("d0", Role.DECODE)]
    j = chooser()
    got = j.choose(RequestInfo("m", 64, 16), ps, ds, local=True)
    assert got is not None and got.local and got.reason == "short_prompt"
    for _ in range(64):
        ds[0].acquire(100, 0, 16)         # 64 sequences decoding on d0
    got = j.choose(RequestInfo("m", 2048, 16), ps, ds, local=True)
    assert got is not None and not got.local and got.reason == "cost"
    assert j.choose(RequestInfo("m", 64, 16), ps, ds, local=False).p is ps[0]


def test_the_learned_handoff_tips_a_marginal_prompt_to_the_decode_instance_alone():
    """A pair whose decode legs come 4 ms later than predicted, more than the local legs
    do, costs those 4 ms more: a prompt the terms put on a pair by a hair goes local."""
    ps, ds = [ep("p0", Role.PREFILL)], [ep("d0", Role.DECODE)]
    for _ in range(3):
        ds[0].acquire(100, 0, 16)         # 3 sequences decoding on d0
    j = chooser()
    info = RequestInfo("m", 64, 16)
    got = j.choose(info, ps, ds, local=True)
    assert got is not None and not got.local and j.handoff_s == 0.0
    assert got.p_ttft_s > 0 and got.d_ttft_s > 0
    pair_watch = j.watch_decode(got, False)
    assert pair_watch is not None
    pair_watch(got.d_ttft_s + 0.005)              # 5 ms after its prediction
    alone = Choice(None, ds[0], "short_prompt", 0.0)
    alone.d_ttft_s = 0.010
    local_watch = j.watch_decode(alone, False)
    assert local_watch is not None
    local_watch(0.011)                            # 1 ms after
    assert j.handoff_observations == (1, 1)
    assert j.handoff_s == pytest.approx(0.004)
    got = j.choose(RequestInfo("m", 64, 16), ps, ds, local=True)
    assert got is not None and got.local
    assert chooser(local_prefill=False).watch_decode(alone, False) is None
    alone.queued = (0.0, 512.0)         # queued prefill on D: its pace is not the hand-off
    assert j.watch_decode(alone, False) is None
    off = PairChooser(CoordinatorConfig(pd={"joint": {"enabled": True}},
                                        kv={"ttft": {"learn": False}}))
    assert off.watch_decode(alone, False) is None


def test_bad_topology_labels_are_refused():
    with pytest.raises(ValidationError, match="RACK/NODE"):
        CoordinatorConfig(pd={"joint": {"topology": {"p0": "rack1"}}})
    with pytest.raises(ValidationError):
        CoordinatorConfig(pd={"joint": {"stall_weight": -1}})


def test_the_transfer_matrix_follows_closeness():
    labels = {"p0": "r1/n1", "10.0.0.1:8001": "r1/n2", "10.0.0.2": "r2/n1", "d3": "r1/n1"}
    ps = [ep("p0", Role.PREFILL, "10.0.0.1"), ep("p1", Role.PREFILL, "10.0.0.1", 8002),
          ep("p2", Role.PREFILL, "10.0.0.5")]
    ds = [ep("d0", Role.DECODE, "10.0.0.1", 8001), ep("d1", Role.DECODE, "10.0.0.2"),
          ep("d2", Role.DECODE, "10.0.0.1", 8003), ep("d3", Role.DECODE, "10.0.0.9")]
    j = chooser(topology=labels, transfer_us_per_token={"same_node": 1, "same_rack": 2,
                                                        "other": 4})
    m = j.transfer_matrix(ps, ds)
    want = [[1e-6 * (1, 2, 4)[closeness(p, d, labels)] for d in ds] for p in ps]
    assert m.tolist() == want
    assert m.tolist() == j.transfer_matrix(ps, ds).tolist()      # cached places
    assert {closeness(p, d, labels) for p in ps for d in ds} == {SAME_NODE, SAME_RACK, OTHER}


def test_more_endpoints_than_kv_slots_choose_the_pair_on_load_alone(caplog):
    """257 endpoints: a joint choice whose candidates include one without a KV slot is made
    on load alone (no cached prefix counted, no rate learned, warned once), instead of a
    RuntimeError for every request; routed() leaves the slotless endpoint out of the
    index."""
    j = PairChooser(CoordinatorConfig(pd={"joint": {"enabled": True, "local_prefill": False}},
                                      kv={"approximate": {"mode": "on"}}))
    ps = [ep(f"p{i}", Role.PREFILL, port=9000 + i) for i in range(129)]
    ds = [ep(f"d{i}", Role.DECODE, port=8000 + i) for i in range(128)]
    body = {"prompt": "x" * 4000}
    for e in ps + ds:
        e.acquire(300, 300, 16)
    ps[100].release(300, 300, 16)         # the idle pair by load: p100, d50
    ds[50].release(300, 300, 16)
    first = RequestInfo("m", 1, 16)
    j.prepare(first, "completions", body)
    got = j.choose(first, ps[:128], ds, False)        # 256 endpoints: every one has a slot
    assert got is not None and (got.p, got.d) == (ps[100], ds[50])
    j.routed(got, first)
    ps[100].acquire(300, 300, 16)
    ps[7].release(300, 300, 16)
    again = RequestInfo("m", 1, 16)
    j.prepare(again, "completions", body)
    got = j.choose(again, ps[:128], ds, False)
    assert got is not None and got.p is ps[100]        # its cached prefix wins
    caplog.clear()
    info = RequestInfo("m", 1, 16)
    j.prepare(info, "completions", body)
    got = j.choose(info, ps, ds, False)                # p128 has no slot: load alone
    assert got is not None and got.p is ps[7] and got.d is ds[50]
    assert got.p_uncached == info.prompt_tokens and got.p_obs is None
    j.routed(Choice(ps[128], ds[50], "cost", 0.0), info)   # no slot: not remembered
    assert ps[128].key not in j.router.slot_map
    assert len([r for r in caplog.records if "routed on load alone" in r.getMessage()]) == 1
