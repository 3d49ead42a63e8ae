"""KV-aware routing end to end: real ``motor sim`` processes publishing KV events on ZMQ.

* exact mode: a controller whose instance table carries each sim's ``kv_events`` address,
  a coordinator following it with ``--policy kv_affinity``: requests sharing a prefix go
  to the instance holding it (the sims' prefix-cache hits and ``cached_tokens``), and an
  instance leaving the table has its blocks purged from the coordinator's index;
* approximate mode: a standalone coordinator without ``--kv-events``.

All processes on 127.0.0.1, each in its own process group, stopped by pid.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from tests.support.procs import free_ports, spawn, stop, wait_http

SIM = ["--time-scale", "0.02", "--enable-prompt-tokens-details"]
PREFIX = "".join(f"shared system prompt line {i:03d}: be helpful and brief.\n" for i in range(24))


def post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def stats(port: int) -> dict[str, Any]:
    return json.loads(get_text(f"http://127.0.0.1:{port}/admin/stats"))


def metric(port: int, name: str, **labels: str) -> float:
    total = 0.0
    for line in get_text(f"http://127.0.0.1:{port}/metrics").splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def complete(gw: int, prompt: str) -> dict[str, Any]:
    return post(gw, "/v1/completions", {"model": "motor-sim", "prompt": prompt, "max_tokens": 2})


def served(sims: list[int]) -> list[int]:
    return [stats(p)["finished"] for p in sims]


def test_exact_mode_follows_events_and_purges_a_removed_instance(tmp_path):
    cport, gw, s1, k1, s2, k2 = free_ports(6)
    cfg = tmp_path / "cluster.json"
    cfg.write_text(json.dumps({
        "controller": {"host": "127.0.0.1", "port": cport, "heartbeat_timeout_s": 120,
                       "remove_after_s": 600},
        "coordinator": {"host": "127.0.0.1", "port": gw, "policy": "kv_affinity"}}))
    sims = [s1, s2]
    procs = [spawn(["sim", "--port", str(s), "--kv-events-endpoint", f"tcp://127.0.0.1:{k}",
                    "--seed", str(i)] + SIM, str(tmp_path / f"sim{i}.log"))
             for i, (s, k) in enumerate(((s1, k1), (s2, k2)))]
    try:
        procs.append(spawn(["controller", "-c", str(cfg)], str(tmp_path / "controller.log")))
        for s in sims:
            wait_http(f"http://127.0.0.1:{s}/health")
        wait_http(f"http://127.0.0.1:{cport}/health")
        for n, (s, k) in (("na", (s1, k1)), ("nb", (s2, k2))):
            post(cport, "/v1/nodes/register", {"node": n, "instances": [{
                "id": f"{n}/sim/0", "model": "motor-sim", "role": "union", "engine": "sim",
                "endpoints": [{"host": "127.0.0.1", "port": s, "dp_rank": 0}],
                "kv_events": f"tcp://127.0.0.1:{k}", "healthy": True}]})
        procs.append(spawn(["coordinator", "-c", str(cfg), "--controller",
                            f"http://127.0.0.1:{cport}"], str(tmp_path / "coordinator.log")))
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        wait_until(lambda: metric(gw, "motor_coordinator_kv_event_subscriptions") >= 2, 20,
                   "both KV-event subscriptions")
        time.sleep(0.5)  # ZMQ slow joiner: the SUB sockets' subscriptions reach the publishers

        first = complete(gw, PREFIX + "question 0?")
        holder = [i for i, n in enumerate(served(sims)) if n == 1]
        assert len(holder) == 1 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        h, other = sims[holder[0]], sims[1 - holder[0]]
        wait_until(lambda: metric(gw, "motor_coordinator_kv_index_blocks", index="exact") >= 20, 20,
                   "the holder's blocks in the exact index")
        hits0 = stats(h)["prefix_cache_hits"]
        for q in range(1, 7):
            out = complete(gw, PREFIX + f"question {q}?")
            # the whole shared prefix (its full 16-token blocks) came from the cache
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PREFIX) - 16
        assert stats(other)["finished"] == 0
        assert stats(h)["finished"] == 7
        assert stats(h)["prefix_cache_hits"] - hits0 >= 6 * (len(PREFIX) - 16)
        assert metric(gw, "motor_coordinator_kv_events_applied_total") > 0

        # a prompt with nothing cached anywhere may go to either; the holder's node leaves
        blocks = metric(gw, "motor_coordinator_kv_index_blocks", index="exact")
        assert blocks >= 20
        node = "na" if h == s1 else "nb"
        post(cport, "/v1/nodes/deregister", {"node": node})
        wait_until(lambda: metric(gw, "motor_coordinator_kv_purges_total", reason="removed") >= 1,
                   20, "the removed instance purged")
        assert metric(gw, "motor_coordinator_kv_index_blocks", index="exact") == 0
        out = complete(gw, PREFIX + "question 9?")   # served by the one left, nothing cached
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert stats(other)["finished"] == 1
    finally:
        for p in procs:
            stop(p)


def test_approximate_mode_without_events(tmp_path):
    gw, s1, s2 = free_ports(3)
    sims = [s1, s2]
    procs = [spawn(["sim", "--port", str(s), "--seed", str(i)] + SIM, str(tmp_path / f"sim{i}.log"))
             for i, s in enumerate(sims)]
    try:
        procs.append(spawn(["coordinator", "--port", str(gw), "--policy", "kv_affinity",
                            "--backend", *(f"http://127.0.0.1:{s}" for s in sims)],
                           str(tmp_path / "coordinator.log")))
        for s in sims:
            wait_http(f"http://127.0.0.1:{s}/health")
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        other_prefix = "Another tenant. " + PREFIX   # shares no leading block with PREFIX
        complete(gw, PREFIX + "question 0?")
        complete(gw, other_prefix + "question 0?")   # nothing matches it: goes to the idle one
        assert served(sims) == [1, 1]
        by_prefix: dict[str, set[int]] = {PREFIX: set(), other_prefix: set()}
        for q in range(1, 6):
            for pre in (PREFIX, other_prefix):
                before = served(sims)
                out = complete(gw, pre + f"question {q}?")
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(pre) - 16
                by_prefix[pre].add([a - b for a, b in zip(served(sims), before)].index(1))
        assert by_prefix[PREFIX] | by_prefix[other_prefix] == {0, 1}
        assert all(len(v) == 1 for v in by_prefix.values()), by_prefix
        assert metric(gw, "motor_coordinator_kv_index_blocks", index="approximate") >= 40
        assert metric(gw, "motor_coordinator_kv_event_subscriptions") == 0

        # a request retried on the other instance counts its prompt once in the hit ratio
        holder = by_prefix[PREFIX].pop()
        post(sims[holder], "/admin/fault", {"mode": "error", "status": 503, "count": 1})
        seen = [metric(gw, f"motor_coordinator_kv_{k}_tokens_total") for k in ("prompt", "matched")]
        before = served(sims)
        out = complete(gw, PREFIX + "question 9?")
        assert [a - b for a, b in zip(served(sims), before)] == \
            [1 if i != holder else 0 for i in range(2)]      # the holder failed, the other answered
        now = [metric(gw, f"motor_coordinator_kv_{k}_tokens_total") for k in ("prompt", "matched")]
        assert now[0] - seen[0] == out["usage"]["prompt_tokens"]
        assert now[1] - seen[1] >= len(PREFIX) - 16           # the first decision's match, once

        # token ids no engine can have: routed on load alone, the engine judges them
        for ids in ([-1], [2**32], [5] * 15 + [2**40]):
            req = urllib.request.Request(
                f"http://127.0.0.1:{gw}/v1/completions", headers={"content-type": "application/json"},
                data=json.dumps({"model": "motor-sim", "prompt": ids, "max_tokens": 2}).encode())
            try:
                urllib.request.urlopen(req, timeout=30).close()
                raise AssertionError(f"prompt {ids} was accepted")
            except urllib.error.HTTPError as e:
                assert e.code == 400, (ids, e.code, e.read())
                assert b"internal error" not in e.read()
        assert "Traceback" not in (tmp_path / "coordinator.log").read_text()
    finally:
        for p in procs:
            stop(p)
