"""Session affinity end to end: a standalone coordinator (``--policy kv_affinity``, both
costs) over two real ``motor sim`` processes. Prompts that share no block go round robin
when they name no session; the requests of one session (``x-session-id`` header, or the
body's ``user``) all go to the instance that served its first one.

All processes on 127.0.0.1, each in its own process group, stopped by pid.
"""
from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.integration.test_kv_routing import SIM, served
from tests.support.procs import free_ports, spawn, stop, wait_http


def complete(gw: int, prompt: str, session: str | None = None, user: str | None = None
             ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "motor-sim", "prompt": prompt, "max_tokens": 2}
    if user is not None:
        body["user"] = user
    headers = {"content-type": "application/json"}
    if session is not None:
        headers["X-Session-Id"] = session
    req = urllib.request.Request(f"http://127.0.0.1:{gw}/v1/completions",
                                 data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def prompt(i: int) -> str:
    # unique from the first block on: nothing cached or routed before matches it
    return f"{i:05d} {'abcdefghij'[i % 10] * 12} tell me something about topic {i}."


def where(sims: list[int], gw: int, i: int, **kw: str) -> int:
    before = served(sims)
    complete(gw, prompt(i), **kw)
    return [a - b for a, b in zip(served(sims), before)].index(1)


@pytest.mark.parametrize("cost", ["tokens", "time"])
def test_a_sessions_requests_follow_its_first_one(tmp_path, cost):
    # (time cost without learning: the sims at --time-scale 0.02 are far faster than the
    # prior rates, so the first instance observed would take every sessionless request).
    # (One worker: with 2, each remembers the sessions it routed, and a session new to a
    # worker follows the other's choice only on an exact tie, which the load of the request
    # before, still being released when the next one arrives, often breaks: see
    # motor/coordinator/policy/sessions.py and test_kv_sessions.py's two-worker test.)
    gw, s1, s2 = free_ports(3)
    sims = [s1, s2]
    cfg = tmp_path / "coordinator.json"
    cfg.write_text(json.dumps({"coordinator": {"host": "127.0.0.1", "port": gw,
                                               "policy": "kv_affinity",
                                               "kv": {"cost": cost, "ttft": {"learn": False}}}}))
    procs = [spawn(["sim", "--port", str(s), "--seed", str(i)] + SIM, str(tmp_path / f"sim{i}.log"))
             for i, s in enumerate(sims)]
    try:
        procs.append(spawn(["coordinator", "-c", str(cfg), "--backend",
                            *(f"http://127.0.0.1:{s}" for s in sims)],
                           str(tmp_path / "coordinator.log")))
        for s in sims:
            wait_http(f"http://127.0.0.1:{s}/health")
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        # no session: one at a time, nothing shared, both idle: both serve
        assert {where(sims, gw, i) for i in range(8)} == {0, 1}
        n = 4
        for kw in ({"session": "conv-a"}, {"session": "conv-b"}, {"user": "carol"}):
            homes = set()
            for _ in range(6):
                homes.add(where(sims, gw, n, **kw))
                n += 1
            assert len(homes) == 1, (kw, homes)
        # the header wins over the body's user
        home_a = where(sims, gw, n, session="conv-a")
        assert {where(sims, gw, n + 1 + j, session="conv-a", user=f"u{j}")
                for j in range(4)} == {home_a}
    finally:
        for p in procs:
            stop(p)
